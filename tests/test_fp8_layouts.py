"""FP8 lowering of linears whose weight is stored [in, out] (GPT-2's Conv1D: y = x @ W + b)."""

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.fp8 import recipes

RECIPES = ("tensorwise", "blockwise", "mxfp8", "rowwise")


class Conv1D(nn.Module):
    """GPT-2's Conv1D (transformers.pytorch_utils.Conv1D): W is [in, out], addmm(b, x, W)."""

    def __init__(self, nx, nf, bias=True):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.05)
        self.bias = nn.Parameter(torch.randn(nf) * 0.05) if bias else None

    def forward(self, x):
        x2d = x.reshape(-1, x.shape[-1])
        y = torch.addmm(self.bias, x2d, self.weight) if self.bias is not None else x2d @ self.weight
        return y.reshape(*x.shape[:-1], -1)


def _emulated_conv1d(x2d, w, b, grad_y, recipe):
    """The three GEMMs of a lowered [in, out] linear, from the recipe's qdq by hand: fprop reads
    W.T's quantization (W columnwise), dgrad W's own (rowwise), wgrad X.T @ dY."""
    q = lambda t, role, col=False: recipes.qdq(t, recipe, role, columnwise=col).float()  # noqa
    y = q(x2d, "input") @ q(w, "weight", True) + (b.float() if b is not None else 0)
    dx = q(grad_y, "grad") @ q(w, "weight").t()
    dw = q(x2d, "input", True).t() @ q(grad_y, "grad", True)
    return y, dx, dw


def _lowering(notes):
    return [n for n in notes if n.startswith(("lowered:", "not lowered:"))]


@pytest.mark.parametrize("shape", [(128, 256), (2, 64, 256)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_stored_in_out_linear_is_exactly_the_recipe(recipe, bias, shape):
    torch.manual_seed(0)
    mod = Conv1D(256, 128, bias=bias)
    x = torch.randn(*shape)
    grad_y = torch.randn(*shape[:-1], 128)
    compiled = torch.compile(mod, backend=graphpass.backend(codegen="eager", fp8=recipe,
                                                             kernels="reference"))
    xx = x.clone().requires_grad_()
    y = compiled(xx)
    y.backward(grad_y)
    ref_y, ref_dx, ref_dw = _emulated_conv1d(x.reshape(-1, 256), mod.weight.detach(), mod.bias,
                                             grad_y.reshape(-1, 128), recipe)
    torch.testing.assert_close(y.reshape(-1, 128), ref_y, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(xx.grad.reshape(-1, 256), ref_dx, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(mod.weight.grad, ref_dw, rtol=1e-6, atol=1e-5)
    if bias:
        torch.testing.assert_close(mod.bias.grad, grad_y.reshape(-1, 128).sum(0))
    report = graphpass.last_report()
    assert _lowering(report.notes) == [f"lowered: <root> (reference/{recipe})"]
    assert report.meta["fp8_coverage"]["fp8_share"] == 1.0


@pytest.mark.parametrize("recipe", RECIPES)
def test_stored_in_out_linear_saves_what_nn_linear_saves(recipe):
    """W is quantized from the parameter itself (no transposed copy), and the backward keeps
    exactly what an nn.Linear of the same shape keeps: X's columnwise FP8 copy (K x M) and its
    scales; W's dgrad copy is re-quantized from the resident parameter."""
    torch.manual_seed(0)
    x = torch.randn(128, 256, requires_grad=True)
    cfg = graphpass.Config(fp8=recipe, save_original="never", memory="default")
    saved = lambda mod: [(r.kind, r.shape, r.dtype, r.bytes)  # noqa: E731
                         for r in graphpass.plan(mod, x, config=cfg).rows if r.kind != "parameter"]
    scale = {"tensorwise": ((), "float32", 4), "blockwise": ((256, 1), "float32", 1024),
             "mxfp8": ((256, 4), "uint8", 1024), "rowwise": ((256, 1), "float32", 1024)}[recipe]
    expected = [("fp8_data", (256, 128), "float8_e4m3fn", 256 * 128), ("fp8_scale", *scale)]
    assert saved(Conv1D(256, 128)) == expected
    assert saved(nn.Linear(256, 128)) == expected


@pytest.mark.parametrize("recipe", RECIPES)
def test_stored_in_out_linear_under_autocast(recipe):
    torch.manual_seed(0)
    mod = Conv1D(256, 256)
    x = torch.randn(2, 64, 256)

    def step(fn):
        mod.zero_grad()
        xx = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(xx)
        y.float().pow(2).sum().backward()
        return y.detach(), xx.grad, mod.weight.grad.clone()

    ref = step(mod)
    got = step(torch.compile(mod, backend=graphpass.backend(codegen="eager", fp8=recipe,
                                                             kernels="reference")))
    assert _lowering(graphpass.last_report().notes) == [f"lowered: <root> (reference/{recipe})"]
    assert got[0].dtype == torch.bfloat16
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    # the bounds of test_fp8_lowering.BOUND: FP8 error on top of bf16 autocast
    assert rel(got[0], ref[0]) < 0.08
    assert rel(got[1], ref[1]) < 0.16
    assert rel(got[2], ref[2]) < 0.16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tied_weight_wgrad_is_lowered(recipe):
    """An output projection tied to the embedding: its wgrad is one term of the weight's summed
    gradient, found and lowered, so no high-precision GEMM is left."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(128, 64)
            self.out = nn.Linear(64, 128, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(self.emb(ids))

    ids = torch.randint(0, 128, (2, 64))
    report = graphpass.plan(Tied(), ids, config=graphpass.Config(fp8=recipe, fp8_exclude=()))
    assert _lowering(report.notes) == [f"lowered: out (reference/{recipe})"]
    cov, flops = report.meta["fp8_coverage"], 2 * 128 * 64 * 128
    assert cov["fp8_share"] == 1.0
    assert cov["fp8_flops"] == {"forward": flops, "dgrad": flops, "wgrad": flops}
