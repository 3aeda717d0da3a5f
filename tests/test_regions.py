"""Selections from the graph's structure (graph/regions.py): the recompute words and the FP8
cache's levels select the same computation and save the same bytes however a block is written
(flat or with submodules, fused or split projections, HF or torchtitan names, bias or not, GELU
or SwiGLU, dense or MoE); an exact selection never changes a gradient."""

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import CheckpointPolicy

import _layouts as L
import graphpass
from graphpass import pipeline
from graphpass.decisions import What
from graphpass.graph.nodes import op_name, tensor_val
from graphpass.graph.regions import LOOKS_FOR
from graphpass.selections import EmptySelectionWarning

WORDS = ("layernorm", "act", "moe_act", "core_attn", "mlp", "moe", "shared_experts", "mla_up_proj")
LEVELS = ("act_input", "attn", "layer_input")
FUSED = ("fused", "flat_fused", "nanogpt")


def _x():
    torch.manual_seed(1)
    return torch.randn(2, 16, L.DIM)


def _plan(model, cfg):
    """(activation bytes, what the selection took: the recomputed forward ops, or the cached
    tensors, as sorted (op, shape) pairs)."""
    selected = []
    original = pipeline.PASSES

    def recorded(graph_pass):
        def run(joint, plan, config, partitioner):
            graph_pass(joint, plan, config, partitioner)
            if graph_pass.__name__ == "recompute":
                selected.extend((op_name(n), tuple(tensor_val(n).shape) if tensor_val(n) is not None else ())
                                for n in joint.graph.nodes
                                if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE)
        run.__name__ = graph_pass.__name__
        return run

    pipeline.PASSES = tuple(recorded(p) for p in original)
    try:
        x = _x().requires_grad_()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", EmptySelectionWarning)  # words an example lacks
            report = graphpass.plan(model, x, config=graphpass.Config(**cfg))
    finally:
        pipeline.PASSES = original
    cached = [(r.kind, r.shape) for r in report.rows if r.decided(What.FP8_CACHED)]
    return report.activation_bytes, sorted(selected) + sorted(cached)


def test_flat_block_caches_the_activation_inputs_as_the_submodule_block_does():
    """A pre-norm Llama block written in one ``forward`` (norms as ``F.rms_norm``) caches under
    ``act_input`` what the same block with attention and MLP submodules caches: the gate and up
    projections' outputs (32x128 each, e4m3 with one E8M0 scale per 1x128 block), nothing else."""
    x = _x().requires_grad_()
    cfg = graphpass.Config(fp8_cache="act_input", fp8_cache_min_bytes=0)
    reports = {layout: graphpass.plan(L.build(layout), x, config=cfg) for layout in ("hf", "flat")}
    exact = graphpass.plan(L.build("flat"), x).activation_bytes
    for layout, modules in (("hf", {"mlp.gate_proj", "mlp.up_proj"}), ("flat", {"gate", "up"})):
        cached = {(r.module, r.kind, r.shape, r.bytes) for r in reports[layout].rows
                  if r.decided(What.FP8_CACHED)}
        assert cached == {(m, kind, shape, n) for m in modules for kind, shape, n in (
            ("fp8_data", (32, 128), 4096), ("fp8_scale", (32, 1), 32))}, layout
    assert reports["flat"].activation_bytes == reports["hf"].activation_bytes
    assert reports["flat"].activation_bytes == exact - 2 * (4 * 32 * 128 - 4096 - 32)


@pytest.mark.parametrize("layout", FUSED)
def test_fused_projections_cache_only_the_chunks_that_feed_the_activation(layout):
    """Fused q/k/v and gate/up projections split or chunked (nanoGPT's ``c_attn``, ``c_fc``),
    with norms whose modules' names say nothing of a norm (``nanogpt``): ``act_input`` caches the gate/up output the SwiGLU reads (32x256) and never the block's input,
    the attention projection's output or q/k/v."""
    x = _x().requires_grad_()
    report = graphpass.plan(L.build(layout), x, config=graphpass.Config(
        fp8_cache="act_input", fp8_cache_min_bytes=0))
    module = {"flat_fused": "c_fc", "fused": "mlp.gate_projup_proj", "nanogpt": "mlp.c_fc"}[layout]
    assert {(r.module, r.kind, r.shape) for r in report.rows if r.decided(What.FP8_CACHED)} == {
        (module, "fp8_data", (32, 256)), (module, "fp8_scale", (32, 2))}
    split = graphpass.plan(L.build("hf"), x, config=graphpass.Config(fp8_cache="act_input",
                                                                    fp8_cache_min_bytes=0))
    assert report.activation_bytes == split.activation_bytes


def _grads(model, cfg):
    torch._dynamo.reset()
    model.zero_grad()
    x = _x().requires_grad_()
    compiled = torch.compile(model, backend=graphpass.backend(codegen="eager", **cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmptySelectionWarning)
        compiled(x).pow(2).mean().backward()
    return [x.grad, *(p.grad.clone() for p in model.parameters())]


# `make test` and CI run the explicit examples only (about 20 s of CPU each);
# GRAPHPASS_PROPERTY_EXAMPLES=20 (`make hunt HUNT_TESTS=...`) draws new ones. Two minutes: CI runs
# it on one torch version; the selections' tests above run on every version.
@pytest.mark.one_version
@settings(max_examples=int(os.environ.get("GRAPHPASS_PROPERTY_EXAMPLES", "1")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow],
          phases=list(Phase) if os.environ.get("GRAPHPASS_PROPERTY_EXAMPLES") else [Phase.explicit])
@example(swiglu=True, bias=False, moe=False, norm="rms", layouts=["flat", "nanogpt"])
@example(swiglu=False, bias=True, moe=False, norm="layer", layouts=["titan", "flat_fused"])
@example(swiglu=True, bias=False, moe=True, norm="rms", layouts=["flat", "fused"])
@given(swiglu=st.booleans(), bias=st.booleans(), moe=st.booleans(),
       norm=st.sampled_from(["rms", "layer"]),
       layouts=st.lists(st.sampled_from(L.LAYOUTS[1:]), min_size=2, max_size=2, unique=True))
def test_one_answer_per_arithmetic(swiglu, bias, moe, norm, layouts):
    """The block with attention and MLP submodules (HF names) and two other layouts of it: per
    recompute word and cache level the same saved bytes, and the same recomputed ops and cached
    tensors (fused layouts among themselves: one GEMM where the others have two or three); all
    the exact selections at once give the same gradients, bit for bit, as none."""
    models = {layout: L.build(layout, swiglu=swiglu, bias=bias, moe=moe, norm=norm)
              for layout in ("hf", *layouts)}
    policies = [dict(recompute=(w,)) for w in WORDS] + [
        dict(fp8_cache=level, fp8_cache_min_bytes=0) for level in LEVELS]
    for cfg in policies:
        got = {layout: _plan(model, cfg) for layout, model in models.items()}
        assert len({b for b, _ in got.values()}) == 1, (cfg, got)
        for group in ([l for l in models if l not in FUSED], [l for l in models if l in FUSED]):
            assert len({tuple(got[l][1]) for l in group}) <= 1, (cfg, {l: got[l] for l in group})
    for layout in layouts:
        model = models[layout]
        base = _grads(model, {})
        grads = _grads(model, dict(recompute=WORDS))
        assert all(torch.equal(a, b) for a, b in zip(grads, base)), layout


# --- never silent about an empty selection --------------------------------------------------------

def _compile_twice(cfg, model, x):
    """Two graphs compiled by one backend (two input shapes: a recompile), its warnings and
    reports."""
    torch._dynamo.reset()
    backend = graphpass.backend(codegen="eager", **cfg)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xx in (x, x[:, :8]):
            compiled(xx.clone().requires_grad_()).sum().backward()
    return [str(w.message) for w in caught if issubclass(w.category, EmptySelectionWarning)], backend


def test_a_selection_that_finds_nothing_warns_once_per_backend():
    """A dense block: ``moe`` finds nothing in either graph (one warning, naming it and what it
    looks for, and each graph's note); ``act`` finds the SwiGLU (no warning); a
    ``recompute_include`` pattern, an ``fp8_exclude`` pattern and a cache level that match
    nothing warn too; the default patterns never do."""
    model = L.build("flat")
    cfg = dict(recompute=("act", "moe"), recompute_include=("*", "encoder.*"), fp8="tensorwise",
               fp8_exclude=("lm_head", "*.router", "decoder.*"), fp8_cache="attn",
               fp8_cache_min_bytes=0)
    messages, backend = _compile_twice(cfg, model, _x())
    name = repr(backend)
    assert sorted(messages) == sorted([
        f"{name}: recompute='moe' selected nothing in the 1 graph(s) compiled so far; it looks "
        f"for {LOOKS_FOR['moe']}",
        f"{name}: recompute_include='encoder.*' selected nothing in the 1 graph(s) compiled so "
        "far; it looks for module paths of the nodes the recompute words selected",
        f"{name}: fp8_exclude='decoder.*' selected nothing in the 1 graph(s) compiled so far; it "
        "looks for module paths of linear layers",
    ]), messages
    report = backend.report()  # the second shape recompiles the frame: its graph replaces the first
    assert report.graphs == 1 and report.meta["replaced_graphs"] == 1
    assert report.notes.count("recompute moe: 0 module(s) — nothing in this graph matched") == 1
    # a second backend warns again; a level that finds something does not
    messages, _ = _compile_twice(dict(recompute=("moe",)), model, _x())
    assert len(messages) == 1 and "recompute='moe'" in messages[0]
    messages, _ = _compile_twice(dict(fp8_cache="act_input", recompute=("layernorm", "core_attn")),
                                 model, _x())
    assert messages == []


def test_a_cache_level_that_finds_nothing_warns():
    """``layer_input`` on a block without norms: nothing reads a norm's input."""
    class NoNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(L.DIM, L.HIDDEN)
            self.fc2 = torch.nn.Linear(L.HIDDEN, L.DIM)

        def forward(self, x):
            return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    messages, _ = _compile_twice(dict(fp8_cache="layer_input", fp8_cache_min_bytes=0), NoNorm(), _x())
    assert len(messages) == 1 and "fp8_activation_cache='layer_input' selected nothing" in messages[0], messages
    assert "saved tensors a norm reads" in messages[0]


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, None), (torch.bfloat16, "tensorwise")])
def test_every_word_finds_its_part_of_a_deepseek_layer(dtype, fp8):
    """MLA, MoE with shared experts: every word finds something, in bf16 (the norms' outputs are
    casts) and under FP8 lowering (the GEMMs are fp8_gemm, their operands quantizes)."""
    from graphpass.models import deepseek
    from graphpass.graph.nodes import module_path
    from graphpass.graph.regions import Regions

    model, (x,) = deepseek.build("tiny", layers=1, seq=64, dtype=dtype)
    found = {}
    original = pipeline.PASSES
    at = [p.__name__ for p in original].index("recompute")
    pipeline.PASSES = (*original[:at], lambda joint, *_: found.update(
        (w, {module_path(n) for n in Regions(joint).select(w)}) for w in WORDS))
    try:
        graphpass.plan(model, x, config=graphpass.Config(fp8=fp8))
    finally:
        pipeline.PASSES = original
    assert {w for w, paths in found.items() if not paths} == {"mlp"}  # its MLP is an MoE
    assert found["shared_experts"] == {"layers.0.mlp.shared_experts",
                                       *(f"layers.0.mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down"))}
    assert "layers.0.mlp.experts" in found["moe"] and "layers.0.mlp.gate" in found["moe"]
    assert found["moe_act"] == {"layers.0.mlp.experts"}
    assert found["act"] == {"layers.0.mlp.shared_experts"}
    assert {"layers.0.self_attn.q_b_proj", "layers.0.self_attn.kv_b_proj"} <= found["mla_up_proj"]
