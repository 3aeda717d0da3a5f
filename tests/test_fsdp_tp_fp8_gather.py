"""FSDP2 + tensor parallelism on a 2-D mesh, with FSDP2's weight all-gathers in FP8
(``graphpass.fsdp_fp8_weights`` on tensor-parallel weights, ``fp8/fsdp.py``).

On 4 gloo ranks (dp=2 x tp=2, ``tests/_gloo_fsdp_tp_fp8_worker.py``), all started at once and
killed at ``TIMEOUT`` (the same processes run tests/test_simple_fsdp_tp_gloo.py's runs and, on
the last rank, the one-process reference): a tiny Llama block made tensor- and
sequence-parallel (torchtitan's plan), ``fully_shard`` on the data-parallel mesh dimension, FP8
tensorwise, 3 SGD steps, the weights all-gathered in bf16 and in FP8: the same bits, half the
gathered bytes, and the unsharded block within FP8's reach. In one process (torch's fake process
group, no communication): the order of the calls and the layouts that are not FP8-gathered;
the post-all-gather's weight for each FSDP2 shard dim.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphpass
from graphpass.fp8.fsdp import FP8GatherShard

from _session import launch, once
from test_fsdp_fp8_gather import assert_same_bits

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo")

WORKER = Path(__file__).with_name("_gloo_fsdp_tp_fp8_worker.py")
# seconds for the 4 ranks: FSDP2+TP's two runs, SimpleFSDP+TP's two
# (tests/test_simple_fsdp_tp_gloo.py) and the reference, imports and compiles included
TIMEOUT = 600
DP, TP = 2, 2
OPTIONS = dict(fp8="tensorwise", kernels="reference", codegen="eager")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _simple_fsdp() -> bool:
    try:
        import torchtitan.experiments.graph_trainer.simple_fsdp  # noqa: F401
    except ImportError:
        return False
    return True


def _run(out: Path) -> None:
    """The 4 ranks at once, killed at TIMEOUT (each one's last lines in the failure): FSDP2+TP,
    then SimpleFSDP+TP (where torchtitan is installed) in the same processes, the last rank
    running the one-process reference too."""
    also = (["simple_fsdp_tp"] if _simple_fsdp() else []) + ["ref"]
    launch("fsdp_tp", {f"rank {r}": [str(WORKER), str(out), str(r), str(DP * TP),
                                     str(out / "store"), *also]
                       for r in range(DP * TP)}, out, TIMEOUT)


def four_ranks(tmp_path_factory) -> Path:
    """The 4-rank run's directory, once per session: this file's and
    tests/test_simple_fsdp_tp_gloo.py's tests read it. A failed run fails each test that reads
    it with its output, without running it again."""
    def fill(out: Path) -> None:
        try:
            _run(out)
        except pytest.fail.Exception as failure:
            (out / "failed").write_text(str(failure))

    out = once(tmp_path_factory, "gloo-4-ranks", fill, timeout=3 * TIMEOUT)
    if (out / "failed").exists():
        pytest.fail((out / "failed").read_text(), pytrace=False)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = four_ranks(tmp_path_factory)
    return ([torch.load(out / f"fsdp_tp-{r}.pt") for r in range(DP * TP)],
            torch.load(out / "fsdp_tp_ref.pt"))


# The 4-process run is shared with tests/test_simple_fsdp_tp_gloo.py (one start and import of
# 4 processes for both), and runs on every torch version CI tests (issue 51).


def test_fsdp2_tp_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks):
    """On each of the 4 ranks: losses and gradients (``full_tensor()``) at every step and the
    parameters after 3 steps are the same bits with the weights all-gathered in FP8 as in bf16.
    The compiled TP block quantizes each weight's TP shard with the shard's own amax; the FP8
    gather's amax is reduced over the data-parallel group only, which is that amax. (q_proj's
    TP shard is sharded by FSDP2 on dim 1, a shard_placement_fn's: its FP8 bytes come back in
    place too.)"""
    ranks, _ = ranks
    for r, rank in enumerate(ranks):
        bf16, fp8 = rank[False], rank[True]
        assert_same_bits(bf16, fp8, r)
        assert fp8["warnings"] == []  # the scales were reduced after each step: none stale
        assert set(fp8["wrapped"][0]) == {f"layers.0.{n}.weight" for n in LINEARS}
    # it trains: the summed loss (of the 4 ranks' rows and sequence halves) goes down
    first, last = (sum(rank[True]["losses"][s] for rank in ranks).item() for s in (0, -1))
    assert last < first - 1.0, (first, last)
    # the 2-D layout FSDP2 made: TP's Shard(0) / Shard(1) inside FSDP2's shard of dp
    placements = ranks[0][True]["placements"]
    assert placements["layers.0.mlp.down_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
    assert placements["layers.0.self_attn.q_proj.weight"] == "(Shard(dim=1), Shard(dim=0))"


def test_fsdp2_tp_fp8_weight_gathers_halve_the_lowered_weights_bytes(ranks):
    """Counted from the collectives each step ran: the block's all-gather (once before the
    forward, once before the backward) moves 1 byte per element of its 7 TP-local linear
    weights instead of 2, and 2 per element of its norms (as uint8); the gradients'
    reduce-scatters are unchanged; the 7 amaxes take one all-reduce (7 fp32) per step, over
    the data-parallel group, none in the all-gathers."""
    ranks, _ = ranks
    shapes = ranks[0][True]["local_shapes"]  # this rank's shard of each parameter (dp and tp)
    fp8_names = set(ranks[0][True]["wrapped"][0])
    linears = sum(torch.Size(shapes[n]).numel() for n in fp8_names) * DP
    norms = sum(torch.Size(s).numel() for n, s in shapes.items() if n not in fp8_names) * DP
    # q and o, gate up and down, k and v: TP-local
    assert linears == (2 * 256 * 256 + 3 * 512 * 256 + 2 * 128 * 256) // TP
    for rank in ranks:
        for bf16_calls, fp8_calls in zip(rank[False]["calls"], rank[True]["calls"]):
            gathers = {k: [(str(d), b) for op, d, b in calls if op == "all_gather_into_tensor"]
                       for k, calls in (("bf16", bf16_calls), ("fp8", fp8_calls))}
            assert gathers["bf16"] == [("torch.bfloat16", 2 * (linears + norms))] * 2
            assert gathers["fp8"] == [("torch.uint8", linears + 2 * norms)] * 2
            assert [c for c in fp8_calls if c[0] == "all_reduce"] == [
                ("all_reduce", torch.float32, 4 * 7)]
            assert not [c for c in bf16_calls if c[0] == "all_reduce"]
            scatters = [[c for c in calls if c[0] == "reduce_scatter_tensor"]
                        for calls in (bf16_calls, fp8_calls)]
            assert scatters[0] == scatters[1] and scatters[0]


def test_fsdp2_tp_rank_report_lists_each_tp_local_weight_gather(ranks):
    """Each rank's report: one ``weight all-gather:`` note per weight FSDP2 gathers for the
    block, with the TP-local shape (what this rank receives) and its bytes: the 7 linears in
    FP8 (1 byte per element), the norms in bf16; every linear reads the gathered bytes."""
    ranks, _ = ranks
    for rank in ranks:
        (report,) = [r for r in rank[True]["reports"]
                     if any(n.startswith("lowered:") for n in r["notes"])]
        notes = report["notes"]
        gathers = [n for n in notes if n.startswith("weight all-gather:")]
        assert ("weight all-gather: self_attn.q_proj.weight: FSDP2 (before the graph), "
                "(128, 256), float8_e4m3fn (as uint8) (graphpass.fsdp_fp8_weights), 32.00 KiB "
                "each all-gather") in gathers
        assert ("weight all-gather: mlp.down_proj.weight: FSDP2 (before the graph), "
                "(256, 256), float8_e4m3fn (as uint8) (graphpass.fsdp_fp8_weights), 64.00 KiB "
                "each all-gather") in gathers
        assert ("weight all-gather: self_attn.o_proj.weight: FSDP2 (before the graph), "
                "(256, 128), float8_e4m3fn (as uint8) (graphpass.fsdp_fp8_weights), 32.00 KiB "
                "each all-gather") in gathers
        assert ("weight all-gather: input_layernorm.weight: FSDP2 (before the graph), (256,), "
                "bfloat16 (parameter dtype), 512 B each all-gather") in gathers
        assert len(gathers) == 9 and sum("float8_e4m3fn" in n for n in gathers) == 7
        assert sum("FSDP2: all-gathered in FP8" in n for n in notes) == 7
        assert sum(n.startswith("lowered:") for n in notes) == 7


# Step 0 of the 2-D run against the unsharded block in one process under the same FP8 backend:
# the loss (relative), the largest relative L2 error of any parameter's gradient, and the
# largest ratio of a gradient's error against float32 to the one-process FP8 block's own
BOUNDS = {"loss": 0.05, "grads": 0.2, "vs_fp32": 1.5}  # measured (2.13.0) 0.005, 0.117, 1.19


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fsdp2_tp_fp8_matches_the_unsharded_fp8_block_within_bounds(ranks):
    """Against one process running the unsharded block in bf16, compiled with the same
    backend, on the whole batch: the step-0 loss and gradients within FP8's reach (they differ
    by scales: each TP shard and row-parallel input scales by its own amax), and no further
    from float32 than FP8's own error."""
    ranks, ref = ranks
    fp8, fp32 = ref["fp8"], ref["fp32"]
    loss = sum(rank[True]["losses"][0] for rank in ranks) / DP
    assert abs(loss - fp8["loss"]) / abs(fp8["loss"]) < BOUNDS["loss"]
    grads = ranks[0][True]["grads"][0]
    for rank in ranks[1:]:  # the full gradients are the same on every rank
        assert all(torch.equal(rank[True]["grads"][0][n], grads[n]) for n in grads)
    names = {n.removeprefix("layers."): n for n in grads}
    assert max(_rel(grads[n], fp8["grads"][n]) for n in names.values()) < BOUNDS["grads"]
    for n in names.values():
        assert _rel(grads[n], fp32["grads"][n]) < BOUNDS["vs_fp32"] * _rel(
            fp8["grads"][n], fp32["grads"][n]), n


# --- one process: torch's fake process group ------------------------------------------------


@pytest.fixture
def mesh():
    """Rank 1 of a 2 x 2 (dp, tp) mesh on torch's fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    from graphpass.distributed import fake_process_group

    with fake_process_group(DP * TP, rank=1):
        yield init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def _tp_pair(mesh):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    return model, lambda: parallelize_module(model, mesh["tp"], plan)


def test_fsdp_fp8_weights_wraps_each_tp_shard_before_or_after_parallelize_module(mesh):
    """``fsdp_fp8_weights`` after ``parallelize_module`` wraps each DTensor weight's local
    tensor (the TP shard FSDP2 will shard); before it, ``parallelize_module`` shards the
    wrapper and keeps it inside the DTensor (as torchao's float8 weights are). Either way the
    DTensor's local tensor is the wrapper of the TP shard, with the same placements."""
    from torch.distributed.tensor import DTensor, Shard

    config = graphpass.Config(**OPTIONS)
    after, parallelize = _tp_pair(mesh)
    parallelize()
    assert graphpass.fsdp_fp8_weights(after, config).fp8 == ("0.weight", "1.weight")
    before, parallelize = _tp_pair(mesh)
    graphpass.fsdp_fp8_weights(before, config)
    parallelize()
    for a, b, placement, whole, shape in ((after[0], before[0], Shard(0), (96, 64), (48, 64)),
                                          (after[1], before[1], Shard(1), (64, 96), (64, 48))):
        for w in (a.weight, b.weight):
            assert isinstance(w, DTensor) and isinstance(w, nn.Parameter)
            assert w.placements == (placement,) and tuple(w.shape) == whole
            local = w.to_local()
            assert isinstance(local, FP8GatherShard) and tuple(local.shape) == shape
            assert local.is_contiguous()
        # (the values: the fake process group's scatter in parallelize_module moves none)
        assert a.weight.to_local()._state.name == b.weight.to_local()._state.name
    # called again: nothing wrapped twice
    assert graphpass.fsdp_fp8_weights(after, config).fp8 == ("0.weight", "1.weight")
    assert not isinstance(after[0].weight.to_local()._tensor, FP8GatherShard)


def test_tp_layouts_the_fp8_gather_does_not_take_and_a_wrong_order_are_said(mesh):
    """A DTensor weight on the 2-D mesh, or with a Partial placement, is left in the parameter
    dtype with a warning naming the layout (FSDP2 gathers it in bf16: the bits of the plain
    run); ``fully_shard`` before ``fsdp_fp8_weights`` is a ValueError saying the order."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    config = graphpass.Config(**OPTIONS)
    for placements, sub in (((Replicate(), Shard(0)), mesh), ((Partial(),), mesh["tp"])):
        model = nn.Sequential(nn.Linear(64, 96, bias=False))
        local = model[0].weight.detach()
        if isinstance(placements[-1], Shard):
            local = local.chunk(TP)[sub["tp"].get_local_rank()].contiguous()
        model[0].weight = nn.Parameter(DTensor.from_local(local, sub, placements,
                                                          run_check=False))
        with pytest.warns(graphpass.FSDPFP8Warning,
                          match=rf"0\.weight is all-gathered in its dtype: a DTensor on a "
                                rf"{sub.ndim}-D mesh with placements"):
            result = graphpass.fsdp_fp8_weights(model, config)
        assert result.fp8 == () and len(result.kept) == 1
        assert not isinstance(model[0].weight.to_local(), FP8GatherShard)
    model, parallelize = _tp_pair(mesh)
    parallelize()
    fully_shard(model, mesh=mesh["dp"])
    with pytest.raises(ValueError, match="sharded with fully_shard already: call it before "
                                         "fully_shard \\(after parallelize_module"):
        graphpass.fsdp_fp8_weights(model, config)


def test_the_gathered_weight_comes_back_in_place_for_any_fsdp_shard_dim():
    """``fsdp_post_all_gather`` on the buffers FSDP2 hands it (the 4-rank run above covers it
    end to end): FSDP2 views the gathered bytes as (-1, *shard.shape[1:]).
    A dim-0 shard's padding rows are at the end; a dim-1 shard (a shard_placement_fn's) is
    copied back into place by FSDP2 before the view. Either way the weight is the first numel
    elements, in FP8 and in the high-precision fallback; a dim-1 shard is not padded."""
    from graphpass.fp8.fsdp import FP8GatheredWeight, _padded, _State

    w = torch.randn(64, 96).to(torch.bfloat16)
    data, scale_inv = graphpass.fp8.recipes.quantize(w, "tensorwise", "weight")
    raw = data.view(torch.uint8)
    shard = FP8GatherShard(w.chunk(2, dim=1)[0].contiguous(), _State("w", "tensorwise"))
    shard._state.size = w.shape
    padded_dim0 = torch.cat([raw, raw.new_zeros(2, 96)])  # 3 ranks of 22 rows: 2 rows of padding
    for gathered in (raw.reshape(-1, 48), padded_dim0):
        out, _ = shard.fsdp_post_all_gather((gathered,), (scale_inv, data.dtype, torch.bfloat16,
                                                          "tensorwise"),
                                            torch.bfloat16)
        assert isinstance(out, FP8GatheredWeight) and tuple(out.shape) == (64, 96)
        assert torch.equal(out._data.view(torch.uint8), raw) and out._scale_inv is scale_inv
    high, _ = shard.fsdp_post_all_gather((w.reshape(-1, 48),), None, torch.bfloat16)
    assert torch.equal(high, w)

    class Mesh:
        def size(self):
            return 2

    assert _padded(raw[:, :48], w.shape, Mesh()).shape == (64, 48)  # dim 1: even, as it is
    assert _padded(raw[:31], w.shape, Mesh()).shape == (32, 96)  # dim 0: to ceil(64 / 2) rows
