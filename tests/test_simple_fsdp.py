"""torchtitan's SimpleFSDP under graphpass FP8, planned on torch's fake process group: each
lowered weight's in-graph all-gather moves FP8 bytes after one amax all-reduce for the graph's
weights (passes/fp8_weight_all_gather.py), and the weights it leaves in bf16 get a note. The bits
and the bytes the step actually gathers are checked on two gloo ranks in
tests/test_simple_fsdp_gloo.py."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy

import graphpass
from graphpass.distributed import fake_process_group
from graphpass.fp8.weight_cache import QUANTIZE_WEIGHT_SHARDS
from graphpass.report import format_bytes

simple_fsdp = pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="needs torch.distributed")

from graphpass.models import llama

KiB = 1024
# the tiny Llama's linears (hidden 256, 4 heads of 64, 2 KV heads, FFN 512): (module, shape)
LINEARS = [("layers.0.self_attn.q_proj", (256, 256)), ("layers.0.self_attn.k_proj", (128, 256)),
           ("layers.0.self_attn.v_proj", (128, 256)), ("layers.0.self_attn.o_proj", (256, 256)),
           ("layers.0.mlp.gate_proj", (512, 256)), ("layers.0.mlp.up_proj", (512, 256)),
           ("layers.0.mlp.down_proj", (256, 512))]
# the weights SimpleFSDP gathers that are not a lowered linear's: the embedding, the norms, the
# output head (kept in bf16 by fp8_exclude's default)
OTHERS = [("tok_embeddings", (256, 256)), ("layers.0.input_layernorm", (256,)),
          ("layers.0.post_attention_layernorm", (256,)), ("norm", (256,)), ("output", (256, 256))]


class LM(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens, targets):
        logits = self.model(tokens).float().flatten(0, 1)
        return nn.functional.cross_entropy(logits, targets.flatten())


class MLP(nn.Module):
    def __init__(self, ffn: int = 512) -> None:
        super().__init__()
        self.up = nn.Linear(256, ffn, bias=False)
        self.down = nn.Linear(ffn, 256, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _fresh() -> None:
    """SimpleFSDP caches the class it derives for each module class, with the properties of the
    first wrapping (its mesh, its policy): a model wrapped on another mesh in the same process
    needs the cache emptied."""
    simple_fsdp._wrap_class_cache.clear()
    torch._dynamo.reset()


def _plan_llama(world: int = 2, **options) -> graphpass.Report:
    """One rank of the tiny Llama LM (1 block, bf16) under SimpleFSDP's fully_shard."""
    from torch.distributed.device_mesh import init_device_mesh

    _fresh()
    with fake_process_group(world):
        model, (tokens,) = llama.build("tiny_lm", layers=1, batch=2, dtype=torch.bfloat16)
        model = simple_fsdp.data_parallel(model, init_device_mesh("cpu", (world,)),
                                          mode="fully_shard")
        return graphpass.plan(LM(model), tokens, torch.zeros_like(tokens), config=graphpass.Config(
            codegen="eager", kernels="reference", **options))


def _plan_mlp(world: int = 2, ffn: int = 512, tokens: int = 64, **options) -> graphpass.Report:
    from torch.distributed.device_mesh import init_device_mesh

    _fresh()
    with fake_process_group(world):
        model = simple_fsdp.data_parallel(MLP(ffn).to(torch.bfloat16),
                                          init_device_mesh("cpu", (world,)), mode="fully_shard")
        x = torch.randn(tokens, 256, dtype=torch.bfloat16, requires_grad=True)
        return graphpass.plan(model, x, config=graphpass.Config(
            codegen="eager", kernels="reference", **options))


def _weight_notes(report: graphpass.Report) -> list[str]:
    return [n for n in report.notes if n.startswith("weight all-gather: ")]


def _gathered(shape: tuple, size: int) -> str:
    numel = 1
    for d in shape:
        numel *= d
    return format_bytes(numel * size)


def test_simple_fsdp_weights_gathered_in_fp8_after_one_amax_all_reduce():
    """Tensorwise FP8: the 7 linears' weights gathered as FP8 bytes (half of bf16's) after ONE
    all-reduce of their 7 amaxes; the embedding, norms and output head gathered in bf16 as
    before; the backward's reduce-scatters untouched. (The same model with
    ``fp8_weight_all_gather=False`` is what tests/test_simple_fsdp_gloo.py trains against; the
    MLP below checks that option's notes here.)"""
    report = _plan_llama(fp8="tensorwise")
    notes = report.notes
    fp8_bytes = sum(n * k for _, (n, k) in LINEARS)
    other_bytes = 2 * (256 * 256 * 2 + 3 * 256)
    assert (f"collectives in the forward: all_gather_into_tensor x12 "
            f"({format_bytes(other_bytes + fp8_bytes)} out), all_reduce x1 (28 B out)") in notes
    # bf16 gradients, reduce-scattered to this rank's half of each: as many bytes as elements
    assert (f"collectives in the backward: reduce_scatter_tensor x12 "
            f"({format_bytes(other_bytes // 2 + fp8_bytes)} out)") in notes
    want = [f"weight all-gather: model.{m}.weight: forward, {s}, bfloat16, {_gathered(s, 2)} "
            "per step" for m, s in OTHERS]
    want += [f"weight all-gather: model.{m}.weight: forward, {s}, float8_e4m3fn (as uint8), "
             f"{_gathered(s, 1)} per step" for m, s in LINEARS]
    assert sorted(_weight_notes(report)) == sorted(want)
    assert [n for n in notes if n.startswith("fp8 all-gather")] == [
        f"fp8 all-gather: model.{m}: weight, forward: quantized shard by shard with the gathered "
        "weight's amax (one all-reduce (max) of the amaxes of 7 weights), the all-gather moves "
        "FP8 bytes; dgrad's columnwise copy is the gathered copy transposed" for m, _ in LINEARS]
    assert sum(n.startswith("lowered: ") for n in notes) == 7
    assert any(n.startswith("fp8 under FSDP in the graph (SimpleFSDP): ") for n in notes)
    assert not any(n.startswith("fp8 under tensor parallelism") for n in notes)


def test_weight_all_gather_off_gathers_bf16_and_saves_the_same_bytes():
    """``fp8_weight_all_gather=False``: every gather bf16, each lowered weight with a note. The
    FP8 all-gather changes what is communicated, not what is saved: the backward's dgrad copies
    are FP8 either way (the gathered copy transposed, or the gathered bf16 weight quantized)."""
    on, off = (_plan_mlp(fp8="tensorwise", fp8_weight_all_gather=v) for v in (True, False))
    assert [n for n in off.notes if n.startswith("fp8 all-gather")] == [
        f"fp8 all-gather: not for {m}: weight: off (fp8_weight_all_gather=False): the all-gather "
        "moves bfloat16, quantized after it" for m in ("up", "down")]
    assert on.activation_bytes == off.activation_bytes
    assert ("collectives in the forward: all_gather_into_tensor x2 (256.00 KiB out), all_reduce "
            "x1 (8 B out)") in on.notes
    assert "collectives in the forward: all_gather_into_tensor x2 (512.00 KiB out)" in off.notes


@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_weight_all_gather_stays_bf16_where_scale_blocks_cross_the_shards(recipe):
    """Per-row and 1x32 scales: dgrad's columnwise copy of a [out, in] weight scales along
    dim 0 (rowwise across the shards; mxfp8 in 32-row blocks that are not the rowwise copy's
    transposed): one gather of both FP8 copies would move as many bytes as bf16, so the gather
    stays bf16 and is quantized after, with a note saying so."""
    report = _plan_mlp(fp8=recipe)
    where = {"rowwise": "one scale per column of the whole weight, along dim 0 across FSDP's row "
                        "shards",
             "mxfp8": "1x32 blocks down each column, 32 rows of dim 0, not the rowwise copy's "
                      "blocks transposed"}[recipe]
    assert [n for n in report.notes if n.startswith("fp8 all-gather")] == [
        f"fp8 all-gather: not for {m}: weight: {recipe} scales: dgrad's columnwise copy of a "
        f"weight has {where}; one all-gather serves both GEMMs, so an FP8 gather would move both "
        "FP8 copies, 2 bytes per element and the scales, no fewer than the bf16 gather: the FP8 "
        "all-gather is for tensorwise and blockwise scaling (docs/distributed.md); the "
        "all-gather moves bfloat16, quantized after it" for m in ("up", "down")]
    assert sorted(_weight_notes(report)) == [
        "weight all-gather: down.weight: forward, (256, 512), bfloat16, 256.00 KiB per step",
        "weight all-gather: up.weight: forward, (512, 256), bfloat16, 256.00 KiB per step"]
    assert sum(n.startswith("lowered: ") for n in report.notes) == 2


def test_blockwise_weights_gather_fp8_and_tile_scales_where_shards_are_whole_tiles():
    """Blockwise on 4 ranks: up's shards are 128 rows (whole 128x128 tiles): quantized shard by
    shard, no all-reduce, its FP8 bytes and tile scales gathered (two all-gathers); down's are
    64 rows (a tile would cross a shard boundary): the bf16 gather, quantized after, with a
    note naming the shard rows and the block. Both linears lowered."""
    report = _plan_mlp(world=4, tokens=128, fp8="blockwise")
    assert [n for n in report.notes if n.startswith("fp8 all-gather")] == [
        "fp8 all-gather: up: weight, forward: each 128-row shard quantized alone in whole "
        "128x128 tiles (no reduction), the all-gathers move FP8 bytes and the tile scales; "
        "dgrad's columnwise copy is the gathered copy and scales transposed",
        "fp8 all-gather: not for down: weight: blockwise: its shards are 64 rows (256 rows over "
        "4 ranks), not a multiple of the 128x128 scale block: a block would cross a shard "
        "boundary, so its scale needs rows of two shards; the all-gather moves bfloat16, "
        "quantized after it"]
    assert sorted(_weight_notes(report)) == [
        "weight all-gather: down.weight: forward, (256, 512), bfloat16, 256.00 KiB per step",
        "weight all-gather: up.weight: forward, (512, 256), float8_e4m3fn (as uint8) and (4, 2) "
        "float32 tile scales, 128.03 KiB per step"]
    # 128 KiB + 32 B for up, 256 KiB for down; no all-reduce
    assert "collectives in the forward: all_gather_into_tensor x3 (384.03 KiB out)" in report.notes
    assert [n for n in report.notes if n.startswith("lowered: ")] == [
        "lowered: up (reference/blockwise)", "lowered: down (reference/blockwise)"]


def test_uneven_shards_stay_bf16_with_a_note():
    """Bad input: 3 ranks over 512 and 256 rows: DTensor pads each shard to the largest and slices
    the padding off the gathered weight. The linears are lowered (all three GEMMs) on the bf16
    gather, quantized after it, with a note; never a quantized padding."""
    report = _plan_mlp(world=3, fp8="tensorwise")
    assert [n for n in report.notes if n.startswith("fp8 all-gather")] == [
        "fp8 all-gather: not for up: weight: uneven shards (512 rows over 3 ranks, gathered as 513 "
        "with each shard padded and the padding sliced off after the all-gather): the all-gather "
        "moves bfloat16, quantized after it",
        "fp8 all-gather: not for down: weight: uneven shards (256 rows over 3 ranks, gathered as "
        "258 with each shard padded and the padding sliced off after the all-gather): the "
        "all-gather moves bfloat16, quantized after it"]
    assert [n for n in report.notes if n.startswith("lowered: ")] == [
        "lowered: up (reference/tensorwise)", "lowered: down (reference/tensorwise)"]
    assert "collectives in the forward: all_gather_into_tensor x2 (514.50 KiB out)" in report.notes


def _graphs(monkeypatch) -> list:
    """The forward and backward graphs graphpass partitions (appended as it returns them)."""
    backend = importlib.import_module("graphpass.backend")
    graphs, run = [], backend.run

    def keep(*args, **kwargs):
        out = run(*args, **kwargs)
        graphs.extend(out[:2])
        return out

    monkeypatch.setattr(backend, "run", keep)
    return graphs


def _ops(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_weight_cache_holds_the_fp8_shards(monkeypatch):
    """fp8_weight_cache=True: the two weights' amaxes, their all-reduce and the shards' quantizes
    are one graphpass::quantize_weight_shards of both shards (cached once per optimizer step, on
    every rank alike), tagged must-recompute: the backward looks dgrad's scale up again. The
    all-gathers still run in the graph, on its FP8 bytes. A note per weight with the bytes held
    (each shard's FP8 data and scale), which the step peak counts as ``cached``; the collectives
    note names the all-reduce inside the op."""
    graphs = _graphs(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphpass.EmptySelectionWarning)  # the shards count
        report = _plan_mlp(fp8="tensorwise", fp8_weight_cache=True)
    fw, bw = graphs
    (op,) = [n for n in fw.graph.nodes if n.target is QUANTIZE_WEIGHT_SHARDS]
    shards = [p for p in fw.graph.find_nodes(op="placeholder")
              if tuple(p.meta["val"].shape) in ((256, 256), (128, 512))]
    assert op.args == (shards, None, "tensorwise", "weight", op.args[4])
    assert op.meta["recompute"] is CheckpointPolicy.MUST_RECOMPUTE
    for gm in (fw, bw):  # no per-micro-batch amax, all-reduce or quantize of a shard
        assert not {"graphpass.amax.default", "graphpass.quantize_amax.default",
                    "_c10d_functional.all_reduce.default"} & set(_ops(gm))
    assert _ops(fw).count("_c10d_functional.all_gather_into_tensor.default") == 2
    for gather in fw.graph.find_nodes(op="call_function",
                                      target=torch.ops._c10d_functional.all_gather_into_tensor.default):
        view = gather.args[0]  # the shard's FP8 bytes, as uint8, in the shard's shape
        assert gather.meta["val"].dtype == torch.uint8
        assert view.args[0].args[0].args[0] is op  # view(view.dtype(getitem(op, 2i)))
    assert _ops(bw).count("graphpass.quantize_weight_shards.default") == 1  # a lookup
    held = 256 * 256 + 4  # each shard: 64 Ki FP8 bytes and a fp32 scale
    assert [n for n in report.notes if n.startswith("fp8_weight_cache")] == [
        f"fp8_weight_cache: {m}: the {s} weight is all-gathered in the graph (SimpleFSDP): its "
        f"{shard} shard's FP8 copy quantized once per optimizer step with the gathered weight's "
        f"amax (one all-reduce of the graph's weights' amaxes) and held between steps "
        f"({held:,} B), all-gathered every micro-batch"
        for m, s, shard in (("up", "512x256", "256x256"), ("down", "256x512", "128x512"))]
    assert [n for n in report.notes if n.startswith("fp8 all-gather: ")] == [
        f"fp8 all-gather: {m}: weight, forward: quantized shard by shard with the gathered "
        "weight's amax (one all-reduce (max) of the amaxes of 2 weights, by the weight cache: "
        "once per optimizer step), the all-gather moves FP8 bytes; dgrad's columnwise copy is "
        "the gathered copy transposed" for m in ("up", "down")]
    assert ("collectives in the forward: all_gather_into_tensor x2 (256.00 KiB out), all_reduce "
            "x1 (8 B out) in fp8_weight_cache's quantize_weight_shards, on the first micro-batch "
            "of each optimizer step") in report.notes
    assert "collectives in the backward: reduce_scatter_tensor x2 (256.00 KiB out)" in report.notes
    assert sorted(_weight_notes(report)) == [
        "weight all-gather: down.weight: forward, (256, 512), float8_e4m3fn (as uint8), "
        "128.00 KiB per step",
        "weight all-gather: up.weight: forward, (512, 256), float8_e4m3fn (as uint8), "
        "128.00 KiB per step"]
    assert report.meta["step_peak"]["by_kind"]["cached"] == 2 * held


def test_weight_cache_auto_caches_the_shards_within_the_budget():
    """``fp8_weight_cache="auto"`` with a memory budget: the shards' op (uncached until then) is
    one candidate of the budget's search, cached where its bytes fit, with the budget's notes;
    the step peak holds the shards as under ``True``."""
    report = _plan_mlp(fp8="tensorwise", fp8_weight_cache="auto", memory_budget=10**9)
    held = 2 * (256 * 256 + 4)
    assert [n for n in report.notes if n.startswith("fp8_weight_cache: <root>")] == [
        "fp8_weight_cache: <root>: the 2 SimpleFSDP weight shards' FP8 copies and the all-reduce "
        f"of their amaxes once per optimizer step, held between steps ({held:,} B), "
        "all-gathered every micro-batch; chosen within memory_budget, saving about 0.1 us of "
        "quantize per micro-batch by the roofline"]
    assert sum("in one op the memory budget may cache (fp8_weight_cache='auto')" in n
               for n in report.notes) == 2
    assert any(n.endswith("all_reduce x1 (8 B out) in fp8_weight_cache's quantize_weight_shards, "
                          "on the first micro-batch of each optimizer step") for n in report.notes)
    assert report.meta["step_peak"]["by_kind"]["cached"] == held


def test_weight_cache_notes_a_bf16_gathered_weight():
    """A weight gathered in bf16 (``fp8_weight_all_gather=False`` here; per-row scales, uneven
    shards) is quantized after its gather every micro-batch: not cached, with a note."""
    with pytest.warns(graphpass.EmptySelectionWarning):  # nothing cached
        report = _plan_mlp(fp8="tensorwise", fp8_weight_cache=True, fp8_weight_all_gather=False)
    assert [n for n in report.notes if n.startswith("fp8_weight_cache")] == [
        f"fp8_weight_cache: not cached: {m}: the {s} weight is all-gathered in the graph "
        "(SimpleFSDP) in bfloat16, quantized after the all-gather every micro-batch (the weight "
        "cache keeps FP8-gathered shards only)" for m, s in (("up", "512x256"),
                                                            ("down", "256x512"))]
    assert "cached" not in report.meta["step_peak"]["by_kind"]


def test_simple_fsdp_with_tensor_parallelism_on_a_2d_mesh():
    """One rank of a (dp=2, tp=2) mesh: a Llama block under torchtitan's TP+SP plan on "tp", then
    SimpleFSDP on "dp". Each weight's TP shard is gathered over dp in FP8 after one all-reduce of
    the 7 amaxes (its scale the TP shard's, as without the FP8 gather); the sequence-parallel
    inputs and gradients keep their FP8 gathers over tp; both notes."""
    from torch.distributed.device_mesh import init_device_mesh
    from graphpass.models import _common

    dp, tp = 2, 2
    _fresh()
    with fake_process_group(dp * tp):
        model, (x,) = llama.build("tiny", layers=1, dtype=torch.bfloat16)
        cfg = model.config
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        block = llama.parallelize(model.layers[0], mesh["tp"])
        block = simple_fsdp.data_parallel(block, mesh["dp"], mode="fully_shard")
        cos, sin = _common.rope_cos_sin(cfg.seq, cfg.head_dim, cfg.rope_theta, x.device, x.dtype)
        local = x.detach().chunk(tp, dim=1)[0].clone().requires_grad_()
        report = graphpass.plan(block, local, cos, sin, config=graphpass.Config(
            fp8="tensorwise", kernels="reference", codegen="eager"))
    notes = report.notes
    shards = [("self_attn.q_proj", (128, 256)), ("self_attn.k_proj", (64, 256)),
              ("self_attn.v_proj", (64, 256)), ("self_attn.o_proj", (256, 128)),
              ("mlp.gate_proj", (256, 256)), ("mlp.up_proj", (256, 256)),
              ("mlp.down_proj", (256, 256))]
    assert sorted(_weight_notes(report)) == sorted(
        [f"weight all-gather: {m}.weight: forward, {s}, float8_e4m3fn (as uint8), "
         f"{_gathered(s, 1)} per step" for m, s in shards]
        + [f"weight all-gather: {m}.weight: forward, (256,), bfloat16, 512 B per step"
           for m in ("input_layernorm", "post_attention_layernorm")])
    assert sum("(one all-reduce (max) of the amaxes of 7 weights)" in n for n in notes) == 7
    assert sum(": input, forward: quantized before the all-gather" in n
               or ": grad, backward: quantized before the all-gather" in n for n in notes) == 4
    # the forward: the SP gathers (2 x 32 KiB FP8) and the weights' (9), one all-reduce for the
    # weights and one per SP gather
    assert ("collectives in the forward: all_gather_into_tensor x11 (321.00 KiB out), "
            "all_reduce x3 (36 B out), reduce_scatter_tensor x2 (32.00 KiB out)") in notes
    assert any(n.startswith("fp8 under FSDP in the graph (SimpleFSDP): ") for n in notes)
    assert any(n.startswith("fp8 under tensor parallelism: sequence-parallel") for n in notes)
