"""Other libraries' layers in a model graphpass compiles: their ops left to them, said per module.

Transformer Engine's modules reach a compiled graph in one of two ways, and these tests build
each with torch's own machinery, in a module whose class lives under ``transformer_engine`` as
TE's do: (1) as a library's custom ops with their own autograd, TE 2.20's ``te.Linear`` under
torch.compile where torch has opaque constant types (``transformer_engine_compile::`` ops); (2)
kept from Dynamo, TE's ``no_torch_dynamo``: a graph break, the module run eagerly between two
compiled graphs. TE itself, which needs a GPU, is run by ``test_te.py``'s GPU test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphpass
from graphpass import Decision, Report, What

NAMESPACE = "transformer_engine_compile"


@torch.library.custom_op(f"{NAMESPACE}::graphpass_test_linear_fwd", mutates_args=())
def _linear_fwd(x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """A library's linear forward: the output and what its backward needs (its own copies)."""
    return [x @ w.t(), x.clone(), w.clone()]


@_linear_fwd.register_fake
def _(x, w):
    return [x.new_empty((*x.shape[:-1], w.shape[0])), torch.empty_like(x), torch.empty_like(w)]


@torch.library.custom_op(f"{NAMESPACE}::graphpass_test_linear_bwd", mutates_args=())
def _linear_bwd(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    return [g @ w, g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])]


@_linear_bwd.register_fake
def _(g, x, w):
    return [torch.empty_like(x), torch.empty_like(w)]


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])


def _backward(ctx, grads):
    x, w = ctx.saved_tensors
    return tuple(_linear_bwd(grads[0], x, w))


_linear_fwd.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("graphpass_test_lib::scale", mutates_args=())
def _scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_scale.register_fake(lambda x: torch.empty_like(x))
_scale.register_autograd(lambda ctx, g: g * 2)


@torch.compiler.disable
def _eager_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


class Linear(nn.Module):
    """Stands where ``te.Linear`` would: its forward one of the library's ops (``traced``) or a
    function Dynamo does not trace."""

    def __init__(self, n_in: int, n_out: int, traced: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.traced = traced

    def forward(self, x):
        return _linear_fwd(x, self.weight)[0] if self.traced else _eager_linear(x, self.weight)


Linear.__module__ = "transformer_engine.pytorch.module.linear"


class Block(nn.Module):
    def __init__(self, traced: bool, other_library: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1 = Linear(64, 128, traced)
        self.fc2 = nn.Linear(128, 64)
        self.other_library = other_library

    def forward(self, x):
        h = nn.functional.gelu(self.fc1(self.norm(x)))
        if self.other_library:
            h = _scale(h)
        return x + self.fc2(h)


def _step(model: nn.Module, backend=None):
    torch.manual_seed(1)
    x = torch.randn(4, 32, 64, requires_grad=True)
    run = torch.compile(model, backend=backend) if backend is not None else model
    run(x).sum().backward()
    return [x.grad, *(p.grad for p in model.parameters())]


def _compiled(traced: bool, **kwargs) -> tuple[Report, list[torch.Tensor], list[torch.Tensor]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Block(traced, **kwargs)
    eager = _step(model)
    model.zero_grad()
    backend = graphpass.backend(codegen="eager")
    compiled = _step(model, backend)
    return backend.report(), eager, compiled


def test_a_librarys_ops_in_the_graph_are_left_to_it_and_said():
    """TE's way under torch 2.15: the module's forward and backward as the library's ops. The
    report names the module and its ops once; what the ops return for their backward is saved
    as their outputs (the rows); gradients are eager's."""
    report, eager, compiled = _compiled(traced=True)
    assert report.graphs == 1
    assert report.notes.count(
        f"left to Transformer Engine: fc1: {NAMESPACE}::graphpass_test_linear_fwd, "
        f"{NAMESPACE}::graphpass_test_linear_bwd: its own quantizes, GEMMs and saved tensors; "
        "graphpass neither lowers nor looks into them") == 1
    assert not [n for n in report.notes if n.startswith("outside the graph")]
    saved = {r.name: r for r in report.rows}
    # the op's copies of the input (4*32*64 fp32) and of the weight (128*64 fp32)
    assert sorted(r.bytes for r in saved.values() if r.module == "fc1") == [32768, 32768]
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)


def test_a_library_module_kept_from_dynamo_is_said_once_outside_the_graph():
    """TE's way under torch 2.11 to 2.14: a graph break at the module, which runs eagerly. Each
    of the two graphs says so; the step's report once."""
    report, eager, compiled = _compiled(traced=False)
    assert report.graphs == 2
    outside = [n for n in report.notes if n.startswith("outside the graph")]
    assert outside == [
        "outside the graph: fc1: a Transformer Engine module (Linear) none of this graph's ops "
        "came from: where Transformer Engine keeps its forward from Dynamo (a graph break), it "
        "runs eagerly between the compiled graphs with Transformer Engine's own FP8 and saved "
        "tensors, outside graphpass's plan and report"]
    assert sum(d.what is What.OUTSIDE_GRAPH for d in report.decisions) == 1
    assert not [n for n in report.notes if n.startswith("left to")]
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)


def test_any_other_librarys_ops_are_said_under_their_namespace():
    """Not only TE: any custom op outside torch's namespaces is another library's."""
    report, eager, compiled = _compiled(traced=True, other_library=True)
    assert ("left to graphpass_test_lib: <root>: graphpass_test_lib::scale: its own quantizes, "
            "GEMMs and saved tensors; graphpass neither lowers nor looks into them"
            ) in report.notes
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e)


def test_a_library_module_in_fp8_model_leaves_the_other_linears_lowered():
    """graphpass lowers the model's own linears around the library's module as without it."""
    torch._dynamo.reset()
    model = Block(traced=True)
    backend = graphpass.backend(codegen="eager", fp8="tensorwise", kernels="reference")
    _step(model, backend)
    notes = backend.report().notes
    assert "lowered: fc2 (reference/tensorwise)" in notes
    assert not [n for n in notes if n.startswith("lowered: fc1")]


@pytest.mark.parametrize("order", ["traced first", "outside first"])
def test_merge_keeps_outside_notes_only_for_modules_no_graph_traced(order):
    """``Report.merge``: an ``outside the graph`` note of a module whose ops another graph holds
    (that module's or an outer one's ``left to`` note) goes; one said by several graphs stays
    once."""
    left = Decision(What.LIBRARY_OPS, "Transformer Engine", "ops", "layers.0")
    gone = Decision(What.OUTSIDE_GRAPH, "Transformer Engine", "why", "layers.0.fc1")
    kept = Decision(What.OUTSIDE_GRAPH, "Transformer Engine", "why", "layers.1.fc1")

    def report(*decisions):
        return Report(rows=[], notes=[str(d) for d in decisions], decisions=list(decisions))

    parts = [report(left, kept), report(gone, kept)]
    merged = Report.merge(parts if order == "traced first" else parts[::-1])
    assert sorted(merged.notes) == sorted([str(left), str(kept)])
    assert sorted(merged.decisions, key=str) == sorted([left, kept], key=str)


def test_a_module_called_across_a_graph_break_keeps_its_name():
    """``self.fc2(gelu(self.fc1(...)))`` breaking at ``fc1``: the resume frame holds ``fc2`` on
    dynamo's stack (``L['___stack1']``), not under ``self``; its path is found in the model of
    the frame before the break, so the lowered linear is ``fc2``, not ``<root>``."""
    torch._dynamo.reset()
    model = Block(traced=False)
    backend = graphpass.backend(codegen="eager", fp8="tensorwise", kernels="reference")
    _step(model, backend)
    report = backend.report()
    assert report.graphs == 2
    assert "lowered: fc2 (reference/tensorwise)" in report.notes, report.notes
    assert not [n for n in report.notes if "<root>" in n], report.notes
    assert {r.module for r in report.rows if r.name.startswith("g1.")} >= {"fc2"}
