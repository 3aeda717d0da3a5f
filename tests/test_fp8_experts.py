"""FP8 lowering of grouped expert GEMMs: ``bmm`` over a 3-D [experts, in, out] weight
(capacity-style MoE, examples/deepseek.py)."""

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.fp8 import recipes

RECIPES = ("tensorwise", "blockwise", "mxfp8")
E, C, K, N = 4, 128, 256, 128  # experts, capacity (tokens per expert), in, out


class Experts(nn.Module):
    """One GEMM per expert over an (E, C, in) buffer, as examples.deepseek.Experts."""

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
    ("tensorwise", 8, "M=8 not a multiple of 16"),
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


@pytest.mark.parametrize("recipe", RECIPES)
def test_memory_passes_on_fp8_experts_are_bit_identical(recipe):
    """save-original, moe_act/moe recompute, the planner and offload move FP8 expert tensors
    around, never change a gradient bit. seq=128 gives an expert capacity of 128 tokens, which
    blockwise needs."""
    from examples import deepseek
    from test_memory_passes import POLICIES, UNOPTIMISED, _compiled_grads

    base, report = _compiled_grads(deepseek, dict(fp8=recipe, **UNOPTIMISED), seq=128, layers=1)
    assert f"lowered: layers.0.mlp.experts (reference/{recipe})" in report.notes
    for policy in [*POLICIES, dict(offload=True, offload_min_bytes=0)]:
        grads, report = _compiled_grads(deepseek, dict(fp8=recipe, **policy), seq=128, layers=1)
        assert all(torch.equal(a, b) for a, b in zip(grads, base)), policy
        if policy.get("save_original") == "always":
            assert "save original: layers.0.mlp.experts re-quantizes its saved input in the backward" in report.notes
        if "moe_act" in policy.get("recompute", ()):
            assert "recomputed: moe_act in backward: layers.0.mlp.experts" in report.notes
