"""FP8 lowering of linear layers: exact against the recipe emulation, close to high precision."""

import fnmatch
import importlib.util

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import graphpass
from graphpass import _compat
from graphpass.fp8 import providers, recipes, torch_gemms
from graphpass.models import deepseek, gpt, llama

RECIPES = ("tensorwise", "blockwise", "mxfp8", "rowwise")
# Relative error (Frobenius) of FP8 vs fp32 on N(0, 1) data with K = 256: E4M3 keeps 3
# mantissa bits (2^-4 relative step), E5M2 for gradients 2 (2^-3). Blockwise and mxfp8 scale
# per block, so they do no worse than tensorwise; the gradients carry E5M2 error (tensorwise)
# or E4M3 error (blockwise/mxfp8, E4M3 everywhere). Measured: <= 0.06 forward, <= 0.12 grads.
BOUND = {"forward": 0.08, "grad": 0.16}


def _run(model, x, fn):
    model.zero_grad()
    x = x.detach().requires_grad_()
    y = fn(x)
    y.float().pow(2).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return y.detach(), x.grad, grads


def _emulated_linear(x2d, w, b, grad_y, recipe):
    """The three GEMMs of a lowered linear, written out from the recipe's qdq by hand."""
    q = lambda t, role, col=False: recipes.qdq(t, recipe, role, columnwise=col).float()  # noqa
    y = q(x2d, "input") @ q(w, "weight").t() + (b.float() if b is not None else 0)
    dx = q(grad_y, "grad") @ q(w, "weight", True)
    dw = q(grad_y, "grad", True).t() @ q(x2d, "input", True)
    return y, dx, dw


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_lowered_linear_is_exactly_the_recipe(recipe, bias):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=bias)
    x = torch.randn(128, 256)
    grad_y = torch.randn(128, 128)
    compiled = torch.compile(lin, backend=graphpass.backend(codegen="eager", fp8=recipe,
                                                             kernels="reference"))
    xx = x.clone().requires_grad_()
    y = compiled(xx)
    y.backward(grad_y)
    ref_y, ref_dx, ref_dw = _emulated_linear(x, lin.weight.detach(), lin.bias, grad_y, recipe)
    torch.testing.assert_close(y, ref_y, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(xx.grad, ref_dx, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lin.weight.grad, ref_dw, rtol=1e-6, atol=1e-5)
    if bias:
        torch.testing.assert_close(lin.bias.grad, grad_y.sum(0))  # bias grad stays exact
    assert _lowering(graphpass.last_report().notes) == [f"lowered: <root> (reference/{recipe})"]


@pytest.mark.parametrize("shape", [(128, 256), (2, 64, 256)], ids=["2d", "3d"])
@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lowered_linear_close_to_high_precision(recipe, shape, dtype):
    torch.manual_seed(0)
    model = nn.Linear(256, 256).to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    ref = _run(model, x, model)
    got = _run(model, x, torch.compile(model, backend=graphpass.backend(codegen="eager", fp8=recipe)))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(got[0], ref[0]) < BOUND["forward"]
    assert rel(got[1], ref[1]) < BOUND["grad"]
    assert rel(got[2]["weight"], ref[2]["weight"]) < BOUND["grad"]
    # the bias grad is an exact sum of dY, but dY = 2y carries the forward's FP8 error
    assert rel(got[2]["bias"], ref[2]["bias"]) < BOUND["forward"]
    assert _lowering(graphpass.last_report().notes) == [f"lowered: <root> (reference/{recipe})"]
    fp8_rows = [r for r in graphpass.last_report().rows if r.kind == "fp8_data"]
    assert fp8_rows, "the quantized input must be what is saved for wgrad"


def _lowering(notes):
    return [n for n in notes if n.startswith(("lowered:", "not lowered:"))]


def _notes(model_module, recipe, **build):
    model, inputs = model_module.build("tiny", **build)
    return _lowering(graphpass.plan(model, *inputs, config=graphpass.Config(fp8=recipe)).notes)


def _linear_paths(model):
    return {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("module", [llama, gpt, deepseek], ids=["llama", "gpt", "deepseek"])
def test_every_linear_is_lowered_or_has_a_reason(module, recipe):
    # seq 64 makes M = 128 tokens, which blockwise needs.
    notes = _notes(module, recipe, seq=64)
    model, _ = module.build("tiny", seq=64)
    said = {n.split(": ", 1)[1].split(" (")[0].split(":")[0]: n for n in notes}
    assert _linear_paths(model) <= set(said), f"linears without a decision: {_linear_paths(model) - set(said)}"
    for path, note in said.items():
        excluded = any(fnmatch.fnmatchcase(path, p) for p in graphpass.Config().fp8_exclude)
        if excluded:
            assert note.startswith("not lowered") and "excluded by pattern" in note
        elif path.endswith("experts") and recipe == "blockwise":
            # grouped bmm experts are lowered (tests/test_fp8_experts.py), but the tiny model's
            # expert capacity is 64 tokens, short of blockwise's 128
            assert note == f"not lowered: {path}: M=64 not a multiple of 128"
        elif module is deepseek and path.endswith("kv_a_proj_with_mqa") and recipe == "blockwise":
            assert note.endswith("N=160 not a multiple of 128")  # 128 latent + 32 rope dims
        else:
            assert note == f"lowered: {path} (reference/{recipe})", note


def test_reasons_for_not_lowering():
    model = nn.Sequential(nn.Linear(50, 64), nn.Linear(64, 64), nn.Linear(64, 64))
    x = torch.randn(32, 50, requires_grad=True)
    cfg = graphpass.Config(fp8="tensorwise", fp8_exclude=("2",), fp8_min_gemm_flops=2 * 32 * 64 * 64 + 1)
    notes = _lowering(graphpass.plan(model, x, config=cfg).notes)
    assert notes == [
        "not lowered: 0: K=50 not a multiple of 16",
        "not lowered: 1: GEMM of 262,144 FLOPs is below fp8_min_gemm_flops=262,145",
        "not lowered: 2: excluded by pattern '2'",
    ]


def test_tokens_need_no_alignment_under_tensorwise_only():
    """M (the tokens) is the wgrad's contraction: block recipes scale it in blocks, so it must be
    a static multiple of their block; tensorwise has no block there and the providers pad the
    contraction to 16, so any M, a dynamic one included, is lowered, with the gradients of the
    same batch compiled static."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    x = torch.randn(40, 32, requires_grad=True)
    for recipe, block in (("blockwise", 128), ("mxfp8", 32)):
        notes = _lowering(graphpass.plan(nn.Linear(128, 128), torch.randn(40, 128),
                                         config=graphpass.Config(fp8=recipe)).notes)
        assert notes == [f"not lowered: <root>: M=40 not a multiple of {block}"]

    def grads(batch, dynamic):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=graphpass.backend(
            codegen="eager", fp8="tensorwise", kernels="reference"), dynamic=dynamic)
        xb = x.detach()[:batch].clone().requires_grad_()
        compiled(xb).square().sum().backward()
        out = [xb.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        return out, graphpass.last_report()

    for batch in (37, 5):
        (dyn, report), (static, _) = grads(batch, True), grads(batch, False)
        assert _lowering(report.notes) == ["lowered: 0 (reference/tensorwise)",
                                           "lowered: 2 (reference/tensorwise)"]
        assert any(r.kind == "symint" for r in report.rows)  # M was dynamic
        assert all(torch.equal(a, b) for a, b in zip(dyn, static))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_eager_tensorwise_pair_is_bit_identical_to_two_quantizes(dtype, role):
    """The op's eager tensorwise "both" (one amax, the columnwise copy a transpose of the
    rowwise bytes) gives the bits of quantizing x and x.t() separately, as Inductor inlines it:
    random values, overflow past the FP8 range, NaN, inf, zeros, an empty and an odd shape."""
    from graphpass.fp8 import ops

    torch.manual_seed(0)
    big = torch.randn(48, 80) * 1e4
    big[3, 5], big[7, 1], big[0, 0] = float("nan"), float("inf"), -float("inf")
    for x in (torch.randn(64, 96) * 3, torch.randn(17, 33) * 1e-6, big, torch.zeros(16, 32),
              torch.empty(0, 16)):
        x = x.to(dtype)
        got = torch.ops.graphpass.quantize(x, "tensorwise", role, "both")
        want = ops._quantize(x, "tensorwise", role, "both")
        assert len(got) == len(want) == 4
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
            if g.element_size() == 1:
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
            else:
                assert torch.equal(g, w)


def test_each_forward_tensor_is_quantized_once():
    """q, k and v read one norm output: it is quantized once per usage, and saved once."""
    model, inputs = llama.build("tiny", layers=1)
    cfg = graphpass.Config(fp8="tensorwise", save_original="never", memory="default")
    rows = graphpass.plan(model, *inputs, config=cfg).rows
    fp8 = sorted((r.module.rsplit(".", 1)[-1], r.shape) for r in rows if r.kind == "fp8_data")
    # Columnwise copies (K x M, M = 64 tokens) of the 4 distinct linear inputs, one per tensor
    # (q/k/v share one, gate/up another). Weights re-quantize from the resident parameter.
    assert fp8 == sorted([
        ("q_proj", (256, 64)), ("o_proj", (256, 64)), ("gate_proj", (256, 64)), ("down_proj", (512, 64))])


def test_fp8_weight_once_saves_each_weights_dgrad_copy():
    """``fp8_weight_once``: each weight's two copies come from one forward quantize, and dgrad's
    (W.T, K x N, 1 byte per element, plus its fp32 tensorwise scale) is saved. Worked out by hand
    for the tiny Llama layer's seven linears (q 256x256, k and v 128x256, o 256x256, gate and
    up 512x256, down 256x512): 589,824 bytes of FP8 data and 7 scales of 4 bytes more than the
    default, which re-quantizes dgrad's copy from the resident weight in the backward. A note per
    weight says so."""
    model, inputs = llama.build("tiny", layers=1)
    options = dict(fp8="tensorwise", save_original="never", memory="default")
    default = graphpass.plan(model, *inputs, config=graphpass.Config(**options))
    once = graphpass.plan(model, *inputs, config=graphpass.Config(**options, fp8_weight_once=True))
    weights = {"q_proj": (256, 256), "k_proj": (256, 128), "v_proj": (256, 128),
               "o_proj": (256, 256), "gate_proj": (256, 512), "up_proj": (256, 512),
               "down_proj": (512, 256)}

    def fp8_rows(report):
        return sorted((r.module.rsplit(".", 1)[-1], r.shape) for r in report.rows
                      if r.kind == "fp8_data")

    assert fp8_rows(once) == sorted(fp8_rows(default) + list(weights.items()))
    assert once.activation_bytes - default.activation_bytes == 589_824 + 7 * 4
    for name, (k, n) in weights.items():
        module = ("layers.0.self_attn." if name[0] in "qkvo" else "layers.0.mlp.") + name
        assert (f"fp8_save_quantized_weight: {module}: the weight's two FP8 copies quantized in the "
                f"forward, from one read; dgrad's copy saved ({k * n + 4:,} B)") in once.notes


def test_delayed_scaling_is_refused_with_alternatives():
    with pytest.raises(ValueError, match="DelayedScaling.*'tensorwise'.*'blockwise'.*'mxfp8'"):
        graphpass.backend(fp8="delayed")


def test_scaled_mm_matches_reference_on_cpu():
    """_scaled_mm's CPU emulation against the reference provider, in both accumulation modes of
    its forward GEMM: the forward within one bf16 ulp (its bias is added to the bf16-rounded
    product in the GEMM's epilogue, the reference's to the fp32 one: one element of 4,096
    differs here), the gradients (no bias; precise under the default) bit for bit."""
    torch.manual_seed(0)
    model = nn.Linear(128, 64).to(torch.bfloat16)
    x = torch.randn(2, 32, 128, dtype=torch.bfloat16)

    def run(**options):
        return _run(model, x, torch.compile(model, backend=graphpass.backend(
            codegen="eager", fp8="tensorwise", **options)))

    ref = run(kernels="reference")
    for options in ({}, {"fp8_accumulate": "precise"}):
        y, dx, grads = run(kernels="scaled_mm", **options)
        torch.testing.assert_close(y, ref[0], rtol=2**-7, atol=0)
        torch.testing.assert_close((dx, grads["weight"]), (ref[1], ref[2]["weight"]),
                                   rtol=0, atol=0)


def test_scaled_mm_refuses_block_recipes():
    """TE runs tensorwise only; torch's scaled_mm tensorwise and blockwise, not mxfp8."""
    for kernels, recipe in (("te", "blockwise"), ("te", "mxfp8"), ("scaled_mm", "mxfp8")):
        with pytest.raises(ValueError, match=f"kernels='{kernels}' with fp8='{recipe}'.*'reference'"):
            graphpass.Config(fp8=recipe, kernels=kernels)
    assert graphpass.Config(fp8="blockwise", kernels="scaled_mm").kernels == "scaled_mm"
    assert "blockwise FP8 GEMM" in providers.get("scaled_mm").supports("blockwise",
                                                                       torch.device("cpu"))


@pytest.mark.parametrize("m,n,k", [(8192, 14336, 4096), (256, 128, 512)])
def test_scaled_mm_layouts_pass_cuda_checks(m, n, k):
    """The three GEMMs' operands, as the lowering passes them, under CUDA's meta checks."""
    provider = providers.get("scaled_mm")
    with FakeTensorMode(allow_non_fake_inputs=False):
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        fake = lambda *s, dt=e4: torch.empty(*s, dtype=dt, device="cuda")  # noqa: E731
        scale = torch.ones((), device="cuda")
        bias = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        # fprop X(M,K) . W(N,K)^T ; dgrad dY(M,N) . (W^T)(K,N)^T ; wgrad (dY^T)(N,M) . (X^T)(K,M)^T
        for a, b, out_shape, bias_ in ((fake(m, k), fake(n, k), (m, n), bias),
                                      (fake(m, n, dt=e5), fake(k, n), (m, k), None),
                                      (fake(n, m, dt=e5), fake(k, m), (n, k), None)):
            out = provider.gemm(a, scale, b, scale, "tensorwise", "x", "y", torch.bfloat16, bias_)
            assert tuple(out.shape) == out_shape and out.device.type == "cuda"
        # and the check is real: a row-major mat2 is refused
        with pytest.raises(RuntimeError):
            torch._scaled_mm(fake(m, k), fake(k, n), scale_a=scale, scale_b=scale,
                             out_dtype=torch.bfloat16)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="transformer_engine is not installed")
def test_te_calls_match_installed_signatures():
    import inspect

    from graphpass.fp8 import te

    for path, kwargs in te.CALLS.items():
        module, _, name = path.rpartition(".")
        fn = getattr(importlib.import_module(module), name)
        params = inspect.signature(fn).parameters
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        missing = [k for k in kwargs if k not in params]
        assert not missing or accepts_kwargs, f"{path} has no parameter(s) {missing}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_providers_agree_on_gpu():
    torch.manual_seed(0)
    model = nn.Linear(4096, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    kinds = ["reference", "scaled_mm"] + (["te"] if providers.te_available() else [])
    outs = {k: _run(model, x, torch.compile(model, backend=graphpass.backend(
        fp8="tensorwise", kernels=k))) for k in kinds}
    for k in kinds[1:]:
        for got, ref in zip(outs[k][:2], outs["reference"][:2]):
            assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 1e-2, k


# --- Inductor code generation of quantize -------------------------------------------------------

def _inductor_step(model, inputs, **cfg):
    """Outputs, gradients and generated code of one compiled bf16 step with Inductor."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    compiled = torch.compile(model, backend=graphpass.backend(codegen="inductor", **cfg))

    def step():
        out = compiled(*xs)
        out.float().pow(2).mean().backward()
        return out.detach()

    out, code = run_and_get_code(step)
    return [out, xs[0].grad, *(p.grad.clone() for p in model.parameters())], "\n".join(code)


def _count_quantizes(seen: list):
    """A user's Inductor post-grad pass: counts the graphpass.quantize nodes it is shown."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class Count(CustomGraphPass):
        def __call__(self, graph):
            seen.append(sum(n.target is torch.ops.graphpass.quantize.default for n in graph.nodes))

        def uuid(self):
            return "count-quantizes"

    return Count()


_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])


def _rel_error(a, b):
    """Relative Frobenius error of ``a`` against ``b``."""
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("device", ["cpu", _CUDA])
def test_inlined_quantize_is_bit_identical_to_the_op(device, recipe, monkeypatch):
    """With Inductor, every tensorwise and blockwise quantize (1x128 activations and gradients,
    128x128 weights, both copies) is inlined after the partition and fused,
    gradients' included: the generated code calls no graphpass.quantize. The contract is bounded
    (tests/test_fp8_lowering.py::test_fused_quantize_is_within_one_fp8_ulp_of_the_op); on the CPU
    Inductor reads the bf16-rounded values eager reads (emulate_precision_casts), so outputs and
    gradients of a bf16 Llama layer are bit-identical to the opaque op's; on CUDA they are held
    to the recipe's bound against the opaque run. Inlining sets Inductor's
    emulate_precision_casts, so the opaque run gets it too: without it, the other fused bf16 ops
    of the layer round differently and nothing would be comparable. Against graphpass's eager
    code generation (the same FP8 recipe, no Inductor), the fused step is within the recipe's
    bound.

    Every FP8 GEMM gets its operands K-major as Inductor lays them out, with no copy: fused, a
    columnwise copy would otherwise be written in the transposed gradient's stride order, which
    cuBLASLt refuses ("Only multiplication of row-major and column-major matrices", seen on an
    H100 before fp8_gemm asked Inductor for fixed strides). Blockwise (the reference provider)
    is the case where Inductor's C++ loop split mishandled the fused copies
    (``_compat.guard_cpp_loop_split``)."""
    from torch._inductor import config as inductor_config

    from graphpass.fp8 import ops

    strides, k_major = [], ops._k_major
    monkeypatch.setattr(ops, "_k_major", lambda t: strides.append(t.stride()) or k_major(t))

    model, inputs = llama.build("tiny", layers=1, seq=64, device=device, dtype=torch.bfloat16)
    with monkeypatch.context() as m, inductor_config.patch(emulate_precision_casts=True):
        # The opaque baseline is the path where Inductor's code would not round fused bf16 values
        # as eager does (torch 2.11's C++ backend ignores emulate_precision_casts; forced here so
        # that every version runs it): fused quantizes would not give the recipe's FP8 bits, so
        # the backend keeps each quantize one op and the report says why.
        m.setattr(_compat, "inductor_rounds_fused_casts", lambda *, device_types: False)
        opaque, opaque_code = _inductor_step(model, inputs, fp8=recipe)
        assert [n for n in graphpass.last_report().notes if n.startswith("fuse_quantize: off: torch ")
                and "each quantize runs as one op" in n]
    seen = []  # a user's post-grad pass runs before the inlining and sees every quantize
    with inductor_config.patch(post_grad_custom_pre_pass=_count_quantizes(seen)):
        fused, fused_code = _inductor_step(model, inputs, fp8=recipe)
    assert not [n for n in graphpass.last_report().notes if n.startswith("fuse_quantize")] or (
        not _compat.inductor_rounds_fused_casts(device_types=[device]))
    assert len(seen) == 2 and all(seen)  # forward and backward
    assert "graphpass.quantize" in opaque_code
    if not _compat.inductor_rounds_fused_casts(device_types=[device]):
        # torch 2.11 on CPU: fusion is off, with the note asserted above
        assert "graphpass.quantize" in fused_code
    else:  # every quantize inlined, the gradients' too, on CPU and CUDA alike
        assert "graphpass.quantize" not in fused_code
    # the GEMMs: the op on the CPU; on CUDA torch's FP8 GEMMs, inlined as Inductor's extern calls
    assert "graphpass.fp8_gemm" in fused_code if device == "cpu" else (
        "extern_kernels._scaled_mm" in fused_code or "graphpass.fp8_gemm" in fused_code)
    if device == "cpu":
        assert all(torch.equal(a, b) for a, b in zip(fused, opaque))
    else:
        assert [_rel_error(a, b) for a, b in zip(fused, opaque)] <= [BOUND["grad"]] * len(fused)
    if _compat.inductor_rounds_fused_casts(device_types=[device]):
        # torch 2.11's Inductor CPU code is no reference for a bf16 step: its gradients of this
        # layer are 76-100% (relative) away from aot_eager's with torch's own backends, no FP8
        eager = _eager_step(model, inputs, fp8=recipe)
        errors = [_rel_error(a, b) for a, b in zip(fused, eager)]
        assert max(errors) <= BOUND["grad"], errors
    assert len(strides) >= 2 * 3 * 7 and all(s[-1] == 1 for s in strides), strides


@pytest.mark.skipif(not _compat.inductor_rounds_fused_casts(device_types=["cpu"]),
                    reason="torch 2.11's CPU code never gets fused quantizes")
def test_two_fused_columnwise_copies_in_one_cpu_kernel_are_the_ops_bits():
    """o_proj's wgrad operands in the tiny Llama's backward: two bf16 (128, 256) tensors' fused
    columnwise quantizes, one C++ kernel with two transposed tile loads. On an AVX-512 CPU with
    GCC 12 that kernel was miscompiled (NaN FP8 bytes from stack garbage,
    ``_compat.guard_cpp_bf16_transpose``); under the settings the backend compiles fused
    quantizes with, both copies and scales are the op's bits, here and on every other CPU."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import ops
    from graphpass.fp8.inductor import fused_quantize

    graphpass.backend(fp8="tensorwise")._inductor_patches([torch.empty(1)])  # the CPU guard

    def quantize_both(g, x):
        return (*fused_quantize(g, "tensorwise", "grad", "columnwise"),
                *fused_quantize(x, "tensorwise", "input", "columnwise"))

    g, x = torch.randn(2, 128, 256).to(torch.bfloat16)
    with inductor_config.patch(emulate_precision_casts=True):
        fused, [code] = run_and_get_code(torch.compile(quantize_both, backend="inductor"), g, x)
    assert code.count('extern "C"') == 1 and code.count("transpose_mxn<") == 2, code
    opaque = (*ops._quantize(g, "tensorwise", "grad", "columnwise"),
              *ops._quantize(x, "tensorwise", "input", "columnwise"))
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t  # noqa: E731
    assert [torch.equal(bits(a), bits(b)) for a, b in zip(fused, opaque)] == [True] * 4


def _eager_step(model, inputs, **cfg):
    """``_inductor_step``'s outputs and gradients under graphpass's eager code generation."""
    torch._dynamo.reset()
    model.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    compiled = torch.compile(model, backend=graphpass.backend(codegen="eager", **cfg))
    out = compiled(*xs)
    out.float().pow(2).mean().backward()
    return [out.detach(), xs[0].grad, *(p.grad.clone() for p in model.parameters())]


def _fp8_ulp(data, scale_inv):
    """The spacing of the FP8 grid at each dequantized value ``data * scale_inv``: the FP8 ulp
    of ``|data|`` (its binade's step; the subnormal step below the smallest normal), scaled."""
    info = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}[data.dtype]
    mantissa, min_exp = info
    d = data.float().abs()
    _, exp = torch.frexp(d)  # d = m * 2**exp with 0.5 <= m < 1
    step = torch.ldexp(torch.ones_like(d), (exp - 1 - mantissa).clamp_min(min_exp - mantissa))
    return step * scale_inv.float()


@pytest.mark.parametrize("recipe,role", [
    ("tensorwise", "input"), ("tensorwise", "grad"),  # E4M3, E5M2
    ("tensorwise_e4m3", "grad"),  # E4M3 gradients (fp8_format="e4m3")
    ("blockwise", "input"), ("blockwise", "weight")])  # 1x128 blocks, 128x128 tiles
@pytest.mark.parametrize("emulate", [True, False], ids=["rounded", "unrounded"])
@pytest.mark.skipif(not _compat.inductor_rounds_fused_casts(device_types=["cpu"]),
                    reason="this torch's Inductor CPU code does not round fused bf16 values as "
                    "eager does, so graphpass keeps every quantize one op on the CPU (fusion_notes)")
def test_fused_quantize_is_within_one_fp8_ulp_of_the_op(recipe, role, emulate):
    """The contract of a fused quantize: each dequantized FP8 value within one FP8 ulp of the
    opaque op's. Fed by a fused bf16 producer (SwiGLU), Inductor's code reads the bf16-rounded
    value eager reads where ``emulate_precision_casts`` is on (what the backend sets): the bits
    are the op's. With it off, the fused cast reads the unrounded fp32 value: other bytes and
    another scale, still within one ulp. Either way the fused code keeps no fp32 copy of the
    whole tensor (the recipe's fp32 upcast, read by the amax and by the cast, was realized
    before ``fused_quantize``), only the bf16 producer's output and the FP8 copies."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import ops
    from graphpass.fp8.inductor import post_grad_pass

    def swiglu_quantize(a, b):
        return ops.quantize(torch.nn.functional.silu(a) * b, recipe, role, "both")

    torch.manual_seed(0)
    a, b = (torch.randn(256, 512, dtype=torch.bfloat16) for _ in range(2))
    opaque = ops.quantize(torch.nn.functional.silu(a) * b, recipe, role, "both")
    assert opaque[0].dtype == recipes.fp8_dtype(recipe, role)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=post_grad_pass("test", None),
                               emulate_precision_casts=emulate,
                               **{"eager_numerics.division_rounding": True}):
        fused, code = run_and_get_code(torch.compile(swiglu_quantize, backend="inductor"), a, b)
    code = "\n".join(code)
    assert "graphpass.quantize" not in code
    for columnwise, (fd, fs), (od, os_) in zip((False, True), zip(fused[::2], fused[1::2]),
                                               zip(opaque[::2], opaque[1::2])):
        assert fs.shape == os_.shape and fs.is_contiguous() and fd.is_contiguous()
        fv, ov = (recipes.dequantize(d, s_, recipe, role) for d, s_ in ((fd, fs), (od, os_)))
        ulp = [_fp8_ulp(d, _per_element(s_, d, recipe, role)) for d, s_ in ((od, os_), (fd, fs))]
        assert ((fv - ov).abs() <= torch.maximum(*ulp)).all()
        same = torch.equal(fd.view(torch.uint8), od.view(torch.uint8)) and torch.equal(fs, os_)
        rounds = emulate and _compat.inductor_rounds_fused_casts(device_types=["cpu"])
        assert same == rounds  # bit-identical exactly where Inductor rounds as eager does
    buffers = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code)
    whole = [(shape, d) for shape, d in buffers if _numel(shape) >= 256 * 512]
    assert sorted(d for shape, d in whole) == [
        "bfloat16"] + [str(recipes.fp8_dtype(recipe, role)).removeprefix("torch.")] * 2, whole


@pytest.mark.parametrize("recipe,role,grouped", [
    ("tensorwise", "grad", False), ("rowwise", "grad", False), ("blockwise", "input", False),
    ("rowwise", "grad", True), ("tensorwise", "grad", True)])  # token groups: expert operands
@pytest.mark.skipif(not _compat.inductor_rounds_fused_casts(device_types=["cpu"]),
                    reason="this torch's Inductor CPU code does not round fused bf16 values as "
                    "eager does, so graphpass keeps every quantize one op on the CPU (fusion_notes)")
def test_a_fused_quantize_of_a_long_elementwise_chain_keeps_no_fp32_copy(recipe, role, grouped):
    """A quantize's input computed by a longer elementwise chain (four bf16 multiply-adds, as
    long as a SwiGLU gradient's) and quantized rowwise and columnwise: Inductor would compute
    the chain inside every amax and cast loop, and realize what two of them share or what grows
    past its limit for inlining, as whole fp32 temporaries (measured before the input and the
    scales were stored: one for tensorwise, two (256, 512) and two (512, 256) for rowwise, four
    for blockwise, three rowwise over token groups; tensorwise over token groups was one op).
    The fused code holds the bf16 input, as the opaque op read it, and the two FP8 copies,
    bit-identical to the op's, rowwise over token groups (groups of 100, 0, 233 and 179 tokens)
    too (``|x|`` in bf16 was a fourth whole buffer while a scatter-max made the (group, column)
    amaxes; the chunked maxima read the chain in place)."""
    import re

    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import ops
    from graphpass.fp8.inductor import post_grad_pass

    def chain(a, b, c):
        x = a
        for _ in range(4):
            x = x * b + c
        return x

    torch.manual_seed(0)
    a, b, c = (torch.randn(512, 256, dtype=torch.bfloat16) for _ in range(3))
    groups = [torch.tensor([100, 100, 333, 512])] if grouped else []
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=post_grad_pass("test", None),
                               emulate_precision_casts=True, fx_graph_cache=False):
        fused, code = run_and_get_code(torch.compile(
            lambda a, b, c, *offs: ops.quantize(chain(a, b, c), recipe, role, "both", *offs),
            backend="inductor"), a, b, c, *groups)
    opaque = ops.quantize(chain(a, b, c), recipe, role, "both", *groups)
    for f, o in zip(fused, opaque):
        assert torch.equal(f.view(torch.uint8) if f.element_size() == 1 else f,
                           o.view(torch.uint8) if o.element_size() == 1 else o)
    code = "\n".join(code)
    assert "torch.ops.graphpass.quantize.default(" not in code  # inlined, not called
    buffers = re.findall(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code)
    whole = sorted(d for shape, d in buffers if _numel(shape) >= 256 * 512)
    assert whole == ["bfloat16"] + [
        str(recipes.fp8_dtype(recipe, role)).removeprefix("torch.")] * 2, whole


def _numel(shape: str) -> int:
    """The element count of a shape as Inductor's code prints it (``"256, 512"``)."""
    n = 1
    for size in filter(None, (p.strip() for p in shape.split(","))):
        n *= int(size)
    return n


def _per_element(scale_inv, data, recipe, role):
    """``scale_inv`` broadcast to ``data``'s shape (a block's scale for each of its values)."""
    block = recipes.block_shape(recipe, role)
    if block is None:
        return scale_inv.expand(data.shape)
    rows, cols = data.shape
    return scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]


@pytest.mark.skipif(not _compat.inductor_rounds_fused_casts(device_types=["cpu"]),
                    reason="this torch's Inductor CPU code does not round fused bf16 values as "
                    "eager does, so graphpass keeps every quantize one op on the CPU (fusion_notes)")
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "nopow2"])
@pytest.mark.parametrize("shape", [(200, 300), (2, 200, 136)], ids=["ragged", "stack"])
def test_inlined_blockwise_quantize_is_the_op_for_every_role_and_usage(shape, pow2):
    """Every blockwise quantize, inlined, gives the op's bits on the CPU: each role (1x128
    blocks, 128x128 tiles), each usage (rowwise, columnwise, both), with M and K no multiples of
    128 (a partial block is padded with zeros: its amax is its own values'), for a stack of
    matrices (one quantized at a time) too, with NaN and inf, under both scale settings. The
    nine quantizes of one tensor share kernels. The (2, 200, 136) stack is the case Inductor's
    C++ loop split wrote partly (K = 136: the last 8 columns never written) before
    ``_compat.guard_cpp_loop_split``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import ops
    from graphpass.fp8.inductor import post_grad_pass

    recipe = "blockwise" if pow2 else "blockwise_nopow2"
    torch.manual_seed(0)
    a, b = (torch.randn(*shape, dtype=torch.bfloat16) * 3 for _ in range(2))
    a.view(-1)[5], a.view(-1)[7] = float("nan"), float("inf")

    def quantizes(a, b):
        x = torch.nn.functional.silu(a) * b
        return [t for role in recipes.ROLES for usage in ops.USAGES
                for t in ops.quantize(x, recipe, role, usage)]

    opaque = quantizes(a, b)
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=post_grad_pass("test", None),
                               emulate_precision_casts=True,
                               **{"eager_numerics.division_rounding": True}):
        fused, code = run_and_get_code(torch.compile(quantizes, backend="inductor"), a, b)
    assert "graphpass.quantize" not in "\n".join(code)
    assert len(fused) == len(opaque) == 3 * 2 * 4
    for f, o in zip(fused, opaque):
        assert f.dtype == o.dtype and f.shape == o.shape and f.stride() == o.stride()
        assert torch.equal(f.view(torch.uint8), o.view(torch.uint8)) if f.element_size() == 1 \
            else torch.equal(f, o)


def test_fuse_quantize_false_keeps_every_quantize_one_op():
    """``fuse_quantize=False`` is the same Inductor compile as the fusion-off path of
    test_inlined_quantize_is_bit_identical_to_the_op: no inlining pass, no precision patches."""
    cpu = [torch.empty(1)]
    off = graphpass.backend(fp8="tensorwise", fuse_quantize=False)._inductor_patches(cpu)
    assert set(off) == {"custom_partitioner_fn"}
    on = graphpass.backend(fp8="tensorwise")._inductor_patches(cpu)
    assert ("post_grad_custom_pre_pass" in on) == _compat.inductor_rounds_fused_casts(
        device_types=["cpu"])


def test_which_quantizes_are_inlined_and_the_notes_that_say_so(monkeypatch):
    """Every tensorwise, rowwise and blockwise quantize, in every role and on every device;
    mxfp8 not. The report says where quantizes stay one op on the graph's devices (torch 2.11's
    CPU code) and under which recipe."""
    from graphpass.fp8.inductor import INLINED_RECIPES, fusion_notes, inlinable

    assert INLINED_RECIPES == ("tensorwise", "rowwise", "blockwise")
    assert inlinable("tensorwise")
    assert inlinable("blockwise") and inlinable("blockwise_nopow2")
    assert not inlinable("mxfp8")
    assert inlinable("rowwise") and inlinable("rowwise_pow2")
    [note] = map(str, fusion_notes(device_types={"cuda"}, recipe="mxfp8"))
    assert note == ("fuse_quantize: off: mxfp8 quantizes run as one op each (graphpass inlines "
                    "tensorwise, rowwise and blockwise ones)")
    monkeypatch.setattr(_compat, "inductor_rounds_fused_casts", lambda *, device_types: True)
    assert fusion_notes(device_types={"cpu"}) == []
    assert fusion_notes(device_types={"cuda"}) == []  # gradients fused on CUDA too
    monkeypatch.setattr(_compat, "inductor_rounds_fused_casts", lambda *, device_types: False)
    [note] = map(str, fusion_notes(device_types={"cpu", "cuda"}))
    assert note.startswith("fuse_quantize: off: torch ")


def test_mxfp8_stays_one_op_under_the_users_post_grad_pass():
    """mxfp8 quantizes are not inlined (reference provider): each stays one op, and the report
    says so. The user's post-grad pass sees both graphs with their quantizes (the inlined
    recipes, where inlining runs after the user's pass, are asserted in
    test_inlined_quantize_is_bit_identical_to_the_op)."""
    from torch._inductor import config as inductor_config

    from graphpass.fp8.inductor import fusion_notes

    seen = []
    # two lowered linears with an activation between (64 tokens: whole 32-blocks): the same
    # quantize and GEMM ops in the forward and backward graphs as a Llama layer's linears, in
    # a compile of a few C++ kernels instead of the layer's dozens
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    inputs = [torch.randn(64, 256)]
    with inductor_config.patch(post_grad_custom_pre_pass=_count_quantizes(seen)):
        _, code = _inductor_step(model, inputs, fp8="mxfp8")
    assert _lowering(graphpass.last_report().notes) == [
        "lowered: 0 (reference/mxfp8)", "lowered: 2 (reference/mxfp8)"]
    assert "graphpass.quantize" in code
    assert len(seen) == 2 and all(seen)
    assert [n for n in graphpass.last_report().notes if n.startswith("fuse_quantize")] == [
        str(d) for d in fusion_notes(device_types={"cpu"}, recipe="mxfp8")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode,expected", [
    ("te", {"forward": True, "dgrad": False, "wgrad": False}),
    ("fast", {"forward": True, "dgrad": True, "wgrad": True}),
    ("precise", {"forward": False, "dgrad": False, "wgrad": False}),
])
def test_scaled_mm_accumulates_per_gemm_role(recipe, mode, expected, monkeypatch):
    """``fp8_accumulate``: torch._scaled_mm gets ``use_fast_accum`` per GEMM role, by default
    (``"te"``) fast for the forward and precise for dgrad and wgrad, as TE and torchao set it.
    The roles are read from the shape of the first operand (rowwise makes every operand E4M3,
    so dtypes cannot tell): with M=64, K=256, N=128 the forward's is x (64, 256), dgrad's the
    gradient (64, 128), wgrad's the gradient transposed (128, 64)."""
    calls, real = [], torch_gemms.scaled_mm
    roles = {(64, 256): "forward", (64, 128): "dgrad", (128, 64): "wgrad"}

    def record(a, b, **kw):
        calls.append((roles[tuple(a.shape)], kw["use_fast_accum"]))
        return real(a, b, **kw)

    monkeypatch.setattr(torch_gemms, "scaled_mm", record)
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False)
    x = torch.randn(64, 256, requires_grad=True)
    options = {} if mode == "te" else {"fp8_accumulate": mode}
    compiled = torch.compile(lin, backend=graphpass.backend(
        codegen="eager", fp8=recipe, kernels="scaled_mm", **options))
    compiled(x).sum().backward()
    assert sorted(calls) == sorted(expected.items())


def test_fp8_accumulate_is_validated():
    assert graphpass.Config(fp8="tensorwise", fp8_accumulate="precise").fp8_accumulate == "precise"
    with pytest.raises(ValueError, match="fp8_accumulate='split'.*'te', 'fast', 'precise'"):
        graphpass.Config(fp8="tensorwise", fp8_accumulate="split")
    assert [str(u) for u in graphpass.Config(fp8_accumulate="fast").unused()] == [
        "fp8_accumulate='fast' has no effect without fp8='tensorwise' (or another recipe)"]


def test_reference_accumulates_in_fp32_whatever_the_mode():
    """The reference provider models the precise accumulation: the mode does not change it."""
    torch.manual_seed(0)
    a, b = torch.randn(64, 256), torch.randn(128, 256)
    (qa, sa), (qb, sb) = recipes.quantize(a, "tensorwise", "input"), recipes.quantize(
        b, "tensorwise", "weight")
    ref = providers.get("reference")
    outs = [ref.gemm(qa, sa, qb, sb, "tensorwise", "input", "weight", torch.float32, None,
                     fast_accum=fast) for fast in (True, False)]
    assert torch.equal(*outs)


def test_h100_roofline_by_hand():
    """graphpass/fp8/cost.py on M=4096 tokens, K=4096, N=512, worked by hand: each GEMM is
    2*4096*512*4096 = 17.18 GFLOP. bf16: 17.18e9 / 989e12 = 17.37 us a GEMM, above its bytes
    (fprop 2*(16.78M + 2.10M + 2.10M) = 41.9 MB / 3.35 TB/s = 12.5 us; dgrad and wgrad the same
    elements), 52.1 us for three. FP8: 8.68 us of FLOPs a GEMM; dgrad's bytes are more
    (2.10M + 2.10M + 2*16.78M = 37.7 MB: 11.27 us), so 8.68 + 11.27 + 8.68 = 28.6 us; quantizes
    6*(16.78M + 2.10M + 2.10M) = 125.8 MB: 37.6 us; 66.2 us in all, slower than bf16. With X
    shared by three linears (q, k, v), its quantize is a third: 6*(5.59M + 2.10M + 2.10M) =
    58.7 MB, 17.5 us, 46.2 us in all, faster than bf16. A tiny GEMM is not judged."""
    from graphpass.fp8 import cost

    alone = cost.linear_estimate(4096, 512, 4096)
    assert alone.bf16 * 1e6 == pytest.approx(52.11, abs=0.01)
    assert alone.fp8_gemms * 1e6 == pytest.approx(28.63, abs=0.01)
    assert alone.quantizes * 1e6 == pytest.approx(37.56, abs=0.01)
    assert alone.faster_in_bf16
    assert alone.describe() == ("H100 roofline: FP8 GEMMs 28.6 us + quantizes 37.6 us > bf16 "
                                "GEMMs 52.1 us")
    shared = cost.linear_estimate(4096, 512, 4096, input_sharers=3)
    assert shared.quantizes * 1e6 == pytest.approx(17.53, abs=0.01)
    assert not shared.faster_in_bf16
    # Llama-3-8B's k/v projections at sequence 8192 (q, k, v share X): FP8 on an H100
    kv = cost.linear_estimate(8192, 1024, 4096, input_sharers=3)
    assert kv.fp8 * 1e6 == pytest.approx(146.7, abs=0.1) and kv.bf16 * 1e6 == pytest.approx(208.5, abs=0.1)
    assert not kv.faster_in_bf16
    tiny = cost.linear_estimate(128, 256, 256)  # FP8 slower, but launch-bound: not judged
    assert tiny.fp8 > tiny.bf16 and not tiny.faster_in_bf16


class _Projections(nn.Module):
    """A lone (4096 -> 512) projection, and q/k/v projections of one other input."""

    def __init__(self):
        super().__init__()
        kw = dict(bias=False, device="meta", dtype=torch.bfloat16)
        self.alone = nn.Linear(4096, 512, **kw)
        self.q, self.k, self.v = (nn.Linear(4096, n, **kw) for n in (4096, 512, 512))

    def forward(self, x, h):
        return self.alone(x).sum() + sum(p(h).sum() for p in (self.q, self.k, self.v))


def test_small_gemm_stays_bf16_with_a_note():
    """Under the default ``fp8_cost_model="h100"``, a linear the roofline estimates slower in FP8
    stays bf16 with a note naming the estimate; the same shape whose input quantize is shared
    with q and v is lowered; ``fp8_cost_model="off"`` lowers every linear. The report's FP8
    coverage counts the kept GEMMs as high precision."""
    model = _Projections()
    x, h = (torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    report = graphpass.plan(model, x, h, config=graphpass.Config(fp8="tensorwise"))
    assert sorted(_lowering(report.notes)) == [
        "lowered: k (reference/tensorwise)", "lowered: q (reference/tensorwise)",
        "lowered: v (reference/tensorwise)",
        "not lowered: alone: faster in bf16 (H100 roofline: FP8 GEMMs 28.6 us + quantizes 37.6 us "
        "> bf16 GEMMs 52.1 us, M=4096 N=512 K=4096; fp8_cost_model='off' lowers it)"]
    flops = {"alone": 512, "q": 4096, "k": 512, "v": 512}  # N; M and K are 4096 for all
    assert report.meta["fp8_coverage"]["fp8_share"] == pytest.approx(
        (4096 + 512 + 512) / sum(flops.values()), abs=1e-4)
    forced = graphpass.plan(model, x, h, config=graphpass.Config(fp8="tensorwise",
                                                                 fp8_cost_model="off"))
    assert [n for n in _lowering(forced.notes) if n.startswith("not lowered")] == []
    assert [str(u) for u in graphpass.Config(fp8_cost_model="off").unused()] == [
        "fp8_cost_model='off' has no effect without fp8='tensorwise' (or another recipe)"]


def test_a_dynamic_size_is_not_judged_and_says_so():
    """Compiled with dynamic shapes, the tokens M of the lone (4096 -> 512) linear above are a
    symbol: the roofline has no size to judge it by (at M=4096 it keeps it bf16), so it is
    lowered as asked, with a note that says why it was not judged."""
    import re

    lin = nn.Linear(4096, 512, bias=False, dtype=torch.bfloat16)
    backend = graphpass.backend(codegen="eager", fp8="tensorwise")
    compiled = torch.compile(lin, backend=backend, dynamic=True)
    compiled(torch.randn(64, 4096, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    notes = [n for n in backend.report().notes if "lowered" in n or "fp8_cost_model" in n]
    assert len(notes) == 2 and notes[1] == "lowered: <root> (reference/tensorwise)", notes
    assert re.fullmatch(r"fp8_cost_model: not judged: <root>: M=s\d+ is dynamic: the roofline "
                        r"has no size to judge it by; lowered", notes[0]), notes


def test_expert_roofline_by_hand():
    """cost.linear_estimate for MoE experts: ``groups`` linears of M tokens each, summed; the
    weight's quantize dropped under the weight cache. DeepSeek-V3's gate projection on one GPU:
    256 experts of M=160 (capacity), N=2048, K=7168. Per expert: 2*160*2048*7168 = 4.70 GFLOP,
    4.75 us at bf16's peak, under each GEMM's bytes, 2*(1.15M + 14.68M + 0.33M) = 32.3 MB:
    9.64 us, 28.93 us for three, 7.407 ms for 256 experts. FP8: fprop (1.15M + 14.68M +
    2*0.33M) = 16.5 MB: 4.92 us; dgrad (0.33M + 14.68M + 2*1.15M) = 17.3 MB: 5.16 us; wgrad
    (0.33M + 1.15M + 2*14.68M) = 30.8 MB: 9.20 us; 19.29 us, 4.938 ms. Quantizes 6*16.15M =
    96.9 MB: 28.93 us, 7.407 ms: FP8 12.35 ms, slower than bf16: the GEMMs read the weights, and
    a quantize reads and writes them for 6 bytes an element against the 1 byte the FP8 GEMMs
    save. Quantized once per optimizer step, 6*(1.15M + 0.33M) = 8.85 MB: 0.676 ms, FP8 5.61 ms:
    faster. At 2,048 tokens per expert (32,768 over 16) the GEMMs are compute-bound: FP8 wins."""
    from graphpass.fp8 import cost

    gate = cost.linear_estimate(160, 2048, 7168, groups=256)
    assert gate.bf16 * 1e3 == pytest.approx(7.407, abs=1e-3)
    assert gate.fp8_gemms * 1e3 == pytest.approx(4.938, abs=1e-3)
    assert gate.quantizes * 1e3 == pytest.approx(7.407, abs=1e-3)
    assert gate.faster_in_bf16
    assert gate.describe() == ("H100 roofline: FP8 GEMMs 4.94 ms + quantizes 7.41 ms > bf16 "
                               "GEMMs 7.41 ms")
    one = cost.linear_estimate(160, 2048, 7168)
    assert gate.fp8 == pytest.approx(256 * one.fp8) and gate.bf16 == pytest.approx(256 * one.bf16)
    cached = cost.linear_estimate(160, 2048, 7168, groups=256, weight_cached=True)
    assert cached.quantizes * 1e3 == pytest.approx(0.676, abs=1e-3)
    assert cached.fp8_time() == "FP8 GEMMs 4.94 ms + quantizes 676.1 us"
    assert cached.fp8_gemms == gate.fp8_gemms and not cached.faster_in_bf16
    assert not cost.linear_estimate(2048, 4096, 7168, groups=16).faster_in_bf16


class _BmmExperts(nn.Module):
    """SwiGLU experts as 3-D [experts, in, out] weights applied by ``bmm`` to an (experts,
    capacity, hidden) buffer (graphpass/models/deepseek.py's form), on ``meta``."""

    def __init__(self, experts, hidden, inter):
        super().__init__()
        kw = dict(device="meta", dtype=torch.bfloat16)
        self.gate = nn.Parameter(torch.empty(experts, hidden, inter, **kw))
        self.up = nn.Parameter(torch.empty(experts, hidden, inter, **kw))
        self.down = nn.Parameter(torch.empty(experts, inter, hidden, **kw))

    def forward(self, x):
        h = nn.functional.silu(torch.bmm(x, self.gate)) * torch.bmm(x, self.up)
        return torch.bmm(h, self.down)


def test_weight_bound_experts_stay_bf16_with_a_note():
    """DeepSeek-V3's 256 routed experts at one GPU's capacity (160 tokens each): the roofline
    keeps all three expert GEMMs in bf16 (each weight quantized every step costs more than FP8's
    GEMMs save), with a note per shape that names the estimate, the option that lowers them and
    what the weight cache would make of them. ``fp8_weight_cache=True`` is a memory option: it
    changes nothing here (memory decisions never change numerics). ``fp8_cost_model="off"``
    lowers them; with 2,048 tokens per expert (compute-bound) the default lowers them too."""
    def notes(capacity, **options):
        model = _BmmExperts(256, 7168, 2048)
        x = torch.empty(256, capacity, 7168, device="meta", dtype=torch.bfloat16,
                        requires_grad=True)
        report = graphpass.plan(model, x, config=graphpass.Config(fp8="rowwise", **options))
        return sorted(_lowering(report.notes)), report.meta["fp8_coverage"]["fp8_share"]

    def note(n, k, cached_quantizes):
        return ("not lowered: <root>: faster in bf16 (H100 roofline: FP8 GEMMs 4.94 ms + "
                f"quantizes 7.41 ms > bf16 GEMMs 7.41 ms, M=160 N={n} K={k} per expert, 256 "
                "experts; fp8_cost_model='off' lowers it; with gradient accumulation and "
                "fp8_weight_cache=True (the weight quantized once per optimizer step) FP8 is the "
                f"faster: FP8 GEMMs 4.94 ms + quantizes {cached_quantizes})")

    kept = ([note(2048, 7168, "676.1 us"), note(7168, 2048, "676.1 us")], 0.0)
    assert notes(160) == kept
    assert notes(160, fp8_weight_cache=True) == kept
    assert notes(160, fp8_cost_model="off") == (["lowered: <root> (reference/rowwise)"], 1.0)
    assert notes(2048) == (["lowered: <root> (reference/rowwise)"], 1.0)


def test_blockwise_scale_option():
    """``fp8_pow2_scales`` for blockwise: None is the recipe's default (power-of-two scales, TE's
    Float8BlockScaling), ``False`` the plain fp8_max / amax scales (DeepSeek-V3's), carried by
    the graph ops as their own recipe string and keyed apart in the compile cache. Rowwise keeps
    its meaning (off unless True); elsewhere the option has no effect, and says where it works."""
    from graphpass.backend import Partitioner

    config = graphpass.Config
    assert config(fp8="blockwise").fp8_recipe == "blockwise"
    assert config(fp8="blockwise", fp8_pow2_scales=True).fp8_recipe == "blockwise"
    assert config(fp8="blockwise", fp8_pow2_scales=False).fp8_recipe == "blockwise_nopow2"
    assert config(fp8="rowwise", fp8_pow2_scales=False).fp8_recipe == "rowwise"
    assert recipes.get_recipe("blockwise").power_2_scales
    assert not recipes.get_recipe("blockwise_nopow2").power_2_scales
    assert recipes.get_recipe("blockwise_nopow2").name == "blockwise"
    assert recipes.from_options("blockwise", fp8_pow2_scales=False).key == "blockwise_nopow2"
    assert recipes.from_options("blockwise").key == recipes.from_options(
        "blockwise", fp8_pow2_scales=True).key == "blockwise"
    for recipe in ("tensorwise", "mxfp8", None):
        ignored = config(fp8=recipe, fp8_pow2_scales=False)
        assert [str(u) for u in ignored.unused()] == [
            "fp8_pow2_scales=False has no effect without fp8='rowwise' or fp8='blockwise' (mxfp8's "
            "E8M0 scales are powers of two by construction, tensorwise's are not rounded)"]
        assert ignored.fp8_recipe == config(fp8=recipe).fp8_recipe
    with pytest.raises(ValueError, match="expected a bool"):
        config(fp8="blockwise", fp8_pow2_scales="no")
    with pytest.raises(ValueError, match="option of fp8='rowwise' and fp8='blockwise'"):
        recipes.from_options("mxfp8", fp8_pow2_scales=True)
    assert config(fp8="blockwise", fp8_pow2_scales=False, kernels="scaled_mm").kernels == (
        "scaled_mm")
    uuids = {Partitioner(config(fp8="blockwise", fp8_pow2_scales=p)).uuid()
             for p in (None, False)}
    assert len(uuids) == 2
    # the CLI's flag and GRAPHPASS_OPTIONS take all three values
    from graphpass import cli_flags, named

    [flag] = [f for f in cli_flags.config_flags() if f.name == "fp8_pow2_scales"]
    assert flag.flag == "--fp8-pow2-scales" and flag.metavar == "true|false|none"
    assert [flag.convert(t) for t in ("true", "false", "none")] == [True, False, None]
    assert named.env_options("fp8=blockwise fp8_pow2_scales=false") == {
        "fp8": "blockwise", "fp8_pow2_scales": False}
    # the two differ where a block's fp8_max / amax is no power of two
    x = torch.randn(256, 256)
    pow2, plain = (recipes.quantize(x, r, "input")[1] for r in ("blockwise", "blockwise_nopow2"))
    assert torch.equal(pow2, 2.0 ** torch.log2(pow2).round()) and not torch.equal(pow2, plain)
    amax = x.abs().reshape(256, 2, 128).amax(-1)
    assert torch.equal(plain, torch.reciprocal(torch.full_like(amax, 448.0) / amax))


@pytest.mark.parametrize("pow2", [None, False], ids=["pow2", "nopow2"])
def test_blockwise_scale_variants_run_on_the_reference(pow2):
    """Both blockwise scale settings lower and run on the reference provider, each exactly its
    recipe (the three GEMMs written out from its qdq), and they differ from each other."""
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False)
    x, grad_y = torch.randn(128, 256), torch.randn(128, 128)
    compiled = torch.compile(lin, backend=graphpass.backend(
        codegen="eager", fp8="blockwise", kernels="reference",
        **({} if pow2 is None else {"fp8_pow2_scales": pow2})))
    xx = x.clone().requires_grad_()
    y = compiled(xx)
    y.backward(grad_y)
    recipe = "blockwise" if pow2 is None else "blockwise_nopow2"
    other = "blockwise_nopow2" if pow2 is None else "blockwise"
    ref = _emulated_linear(x, lin.weight.detach(), None, grad_y, recipe)
    for got, want, not_want in zip((y, xx.grad, lin.weight.grad), ref, _emulated_linear(
            x, lin.weight.detach(), None, grad_y, other)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        assert not torch.equal(got, not_want)


def _blockwise_gemms(m=256, n=384, k=512, recipe="blockwise"):
    """The three GEMMs of a blockwise linear (M=256, N=384, K=512): operands as the lowering
    quantizes them, and their roles. dgrad contracts over N=384, three 128-blocks: its weight
    scales are padded to four (L4)."""
    torch.manual_seed(0)
    x, w, dy = torch.randn(m, k), torch.randn(n, k), torch.randn(m, n)

    def q(t, role, columnwise=False):
        return recipes.quantize(t, recipe, role, columnwise=columnwise)

    return {"fprop": (*q(x, "input"), *q(w, "weight"), "input", "weight"),
            "dgrad": (*q(dy, "grad"), *q(w, "weight", True), "grad", "weight"),
            "wgrad": (*q(dy, "grad", True), *q(x, "input", True), "grad", "input")}


_NO_BLOCKWISE_MM = pytest.mark.skipif(torch_gemms.blockwise_scaled_mm_missing() is not None,
                                      reason=str(torch_gemms.blockwise_scaled_mm_missing()))


@_NO_BLOCKWISE_MM
@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_nopow2"])
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_blockwise_scale_layouts_pass_torchs_checks(gemm, recipe):
    """The scales graphpass hands torch.nn.functional.scaled_mm for each blockwise GEMM pass
    torch's own shape and stride checks (its meta function, the one a CUDA call runs first), on
    fake CUDA tensors with the layouts of the real ones; the recipe's own row-major scales are
    refused, so the check is live."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphpass.fp8 import blockwise_gemm

    a, sa, b, sb, a_role, b_role = _blockwise_gemms(recipe=recipe)[gemm]
    layouts = blockwise_gemm.scale_layouts(sa, sb, a_role, b_role)
    assert layouts[1::2] == ("BlockWise1x128",
                             "BlockWise1x128" if gemm == "wgrad" else "BlockWise128x128")
    functional = torch.nn.functional

    def call(scale_a, scale_b):
        with FakeTensorMode():
            def fake(t):
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

            return functional.scaled_mm(
                fake(a), fake(b).t(), fake(scale_a), getattr(functional.ScalingType, layouts[1]),
                fake(scale_b), getattr(functional.ScalingType, layouts[3]),
                output_dtype=torch.bfloat16)

    out = call(layouts[0], layouts[2])
    assert out.shape == (a.shape[0], b.shape[0]) and out.device.type == "cuda"
    # (M, K/128) row-major: torch wants it column-major. torch 2.11-2.14's meta function refuses
    # it; 2.15's accepts it (whether its CUDA kernel still refuses it takes a GPU to tell), so
    # there the positive call above is the whole check.
    if _compat.TORCH_VERSION < (2, 15):
        with pytest.raises(RuntimeError, match="blockwise scaling"):
            call(sa, layouts[2])
    else:
        call(sa, layouts[2])


@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_blockwise_gemms_with_a_128x128_operand_never_ask_for_fast_accumulation(gemm, monkeypatch):
    """cuBLASLt has no fast accumulation with 128x128 scales: torch raises "scaled_gemm doesn't
    support fast accum with 128x128 blockwise scaling" (an H200, torch 2.11; the meta function
    does not check it, so the CPU never saw it). The forward GEMM, fast under the default
    ``fp8_accumulate="te"``, and every GEMM under ``"fast"`` accumulate precisely where the
    weight's tiles are an operand; wgrad (1x128 x 1x128) keeps what it is asked for."""
    from graphpass.fp8 import blockwise_gemm

    asked = []

    def record(a, b, *, use_fast_accum, out_dtype, **_):
        asked.append(use_fast_accum)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch_gemms, "blockwise_scaled_mm", record)
    a, sa, b, sb, a_role, b_role = _blockwise_gemms()[gemm]
    for fast in (True, False):
        blockwise_gemm.gemm(a, sa, b, sb, a_role, b_role, torch.bfloat16, None, fast_accum=fast)
    assert asked == [gemm == "wgrad", False]


@pytest.mark.parametrize("recipe", ["blockwise", "blockwise_nopow2"])
@pytest.mark.parametrize("gemm", ["fprop", "dgrad", "wgrad"])
def test_blockwise_scale_layouts_mean_the_reference(gemm, recipe):
    """Read as torch defines them (scale_a[m, kb] for 1x128; scale_b[n, kb] for 1x128 and
    scale_b[kb, n // 128] for 128x128), the layouts give the reference provider's product: the
    same dequantized operands, summed in fp32."""
    from graphpass.fp8 import blockwise_gemm

    a, sa, b, sb, a_role, b_role = _blockwise_gemms(recipe=recipe)[gemm]
    scale_a, _, scale_b, recipe_b = blockwise_gemm.scale_layouts(sa, sb, a_role, b_role)
    (m, k), n = a.shape, b.shape[0]
    kb = k // 128
    a32 = (a.float().view(m, kb, 128) * scale_a[:, :, None]).view(m, k)
    if recipe_b == "BlockWise1x128":
        b_scale = scale_b
    else:
        b_scale = scale_b[:kb].repeat_interleave(128, dim=1)[:, :n].t()  # (N, K/128)
    b32 = (b.float().view(n, kb, 128) * b_scale[:, :, None]).view(n, k)
    ref = providers.get("reference").gemm(a, sa, b, sb, recipe, a_role, b_role,
                                          torch.float32, None)
    torch.testing.assert_close(a32 @ b32.t(), ref, rtol=1e-5, atol=1e-4)


def test_a_small_projection_whose_input_is_quantized_anyway_is_lowered():
    """A (4096 -> 128) projection (a k/v shard under tensor parallelism) alone is faster in
    bf16: its GEMMs are memory-bound (bf16 31.9 us; FP8 21.3 us) and its quantizes, X's
    6 x 16.78M B above all, take 31.9 us. Beside a lowered q of the same input, X's quantize is
    paid already: 21.3 + 1.9 us, lowered (keeping it bf16 would keep a bf16 X saved too)."""
    from graphpass.fp8 import cost

    alone = cost.linear_estimate(4096, 128, 4096)
    assert alone.faster_in_bf16 and alone.quantizes * 1e6 == pytest.approx(31.93, abs=0.01)
    quantized = cost.linear_estimate(4096, 128, 4096, input_quantized=True)
    assert quantized.quantizes * 1e6 == pytest.approx(1.88, abs=0.01)
    assert not quantized.faster_in_bf16

    class QK(nn.Module):
        def __init__(self):
            super().__init__()
            kw = dict(bias=False, device="meta", dtype=torch.bfloat16)
            self.q, self.k = nn.Linear(4096, 4096, **kw), nn.Linear(4096, 128, **kw)

        def forward(self, h):
            return self.q(h).sum() + self.k(h).sum()

    h = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16, requires_grad=True)
    report = graphpass.plan(QK(), h, config=graphpass.Config(fp8="tensorwise"))
    assert sorted(_lowering(report.notes)) == ["lowered: k (reference/tensorwise)",
                                               "lowered: q (reference/tensorwise)"]


def test_one_device_description_times_fp8_and_the_memory_budget():
    """The FP8 cost model and the memory budget time their choices on one device description
    (graph/roofline.py): the same object, with each dtype's peak, the HBM bandwidth and the host
    link (by hand: a 4096^3 GEMM is 137.4 GFLOP)."""
    from graphpass.fp8 import cost
    from graphpass.graph import roofline
    from graphpass.passes import memory_budget

    assert cost.H100 is memory_budget.H100 is roofline.H100
    assert cost.linear_estimate(4096, 512, 4096).gpu is roofline.H100
    h100, flops = roofline.H100, 2 * 4096**3
    assert h100.compute(flops, 0, torch.bfloat16) * 1e6 == pytest.approx(138.97, abs=0.01)
    assert h100.compute(flops, 0, torch.float8_e4m3fn) * 1e6 == pytest.approx(69.45, abs=0.01)
    assert h100.compute(flops, 0, torch.float32) * 1e3 == pytest.approx(2.051, abs=0.001)
    assert h100.compute(0, 3.35e9) == pytest.approx(1e-3)  # 3.35 GB of HBM traffic: bytes-bound
    assert h100.copy(50e9) == pytest.approx(1.0)


def test_an_op_whose_code_does_not_trace_stays_with_a_warning():
    """Where the inlining cannot trace an FP8 op's code (a GEMM per token group reads the group
    sizes on the host), Inductor's code calls the op, and an ``OpaqueOpWarning`` names the node
    and the error's first line. (On a CUDA build, tests/test_triton_inductor.py compiles such
    graphs for sm_90.)"""
    from types import SimpleNamespace

    from graphpass.fp8 import inductor

    class Match:
        def replace_by_example(self, fn, args, trace_fn=None):
            raise RuntimeError("Could not guard on data-dependent expression u0 < 16\nmore")

        def output_node(self):
            return SimpleNamespace(name="fp8_gemm_default_3",
                                   target="graphpass.fp8_gemm.default")

    with pytest.warns(graphpass.OpaqueOpWarning) as caught:
        inductor._replace_or_keep(Match(), None, [], None)
    assert [str(w.message) for w in caught] == [
        "graphpass: fp8_gemm_default_3 (graphpass.fp8_gemm.default) stays graphpass's op in "
        "Inductor's code, its dispatch and checks on the host every step: its code did not "
        "trace (RuntimeError: Could not guard on data-dependent expression u0 < 16)"]
