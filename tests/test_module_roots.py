"""Module paths begin at the model whatever the compiled frame calls it (a decorated forward, a
functools.partial, a bound method, a wrapper module), and the output head is recognised from the
graph as well as by its name: fp8_exclude's defaults keep it in high precision either way, with a
note, and a head that is lowered says so."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.decisions import What
from graphpass.graph.nodes import normalize_path
from graphpass.testing import assert_fp8_lowered

D, V = 64, 512  # a head of V columns from D: at least 4x


def passthrough(f):
    """A ``(*args, **kwargs)`` decorator, as transformers' ``deprecate_kwarg`` is."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        return f(*args, **kwargs)
    return wrapper


class Body(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x).relu()


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Body()
        self.lm_head = nn.Linear(D, V)

    def forward(self, x):
        return self.lm_head(self.body(x))


class DecoratedLM(LM):
    @passthrough
    def forward(self, x):
        return self.lm_head(self.body(x))


def _hf_decorated():
    from transformers.utils.deprecation import deprecate_kwarg

    class HFDecoratedLM(LM):
        @deprecate_kwarg("past_key_value", new_name="past_key_values", version="9.0")
        def forward(self, x, past_key_values=None):
            return self.lm_head(self.body(x))

    return HFDecoratedLM()


class WithLoss(nn.Module):
    """A loss wrapper: the model its one child with parameters, a loss module beside it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.loss = nn.MSELoss()

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs)
        return self.loss(out, torch.zeros_like(out))


FRAMES = {
    "module": lambda: LM(),
    "decorated forward": lambda: DecoratedLM(),
    "transformers deprecate_kwarg": _hf_decorated,
    "functools.partial": lambda: functools.partial(LM()),
    "partial of the bound forward": lambda: functools.partial(LM().forward),
    "torch.compile(model.forward)": lambda: LM().forward,
    "decorated forward, bound": lambda: DecoratedLM().forward,
    "accelerate's wrapped forward": lambda: _wrapped_forward(LM()),
    "nn.DataParallel": lambda: nn.DataParallel(LM()),
    "nn.DataParallel of a decorated forward": lambda: nn.DataParallel(DecoratedLM()),
}


def _wrapped_forward(model: nn.Module) -> nn.Module:
    """accelerate's ``prepare``: ``model.forward`` replaced by a ``functools.wraps`` wrapper
    (``convert_outputs_to_fp32``), an instance attribute."""
    model.forward = passthrough(model.forward)
    return model


def _compile_step(fn, *args, **options):
    backend = graphpass.backend(codegen="eager", fp8="tensorwise", fp8_min_gemm_flops=0, **options)
    out = torch.compile(fn, backend=backend)(*args)
    out.sum().backward()
    return backend.report()


def _fp8(report):
    """{module: lowered?} and the not-lowered reasons, by module."""
    lowered = {d.module for d in report.decisions if d.what is What.LOWERED}
    not_lowered = {d.module: d.why for d in report.decisions if d.what is What.NOT_LOWERED}
    return lowered, not_lowered


@pytest.mark.parametrize("frame", list(FRAMES))
def test_paths_begin_at_the_model_whatever_the_frame_calls_it(frame):
    report = _compile_step(FRAMES[frame](), torch.randn(32, D))
    lowered, not_lowered = _fp8(report)
    assert lowered == {"body.fc"}
    # by its name: the head's path is the model's, so the default pattern matches it
    assert set(not_lowered) == {"lm_head"}
    assert not_lowered["lm_head"] == "excluded by pattern 'lm_head'"
    # the rows too: a saved weight by its parameter's path, activations by their modules
    assert {r.module for r in report.rows} == {"body", "body.fc", "lm_head.weight"}


@pytest.mark.parametrize("model", [lambda: WithLoss(DecoratedLM()),
                                   lambda: nn.Sequential(DecoratedLM())])
def test_a_module_of_your_own_around_the_model_keeps_its_head_in_high_precision(model):
    """Your wrapper is part of the paths (``model.lm_head``, ``0.lm_head``), which the pattern
    'lm_head' does not match; the graph shows the head."""
    report = _compile_step(model(), torch.randn(32, D))
    lowered, not_lowered = _fp8(report)
    prefix = "model." if isinstance(model(), WithLoss) else "0."
    assert lowered == {prefix + "body.fc"} and set(not_lowered) == {prefix + "lm_head"}
    assert not_lowered[prefix + "lm_head"] == (
        f"the output head (from the graph: a graph output through no other GEMM, {V} columns "
        f"from {D}); fp8_exclude's 'output' and 'lm_head' keep it in high precision")


def test_a_child_named_like_a_function_attribute_stays_in_the_path():
    class Funcs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.func = nn.Linear(D, D)
            self.lm_head = nn.Linear(D, V)

        def forward(self, x):
            return self.lm_head(self.func(x).relu())

    lowered, not_lowered = _fp8(_compile_step(Funcs(), torch.randn(32, D)))
    assert lowered == {"func"} and set(not_lowered) == {"lm_head"}


def test_a_model_whose_only_part_is_a_layer_stack_is_no_wrapper():
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Body(), Body()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    lowered, _ = _fp8(_compile_step(Stack(), torch.randn(32, D)))
    assert lowered == {"layers.0.fc", "layers.1.fc"}


class Breaking(nn.Module):
    """A child whose forward breaks the graph: dynamo compiles the rest of the child's forward
    as frames of their own, whose ``self`` is the child, not the model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x):
        x = self.fc1(x).relu()
        torch._dynamo.graph_break()
        return self.fc2(x)


class TwoStacks(nn.Module):
    """Two children of one class (an encoder and a decoder): paths relative to each child's own
    frame would be the same for both."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(D, D)
        self.encoder = Breaking()
        self.decoder = Breaking()

    def forward(self, x):
        return self.decoder(self.encoder(self.pre(x)))


def test_a_graph_break_inside_a_childs_forward_keeps_the_models_paths():
    """The child's forward is a frame of its own, named from the model (``encoder.fc1``, not
    ``fc1``); the decoder runs the encoder's compiled code (dynamo's cache serves it to a module
    of the same class), so a pattern naming the decoder reaches nothing: a warning and a note."""
    torch._dynamo.reset()
    with pytest.warns(graphpass.EmptySelectionWarning, match=r"fp8_exclude='decoder\.\*'"):
        report = _compile_step(TwoStacks(), torch.randn(32, D), fp8_exclude=("decoder.*",))
    lowered, not_lowered = _fp8(report)
    assert report.graphs == 3  # pre, and the encoder's forward cut in two by its break
    assert lowered == {"pre", "encoder.fc1", "encoder.fc2"} and not not_lowered
    assert {r.module.split(".")[0] for r in report.rows if r.module} <= {"pre", "encoder"}
    assert [n for n in report.notes if n.startswith("compiled frame")] == [
        "compiled frame: encoder: Breaking.forward compiled as a frame of its own (a graph break "
        "inside it), its paths from encoder; dynamo serves this compiled code to the other "
        "modules of its class (decoder) wherever their forward runs as a frame and the guards "
        "pass, with the decisions made for encoder: options naming only their paths do not "
        "reach it"]


def test_a_graph_break_inside_an_only_childs_forward():
    torch._dynamo.reset()
    model = TwoStacks()
    del model.decoder
    model.forward = lambda x: model.encoder(model.pre(x))
    report = _compile_step(model, torch.randn(32, D))
    assert _fp8(report)[0] == {"pre", "encoder.fc1", "encoder.fc2"}
    assert [n for n in report.notes if n.startswith("compiled frame")] == [
        "compiled frame: encoder: Breaking.forward compiled as a frame of its own (a graph break "
        "inside it), its paths from encoder"]


@pytest.mark.parametrize("source, path", [
    ("L['self'].layers[0]._modules['attn']._parameters['weight']", "layers.0.attn.weight"),
    ("L['args'][0].body.fc", "body.fc"),
    ("L['args'][0]._modules['lm_head']._parameters['weight']", "lm_head.weight"),
    ("L['fn'].func.body", "body"),
    ("L['fn'].func.__self__._modules['lm_head']", "lm_head"),
    ("L['self']._orig_mod.layers[1]._checkpoint_wrapped_module.mlp", "layers.1.mlp"),
    ("L['m'].body", "body"),
    ("G['model']._modules['lm_head']._parameters['weight']", "lm_head.weight"),  # a global
    ("L['self']", ""),
])
def test_normalize_path_by_names_alone(source, path):
    assert normalize_path(source) == path


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class MaskedLM(nn.Module):
    """A BERT-like masked LM: its head is ``decoder``, and the loss is computed in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.block = Block()
        self.decoder = nn.Linear(D, V)

    def forward(self, ids, labels):
        logits = self.decoder(self.block(self.embed(ids)))
        return F.cross_entropy(logits.view(-1, V), labels.view(-1))


class Logits(nn.Module):
    """Logits returned for a loss outside the graph, the head named neither lm_head nor output."""

    def __init__(self, out: int = V) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.block = Block()
        self.proj = nn.Linear(D, out)

    def forward(self, ids):
        return self.proj(self.block(self.embed(ids)))


IDS = torch.randint(0, V, (2, 16))


@pytest.mark.parametrize("model, args, head, how", [
    (MaskedLM, (IDS, IDS), "decoder", "the logits of a log-softmax, through no other GEMM"),
    (Logits, (IDS,), "proj", f"a graph output through no other GEMM, {V} columns from {D}"),
])
def test_the_output_head_is_recognised_from_the_graph(model, args, head, how):
    torch.manual_seed(0)
    report = _compile_step(model(), *args)
    assert_fp8_lowered(report)  # a head fp8_exclude keeps is an allowed reason by default
    lowered, not_lowered = _fp8(report)
    assert lowered == {"block.up", "block.down"}  # the up-projection (4x) reaches a GEMM first
    assert set(not_lowered) == {head}
    assert not_lowered[head] == (
        f"the output head (from the graph: {how}); fp8_exclude's 'output' and 'lm_head' keep it "
        "in high precision")
    # a head lowered because fp8_exclude names no head is a note too
    report = _compile_step(model(), *args, fp8_exclude=("*.gate",))
    lowered, not_lowered = _fp8(report)
    assert lowered == {"block.up", "block.down", head} and not not_lowered
    note = next(n for n in report.notes if n.startswith(f"lowered: {head} "))
    assert note.endswith(f"the output head (from the graph: {how}), lowered: fp8_exclude has "
                         "neither 'lm_head' nor 'output')")


def test_a_projection_no_wider_than_its_input_is_no_head():
    lowered, not_lowered = _fp8(_compile_step(Logits(out=2 * D), IDS))
    assert lowered == {"block.up", "block.down", "proj"} and not not_lowered


class RowParallelOut(nn.Module):
    """A block's output projection wider than its input, as a row-parallel shard is under tensor
    parallelism (o_proj's heads / TP columns in, the hidden size out: 8 K at TP 8), adding into
    the residual stream: not a head, whatever its width."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(D, D // 4)
        self.o_proj = nn.Linear(D // 4, D)

    def forward(self, x):
        return x + self.o_proj(self.down(x).relu())


def test_a_wide_projection_into_the_residual_stream_is_no_head():
    lowered, not_lowered = _fp8(_compile_step(RowParallelOut(), torch.randn(32, D)))
    assert lowered == {"down", "o_proj"} and not not_lowered


@pytest.mark.parametrize("frame", list(FRAMES))
def test_a_positional_input_is_named_by_the_forwards_argument_whatever_the_frame(frame):
    """fp8=None: fc saves the input itself, a row named by the forward's argument, ``x``, not
    by the ``*args`` item a decorator's wrapper or a partial took it as."""
    backend = graphpass.backend(codegen="eager")
    torch.compile(FRAMES[frame](), backend=backend)(torch.randn(32, D)).sum().backward()
    report = backend.report()
    assert {r.module for r in report.rows} == {"body", "input:x", "lm_head.weight"}


class TwoInputs(nn.Module):
    """A forward of two positional inputs behind a decorator; the second is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    @passthrough
    def forward(self, x, gain, *extra):
        out = self.fc(x) * gain
        for e in extra:
            out = out * e
        return out


def test_positional_inputs_behind_a_decorator_by_name_and_varargs_by_position():
    x, gain, e = (torch.randn(32, D, requires_grad=True) for _ in range(3))
    backend = graphpass.backend(codegen="eager")
    torch.compile(TwoInputs(), backend=backend)(x, gain, e).sum().backward()
    inputs = {r.module for r in backend.report().rows if r.module.startswith("input:")}
    # fc's output times gain saves gain; the product times extra[0] saves extra[0]; x for wgrad
    assert inputs == {"input:x", "input:gain", "input:extra[0]"}


class StarForward(nn.Module):
    """A model whose own forward takes ``*xs``: its name is the inputs' name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, *xs):
        return self.fc(xs[0]) * xs[1]


def test_a_forward_of_its_own_varargs_keeps_their_name():
    x, y = (torch.randn(32, D, requires_grad=True) for _ in range(2))
    backend = graphpass.backend(codegen="eager")
    torch.compile(StarForward(), backend=backend)(x, y).sum().backward()
    inputs = {r.module for r in backend.report().rows if r.module.startswith("input:")}
    assert inputs == {"input:xs[0]", "input:xs[1]"}
