"""FP8 lowering of grouped expert GEMMs: ``bmm`` over a 3-D [experts, in, out] weight
(capacity-style MoE, graphpass/models/deepseek.py)."""

import re

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.fp8 import ops, recipes, torch_gemms

RECIPES = ("tensorwise", "blockwise", "mxfp8", "rowwise")
# with tensorwise in TE's all-E4M3 format (fp8_format="e4m3"), named as the graph ops name it
WITH_E4M3 = (*RECIPES, "tensorwise_e4m3")


def _fp8(recipe):
    """The Config options of a recipe of WITH_E4M3."""
    if recipe == "tensorwise_e4m3":
        return {"fp8": "tensorwise", "fp8_format": "e4m3"}
    return {"fp8": recipe}
E, C, K, N = 4, 128, 256, 128  # experts, capacity (tokens per expert), in, out


class Experts(nn.Module):
    """One GEMM per expert over an (E, C, in) buffer, as graphpass.models.deepseek.Experts."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, K, N) * 0.05)

    def forward(self, x):
        return torch.bmm(x, self.weight)


def _emulated(x, w, grad_y, recipe):
    """Per expert, the three GEMMs of a [in, out] linear from the recipe's qdq by hand: every
    scale belongs to one expert (tensorwise: one per expert's weight, one per expert's tokens)."""
    q = lambda t, role, col=False: recipes.qdq(t, recipe, role, columnwise=col).float()  # noqa
    y, dx, dw = [], [], []
    for xe, we, ge in zip(x, w, grad_y):
        y.append(q(xe, "input") @ q(we, "weight", True))
        dx.append(q(ge, "grad") @ q(we, "weight").t())
        dw.append(q(xe, "input", True).t() @ q(ge, "grad", True))
    return torch.stack(y), torch.stack(dx), torch.stack(dw)


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_bmm_is_exactly_the_recipe(recipe):
    torch.manual_seed(0)
    experts = Experts()
    x, grad_y = torch.randn(E, C, K), torch.randn(E, C, N)
    compiled = torch.compile(experts, backend=graphpass.backend(codegen="eager", fp8=recipe,
                                                                 kernels="reference"))
    xx = x.clone().requires_grad_()
    y = compiled(xx)
    y.backward(grad_y)
    ref_y, ref_dx, ref_dw = _emulated(x, experts.weight.detach(), grad_y, recipe)
    assert torch.equal(y, ref_y)
    assert torch.equal(xx.grad, ref_dx)
    assert torch.equal(experts.weight.grad, ref_dw)
    report = graphpass.last_report()
    assert [n for n in report.notes if "lowered" in n] == [f"lowered: <root> (reference/{recipe})"]
    flops = 2 * E * C * K * N
    assert report.meta["fp8_coverage"]["fp8_flops"] == {"forward": flops, "dgrad": flops,
                                                        "wgrad": flops}


def test_grouped_scales_are_per_expert():
    """Tensorwise: one scale per expert, so an expert with large values does not crush the
    others' resolution."""
    x = torch.randn(E, C, K)
    x[0] *= 1000
    data, scale_inv = torch.ops.graphpass.quantize(x, "tensorwise", "input", "rowwise")
    assert data.shape == (E, C, K) and scale_inv.shape == (E,)
    for e in range(E):
        ref_data, ref_scale = recipes.quantize(x[e], "tensorwise", "input")
        assert torch.equal(data[e].view(torch.uint8), ref_data.view(torch.uint8))
        assert torch.equal(scale_inv[e], ref_scale)


@pytest.mark.parametrize("recipe,capacity,reason", [
    ("blockwise", 64, "M=64 not a multiple of 128"),
    ("mxfp8", 16, "M=16 not a multiple of 32"),  # tensorwise takes any M (tests/test_fp8_lowering.py)
])
def test_misaligned_experts_are_noted(recipe, capacity, reason):
    x = torch.randn(E, capacity, K, requires_grad=True)
    report = graphpass.plan(Experts(), x, config=graphpass.Config(fp8=recipe))
    assert [n for n in report.notes if "lowered" in n] == [f"not lowered: <root>: {reason}"]
    assert report.meta["fp8_coverage"]["high_precision_flops"] == {reason: 3 * 2 * E * capacity * K * N}


def test_grouped_gemm_plans_at_real_size():
    """DeepSeek-V3 expert shapes under fake tensors: fake implementations and FLOP formulas."""
    e, c, k, n = 16, 1024, 7168, 2048
    with torch.device("meta"):
        experts = Experts.__new__(Experts)
        nn.Module.__init__(experts)
        experts.weight = nn.Parameter(torch.empty(e, k, n, dtype=torch.bfloat16))
        x = torch.empty(e, c, k, dtype=torch.bfloat16, requires_grad=True)
    report = graphpass.plan(experts, x, config=graphpass.Config(fp8="blockwise"))
    flops = 2 * e * c * k * n
    assert report.meta["fp8_coverage"]["fp8_flops"] == {"forward": flops, "dgrad": flops,
                                                        "wgrad": flops}
    # the backward keeps X's columnwise FP8 copy (E, K, C) and its 1x128 scales (E, K, C/128)
    fp8 = sorted((r.shape, r.bytes) for r in report.rows if r.kind in ("fp8_data", "fp8_scale"))
    assert fp8 == [((e, k, c // 128), e * k * (c // 128) * 4), ((e, k, c), e * k * c)]


# Half a minute to three minutes each (torch 2.11's CPU Inductor): on one torch version in CI;
# the token-grouped experts' test below checks the memory passes' bit-identity on experts on
# every version.
@pytest.mark.one_version
@pytest.mark.parametrize("recipe", RECIPES)
def test_memory_passes_on_fp8_experts_are_bit_identical(recipe):
    """save-original, moe_act/moe recompute, the planner and offload move FP8 expert tensors
    around, never change a gradient bit. seq=128 gives an expert capacity of 128 tokens, which
    blockwise needs."""
    from graphpass.models import deepseek
    from test_memory_passes import POLICIES, UNOPTIMISED, _compiled_grads

    base, report = _compiled_grads(deepseek, dict(fp8=recipe, **UNOPTIMISED), seq=128, layers=1)
    assert f"lowered: layers.0.mlp.experts (reference/{recipe})" in report.notes
    for policy in [*POLICIES, dict(offload=True, offload_min_bytes=0),
                   dict(fp8_weight_once=True)]:
        grads, report = _compiled_grads(deepseek, dict(fp8=recipe, **policy), seq=128, layers=1)
        assert all(torch.equal(a, b) for a, b in zip(grads, base)), policy
        if policy.get("save_original") == "always":
            assert "save original: layers.0.mlp.experts re-quantizes its saved input in the backward" in report.notes
        if "moe_act" in policy.get("recompute", ()):
            assert "recomputed: moe_act in backward: layers.0.mlp.experts" in report.notes
        if policy.get("fp8_weight_once"):
            assert any(n.startswith("fp8_save_quantized_weight: layers.0.mlp.experts: the weight's two FP8 "
                                    "copies") for n in report.notes), report.notes


# --- experts over token groups: torch._grouped_mm / F.grouped_mm with offsets (transformers 5.x,
# torchtitan). x (T, K) is sorted by expert; group g is rows offs[g-1]:offs[g].

T = 512
# an empty group, groups that are not multiples of 128 (nor of 32), and tokens past offs[-1]
OFFSETS = {"aligned": [128, 256, 384, 512], "ragged": [0, 100, 333, 500]}
GROUPED_MM = {"_grouped_mm": torch._grouped_mm}
if hasattr(torch.nn.functional, "grouped_mm"):
    GROUPED_MM["F.grouped_mm"] = torch.nn.functional.grouped_mm


class TokenGroupedExperts(nn.Module):
    """One GEMM per expert over its token group. ``stored_kn``: W is (E, K, N) and read as
    stored (``_grouped_mm(x, W)``); else (E, N, K), nn.Linear's layout, read transposed
    (transformers' Mixtral experts)."""

    def __init__(self, stored_kn, fn=torch._grouped_mm):
        super().__init__()
        self.stored_kn, self.fn = stored_kn, fn
        shape = (E, K, N) if stored_kn else (E, N, K)
        # bfloat16: torch's grouped_mm takes no other dtype on CPU
        self.weight = nn.Parameter((torch.randn(*shape) * 0.05).to(torch.bfloat16))

    def forward(self, x, offs):
        w = self.weight if self.stored_kn else self.weight.transpose(-2, -1)
        return self.fn(x, w, offs=offs)


def _dq(t, recipe, role, columnwise=False):
    """quantize then dequantize to float32, as the reference GEMM sees its operands."""
    data, scale = recipes.quantize(t, recipe, role, columnwise=columnwise)
    return recipes.dequantize(data, scale, recipe, role, columnwise=columnwise)


def _qdq_group(t, recipe, role, columnwise=False):
    """A token group's qdq, quantized on its own (mxfp8: zero-padded to whole 32-row blocks,
    which is what quantizing it alone means columnwise, and changes no row rowwise)."""
    n = t.shape[0]
    if recipe == "mxfp8" and n % 32:
        t = torch.nn.functional.pad(t, (0, 0, 0, -n % 32))
    return _dq(t, recipe, role, columnwise)[:n]


def _emulated_groups(x, w_kn, grad_y, offs, recipe):
    """Per group, the three GEMMs from the recipe's qdq by hand, with the weight as (E, K, N):
    y_g = x_g @ W_g, dx_g = dY_g @ W_g.T, dW_g = x_g.T @ dY_g. Rows past offs[-1] are 0, as
    is an empty group's dW."""
    bf16 = torch.bfloat16
    y, dx = torch.zeros(T, N, dtype=bf16), torch.zeros(T, K, dtype=bf16)
    dw = torch.zeros(E, K, N, dtype=bf16)
    start = 0
    for g, end in enumerate(offs):
        if end > start:
            xg, gg = x[start:end], grad_y[start:end]
            # the weight's qdq is per expert and per usage, as in _emulated
            y[start:end] = _qdq_group(xg, recipe, "input") @ _dq(w_kn[g], recipe, "weight", True)
            dx[start:end] = _qdq_group(gg, recipe, "grad") @ _dq(w_kn[g], recipe, "weight").t()
            dw[g] = _qdq_group(xg, recipe, "input", True).t() @ _qdq_group(gg, recipe, "grad", True)
        start = end
    return y, dx, dw


@pytest.mark.parametrize("fn", GROUPED_MM)
@pytest.mark.parametrize("stored_kn", [True, False], ids=["EKN", "ENK"])
@pytest.mark.parametrize("recipe", WITH_E4M3)
def test_token_grouped_experts_are_exactly_the_recipe(recipe, stored_kn, fn):
    """Each case of OFFSETS through one compile (the offsets are data: a recompile would raise),
    each with the data it had as a test of its own (the same seed)."""
    torch.manual_seed(0)
    experts = TokenGroupedExperts(stored_kn, GROUPED_MM[fn])
    data_seed = torch.get_rng_state()
    compiled = torch.compile(experts, backend=graphpass.backend(codegen="eager", **_fp8(recipe),
                                                                 kernels="reference"))
    for i, offsets in enumerate(OFFSETS):
        torch.set_rng_state(data_seed)
        experts.weight.grad = None
        offs = torch.tensor(OFFSETS[offsets], dtype=torch.int32)
        x, grad_y = torch.randn(T, K, dtype=torch.bfloat16), torch.randn(T, N, dtype=torch.bfloat16)
        xx = x.clone().requires_grad_()
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            y = compiled(xx, offs)
            y.backward(grad_y)
        w = experts.weight.detach()
        w_kn = w if stored_kn else w.transpose(-2, -1)
        ref_y, ref_dx, ref_dw = _emulated_groups(x, w_kn, grad_y, OFFSETS[offsets], recipe)
        # the weight's columnwise qdq (ENK) is the transpose of the rowwise qdq of W.T (EKN)
        assert torch.equal(y, ref_y), offsets
        assert torch.equal(xx.grad, ref_dx), offsets
        assert torch.equal(experts.weight.grad, ref_dw if stored_kn else ref_dw.transpose(-2, -1)), \
            offsets
    report = graphpass.last_report()
    assert [n for n in report.notes if "lowered" in n] == [f"lowered: <root> (reference/{recipe})"]
    flops = 2 * T * K * N
    assert report.meta["fp8_coverage"]["fp8_flops"] == {"forward": flops, "dgrad": flops,
                                                        "wgrad": flops}
    assert report.meta["fp8_coverage"]["fp8_share"] == 1.0


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_quantize_scales_per_group(recipe):
    """Tensorwise: one scale per token group (TE GroupedLinear); columnwise blocks restart at
    each group and pad its last block: the scale columns are the groups' own, in order. Rowwise:
    one scale per column and group, each group's data from its 16-aligned start."""
    torch.manual_seed(0)
    x = torch.randn(T, K)
    x[100:333] *= 1000
    offs = torch.tensor(OFFSETS["ragged"], dtype=torch.int32)
    data, scale = torch.ops.graphpass.quantize(x, recipe, "input", "columnwise", offs)
    if recipe == "rowwise":  # the 16-aligned token layout, by hand: ceil(T / 16) * 16 + 16 * G
        assert data.shape == (K, -(-T // 16) * 16 + 16 * E)
        # groups of 0, 100, 233 and 167 tokens from columns 0, 0, 112 and 352 (sizes rounded up
        # to 16, summed); every other column (padding, rows past offs[-1]) is 0
        firsts = [0, 0, 112, 352]
        used = torch.zeros(data.shape[1], dtype=torch.bool)
        for first, n in zip(firsts, (0, 100, 233, 167)):
            used[first:first + n] = True
        assert not data[:, ~used].view(torch.uint8).any()
    else:
        assert data.shape == (K, T)
        assert torch.equal(data[:, 500:].view(torch.uint8), torch.zeros(K, 12, dtype=torch.uint8))
        firsts = [0, *OFFSETS["ragged"][:-1]]
    cols, start = [], 0
    for g, end in enumerate(OFFSETS["ragged"]):
        if end == start:
            if recipe == "tensorwise":
                assert scale[g] == 1.0
            if recipe == "rowwise":  # one scale per column of x and group: (G, K)
                assert (scale[g] == 1.0).all()
            continue
        xg = torch.nn.functional.pad(x[start:end], (0, 0, 0, -(end - start) % 32)) if recipe == "mxfp8" else x[start:end]
        ref_data, ref_scale = recipes.quantize(xg, recipe, "input", columnwise=True)
        first = firsts[g]
        assert torch.equal(data[:, first:first + end - start].view(torch.uint8),
                           ref_data[:, :end - start].view(torch.uint8))
        if recipe == "tensorwise":
            assert torch.equal(scale[g], ref_scale)
        elif recipe == "rowwise":
            assert torch.equal(scale[g], ref_scale[:, 0])
        else:
            cols.append(ref_scale)
        start = end
    if recipe == "rowwise":
        assert scale.shape == (E, K)
    elif recipe != "tensorwise":
        block = 128 if recipe == "blockwise" else 32
        used = torch.cat(cols, dim=1)
        assert scale.shape == (K, -(-T // block) + E)
        assert torch.equal(scale[:, :used.shape[1]], used)
        one = 127 if recipe == "mxfp8" else 1.0
        assert (scale[:, used.shape[1]:] == one).all()
    # under fake tensors: the same shapes and dtypes, no values read
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.graphpass.quantize(mode.from_tensor(x), recipe, "input", "columnwise",
                                            mode.from_tensor(offs))
    assert [(f.shape, f.dtype) for f in fake] == [(data.shape, data.dtype), (scale.shape, scale.dtype)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_grouped_quantize_is_each_group_quantized_alone_without_a_host_sync(
        dtype, monkeypatch):
    """The columnwise 1x128 copy of token-grouped x (the wgrad operand) in one pass: blocks
    restart at each group, a group's partial last block holds its own tokens' amax, and no value
    is read on the host (``tolist`` and ``item`` raise here). Bit for bit each group quantized
    alone by the recipe, with a NaN inside a group, inf in a row past offs[-1] (data 0), an empty
    group, and the unused scale columns 1."""
    torch.manual_seed(0)
    x = torch.randn(T, K, dtype=dtype)
    x[150:333] *= 1000
    x[120, 3] = float("nan")
    x[505, 7] = float("inf")  # past offs[-1] = 500
    offs = torch.tensor(OFFSETS["ragged"], dtype=torch.int32)

    def no_sync(*args, **kwargs):
        raise AssertionError("a value read on the host")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_sync)
        m.setattr(torch.Tensor, "item", no_sync)
        data, scale = torch.ops.graphpass.quantize(x, "blockwise", "grad", "columnwise", offs)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 (NaN != NaN: compare bits)
    assert torch.equal(u8(data[:, 500:]), torch.zeros(K, T - 500, dtype=torch.uint8))
    start, col = 0, 0
    for end in OFFSETS["ragged"]:
        if end > start:
            ref, ref_s = recipes.quantize(x[start:end], "blockwise", "grad", columnwise=True)
            assert torch.equal(u8(data[:, start:end]), u8(ref))
            assert torch.equal(scale[:, col:col + ref_s.shape[1]], ref_s)
            col += ref_s.shape[1]
        start = end
    assert scale.shape == (K, -(-T // 128) + E) and (scale[:, col:] == 1.0).all()


@pytest.mark.parametrize("role", ["input", "grad"])
def test_tensorwise_grouped_quantize_is_each_group_quantized_alone(role):
    """Tensorwise grouped quantizes run in one pass over all groups (no loop, no host sync):
    bit for bit each group quantized on its own by the recipe, with a NaN inside a group, an
    empty group (scale 1), and inf in rows past offs[-1] (data 0); 3-D expert weights likewise."""
    torch.manual_seed(0)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    x[150:333] *= 1000
    x[120, 3] = float("nan")
    x[505, 7] = float("inf")  # past offs[-1] = 500
    offs = torch.tensor(OFFSETS["ragged"], dtype=torch.int32)
    row, row_s, col, col_s = torch.ops.graphpass.quantize(x, "tensorwise", role, "both", offs)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731 (NaN != NaN: compare bits)
    assert torch.equal(u8(row[500:]), torch.zeros(T - 500, K, dtype=torch.uint8))
    assert torch.equal(u8(col), u8(row.t().contiguous()))
    assert row_s[0] == col_s[0] == 1.0
    start = 0
    for g, end in enumerate(OFFSETS["ragged"]):
        if end > start:
            ref, ref_s = recipes.quantize(x[start:end], "tensorwise", role)
            assert torch.equal(u8(row[start:end]), u8(ref))
            assert torch.equal(row_s[g], ref_s) and torch.equal(col_s[g], ref_s)
        start = end
    w = torch.randn(E, N, K)
    w[1] *= 1e-3
    parts = torch.ops.graphpass.quantize(w, "tensorwise", "weight", "both")
    for e in range(E):
        ref = [*recipes.quantize(w[e], "tensorwise", "weight"),
               *recipes.quantize(w[e], "tensorwise", "weight", columnwise=True)]
        for got, want in zip(parts, ref):
            assert torch.equal(got[e].view(torch.uint8) if got.dtype.itemsize == 1 else got[e],
                               want.view(torch.uint8) if want.dtype.itemsize == 1 else want)


def test_token_grouped_experts_plan_at_real_size():
    """DeepSeek-V3 expert shapes, 8k routed tokens, under fake tensors, every GEMM lowered."""
    e, t, k, n = 16, 8192, 7168, 2048
    with torch.device("meta"):
        experts = TokenGroupedExperts.__new__(TokenGroupedExperts)
        nn.Module.__init__(experts)
        experts.stored_kn, experts.fn = False, torch._grouped_mm
        experts.weight = nn.Parameter(torch.empty(e, n, k, dtype=torch.bfloat16))
        x = torch.empty(t, k, dtype=torch.bfloat16, requires_grad=True)
        offs = torch.empty(e, dtype=torch.int32)
    # 512 tokens an expert read their weights: the cost model keeps them bf16, M their average
    kept = graphpass.plan(experts, x, offs, config=graphpass.Config(fp8="blockwise"))
    assert [n for n in kept.notes if "lowered" in n] == [
        "not lowered: <root>: faster in bf16 (H100 roofline: FP8 GEMMs 405.8 us + quantizes "
        "555.9 us > bf16 GEMMs 729.6 us, M=512 N=2048 K=7168 per expert (M: the token groups' "
        "average), 16 experts; fp8_cost_model='off' lowers it; with gradient accumulation and "
        "fp8_weight_cache=True (the weight quantized once per optimizer step) FP8 is the faster: "
        "FP8 GEMMs 405.8 us + quantizes 135.2 us)"]
    # the rest is about the FP8 plan: every GEMM lowered
    report = graphpass.plan(experts, x, offs, config=graphpass.Config(fp8="blockwise",
                                                                      fp8_cost_model="off"))
    flops = 2 * t * k * n
    assert report.meta["fp8_coverage"]["fp8_flops"] == {"forward": flops, "dgrad": flops,
                                                        "wgrad": flops}
    # the backward keeps x's columnwise copy (K, T) and its per-group-padded 1x128 scales
    fp8 = sorted((r.shape, r.bytes) for r in report.rows if r.kind in ("fp8_data", "fp8_scale"))
    assert fp8 == [((k, t // 128 + e), k * (t // 128 + e) * 4), ((k, t), k * t)]
    # these blockwise quantizes are inlined under Inductor (no loop over the groups); where this
    # torch's Inductor CPU code fuses no quantize at all (2.11), a note says so
    from graphpass import _compat

    notes = [n for n in report.notes if n.startswith("fuse_quantize")]
    if _compat.inductor_rounds_fused_casts(device_types=["cpu"]):
        assert notes == []
    else:
        [note] = notes
        assert note.endswith("each quantize runs as one op (torch >= 2.13 fuses them)")


def test_misaligned_token_grouped_experts_are_noted():
    experts = TokenGroupedExperts(False)
    experts.weight = nn.Parameter(torch.randn(E, 96, K, dtype=torch.bfloat16))
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor(OFFSETS["aligned"], dtype=torch.int32)
    report = graphpass.plan(experts, x, offs, config=graphpass.Config(fp8="blockwise"))
    reason = "N=96 not a multiple of 128"
    assert [n for n in report.notes if "lowered" in n] == [f"not lowered: <root>: {reason}"]
    assert report.meta["fp8_coverage"]["high_precision_flops"] == {reason: 3 * 2 * T * K * 96}


class _GroupedSwiGLU(nn.Module):
    def __init__(self, hidden, inter, experts):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, inter) * 0.05)

    def forward(self, routed, offs):
        gate, up = torch._grouped_mm(routed, self.gate_up_proj.transpose(-2, -1),
                                     offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(nn.functional.silu(gate) * up, self.down_proj.transpose(-2, -1),
                                 offs=offs)


class TokenRoutedMoE(nn.Module):
    """A Mixtral-style routed MoE layer over token groups, as transformers 5.x writes it: top-2
    routing, tokens sorted by expert, ``_grouped_mm`` with offsets for gate/up and down."""

    def __init__(self, hidden=256, inter=256, experts=E, top_k=2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = _GroupedSwiGLU(hidden, inter, experts)

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        weights, ids = torch.topk(self.router(x).softmax(-1), self.top_k)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        routed = x[perm // self.top_k]
        counts = torch.histc(ids_sorted.float(), bins=self.experts.gate_up_proj.shape[0], min=0,
                             max=self.experts.gate_up_proj.shape[0] - 1)
        out = self.experts(routed, torch.cumsum(counts, 0, dtype=torch.int32))
        out = out * weights.reshape(-1)[perm, None]
        y = torch.zeros_like(x).index_add(0, perm // self.top_k, out)
        return y.reshape(b, s, h)


class _TokenRoutedExample:
    @staticmethod
    def build(size, seq=64, layers=1):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.add_module("mlp", TokenRoutedMoE())  # recompute's words find "<parent>.experts"
        return model.to(torch.bfloat16), [torch.randn(2, seq, 256, dtype=torch.bfloat16)]


@pytest.mark.parametrize("recipe", WITH_E4M3)
def test_memory_passes_on_token_grouped_experts_are_bit_identical(recipe):
    """The memory policies on a routed MoE layer whose experts are _grouped_mm over token groups
    (ragged, data-dependent groups): gradients bit-identical to TE-style FP8 with torch's
    min-cut, per recipe."""
    from test_memory_passes import POLICIES, UNOPTIMISED, _compiled_grads

    module = _TokenRoutedExample
    base, report = _compiled_grads(module, dict(**_fp8(recipe), **UNOPTIMISED))
    router = 3 * 2 * 128 * 256 * E  # the router stays high precision (default fp8_exclude)
    assert report.meta["fp8_coverage"]["high_precision_flops"] == {"excluded by pattern '*.router'": router}
    assert f"lowered: mlp.experts (reference/{recipe})" in report.notes
    for policy in [*POLICIES, dict(offload=True, offload_min_bytes=0),
                   dict(fp8_weight_once=True)]:
        grads, report = _compiled_grads(module, dict(**_fp8(recipe), **policy))
        assert all(torch.equal(a, b) for a, b in zip(grads, base)), policy
        if policy.get("save_original") == "always":
            assert "save original: mlp.experts re-quantizes its saved input in the backward" in report.notes
        if "moe_act" in policy.get("recompute", ()):
            assert "recomputed: moe_act in backward: mlp.experts" in report.notes, report.notes


# --- providers for token groups: torch._scaled_grouped_mm on CUDA --------------------------------

def test_tensorwise_forward_runs_as_one_grouped_call(monkeypatch):
    """Tensorwise (HYBRID) experts' forward, both operands E4M3, is one
    torch._scaled_grouped_mm (token groups: 2d x 3d; bmm experts: 3d x 3d), its scales given per
    row in their own allocations (the argument layouts' fake-CUDA check against torch's meta
    function: tests/test_fp8_rowwise.py::test_tensorwise_grouped_calls_pass_torchs_own_checks);
    an E5M2 gradient operand takes the per-expert path, which the grouped kernel's rules
    refuse."""
    from graphpass.fp8 import providers

    calls = []
    real = providers.grouped_mm_call
    monkeypatch.setattr(providers, "grouped_mm_call", lambda *a, **k: calls.append(a) or real(*a, **k))
    offs = torch.tensor(OFFSETS["ragged"], dtype=torch.int32)
    scaled_mm = providers.get("scaled_mm")
    x = torch.randn(T, K, dtype=torch.bfloat16)
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    a, sa = torch.ops.graphpass.quantize(x, "tensorwise", "input", "rowwise", offs)
    b, sb = torch.ops.graphpass.quantize(w, "tensorwise", "weight", "rowwise")
    out = scaled_mm.grouped_gemm(a, sa, b, sb, offs, "tensorwise", "input", "weight",
                                 torch.bfloat16, None)
    ref = providers.get("reference")
    assert torch.equal(out, ref.grouped_gemm(a, sa, b, sb, offs, "tensorwise", "input",
                                             "weight", torch.bfloat16, None))
    assert len(calls) == 1
    g, sg = torch.ops.graphpass.quantize(x[:, :N].contiguous(), "tensorwise", "grad", "rowwise",
                                         offs)
    assert g.dtype == recipes.E5M2
    wt, swt = torch.ops.graphpass.quantize(w, "tensorwise", "weight", "columnwise")
    singles = []
    real_mm = torch_gemms.scaled_mm
    monkeypatch.setattr(torch_gemms, "scaled_mm", lambda *a, **k: singles.append(1) or real_mm(*a, **k))
    scaled_mm.grouped_gemm(g, sg, wt, swt, offs, "tensorwise", "grad", "weight", torch.bfloat16,
                           None)
    assert len(calls) == 1 and len(singles) == 3  # the 3 non-empty groups, one _scaled_mm each
    xb = torch.randn(E, C, K, dtype=torch.bfloat16)
    a3, sa3 = torch.ops.graphpass.quantize(xb, "tensorwise", "input", "rowwise")
    out = scaled_mm.batched_gemm(a3, sa3, b, sb, "tensorwise", "input", "weight", torch.bfloat16,
                                 None)
    assert len(calls) == 2 and out.shape == (E, C, N)
    assert torch.equal(out, ref.batched_gemm(a3, sa3, b, sb, "tensorwise", "input",
                                             "weight", torch.bfloat16, None))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scaled_batched_forward_matches_the_per_expert_loop_on_cuda():
    """CUDA: bmm experts' forward as one torch._scaled_grouped_mm is close to one _scaled_mm per
    expert (same FP8 operands and scales, fp32 accumulation in another order: on an H100 with
    torch 2.11 some outputs differ in their last bf16 bit at these shapes, none at (4, 256, 512,
    1024)); the compiled step with kernels='scaled_mm' is close to the reference provider's."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    from graphpass.fp8 import providers

    torch.manual_seed(0)
    x, w = torch.randn(E, C, K, device="cuda"), torch.randn(E, N, K, device="cuda")
    a, sa = torch.ops.graphpass.quantize(x, "tensorwise", "input", "rowwise")
    b, sb = torch.ops.graphpass.quantize(w, "tensorwise", "weight", "rowwise")
    loop = torch.stack([providers.get("scaled_mm").gemm(a[e], sa[e], b[e], sb[e], "tensorwise",
                                                        "input", "weight", torch.bfloat16, None)
                        for e in range(E)])
    torch.testing.assert_close(providers.tensorwise_batched(a, sa, b, sb, torch.bfloat16),
                               loop, rtol=8e-3, atol=1e-2)  # 2**-7: one bf16 ulp
    got = []
    for kernels in ("reference", "scaled_mm"):
        torch.manual_seed(0)
        experts = Experts().to("cuda", torch.bfloat16)
        xx = torch.randn(E, C, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch._dynamo.reset()
        y = torch.compile(experts, backend=graphpass.backend(codegen="eager", fp8="tensorwise",
                                                             kernels=kernels))(xx)
        y.backward(torch.ones_like(y))
        got.append((y.detach(), xx.grad, experts.weight.grad))
    for r, g in zip(*got):
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)


def _compiled_token_groups(recipe, kernels, device, offsets="ragged", stored_kn=False,
                           **options):
    torch.manual_seed(0)
    experts = TokenGroupedExperts(stored_kn).to(device)
    offs = torch.tensor(OFFSETS[offsets], dtype=torch.int32, device=device)
    x = torch.randn(T, K, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad_y = torch.randn(T, N, dtype=torch.bfloat16, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(experts, backend=graphpass.backend(codegen="eager", fp8=recipe,
                                                                 kernels=kernels, **options))
    y = compiled(x, offs)
    y.backward(grad_y)
    return y.detach(), x.grad, experts.weight.grad


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_token_grouped_gradient_is_quantized_once_for_dgrad_and_wgrad(recipe, monkeypatch):
    """The gradient of a token-grouped GEMM is quantized by one ``usage="both"`` op for dgrad's
    rowwise and wgrad's columnwise copy (on CUDA the grouped kernels then read it twice, not
    four times), the backward's only gradient quantize; gradients bit-identical to two
    quantizes."""
    import sys

    from graphpass.passes import lower_fp8

    backend_module = sys.modules["graphpass.backend"]  # graphpass.backend is the function

    def run():
        backwards = []

        def keep(*args, **kwargs):
            partition = real_run(*args, **kwargs)
            backwards.append(partition.backward.graph)
            return partition

        with monkeypatch.context() as m:
            m.setattr(backend_module, "run", keep)
            y, dx, dw = _compiled_token_groups(recipe, "reference", "cpu", stored_kn=True)
        usages = [n.args[3] for n in backwards[-1].nodes
                  if n.target is ops.QUANTIZE and n.args[2] == "grad"]
        return usages, (y, dx, dw)

    real_run = backend_module.run
    usages, grads = run()
    assert usages == ["both"]
    monkeypatch.setattr(lower_fp8, "_merge_grouped_gradient_quantizes", lambda graph: None)
    usages, apart = run()
    assert sorted(usages) == ["columnwise", "rowwise"]
    assert all(torch.equal(a, b) for a, b in zip(grads, apart))


def test_scaled_mm_provider_runs_token_groups_per_group_on_cpu():
    """On the CPU, kernels='scaled_mm' runs a token group's dgrad and wgrad as torch._scaled_mm
    (its CPU emulation), one per group, and the forward as one emulated grouped call: the
    reference's numbers, up to _scaled_mm's bf16 rounding."""
    ref = _compiled_token_groups("tensorwise", "reference", "cpu")
    got = _compiled_token_groups("tensorwise", "scaled_mm", "cpu")
    assert "lowered: <root> (scaled_mm/tensorwise)" in graphpass.last_report().notes
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)


def test_scaled_mm_calls_follow_cublaslt_rules(monkeypatch):
    """Two rules of cuBLASLt's FP8 GEMM that torch._scaled_mm's CPU emulation does not enforce,
    both found on an H100: the contraction dimension a multiple of 16 (a token group's wgrad
    contracts over its 100 tokens), and each scale in its own allocation (a view into the
    per-group scale vector gave CUBLAS_STATUS_NOT_SUPPORTED). Checked here on every call the
    per-group path makes on the CPU."""
    calls, real = [], torch_gemms.scaled_mm

    def checked(a, b, *, scale_a, scale_b, bias, out_dtype, use_fast_accum):
        calls.append(a.shape)
        assert a.shape[-1] % 16 == 0 and b.shape[0] % 16 == 0, (a.shape, b.shape)
        assert scale_a.storage_offset() == 0 and scale_b.storage_offset() == 0
        return real(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum)

    monkeypatch.setattr(torch_gemms, "scaled_mm", checked)
    _compiled_token_groups("tensorwise", "scaled_mm", "cpu")  # ragged: groups of 100, 233, 167
    assert len(calls) == 2 * 3  # dgrad and wgrad of the three non-empty groups (the forward is
    # one grouped call: tests/test_fp8_rowwise.py::test_tensorwise_experts_say_what_still_loops)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("offsets", OFFSETS)
def test_scaled_grouped_mm_matches_the_reference_on_cuda(offsets):
    """CUDA: the forward as one torch._scaled_grouped_mm, dgrad/wgrad per group (_scaled_mm),
    against the reference provider on the same device: same quantized operands, fp32
    accumulation in another order, so close, not equal. Rows past offs[-1] (ragged: 500 of
    512) are compared in the weight gradient only, where they must count for nothing: the
    output and input-gradient rows there are what the grouped kernel leaves, unwritten, as
    torch's own _grouped_mm leaves them (0 from the reference)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    ref = _compiled_token_groups("tensorwise", "reference", "cuda", offsets)
    got = _compiled_token_groups("tensorwise", "scaled_mm", "cuda", offsets)
    end = OFFSETS[offsets][-1]
    for i, (r, g) in enumerate(zip(ref, got)):
        if i < 2:  # the output and the input gradient: rows of the groups
            r, g = r[:end], g[:end]
        torch.testing.assert_close(g, r, rtol=1.6e-2, atol=1e-2)


def test_fp8_cache_leaves_token_grouped_copies_alone():
    """fp8_cache reuses the lowering's columnwise copies of plain linears only: a grouped copy
    (per-group scales) is not one it can dequantize; the step compiles and runs (it raised on
    the grouped quantize's fifth argument before)."""
    from test_memory_passes import _compiled_grads

    _, report = _compiled_grads(_TokenRoutedExample, dict(fp8="tensorwise", fp8_cache="all",
                                                          fp8_cache_min_bytes=0))
    assert "lowered: mlp.experts (reference/tensorwise)" in report.notes


# --- quantize before dispatch (passes/regather.py): the routed experts' wgrad operand re-derived
# in the backward from the layer input instead of saving the dispatched tokens' copy

def _without_regather(monkeypatch):
    from graphpass import pipeline

    monkeypatch.setattr(pipeline, "PASSES", tuple(p for p in pipeline.PASSES
                                                  if p.__name__ != "regather"))


def _saved_rows(report):
    from collections import Counter

    return Counter((r.module, r.op, r.kind, r.dtype, r.shape, r.bytes) for r in report.rows
                   if r.kind != "parameter")


# The dispatched tokens' columnwise copy: 128 tokens x top-2 = 256 rows of K=256, FP8 (K, 256),
# and its scales: one per expert (tensorwise), 1x128 blocks restarting per group,
# (K, 256/128 + 4) fp32 (blockwise), 1x32 blocks, (K, 256/32 + 4) E8M0 bytes (mxfp8), one fp32
# scale per column and expert, (E, K) (rowwise). Rowwise's data is in the 16-aligned token
# layout, by hand from its formula: ceil(256 / 16) * 16 + 16 * E columns, (K, 320).
DISPATCHED_COLUMNS = {"rowwise": -(-256 // 16) * 16 + 16 * E}
DISPATCHED_SCALES = {"tensorwise": ("float32", (E,), 4 * E),
                     "blockwise": ("float32", (K, 2 + E), 4 * K * (2 + E)),
                     "mxfp8": ("uint8", (K, 8 + E), K * (8 + E)),
                     "rowwise": ("float32", (E, K), 4 * E * K)}  # per column of x and expert


@pytest.mark.parametrize("recipe", RECIPES)
def test_quantize_before_dispatch_saves_the_layer_input_not_the_dispatched_copy(recipe, monkeypatch):
    """Top-2 routed MoE under torch's default heuristics (memory="default"): the min-cut saves the
    FP8 copy of the 256 dispatched rows for the experts' wgrad; the layer input (128, 256) bf16
    is saved anyway (the bf16 router's wgrad reads it). The pass re-gathers it in the backward
    instead: exactly that copy leaves the saved set, nothing joins it."""
    config = graphpass.Config(fp8=recipe, memory="default")
    model, inputs = _TokenRoutedExample.build("tiny")
    with_it = graphpass.plan(model, *inputs, config=config)
    with monkeypatch.context() as m:
        _without_regather(m)
        without = graphpass.plan(model, *inputs, config=config)
    dtype, shape, scale_bytes = DISPATCHED_SCALES[recipe]
    columns = DISPATCHED_COLUMNS.get(recipe, 2 * 128)
    copy = [("mlp.experts", "graphpass.quantize", "fp8_data", "float8_e4m3fn", (K, columns),
             K * columns),
            ("mlp.experts", "graphpass.quantize", "fp8_scale", dtype, shape, scale_bytes)]
    assert without.activation_bytes - with_it.activation_bytes == K * columns + scale_bytes
    assert sorted((_saved_rows(without) - _saved_rows(with_it)).elements()) == sorted(copy)
    assert not _saved_rows(with_it) - _saved_rows(without)
    layer_input = ("mlp", "aten.view", "activation", "bfloat16", (128, 256), 128 * 256 * 2)
    assert _saved_rows(with_it)[layer_input] == 1
    notes = [n for n in with_it.notes if n.startswith("dispatch:")]
    assert notes == [f"dispatch: mlp.experts: aten.index of view: re-gathers view (128, 256) bfloat16 "
                     f"from mlp in the backward for the wgrad's FP8 copy instead of saving "
                     f"{K * columns + scale_bytes:,} B of the dispatched tokens (2,048 B more kept); "
                     f"{K * columns + scale_bytes:,} B fewer saved in all"]
    assert "recomputed: dispatch (aten.index of view, re-gathered) in backward: mlp, mlp.experts" in with_it.notes


@pytest.mark.parametrize("recipe", WITH_E4M3)
def test_quantize_before_dispatch_is_bit_identical(recipe, monkeypatch):
    """Gradients with and without the pass, where it applies (memory="default", and
    save_original="always", where it replaces the dispatched tokens in bf16), per recipe."""
    from test_memory_passes import _compiled_grads

    for policy in (dict(memory="default"), dict(memory="default", save_original="always")):
        grads, report = _compiled_grads(_TokenRoutedExample, dict(**_fp8(recipe), **policy))
        assert any(n.startswith("dispatch: mlp.experts: aten.index") for n in report.notes), policy
        with monkeypatch.context() as m:
            _without_regather(m)
            base, report = _compiled_grads(_TokenRoutedExample, dict(**_fp8(recipe), **policy))
        assert not any(n.startswith("dispatch:") for n in report.notes)
        assert all(torch.equal(a, b) for a, b in zip(grads, base)), policy


def test_quantize_before_dispatch_on_deepseek_is_bit_identical(monkeypatch):
    """The capacity-style dispatch of graphpass/models/deepseek.py (index_select into (E, C, hidden),
    bmm experts): re-gathered, gradients bit-identical."""
    from graphpass.models import deepseek
    from test_memory_passes import _compiled_grads

    cfg = dict(fp8="tensorwise", memory="default")
    grads, report = _compiled_grads(deepseek, cfg, seq=32, layers=1)
    assert any(n.startswith("dispatch: layers.0.mlp.experts: aten.index of ") and "re-gathers" in n
               for n in report.notes), report.notes
    with monkeypatch.context() as m:
        _without_regather(m)
        base, _ = _compiled_grads(deepseek, cfg, seq=32, layers=1)
    assert all(torch.equal(a, b) for a, b in zip(grads, base))


class _RoutedBy(nn.Module):
    """Experts over tokens routed by given expert ids (top-1, no router): nothing but the
    dispatch reads the layer input."""

    def __init__(self):
        super().__init__()
        self.experts = _GroupedSwiGLU(256, 256, E)

    def forward(self, x, ids):
        ids_sorted, perm = torch.sort(ids)
        counts = torch.histc(ids_sorted.float(), bins=E, min=0, max=E - 1)
        out = self.experts(x[perm], torch.cumsum(counts, 0, dtype=torch.int32))
        return torch.zeros_like(x).index_add(0, perm, out)


def test_quantize_before_dispatch_notes_where_it_does_not_apply():
    torch.manual_seed(0)
    model = _RoutedBy().to(torch.bfloat16)
    x = torch.randn(128, 256, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, E, (128,))
    # top-1, the layer input (a graph input here) saved by nothing else: its 65,536 B in bf16
    # outweigh the dispatched copy, 32,768 B of FP8 (K=256 x 128 tokens) and 16 B of scales
    report = graphpass.plan(model, x, ids, config=graphpass.Config(fp8="tensorwise",
                                                                    memory="default"))
    assert [n for n in report.notes if n.startswith("dispatch:")] == [
        "dispatch: experts: not re-gathered: aten.index of primals_2: keeping primals_2 and the "
        "indices (65,536 B) saves no bytes over the dispatched copy (32,784 B)"]
    assert sum(r.bytes for r in report.rows if r.kind.startswith("fp8")) == 2 * (32768 + 16)
    model, inputs = _TokenRoutedExample.build("tiny")
    # save_original="never": the FP8 copy is what the user asked for (TE's default)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(
        fp8="tensorwise", memory="default", save_original="never"))
    assert [n for n in report.notes if n.startswith("dispatch:")] == [
        "dispatch: mlp.experts: not re-gathered: aten.index of view: save_original='never' saves "
        "the dispatched tokens' FP8 copy (quantized in the forward, as Transformer Engine does)"]
    # the planner's min-cut (memory="auto") re-gathers by itself already
    report = graphpass.plan(model, *inputs, config=graphpass.Config(fp8="tensorwise"))
    assert [n for n in report.notes if n.startswith("dispatch:")] == [
        "dispatch: mlp.experts: not re-gathered: aten.index of view: the plan already saves no "
        "copy of the dispatched tokens (it re-gathers them)"]


def test_quantize_before_dispatch_keeps_the_plan_when_the_min_cut_disagrees(monkeypatch):
    """Where torch's min-cut of the tagged graph does not save fewer bytes than the plan before
    (simulated: the second ``exact_partition`` answers as the first), the tags are undone: the
    saved set is the one without the pass, and the note says why."""
    from graphpass import min_cut

    config = graphpass.Config(fp8="tensorwise", memory="default")
    model, inputs = _TokenRoutedExample.build("tiny")
    with monkeypatch.context() as m:
        _without_regather(m)
        without = graphpass.plan(model, *inputs, config=config)
    first = []

    def stale(*args, **kwargs):  # every call answers as the first one did
        if not first:
            first.append(real_exact_partition(*args, **kwargs))
        return first[0]

    real_exact_partition = min_cut.exact_partition
    monkeypatch.setattr(min_cut, "exact_partition", stale)
    report = graphpass.plan(model, *inputs, config=config)
    assert _saved_rows(report) == _saved_rows(without)
    assert [n for n in report.notes if n.startswith("dispatch:")] == [
        "dispatch: mlp.experts: not re-gathered: aten.index of view: torch's min-cut of the "
        f"re-gathering plan saves {without.activation_bytes:,} B, not fewer than "
        f"{without.activation_bytes:,} B"]
    assert not any("dispatch (" in n for n in report.notes)


class _SavedDispatch(nn.Module):
    """The token-routed MoE layer under the user's selective checkpoint: the dispatch (every
    ``aten.index``) MUST_SAVE, everything else PREFER_RECOMPUTE."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self.mlp = moe

    def forward(self, x):
        import functools

        from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                            create_selective_checkpoint_contexts)

        def policy(ctx, op, *args, **kwargs):
            return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.index.Tensor
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        return checkpoint(self.mlp, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def test_quantize_before_dispatch_keeps_the_users_checkpoint_policy():
    """Where the user's checkpoint policy saves the dispatch, the pass does not re-gather it and
    says so, naming the nodes the policy keeps."""
    model, inputs = _TokenRoutedExample.build("tiny")
    model = _SavedDispatch(model.mlp)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(fp8="tensorwise",
                                                                    memory="default"))
    notes = [n for n in report.notes if n.startswith("dispatch:")]
    assert len(notes) == 1 and notes[0].startswith(
        "dispatch: mlp.experts: not re-gathered: aten.index of "), notes
    # the dispatch the policy saves, and the graphpass quantize its region's policy covers
    assert ": your checkpoint policy decides index (MUST_SAVE), quantize" in notes[0], notes
    assert not any(n.startswith("dispatch: mlp.experts: aten.index") for n in report.notes)


# --- Transformer Engine's grouped GEMM, as graphpass calls it (CI has no TE: its two entry points
# are stood in for here, on the CPU; tests/test_te.py checks the keywords against the real ones)

class _StandInStorage:
    """TE's Float8TensorStorage as graphpass builds it: data, one fp32 scale_inv, the TE dtype."""

    def __init__(self, *, data, fp8_scale_inv, fp8_dtype, data_transpose, quantizer):
        assert data_transpose is None and quantizer is None
        assert fp8_scale_inv.shape == (1,) and fp8_scale_inv.dtype == torch.float32
        self.data, self.scale_inv, self.fp8_dtype = data, fp8_scale_inv, fp8_dtype

    def dequantize(self):
        return self.data.float() * self.scale_inv


def _stand_in_te(calls: list):
    from graphpass.fp8.te import TransformerEngine

    def cublaslt_rules(A, B):  # the rules the H100 taught (test_scaled_mm_calls_follow_...)
        assert A.data.shape[-1] % 16 == 0 and A.data.shape[-1] == B.data.shape[-1]
        assert A.scale_inv.storage_offset() == 0 and B.scale_inv.storage_offset() == 0

    def general_gemm(A, B, *, out_dtype, layout, bias, use_split_accumulator):
        calls.append(("gemm", 1, use_split_accumulator))
        assert layout == "TN" and bias is None
        cublaslt_rules(A, B)
        return ((B.dequantize() @ A.dequantize().t()).to(out_dtype),)

    def general_grouped_gemm(A, B, out, *, quantization_params, out_dtype, layout, single_output,
                             use_split_accumulator):
        calls.append(("grouped", len(A), use_split_accumulator))
        assert layout == "TN" and not single_output and quantization_params == [None] * len(A)
        assert len(A) == len(B) == len(out)
        for a, b, o in zip(A, B, out):  # TN: out = B @ A.T, written in place
            cublaslt_rules(a, b)
            o.copy_((b.dequantize() @ a.dequantize().t()).to(o.dtype))
        return out, None, None

    te = TransformerEngine.__new__(TransformerEngine)  # its __init__ imports TE
    te._storage, te._gemm, te._grouped_gemm = _StandInStorage, general_gemm, general_grouped_gemm
    te._te_dtype = {recipes.E4M3: "E4M3", recipes.E5M2: "E5M2"}
    te.supports = lambda recipe, device: None  # the kernels run on the CPU here
    return te


def test_te_runs_each_grouped_gemm_as_one_grouped_call(monkeypatch):
    """kernels='te' on experts: each grouped or batched GEMM is one general_grouped_gemm (TE's
    grouped GEMM) of its non-empty groups, TN, with cuBLASLt's rules met (token groups of 100,
    233 and 167: wgrads contract over those, padded to 16); the numbers are the reference
    provider's (the same dequantized products, accumulated in fp32; where the wgrad's tokens are
    zero-padded the fp32 sum runs in another order: within one bf16 ulp)."""
    from graphpass.fp8 import providers

    calls, real_get = [], providers.get
    te = _stand_in_te(calls)
    ref = _compiled_token_groups("tensorwise", "reference", "cpu")
    ref_bmm = _compiled_bmm_experts("reference")
    monkeypatch.setattr(providers, "te_available", lambda: True)
    monkeypatch.setattr(providers, "get", lambda name: te if name == "te" else real_get(name))

    got = _compiled_token_groups("tensorwise", "te", "cpu")
    assert "lowered: <root> (te/tensorwise)" in graphpass.last_report().notes
    # forward (input x weight), dgrad (grad x weight), wgrad (grad x input): 3 non-empty groups
    assert sorted(calls) == [("grouped", 3, False), ("grouped", 3, True), ("grouped", 3, True)]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])  # y, dgrad
    # wgrad over zero-padded tokens: fp32 sums in another order, one bf16 ulp apart (or a few
    # fp32 ulps where they cancel to near 0: 1.9e-6 seen on torch 2.11)
    torch.testing.assert_close(got[2], ref[2], rtol=2**-7, atol=1e-5)

    calls.clear()
    got = _compiled_bmm_experts("te")
    assert sorted(calls) == [("grouped", E, False), ("grouped", E, True), ("grouped", E, True)]
    assert all(torch.equal(g, r) for r, g in zip(ref_bmm, got))


def test_te_runs_the_all_e4m3_format(monkeypatch):
    """fp8_format='e4m3' with kernels='te': TE's Float8CurrentScaling in its Format.E4M3, which
    the TE provider runs as it runs HYBRID (each operand's storage carries its FP8 dtype, here
    E4M3 for the gradients too); each grouped GEMM is one general_grouped_gemm, and the numbers
    are the reference provider's for the same format."""
    from graphpass.fp8 import providers
    from graphpass.fp8.te import TransformerEngine

    real_te = TransformerEngine.__new__(TransformerEngine)  # its __init__ imports TE
    assert real_te.supports("tensorwise_e4m3", torch.device("cuda")) is None
    assert "runs fp8='tensorwise'" in real_te.supports("rowwise", torch.device("cuda"))
    calls, dtypes, real_get = [], [], providers.get
    te = _stand_in_te(calls)
    wrap = te._wrap
    te._wrap = lambda data, scale_inv: dtypes.append(data.dtype) or wrap(data, scale_inv)
    ref = _compiled_token_groups("tensorwise", "reference", "cpu", fp8_format="e4m3")
    monkeypatch.setattr(providers, "te_available", lambda: True)
    monkeypatch.setattr(providers, "get", lambda name: te if name == "te" else real_get(name))
    got = _compiled_token_groups("tensorwise", "te", "cpu", fp8_format="e4m3")
    assert "lowered: <root> (te/tensorwise_e4m3)" in graphpass.last_report().notes
    assert sorted(calls) == [("grouped", 3, False), ("grouped", 3, True), ("grouped", 3, True)]
    assert dtypes and set(dtypes) == {recipes.E4M3}
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    torch.testing.assert_close(got[2], ref[2], rtol=2**-7, atol=1e-5)  # as for HYBRID above


@pytest.mark.parametrize("mode,split", [("te", {"forward": False, "dgrad": True, "wgrad": True}),
                                        ("fast", dict.fromkeys(("forward", "dgrad", "wgrad"), False)),
                                        ("precise", dict.fromkeys(("forward", "dgrad", "wgrad"), True))])
def test_te_split_accumulator_per_gemm_role(mode, split, monkeypatch):
    """``fp8_accumulate`` on TE's general_gemm (the CPU stand-in records its arguments): by default
    (``"te"``) the split accumulator is off for the forward and on for dgrad and wgrad, as in TE's
    own Float8CurrentScaling linear. The roles are read from the operands' TE dtypes and shapes:
    the forward's are both E4M3; dgrad's B is the (M, N) gradient and A the (K, N) weight."""
    from graphpass.fp8 import providers

    calls, real_get = [], providers.get
    te = _stand_in_te(calls)
    plain = te._gemm

    def general_gemm(A, B, **kw):
        role = "forward" if A.fp8_dtype == B.fp8_dtype == "E4M3" else (
            "dgrad" if A.data.shape == (K, N) else "wgrad")
        calls.append((role, kw["use_split_accumulator"]))
        return plain(A, B, **kw)

    te._gemm = general_gemm
    monkeypatch.setattr(providers, "te_available", lambda: True)
    monkeypatch.setattr(providers, "get", lambda name: te if name == "te" else real_get(name))
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    x = torch.randn(64, K, requires_grad=True)
    options = {} if mode == "te" else {"fp8_accumulate": mode}
    torch._dynamo.reset()
    compiled = torch.compile(lin, backend=graphpass.backend(codegen="eager", fp8="tensorwise",
                                                            kernels="te", **options))
    compiled(x).sum().backward()
    assert sorted(c for c in calls if c[0] != "gemm") == sorted(split.items())


def _compiled_bmm_experts(kernels):
    torch.manual_seed(0)
    experts = Experts()
    x, grad_y = torch.randn(E, C, K, requires_grad=True), torch.randn(E, C, N)
    torch._dynamo.reset()
    y = torch.compile(experts, backend=graphpass.backend(codegen="eager", fp8="tensorwise",
                                                         kernels=kernels))(x)
    y.backward(grad_y)
    return y.detach(), x.grad, experts.weight.grad


# --- per-expert loops of linears: each expert an nn.Linear called on the tokens routed to it

class _LoopedExperts(nn.Module):
    """transformers' "eager" experts in miniature: ``nonzero`` picks each expert's tokens, whose
    count is known only at run time (an unbacked size once dynamo captures ``nonzero``)."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(K, N, bias=False) for _ in range(E))

    def forward(self, x, choice):
        out = x.new_zeros(x.shape[0], N)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero().squeeze(-1)
            out = out.index_add(0, idx, expert(x[idx]))
        return out


@pytest.mark.parametrize("kernels", ["reference", "scaled_mm"])
def test_per_expert_loop_of_linears_is_lowered_exactly(kernels):
    """Tensorwise: each expert's linear is lowered though its token count is dynamic (wgrad's
    contraction is padded to 16 by the provider; no scaling block runs along the tokens). Groups
    of 100, 0, 233 and 179 tokens; outputs and gradients are the recipe's qdq by hand, per
    expert, and the report names the unbacked sizes it assumed for FLOPs."""
    torch.manual_seed(0)
    model = _LoopedExperts()
    x, grad_y = torch.randn(512, K, requires_grad=True), torch.randn(512, N)
    choice = torch.tensor([0] * 100 + [2] * 233 + [3] * 179)[torch.randperm(512)]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=graphpass.backend(codegen="eager", fp8="tensorwise",
                                                              kernels=kernels))
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        y = compiled(x, choice)  # one graph (without it, dynamo breaks it at nonzero)
    y.backward(grad_y)
    notes = graphpass.last_report().notes
    assert [n for n in notes if n.startswith("lowered")] == [
        f"lowered: experts.{e} ({kernels}/tensorwise)" for e in range(E)]
    assert any(n.startswith("sizes: unbacked u0 assumed 4096 in the FLOPs of") for n in notes)
    # the cost model has no token count to judge each expert by, and says so
    judged = [n for n in notes if n.startswith("fp8_cost_model")]
    assert len(judged) == E and all(re.fullmatch(
        rf"fp8_cost_model: not judged: experts\.{e}: M=u\d+ is dynamic: the roofline has no "
        r"size to judge it by; lowered", n) for e, n in enumerate(judged)), judged

    q = lambda t, role: recipes.qdq(t, "tensorwise", role).float()  # noqa: E731
    ref_y, ref_dx = torch.zeros(512, N), torch.zeros(512, K)
    for e, expert in enumerate(model.experts):
        idx = (choice == e).nonzero().squeeze(-1)
        xe, ge, we = x.detach()[idx], grad_y[idx], expert.weight.detach()
        ref_y[idx] = q(xe, "input") @ q(we, "weight").t()
        ref_dx[idx] = q(ge, "grad") @ q(we, "weight")
        ref_dw = q(ge, "grad").t() @ q(xe, "input")
        if kernels == "reference":
            assert torch.equal(expert.weight.grad, ref_dw)
        else:  # _scaled_mm's CPU emulation accumulates in its own order
            torch.testing.assert_close(expert.weight.grad, ref_dw, rtol=1e-5, atol=1e-5)
    check = torch.equal if kernels == "reference" else (
        lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5) or True)
    assert check(y.detach(), ref_y) and check(x.grad, ref_dx)


# --- bad input to the token-grouped paths: a clear error, or the same bits ---------------------

@pytest.mark.parametrize("offs, why", [
    ([128, 256, 384, 528], r"the last \(528\) is past the 512 token rows"),
    ([384, 256, 384, 512], r"they decrease \(offs\[0\] = 384, offs\[1\] = 256\)"),
    ([-16, 256, 384, 512], r"the first is negative \(-16\)"),
], ids=["past_the_tokens", "decreasing", "negative"])
def test_offsets_that_are_not_group_ends_are_a_clear_error(offs, why):
    """Offsets past the tokens made the recipe's gather fail deep in torch (an IndexError out of
    _quantize_groups_rowwise) and the grouped GEMMs read rows that are not there; decreasing or
    negative ones gave groups no grouped GEMM defines. Each is one ValueError naming graphpass,
    the offsets and what is wrong, from the GEMM and from mxfp8's quantize (which loops over the
    groups on the host); the other quantizes read nothing on the host and do not fail. Offsets
    short of the tokens (rows in no group) and empty groups are valid (``OFFSETS["ragged"]``)."""
    offsets = torch.tensor(offs, dtype=torch.int32)
    message = rf"graphpass fp8: token group offsets \[.*\] are not group ends over 512 token rows: {why}"
    with pytest.raises(ValueError, match=message):
        ops.check_token_groups(offsets, T)
    x = torch.randn(T, K, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        ops.quantize(x, "mxfp8", "input", "columnwise", offsets)
    for recipe in ("rowwise", "tensorwise", "blockwise"):
        ops.quantize(x, recipe, "input", "both", offsets)
    data, scale = ops.quantize(x, "tensorwise", "input", "rowwise",
                               torch.tensor(OFFSETS["aligned"], dtype=torch.int32))
    w = torch.randn(E, N, K, dtype=torch.bfloat16)
    wq, ws = ops.quantize(w, "tensorwise", "weight", "rowwise")
    with pytest.raises(ValueError, match=message):
        ops.fp8_gemm(data, scale, wq, ws, "tensorwise", "input,weight", torch.bfloat16, None,
                     "reference", offsets)
    ops.check_token_groups(torch.tensor(OFFSETS["ragged"], dtype=torch.int32), T)  # valid


@pytest.mark.parametrize("recipe, kernels", [("rowwise", "reference"), ("rowwise", "scaled_mm"),
                                             ("mxfp8", "reference")])
def test_a_compiled_step_with_offsets_past_the_tokens_raises_the_clear_error(recipe, kernels):
    """Under torch.compile the check runs in the step (the offsets are data): the user sees the
    ValueError itself, not torch's IndexError from inside the recipe."""
    torch.manual_seed(0)
    experts = TokenGroupedExperts(False)
    compiled = torch.compile(experts, backend=graphpass.backend(
        codegen="eager", fp8=recipe, kernels=kernels))
    x = torch.randn(T, K, dtype=torch.bfloat16, requires_grad=True)
    compiled(x, torch.tensor(OFFSETS["aligned"], dtype=torch.int32)).sum().backward()
    with pytest.raises(ValueError, match="the last \\(528\\) is past the 512 token rows"):
        compiled(x, torch.tensor([128, 256, 384, 528], dtype=torch.int32)).sum().backward()


@pytest.mark.parametrize("stored_kn", [True, False], ids=["EKN", "ENK"])
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_non_contiguous_expert_weights_are_lowered_with_the_same_bits(recipe, stored_kn):
    """An expert weight whose strides are its transpose's (a parameter made from a transposed
    tensor): autograd computes its gradient in that layout, as the other orientation's grouped
    GEMM transposed, which the lowering did not recognise: wgrad stayed in bf16 beside FP8
    forward and dgrad, with a note saying 'wgrad not in this graph'. Now all three GEMMs are
    lowered and the step's output and gradients are bit for bit those of the contiguous weight
    (the quantizes read any layout; the FP8 copies are contiguous)."""
    offs = torch.tensor(OFFSETS["ragged"], dtype=torch.int32)
    x = torch.randn(T, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    grad_y = torch.randn(T, N, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    results, notes = [], []
    for transposed in (False, True):
        torch.manual_seed(0)
        experts = TokenGroupedExperts(stored_kn)
        if transposed:
            w = experts.weight.detach()
            experts.weight = nn.Parameter(w.transpose(-2, -1).contiguous().transpose(-2, -1))
            assert not experts.weight.is_contiguous() and torch.equal(experts.weight, w)
        torch._dynamo.reset()
        compiled = torch.compile(experts, backend=graphpass.backend(
            codegen="eager", fp8=recipe, kernels="reference"))
        xx = x.clone().requires_grad_()
        y = compiled(xx, offs)
        y.backward(grad_y)
        results.append((y, xx.grad, experts.weight.grad))
        notes.append([n for n in graphpass.last_report().notes if "lowered" in n])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert notes[1] == notes[0] == [f"lowered: <root> (reference/{recipe})"]


def test_a_recipe_the_grouped_kernel_cannot_take_is_a_clear_error_or_noted():
    """blockwise has no grouped FP8 kernel: under kernels='scaled_mm' on the CPU (torch's
    blockwise GEMM is CUDA's) it is one clear error at compile time naming the way out, and
    kernels='auto' runs the reference provider with a note. (tensorwise's HYBRID format, whose
    E5M2 gradients the grouped kernel refuses, loops per expert with a note:
    test_fp8_rowwise.py::test_tensorwise_experts_say_what_still_loops.)"""
    with pytest.raises(Exception, match="kernels='scaled_mm' cannot run here: torch's blockwise "
                                        "FP8 GEMM \\(cuBLASLt\\) has no cpu kernel; use "
                                        "kernels='auto' or 'reference'"):
        _compiled_token_groups("blockwise", "scaled_mm", "cpu")
    ref = _compiled_token_groups("blockwise", "reference", "cpu")
    got = _compiled_token_groups("blockwise", "auto", "cpu")
    assert any(n.startswith("kernels: kernels='auto' chose reference on cpu")
               for n in graphpass.last_report().notes)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
