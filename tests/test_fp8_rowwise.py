"""The rowwise recipe (``fp8="rowwise"``): its math, its dense GEMMs on ``torch._scaled_mm`` with
rowwise scales, and expert GEMMs as one ``torch._scaled_grouped_mm`` each (forward, dgrad and
wgrad), on the CPU through the kernel's emulation, which checks the CUDA kernel's operand rules."""

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass import _compat
from graphpass.fp8 import cublaslt, providers, recipes, torch_gemms

E, K, N = 4, 64, 48
# groups of 100, 0, 233 and 179 tokens: an empty group, none a multiple of 16
ENDS = [100, 100, 333, 512]
T = ENDS[-1]


# --- the recipe ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("columnwise", [False, True])
def test_rowwise_scales_each_row_on_its_own(pow2, columnwise):
    """One fp32 scale per row of the quantized data (per column of x columnwise), E4M3 in every
    role: each row is bit for bit that row quantized alone by the same scale rule as tensorwise
    E4M3; an all-zero row gets scale 1, a NaN is ignored by its row's amax; power-of-two scales
    are powers of two."""
    name = "rowwise_pow2" if pow2 else "rowwise"
    torch.manual_seed(0)
    x = torch.randn(48, 80) * torch.logspace(-3, 3, 80)  # columns of very different magnitude
    x[:, 5] = 0.0
    x[7, 9] = float("nan")
    rows = x.t() if columnwise else x
    for role in recipes.ROLES:
        data, scale_inv = recipes.quantize(x, name, role, columnwise=columnwise)
        assert data.dtype == recipes.E4M3 and scale_inv.dtype == torch.float32
        assert data.shape == rows.shape and scale_inv.shape == (rows.shape[0], 1)
        e4m3 = recipes.Recipe("tensorwise", "E4M3", power_2_scales=pow2)
        for i in (0, 5, 9, 47):
            ref_data, ref_inv = recipes.quantize(rows[i:i + 1], e4m3, role)
            assert torch.equal(data[i:i + 1].view(torch.uint8), ref_data.view(torch.uint8))
            assert torch.equal(scale_inv[i], ref_inv.reshape(1))
        zero_row = 5 if columnwise else None
        if zero_row is not None:
            assert scale_inv[zero_row] == 1.0
        if pow2:
            assert scale_inv.log2().frac().eq(0).all()
        back = recipes.dequantize(data, scale_inv, name, role, columnwise=columnwise)
        assert back.shape == x.shape


def test_rowwise_stacks_and_groups_are_each_part_quantized_alone():
    """3-D expert weights in one pass equal each expert quantized alone, both usages; the
    columnwise copy of token groups equals each group quantized alone, each group's columns
    from its 16-aligned start, scales (G, K), every other column 0 (padding and the rows past
    the last group), an empty group's scales 1."""
    torch.manual_seed(0)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    d, s, dt, st = torch.ops.graphpass.quantize(w, "rowwise", "weight", "both")
    for e in range(E):
        rd, rs = recipes.quantize(w[e], "rowwise", "weight")
        cd, cs = recipes.quantize(w[e], "rowwise", "weight", columnwise=True)
        assert torch.equal(d[e].view(torch.uint8), rd.view(torch.uint8)) and torch.equal(s[e], rs)
        assert torch.equal(dt[e].view(torch.uint8), cd.view(torch.uint8)) and torch.equal(st[e], cs)
    x = torch.randn(T + 12, K, dtype=torch.bfloat16)
    x[200:333] *= 1000
    x[T + 3, 0] = float("inf")  # past the last group: its data is 0, no scale sees it
    offs = torch.tensor(ENDS, dtype=torch.int32)
    data, scale = torch.ops.graphpass.quantize(x, "rowwise", "input", "columnwise", offs)
    # the 16-aligned token layout, by hand from its formula: ceil(524 / 16) * 16 + 16 * G
    # columns; group g from sum(ceil(n_h / 16) * 16 for h < g) on (groups of 100, 0, 233, 179)
    assert data.shape == (K, -(-(T + 12) // 16) * 16 + 16 * E) and scale.shape == (E, K)
    used = torch.zeros(data.shape[1], dtype=torch.bool)
    start, first = 0, 0
    for g, end in enumerate(ENDS):
        n = end - start
        if n == 0:
            assert (scale[g] == 1.0).all()
            continue
        rd, rs = recipes.quantize(x[start:end], "rowwise", "input", columnwise=True)
        assert torch.equal(data[:, first:first + n].view(torch.uint8), rd.view(torch.uint8))
        assert torch.equal(scale[g], rs[:, 0])
        used[first:first + n] = True
        start, first = end, first + -(-n // 16) * 16
    assert not data[:, ~used].view(torch.uint8).any()


def test_fp8_format_is_validated():
    """fp8_format='e4m3' (TE's Format.E4M3) is an option of fp8='tensorwise'; its recipe name is
    what the graph ops carry (so the compile caches tell it apart), with gradients E4M3."""
    config = graphpass.Config(fp8="tensorwise", fp8_format="e4m3")
    assert config.fp8_recipe == "tensorwise_e4m3"
    assert graphpass.Config(fp8="tensorwise").fp8_recipe == "tensorwise"
    assert graphpass.Config(fp8="tensorwise", fp8_format="e4m3", kernels="te").kernels == "te"
    assert [recipes.fp8_dtype("tensorwise_e4m3", r) for r in recipes.ROLES] == [recipes.E4M3] * 3
    assert recipes.fp8_dtype("tensorwise", "grad") == recipes.E5M2
    for fp8 in (None, "rowwise", "blockwise", "mxfp8"):
        ignored = graphpass.Config(fp8=fp8, fp8_format="e4m3")
        assert [str(u) for u in ignored.unused()] == [
            "fp8_format='e4m3' has no effect without fp8='tensorwise' (the other recipes are E4M3 "
            "in every role already)"]
        assert ignored.fp8_recipe == graphpass.Config(fp8=fp8).fp8_recipe
    with pytest.raises(ValueError, match="fp8_format='E4M3'; valid values are: 'hybrid', 'e4m3'"):
        graphpass.Config(fp8="tensorwise", fp8_format="E4M3")
    from graphpass.backend import Partitioner

    keys = {Partitioner(graphpass.Config(fp8="tensorwise", fp8_format=f)).uuid()
            for f in ("hybrid", "e4m3")}
    assert len(keys) == 2


def test_rowwise_options_are_validated():
    assert graphpass.Config(fp8="rowwise", fp8_pow2_scales=True).fp8_recipe == "rowwise_pow2"
    assert graphpass.Config(fp8="rowwise").fp8_recipe == "rowwise"
    assert graphpass.Config(fp8="rowwise", kernels="scaled_mm").kernels == "scaled_mm"
    assert [str(u) for u in graphpass.Config(fp8="tensorwise", fp8_pow2_scales=True).unused()] == [
        "fp8_pow2_scales=True has no effect without fp8='rowwise' or fp8='blockwise' (mxfp8's E8M0 "
        "scales are powers of two by construction, tensorwise's are not rounded)"]
    with pytest.raises(ValueError, match="Transformer Engine has no rowwise"):
        graphpass.Config(fp8="rowwise", kernels="te")
    with pytest.raises(ValueError, match="expected a bool"):
        graphpass.Config(fp8="rowwise", fp8_pow2_scales=1)
    with pytest.raises(ValueError, match="E4M3 for every role"):
        recipes.Recipe("rowwise", "HYBRID", power_2_scales=False)
    with pytest.raises(ValueError, match="is_rowwise"):
        recipes.block_shape("rowwise", "input")


# --- dense GEMMs on torch._scaled_mm with rowwise scales -------------------------------------------

def _checked_scaled_mm(monkeypatch, calls):
    """torch._scaled_mm's CPU emulation, held to what the CUDA rowwise kernel takes (torch 2.13's
    checks, and the two cuBLASLt rules of fp8/cublaslt.py): scale_a (M, 1) and scale_b (1, N),
    fp32, contiguous, each in its own allocation; K a multiple of 16; a bf16 output."""
    real = torch_gemms.scaled_mm

    def checked(a, b, *, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        calls.append((tuple(a.shape), tuple(b.shape)))
        assert a.dtype == b.dtype == recipes.E4M3
        assert a.shape[1] % 16 == 0 and b.shape[0] % 16 == 0 and b.shape[1] % 16 == 0
        assert b.stride(0) == 1  # column-major mat2
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        for s in (scale_a, scale_b):
            assert s.dtype == torch.float32 and s.is_contiguous() and s.storage_offset() == 0
        assert out_dtype == torch.bfloat16
        assert bias is None or bias.dtype == torch.bfloat16
        return real(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum)

    monkeypatch.setattr(torch_gemms, "scaled_mm", checked)


class _Conv1D(nn.Module):
    """GPT-2's Conv1D: weight stored [in, out], y = x @ W + b."""

    def __init__(self, k, n):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(k, n) * 0.05)
        self.bias = nn.Parameter(torch.randn(n) * 0.05)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(
            *x.shape[:-1], -1)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.out = nn.Linear(64, 128, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.emb(ids))


# Config options of each all-E4M3 recipe whose expert GEMMs run as one grouped call each.
E4M3_RECIPES = {"rowwise": {"fp8": "rowwise"},
                "rowwise_pow2": {"fp8": "rowwise", "fp8_pow2_scales": True},
                "tensorwise_e4m3": {"fp8": "tensorwise", "fp8_format": "e4m3"}}


def _step(model, inputs, kernels, recipe="rowwise", pow2=False, fixed_grad=False, **options):
    """Outputs and gradients of one step. The loss is ``sum(y^2)``, or with ``fixed_grad`` a
    seeded random gradient of ``y``: then the backward's FP8 operands do not depend on the
    forward's rounding, so two kernels' gradients differ only as their GEMMs do."""
    torch._dynamo.reset()
    params = dict(model.named_parameters())
    for p in params.values():
        p.grad = None
    options = {"fp8": recipe, **({"fp8_pow2_scales": True} if pow2 else {}), **options}
    compiled = torch.compile(model, backend=graphpass.backend(
        codegen="eager", kernels=kernels, fp8_exclude=(), **options))
    inputs = [i.clone().requires_grad_() if i.is_floating_point() else i for i in inputs]
    y = compiled(*inputs)
    if fixed_grad:
        g = torch.Generator(device=y.device).manual_seed(1)
        y.backward(torch.randn(y.shape, generator=g, device=y.device).to(y.dtype))
    else:
        y.float().square().sum().backward()
    return [y.detach()] + [i.grad for i in inputs if i.is_floating_point()] + [
        p.grad.clone() for p in params.values()]


@pytest.mark.parametrize("form", ["linear", "conv1d", "tied"])
@pytest.mark.parametrize("pow2", [False, True])
def test_dense_rowwise_on_scaled_mm_is_the_reference(form, pow2, monkeypatch):
    """nn.Linear (with a bf16 bias, fused), GPT-2's Conv1D ([in, out] weight) and an output
    projection tied to the embedding, bf16, under fp8='rowwise': every GEMM (forward, dgrad,
    wgrad) one rowwise torch._scaled_mm that follows the CUDA kernel's rules, outputs and
    gradients bit-identical to the reference provider."""
    torch.manual_seed(0)
    if form == "linear":
        model, inputs, gemms = nn.Linear(256, 128), [torch.randn(2, 64, 256)], 3
    elif form == "conv1d":
        model, inputs, gemms = _Conv1D(256, 128), [torch.randn(2, 64, 256)], 3
    else:
        model, inputs, gemms = _Tied(), [torch.randint(0, 128, (2, 64))], 3
    model = model.to(torch.bfloat16)
    inputs = [i.to(torch.bfloat16) if i.is_floating_point() else i for i in inputs]
    ref = _step(model, inputs, "reference", pow2=pow2)
    calls = []
    _checked_scaled_mm(monkeypatch, calls)
    got = _step(model, inputs, "scaled_mm", pow2=pow2)
    assert len(calls) == gemms
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    notes = [n for n in graphpass.last_report().notes if n.startswith("lowered")]
    assert notes and all("(scaled_mm/rowwise)" in n for n in notes)


# --- expert GEMMs as one torch._scaled_grouped_mm each ---------------------------------------------

class _TokenGrouped(nn.Module):
    def __init__(self, stored_kn, k=K, n=N):
        super().__init__()
        self.stored_kn = stored_kn
        shape = (E, k, n) if stored_kn else (E, n, k)
        self.weight = nn.Parameter((torch.randn(*shape) * 0.05).to(torch.bfloat16))

    def forward(self, x, offs):
        w = self.weight if self.stored_kn else self.weight.transpose(-2, -1)
        return torch._grouped_mm(x, w, offs=offs)


class _Bmm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter((torch.randn(E, K, N) * 0.05).to(torch.bfloat16))

    def forward(self, x):
        return torch.bmm(x, self.weight)


def _count_grouped(monkeypatch):
    """Each grouped call's form (2d x 3d, 2d x 2d, 3d x 3d), through the emulation that checks
    the kernel's rules; a per-group _scaled_mm would show in the second list."""
    grouped, single = [], []
    real_grouped, real_mm = providers.scaled_grouped_mm_emulated, torch_gemms.scaled_mm

    def grouped_call(a, b, scale_a, scale_b, offs):
        grouped.append(f"{a.dim()}d x {b.dim()}d")
        return real_grouped(a, b, scale_a, scale_b, offs)

    def mm(*args, **kwargs):
        single.append(1)
        return real_mm(*args, **kwargs)

    monkeypatch.setattr(providers, "scaled_grouped_mm_emulated", grouped_call)
    monkeypatch.setattr(torch_gemms, "scaled_mm", mm)
    return grouped, single


@pytest.mark.parametrize("recipe", E4M3_RECIPES)
@pytest.mark.parametrize("stored_kn", [True, False], ids=["EKN", "ENK"])
def test_token_groups_run_one_grouped_call_per_gemm(stored_kn, recipe, monkeypatch):
    """Experts over token groups of 100, 0, 233 and 179 tokens under fp8='rowwise' (and its
    power-of-two scales) and under fp8='tensorwise' with fp8_format='e4m3', with
    kernels='scaled_mm': forward and dgrad one 2d x 3d torch._scaled_grouped_mm each, wgrad one
    2d x 2d (groups at 16-aligned starts: rowwise's operands quantized so, tensorwise's moved
    there on the device), no per-group _scaled_mm;
    outputs and gradients bit-identical to the reference provider, which runs each expert's
    GEMMs on their own. Tensorwise scales (one per token group and per expert) are given to the
    kernel per row, which is the same arithmetic."""
    torch.manual_seed(0)
    model = _TokenGrouped(stored_kn)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    offs = torch.tensor(ENDS, dtype=torch.int32)
    ref = _step(model, [x, offs], "reference", **E4M3_RECIPES[recipe])
    grouped, single = _count_grouped(monkeypatch)
    got = _step(model, [x, offs], "scaled_mm", **E4M3_RECIPES[recipe])
    assert sorted(grouped) == ["2d x 2d", "2d x 3d", "2d x 3d"] and not single
    assert [n for n in graphpass.last_report().notes if n.startswith("grouped gemms")] == [
        "grouped gemms: <root>: forward, dgrad and wgrad each one torch._scaled_grouped_mm (CUDA "
        "sm90+, its emulation on the CPU; one torch._scaled_mm per expert on older GPUs); "
        "accumulation: forward fast, dgrad precise, wgrad precise (fp8_accumulate='te'; 'fast' "
        "for all three as torchao's MoE training)"]
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise_e4m3"])
def test_bmm_experts_run_one_grouped_call_per_gemm(recipe, monkeypatch):
    """bmm experts (capacity 100, not a multiple of 16: the wgrad's contraction is zero-padded)
    under fp8='rowwise' and under tensorwise with fp8_format='e4m3': forward, dgrad and wgrad
    one 3d x 3d torch._scaled_grouped_mm each, bit-identical to the reference provider."""
    torch.manual_seed(0)
    model = _Bmm()
    x = torch.randn(E, 100, K, dtype=torch.bfloat16)
    ref = _step(model, [x], "reference", **E4M3_RECIPES[recipe])
    grouped, single = _count_grouped(monkeypatch)
    got = _step(model, [x], "scaled_mm", **E4M3_RECIPES[recipe])
    assert grouped == ["3d x 3d"] * 3 and not single
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_grouped_calls_pass_torchs_own_checks():
    """The arguments graphpass gives torch._scaled_grouped_mm in its three forms pass torch's
    meta checks (which mirror the CUDA kernel's) on CUDA fake tensors, without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen = []

    def fake_kernel(a, b, *, scale_a, scale_b, offs, out_dtype, use_fast_accum):
        seen.append(f"{a.dim()}d x {b.dim()}d")
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype,
                                        use_fast_accum=use_fast_accum)

    e4 = recipes.E4M3
    with FakeTensorMode(), pytest.MonkeyPatch.context() as m:
        m.setattr(torch_gemms, "scaled_grouped_mm", fake_kernel)
        cuda = lambda *s, dt=e4: torch.empty(*s, dtype=dt, device="cuda")  # noqa: E731
        offs = cuda(len(ENDS), dt=torch.int32)
        out = providers.grouped_mm_call(cuda(T, K), cuda(E, N, K).transpose(-2, -1),
                                        providers.own_rows(cuda(T, 1, dt=torch.float32), (T,)),
                                        cuda(E, N, dt=torch.float32), offs)
        assert out.shape == (T, N) and out.dtype == torch.bfloat16
        out = providers.grouped_mm_call(cuda(K, T + 64), cuda(N, T + 64).t(),
                                        cuda(E * K, dt=torch.float32),
                                        cuda(E * N, dt=torch.float32), offs)
        assert out.shape == (E, K, N)
        out = providers.rowwise_batched(cuda(E, 96, K), cuda(E, 96, 1, dt=torch.float32),
                                        cuda(E, N, K), cuda(E, N, 1, dt=torch.float32),
                                        torch.bfloat16)
        assert out.shape == (E, 96, N)
        with pytest.raises(RuntimeError, match="E4M3"):
            torch._scaled_grouped_mm(cuda(T, K, dt=recipes.E5M2), cuda(E, N, K).transpose(-2, -1),
                                     cuda(T, dt=torch.float32), cuda(E, N, dt=torch.float32),
                                     offs=offs, out_dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match="bfloat16"):  # why fp32 outputs are cast after
            torch._scaled_grouped_mm(cuda(T, K), cuda(E, N, K).transpose(-2, -1),
                                     cuda(T, dt=torch.float32), cuda(E, N, dt=torch.float32),
                                     offs=offs, out_dtype=torch.float32)
    assert seen == ["2d x 3d", "2d x 2d", "3d x 3d"]


def test_tensorwise_grouped_calls_pass_torchs_own_checks(monkeypatch):
    """Tensorwise experts under fp8_format='e4m3' (one scale per token group or expert): the
    arguments graphpass gives torch._scaled_grouped_mm in its three forms (the scalar scales
    given per row, each in its own contiguous allocation) pass torch's meta checks on CUDA fake
    tensors of the same sizes, strides and dtypes. The adapter runs on the CPU (a CPU-only torch
    cannot index fake CUDA tensors), recording each call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    real = providers.grouped_mm_call

    def record(a, b, scale_a, scale_b, offs, *, fast_accum=False):
        calls.append((a, b, scale_a, scale_b, offs))
        for s in (scale_a, scale_b):
            assert s.is_contiguous() and s.storage_offset() == 0
        return real(a, b, scale_a, scale_b, offs, fast_accum=fast_accum)

    monkeypatch.setattr(providers, "grouped_mm_call", record)
    e4 = recipes.E4M3
    q = lambda *s: torch.randn(*s).to(e4)  # noqa: E731
    scales, offs = torch.rand(E) + 0.5, torch.tensor(ENDS, dtype=torch.int32)
    assert providers.tensorwise_grouped(q(T, K), scales, q(E, N, K), scales, offs,
                                        torch.bfloat16).shape == (T, N)
    assert providers.tensorwise_grouped(q(K, T), scales, q(N, T), scales, offs,
                                        torch.bfloat16).shape == (E, K, N)
    assert providers.tensorwise_batched(q(E, 100, K), scales, q(E, N, K), scales,
                                        torch.float32).shape == (E, 100, N)
    forms = []
    with FakeTensorMode():
        like = lambda t: None if t is None else torch.empty_strided(  # noqa: E731
            t.shape, t.stride(), dtype=t.dtype, device="cuda")
        for a, b, sa, sb, o in calls:
            out = torch._scaled_grouped_mm(like(a), like(b), like(sa), like(sb), offs=like(o),
                                           out_dtype=torch.bfloat16)
            assert out.dtype == torch.bfloat16
            forms.append(f"{a.dim()}d x {b.dim()}d")
    assert forms == ["2d x 3d", "2d x 2d", "3d x 3d"]


def test_grouped_rules_refuse_what_the_kernel_refuses():
    """The CPU emulation's checks (fp8/cublaslt.py) refuse each operand the CUDA kernel would
    not take, so a CPU test cannot pass with a call an H100 refuses."""
    e4 = recipes.E4M3
    t = lambda *s, dt=e4: torch.zeros(*s, dtype=dt)  # noqa: E731
    f = lambda *s: torch.ones(*s)  # noqa: E731
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)
    check = cublaslt.check_scaled_grouped_mm
    check(t(64, K), t(3, N, K).transpose(-2, -1), f(64), f(3, N), offs)  # fine
    check(t(K, 64), t(N, 64).t(), f(3 * K), f(3 * N), offs)  # fine
    bad = [
        ((t(64, K, dt=recipes.E5M2), t(3, N, K).transpose(-2, -1), f(64), f(3, N), offs), "E4M3"),
        ((t(64, K), t(3, K, N), f(64), f(3, N), offs), "column-major"),
        ((t(64, K), t(3, N, K).transpose(-2, -1), f(64, 1), f(3, N), offs), "1-D"),
        ((t(64, K), t(3, N, K).transpose(-2, -1), f(64), f(3, N), offs.long()), "int32"),
        ((t(64, 40), t(3, N, 40).transpose(-2, -1), f(64), f(3, N), offs), "multiples of 16"),
        ((t(K, 64), t(N, 64).t(), f(3 * K), f(N), offs), "elements"),
        ((t(K, 64), t(N, 64).t(), f(3 * K), f(3 * N),
          torch.tensor([10, 30, 64], dtype=torch.int32)), "start at multiples of 16"),
        ((t(3, 32, K), t(3, N, K).transpose(-2, -1), f(3, 32), f(3, N), offs), "offsets"),
    ]
    for args, why in bad:
        with pytest.raises(ValueError, match=why):
            check(*args)


def test_aligned_token_positions():
    """The scatter into the 16-aligned token layout (the tensorwise wgrad's operands, quantized in
    (K, T)) of groups 100, 0, 233, 179 (and 12 tokens past the end):
    each token keeps its group and order, groups start at multiples of 16, on the device."""
    offs = torch.tensor(ENDS, dtype=torch.int32)
    positions, padded_offs, padded = providers.aligned_token_positions(offs, T + 12)
    assert padded_offs.tolist() == [112, 112, 352, 544] and padded == 528 + 64
    assert positions[:100].tolist() == list(range(100))
    assert positions[100:333].tolist() == list(range(112, 345))
    assert positions[333:512].tolist() == list(range(352, 531))
    assert positions[512:].tolist() == list(range(544, 556))
    assert int(positions.max()) < padded


# --- quantizes inlined into Inductor's kernels -----------------------------------------------------

@pytest.mark.parametrize("options, k", [(dict(fp8="rowwise", kernels="scaled_mm"), K),
                                        (dict(fp8="tensorwise", fp8_format="e4m3",
                                              kernels="scaled_mm"), K),
                                        (dict(fp8="blockwise", kernels="reference"), 128)],
                         ids=["rowwise", "tensorwise_e4m3", "blockwise"])
def test_grouped_quantizes_are_inlined_and_bit_identical_to_the_op(options, k, monkeypatch):
    """With Inductor (CPU), rowwise, tensorwise and blockwise quantizes, the token-grouped ones
    included (per-(group, column), per-group and per-block scales), are inlined after the
    partition: the generated code calls no graphpass.quantize, and outputs and gradients are
    bit-identical to the opaque op's (fuse_quantize=False), under the same precision settings."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    if not _compat.inductor_rounds_fused_casts(device_types=["cpu"]):
        pytest.skip("this torch's Inductor CPU code leaves quantizes one op (a report note)")
    torch.manual_seed(0)
    model = _TokenGrouped(stored_kn=False, k=k, n=k)  # blockwise: whole 128-blocks along K, N
    x = torch.randn(T, k, dtype=torch.bfloat16)
    offs = torch.tensor(ENDS, dtype=torch.int32)

    def step(fuse):
        torch._dynamo.reset()
        model.weight.grad = None
        compiled = torch.compile(model, backend=graphpass.backend(**options, fuse_quantize=fuse))
        xx = x.clone().requires_grad_()

        def run():
            y = compiled(xx, offs)
            y.float().square().sum().backward()
            return y.detach()

        y, code = run_and_get_code(run)
        return [y, xx.grad, model.weight.grad.clone()], "\n".join(code)

    with inductor_config.patch(emulate_precision_casts=True):
        opaque, opaque_code = step(False)
    fused, fused_code = step(True)
    call = "torch.ops.graphpass.quantize.default("
    assert call in opaque_code and call not in fused_code
    assert "graphpass.fp8_gemm" in fused_code
    for a, b in zip(fused, opaque):
        assert torch.equal(a, b)


@pytest.mark.parametrize("form", ["bmm", "token_groups"])
def test_tensorwise_experts_say_what_still_loops(form, monkeypatch):
    """Never silent: under tensorwise's HYBRID format (the default), the scaled_mm provider's
    expert forward is one grouped call and dgrad and wgrad are one _scaled_mm per expert (E5M2
    gradients, which the grouped kernel refuses); the report says so, and the CPU run makes
    exactly those calls. With fp8_format='e4m3' the note says all three are grouped and the run
    makes one grouped call per GEMM and no _scaled_mm."""
    torch.manual_seed(0)
    if form == "bmm":
        model, inputs, forms = _Bmm(), [torch.randn(E, 96, K, dtype=torch.bfloat16)], ["3d x 3d"]
        loops = 2 * E
    else:
        model = _TokenGrouped(stored_kn=False)
        inputs = [torch.randn(T, K, dtype=torch.bfloat16), torch.tensor(ENDS, dtype=torch.int32)]
        forms, loops = ["2d x 3d"], 2 * 3  # dgrad and wgrad of the 3 non-empty groups
    grouped, single = _count_grouped(monkeypatch)
    _step(model, inputs, "scaled_mm", recipe="tensorwise")
    assert grouped == forms and len(single) == loops
    [note] = [n for n in graphpass.last_report().notes if n.startswith("grouped gemms")]
    assert "dgrad and wgrad one torch._scaled_mm per expert" in note and "E5M2" in note
    grouped.clear(), single.clear()
    _step(model, inputs, "scaled_mm", recipe="tensorwise", fp8_format="e4m3")
    assert len(grouped) == 3 and not single
    [note] = [n for n in graphpass.last_report().notes if n.startswith("grouped gemms")]
    assert note.startswith("grouped gemms: <root>: forward, dgrad and wgrad each one "
                           "torch._scaled_grouped_mm")
    assert "per expert:" not in note and "E5M2" not in note


# --- on an H100: the real kernels against the reference provider -----------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise_e4m3"])
@pytest.mark.parametrize("form", ["linear", "token_groups", "bmm"])
def test_rowwise_kernels_match_the_reference_on_cuda(form, recipe):
    """CUDA sm90+: rowwise torch._scaled_mm and torch._scaled_grouped_mm (forward, dgrad, wgrad,
    groups of 100, 0, 233, 179 tokens) against the reference provider on the same device: the
    same FP8 operands and scales, accumulation in another order (and fast in the forward GEMM),
    so close, not equal. The same for tensorwise with fp8_format='e4m3', whose expert GEMMs take
    the same grouped calls (dense GEMMs: tensorwise torch._scaled_mm).

    The backward is seeded with a fixed gradient: with ``sum(y^2)`` the gradient is ``2y``, so
    the forward's few-ulp differences moved some of its values across an FP8 rounding boundary
    (an E4M3 step is 6-12%), and the gradients differed by that (0.03-0.04 on 0.1-1% of their
    elements on an H200), which says nothing about the kernels."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    torch.manual_seed(0)
    if form == "linear":
        model, inputs = nn.Linear(256, 128), [torch.randn(2, 64, 256)]
    elif form == "token_groups":
        model, inputs = _TokenGrouped(False), [torch.randn(T, K), torch.tensor(ENDS, dtype=torch.int32)]
    else:
        model, inputs = _Bmm(), [torch.randn(E, 100, K)]
    model = model.to("cuda", torch.bfloat16)
    inputs = [i.to("cuda", torch.bfloat16) if i.is_floating_point() else i.to("cuda")
              for i in inputs]
    ref = _step(model, inputs, "reference", fixed_grad=True, **E4M3_RECIPES[recipe])
    got = _step(model, inputs, "scaled_mm", fixed_grad=True, **E4M3_RECIPES[recipe])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)


# --- coverage: rowwise lowers what tensorwise lowers ------------------------------------------------

@pytest.mark.parametrize("name", ["deepseek", "mixtral"])
def test_rowwise_lowers_every_gemm_tensorwise_lowers(name):
    """FP8 coverage of GEMM FLOPs under rowwise and under tensorwise's all-E4M3 format equals
    tensorwise's (HYBRID) on the tiny DeepSeek example (MLA, bmm experts) and the tiny Hugging
    Face Mixtral (bf16, torch._grouped_mm experts), with nothing excluded: the same linears
    lowered, the same FP8 FLOPs."""
    if name == "deepseek":
        from graphpass.models import deepseek

        # one layer: the tiny model's layers are the same block (MLA, shared and routed bmm
        # experts), so one holds every kind of linear the comparison covers, traced once a plan
        model, inputs = deepseek.build("tiny", seq=64, layers=1)
    else:
        transformers = pytest.importorskip("transformers")
        cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=512,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=256,
                                         num_local_experts=4, num_experts_per_tok=2,
                                         max_position_embeddings=64,
                                         experts_implementation="grouped_mm")
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
        inputs = [torch.randint(0, 256, (2, 64))]
    got = {}
    for recipe, options in (("tensorwise", {"fp8": "tensorwise"}), ("rowwise", {"fp8": "rowwise"}),
                            ("tensorwise_e4m3", E4M3_RECIPES["tensorwise_e4m3"])):
        report = graphpass.plan(model, *inputs, config=graphpass.Config(fp8_exclude=(), **options))
        lowered = sorted(n.split(" (")[0] for n in report.notes if n.startswith("lowered: "))
        got[recipe] = (lowered, report.meta["fp8_coverage"]["fp8_flops"],
                       report.meta["fp8_coverage"]["fp8_share"])
    assert got["rowwise"] == got["tensorwise"] == got["tensorwise_e4m3"]
    assert any("experts" in n for n in got["rowwise"][0])


@pytest.mark.parametrize("chunk", [1, 7, 16, 128])
def test_group_column_amax_is_each_groups_own_max(chunk):
    """The rowwise grouped quantize's column maxima per token group (chunked, no scatter atomics)
    equal each group's own max bit for bit, over random group ends: empty groups (0), groups
    inside one chunk, groups over many, rows past the last group left out."""
    import random

    from graphpass.fp8 import ops

    for trial in range(60):
        rng = random.Random(trial)
        torch.manual_seed(trial)
        t, k = rng.randint(1, 400), rng.randint(1, 6)
        ends = sorted(rng.randint(0, t) for _ in range(rng.randint(1, 10)))
        a = torch.rand(t, k, dtype=rng.choice([torch.bfloat16, torch.float32])) * 10
        got = ops._group_column_amax(a, torch.tensor(ends, dtype=torch.int32), chunk)
        start = 0
        for g, end in enumerate(ends):
            want = a[start:end].amax(0) if end > start else torch.zeros(k, dtype=a.dtype)
            assert torch.equal(got[g], want), (trial, g, start, end)
            start = end


# --- the wgrad's operands in the 16-aligned token layout, written by the quantize -----------------

# Token groups (ends over 524 rows) covering the layout's cases: ragged groups, empty ones (first,
# middle, last), groups of whole multiples of 16, and rows past offs[-1] (none, or 12 to 524).
ALIGNED_CASES = {"ragged": [100, 100, 333, 512], "multiples_of_16": [16, 160, 160, 512],
                 "empty_ends": [0, 0, 233, 233], "all_rows": [17, 48, 301, 524],
                 "none": [0, 0, 0, 0]}


def _unaligned_rowwise_columnwise(x, offs):
    """The columnwise rowwise copy of token-grouped x in (K, T), each group in its own columns
    ``offs[g-1]:offs[g]`` (what ``ops._quantize_groups_rowwise`` wrote before the aligned layout;
    its data then moved to the aligned layout in the GEMM by ``providers._scatter_tokens``)."""
    from graphpass.fp8 import ops

    t, k = x.shape
    groups = offs.shape[0]
    group = providers.group_of_rows(offs, t)
    a = x.abs()
    amax = ops._group_column_amax(torch.where(torch.isnan(a), 0.0, a), offs).float()
    scale = recipes.tensorwise_scale(amax, "rowwise", "input")
    row_scale = torch.cat([scale, scale.new_ones((1, k))])[group]
    data = recipes.scaled_cast(torch.where((group < groups)[:, None], x.float(), 0.0), row_scale,
                               "rowwise", "input")
    return data.t().contiguous(), recipes.reciprocal(scale)


def test_aligned_quantize_is_the_unaligned_one_moved_to_aligned_starts():
    """The rowwise columnwise copy over token groups, written in the 16-aligned token layout by a
    gather, is bit for bit the (K, T) copy with its tokens moved to the aligned group starts by
    the scatter (``index_copy_``) the wgrad ran on it: every column, padding zero bytes included;
    the same scales. For each case of ALIGNED_CASES, in eager and compiled by Inductor (CPU, one
    compile for all cases: the offsets are an input), whose code has no scatter. Rows past
    offs[-1] hold inf and NaN that no column shows; a NaN inside a group is NaN in its column
    (eager: the same byte; Inductor's cast may flip a NaN's sign bit)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import ops

    torch.manual_seed(0)
    t = 524
    compiled = torch.compile(
        lambda x, offs: ops._quantize(x, "rowwise", "input", "columnwise", offs),
        backend="inductor", dynamic=False)
    # by hand from the layout's formula: ceil(524 / 16) * 16 + 16 * G columns
    columns = -(-t // 16) * 16 + 16 * 4
    code = None
    for case, ends in ALIGNED_CASES.items():
        x = torch.randn(t, K, dtype=torch.bfloat16) * torch.logspace(-2, 2, K).to(torch.bfloat16)
        x[120:200] *= 1000
        x[150, 3] = float("nan")
        if ends[-1] < t:
            x[-2, 0], x[-1, 1] = float("inf"), float("nan")
        offs = torch.tensor(ends, dtype=torch.int32)
        old_data, old_scale = _unaligned_rowwise_columnwise(x, offs)
        positions, _, old_columns = providers.aligned_token_positions(offs, t)
        assert old_columns == columns
        want = providers._scatter_tokens(old_data, positions, columns)
        eager = torch.ops.graphpass.quantize(x, "rowwise", "input", "columnwise", offs)
        with inductor_config.patch(emulate_precision_casts=True):
            if code is None:  # the one compile (run_and_get_code resets dynamo first)
                fused, code = run_and_get_code(compiled, x, offs)
            else:  # the same code for the other offsets: a recompile would raise
                with torch._dynamo.config.patch(error_on_recompile=True):
                    fused = compiled(x, offs)
        for data, scale in (eager, fused):
            assert data.shape == (K, columns) and scale.shape == (len(ends), K), case
            # a NaN's FP8 byte may differ in its sign bit (Inductor's cast against eager's)
            nan = want.float().isnan()
            assert torch.equal(data.float().isnan(), nan), case
            assert torch.equal(data.view(torch.uint8)[~nan], want.view(torch.uint8)[~nan]), case
            assert torch.equal(scale, old_scale), case
        assert torch.equal(eager[0].view(torch.uint8), want.view(torch.uint8)), case
    code = "\n".join(code)
    assert "index_copy" not in code and "scatter" not in code
    assert "graphpass.quantize" not in code
    # the (K, P) FP8 copy is allocated once and written by a generated kernel, nothing else
    assert code.count(f"empty_strided_cpu(({K}, {columns}), ({columns}, 1), "
                      "torch.float8_e4m3fn)") == 1


def test_aligned_token_sources():
    """The gather of the 16-aligned token layout for groups of 100, 0, 233 and 179 tokens (and
    12 rows past the end, in no column), by hand: groups from columns 0, 112, 112 and 352 (each
    size rounded up to 16, summed), each holding its tokens in order, then padding."""
    offs = torch.tensor(ENDS, dtype=torch.int32)
    columns = providers.aligned_tokens(T + 12, len(ENDS))
    assert columns == 528 + 64
    group, token, valid = providers.aligned_token_sources(offs, columns)
    assert providers.aligned_group_ends(offs).tolist() == [112, 112, 352, 544]
    assert valid.nonzero().flatten().tolist() == [*range(100), *range(112, 345), *range(352, 531)]
    assert token[valid].tolist() == list(range(T))
    assert group[:112].eq(0).all() and group[112:352].eq(2).all() and group[352:544].eq(3).all()
    assert group[544:].eq(len(ENDS)).all() and token[~valid].eq(0).all()


class _GroupedByHand(torch.autograd.Function):
    """``torch._grouped_mm(x, w.transpose(-2, -1), offs)`` under the rowwise recipe by hand, one
    token group at a time (tests/test_fp8_experts.py's per-group qdq): forward, dgrad and wgrad
    each from the group's own quantized operands, accumulated in fp32; rows past the last group,
    and an empty group's weight gradient, 0."""

    @staticmethod
    def forward(ctx, x, w, ends):
        from test_fp8_experts import _dq, _qdq_group

        ctx.save_for_backward(x, w)
        ctx.ends = ends
        y = x.new_zeros(x.shape[0], w.shape[1])
        for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
            if end > start:
                y[start:end] = (_qdq_group(x[start:end], "rowwise", "input")
                                @ _dq(w[g], "rowwise", "weight").t())
        return y

    @staticmethod
    def backward(ctx, dy):
        from test_fp8_experts import _dq, _qdq_group

        x, w = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        for g, (start, end) in enumerate(zip([0, *ctx.ends[:-1]], ctx.ends)):
            if end > start:
                dyg, xg = dy[start:end], x[start:end]
                dx[start:end] = (_qdq_group(dyg, "rowwise", "grad")
                                 @ _dq(w[g], "rowwise", "weight", True))
                dw[g] = (_qdq_group(dyg, "rowwise", "grad", True).t()
                         @ _qdq_group(xg, "rowwise", "input", True))
        return dx, dw, None


def test_experts_step_on_aligned_wgrad_operands_is_the_per_group_recipe(monkeypatch):
    """The benchmarks' routed experts (size "tiny": SwiGLU over 4 token groups, H 256, I 128,
    512 rows) over groups of 0, 96, 237 and 167 tokens and 12 rows past offs[-1], one training
    step under fp8='rowwise': outputs and gradients bit-identical to the per-group recipe by
    hand, with kernels='scaled_mm' (codegen eager, and Inductor, whose inlined quantizes write
    the aligned layout) and 'reference' (one GEMM per group on its columns of that layout).
    Under scaled_mm each GEMM is one grouped call (the emulation checks the CUDA kernel's rules:
    16-aligned groups in the 2d x 2d wgrad) and no operand is scattered."""
    import torch.nn.functional as F

    from benchmarks import _experts

    ends = [0, 96, 333, 500]
    g = torch.Generator().manual_seed(1)
    dy = (torch.randn(512, 256, generator=g) * 0.02).to(torch.bfloat16)

    def step(compiled_with=None):
        torch._dynamo.reset()
        model, (x, _) = _experts.build("tiny")
        experts = model.mlp.experts
        x = x.detach().requires_grad_()
        if compiled_with is None:
            gate, up = _GroupedByHand.apply(x, experts.gate_up_proj, ends).chunk(2, -1)
            y = _GroupedByHand.apply(F.silu(gate) * up, experts.down_proj, ends)
        else:
            y = torch.compile(model, backend=graphpass.backend(**compiled_with, fp8="rowwise",
                                                               fp8_exclude=()))(
                x, torch.tensor(ends, dtype=torch.int32))
        y.backward(dy)
        return [y.detach(), x.grad, experts.gate_up_proj.grad, experts.down_proj.grad]

    def no_scatter(*args):
        raise AssertionError("a wgrad operand scattered to the aligned layout in the GEMM")

    want = step()
    monkeypatch.setattr(providers, "_scatter_tokens", no_scatter)
    assert all(torch.equal(a, b) for a, b in zip(
        step(dict(codegen="eager", kernels="reference")), want))
    grouped, single = _count_grouped(monkeypatch)
    # torch 2.11's Inductor C++ code is no numerical reference for a bf16 step (the SwiGLU
    # between the GEMMs; DEVELOPERS.md): there the Inductor step is not compared
    exact = _compat.inductor_rounds_fused_casts(device_types=["cpu"])
    for codegen in ("eager", "inductor"):
        grouped.clear()
        got = step(dict(codegen=codegen, kernels="scaled_mm"))
        assert sorted(grouped) == ["2d x 2d"] * 2 + ["2d x 3d"] * 4 and not single, codegen
        if codegen == "eager" or exact:
            # y and dx bit for bit; the weight gradients to within rounding: the 2d x 2d kernel
            # (and its CPU emulation) contracts each group over its 16-aligned columns, zero
            # padding included, and a CPU matmul's fp32 sums over a longer contraction may
            # round differently (an AMD EPYC's did: 13 of 393,216 elements one or two bf16
            # ulps apart), so within a bf16 ulp of the tensor's largest value
            assert all(torch.equal(a, b) for a, b in zip(got[:2], want[:2])), codegen
            for a, b in zip(got[2:], want[2:]):
                torch.testing.assert_close(a, b, rtol=0, atol=2**-8 * b.abs().max().item(),
                                           msg=codegen)


def test_grouped_gemms_note_says_how_each_gemm_accumulates():
    """The expert linears' note names each GEMM's accumulation and the option that changes it
    (torchao's MoE training accumulates all three fast); blockwise, whose cuBLASLt kernel has
    no fast mode with 128x128 scales, says nothing of it."""
    from graphpass.fp8 import recipes
    from graphpass.passes.lower_fp8 import _grouped_kernels

    fast = recipes.from_options("rowwise", fp8_accumulate="fast")
    assert _grouped_kernels(fast).endswith(
        "accumulation: forward fast, dgrad fast, wgrad fast (fp8_accumulate='fast'; 'fast' for "
        "all three as torchao's MoE training)")
    precise = recipes.from_options("tensorwise", fp8_accumulate="precise")
    assert "accumulation: forward precise, dgrad precise, wgrad precise" in _grouped_kernels(
        precise)
    assert "accumulation" not in _grouped_kernels(recipes.from_options("blockwise"))
