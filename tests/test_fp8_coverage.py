"""FP8 coverage: the share of a step's GEMM FLOPs that run as FP8 GEMMs, and no silent GEMM.

Every GEMM-like op of a graph compiled with ``fp8`` on is either an FP8 GEMM or named in a
``not lowered: <module>: <reason>`` note, and its FLOPs are counted per phase and per reason.
"""

import pytest
import torch
import torch.nn as nn

import importlib

import graphpass
from graphpass.graph.ops import GEMM_OPS
from graphpass.report.coverage import coverage_lines
from graphpass.graph.nodes import module_path, op_name
from graphpass.report import Report
from graphpass.models import deepseek, gpt, llama

RECIPES = ("tensorwise", "blockwise", "mxfp8")
FP8 = {"graphpass.fp8_gemm", "aten._scaled_mm", "aten._scaled_grouped_mm"}


def _compiled_graphs(monkeypatch):
    """Capture the forward and backward modules every partition returns."""
    graphs = []
    backend_module = importlib.import_module("graphpass.backend")  # graphpass.backend is the function
    real = backend_module.run

    def capturing(*args, **kwargs):
        partition = real(*args, **kwargs)
        graphs.extend((partition.forward, partition.backward))
        return partition

    monkeypatch.setattr(backend_module, "run", capturing)
    return graphs


def assert_no_silent_gemm(graphs, notes):
    """Each GEMM-like node of the compiled graphs is FP8 or its module has a not-lowered note.
    Read here, after the compile, a node's path begins at its frame's module: a child's forward
    compiled as a frame of its own (a graph break inside it) gives paths within that child, which
    the notes give from the model (``block.0.attn`` noted as ``decoder.block.0.attn``)."""
    noted = {n.split(": ")[1] for n in notes if n.startswith("not lowered: ")}
    noted |= {path.split(".", i)[-1] for path in noted for i in range(1, path.count(".") + 1)}
    checked = 0
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or op_name(node) not in GEMM_OPS:
                continue
            checked += 1
            if op_name(node) not in FP8:
                assert (module_path(node) or "<root>") in noted, (
                    f"silent high-precision {op_name(node)} in {module_path(node)!r}; notes: {notes}")
    assert checked, "no GEMM found: the walk itself is broken"


@pytest.mark.parametrize("exclude", ["default", "none"])
@pytest.mark.parametrize("module", [llama, gpt, deepseek], ids=["llama", "gpt", "deepseek"])
def test_every_gemm_of_the_examples_is_lowered_or_noted(module, exclude, monkeypatch):
    graphs = _compiled_graphs(monkeypatch)
    model, inputs = module.build("tiny", seq=64)
    cfg = graphpass.Config(fp8="tensorwise", **({} if exclude == "default" else {"fp8_exclude": ()}))
    report = graphpass.plan(model, *inputs, config=cfg)
    assert_no_silent_gemm(graphs, report.notes)
    cov = report.meta["fp8_coverage"]
    hp = sum(cov["high_precision_flops"].values())
    assert sum(cov["gemm_flops"].values()) == sum(cov["fp8_flops"].values()) + hp
    assert cov["fp8_share"] == pytest.approx(1 - hp / sum(cov["gemm_flops"].values()))


def _two_linears():
    # layer 1 has N = 8: not a multiple of 16, so it stays in high precision under every recipe
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 8))


@pytest.mark.parametrize("recipe", RECIPES)
def test_coverage_numbers_by_hand(recipe):
    model, x = _two_linears(), torch.randn(128, 128, requires_grad=True)
    report = graphpass.plan(model, x, config=graphpass.Config(fp8=recipe))
    big, small = 2 * 128 * 128 * 128, 2 * 128 * 128 * 8  # FLOPs of each linear's GEMMs
    multiple = {"tensorwise": 16, "blockwise": 128, "mxfp8": 32}[recipe]
    reason = f"N=8 not a multiple of {multiple}"
    assert report.meta["fp8_coverage"] == {
        "gemm_flops": {"forward": big + small, "dgrad": big + small, "wgrad": big + small},
        "fp8_flops": {"forward": big, "dgrad": big, "wgrad": big},
        "high_precision_flops": {reason: 3 * small},
        "fp8_share": big / (big + small),
    }
    assert f"not lowered: 1: {reason}" in report.notes
    lines = report.table().splitlines()
    assert (f"fp8: {big / (big + small):.1%} of {3 * (big + small):,} GEMM FLOPs run as FP8 GEMMs "
            "(forward 94.1%, dgrad 94.1%, wgrad 94.1%)") in lines
    assert f"  high precision: 5.9% ({3 * small:,} FLOPs): {reason}" in lines
    assert Report.from_json(report.to_json()).meta["fp8_coverage"] == report.meta["fp8_coverage"]


def test_coverage_without_dgrad_of_the_first_linear():
    """An input that needs no gradient has no dgrad GEMM: it is not counted."""
    model, x = _two_linears(), torch.randn(128, 128)
    cov = graphpass.plan(model, x, config=graphpass.Config(fp8="tensorwise")).meta["fp8_coverage"]
    big, small = 2 * 128 * 128 * 128, 2 * 128 * 128 * 8
    assert cov["gemm_flops"] == {"forward": big + small, "dgrad": small, "wgrad": big + small}
    assert cov["fp8_flops"] == {"forward": big, "dgrad": 0, "wgrad": big}


class _Scores(nn.Module):
    """q @ k.T written out: a GEMM of two activations, which has no weight to quantize."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.q(x) @ self.k(x).transpose(-1, -2)


def test_activation_gemms_are_noted_with_their_backward(monkeypatch):
    graphs = _compiled_graphs(monkeypatch)
    x = torch.randn(2, 64, 64, requires_grad=True)
    report = graphpass.plan(_Scores(), x, config=graphpass.Config(fp8="tensorwise"))
    assert_no_silent_gemm(graphs, report.notes)
    reason = ("aten.bmm of two activations (no weight operand, e.g. attention scores); graphpass "
              "lowers GEMMs against a weight")
    assert f"not lowered: <root>: {reason}" in report.notes
    lin, scores = 2 * 128 * 64 * 64, 2 * 2 * 64 * 64 * 64
    cov = report.meta["fp8_coverage"]
    # the scores' two backward GEMMs (dq and dk) are activation gradients: dgrad
    assert cov["gemm_flops"] == {"forward": 2 * lin + scores, "dgrad": 2 * lin + 2 * scores,
                                 "wgrad": 2 * lin}
    assert cov["high_precision_flops"] == {reason: 3 * scores}


def test_fp8_off_reports_no_coverage():
    model, x = _two_linears(), torch.randn(128, 128)
    assert "fp8_coverage" not in graphpass.plan(model, x).meta


def test_merged_reports_add_coverage():
    model, x = _two_linears(), torch.randn(128, 128, requires_grad=True)
    one = graphpass.plan(model, x, config=graphpass.Config(fp8="tensorwise"))
    merged = Report.merge([one, one])
    cov, single = merged.meta["fp8_coverage"], one.meta["fp8_coverage"]
    assert cov["gemm_flops"] == {k: 2 * v for k, v in single["gemm_flops"].items()}
    assert cov["high_precision_flops"] == {k: 2 * v for k, v in single["high_precision_flops"].items()}
    assert cov["fp8_share"] == single["fp8_share"]
    assert coverage_lines(cov)[1:] == [line.replace(f"{v:,}", f"{2 * v:,}") for line, v in
                                       zip(coverage_lines(single)[1:],
                                           single["high_precision_flops"].values())]
