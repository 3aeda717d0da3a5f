"""torchtitan's SimpleFSDP under graphpass FP8 on two gloo ranks (``tests/_simple_fsdp_worker.py``,
run by the 2-rank launch of ``tests/test_distributed_gloo.py``, ``two_ranks``: the processes of
the other gloo files' 2-rank scenarios, started as subprocesses and killed at its limit).

The tiny Llama LM (1 block, fp32 parameters, torchtitan's mixed-precision policy: bf16 compute,
fp32 gradient reduction) under ``data_parallel(mode="fully_shard")``, compiled whole with graphpass
FP8 tensorwise, 3 SGD steps of 2 micro-batches, with the weights' FP8 all-gather, without it
(``fp8_weight_all_gather=False``: bf16 gathers, quantized after), and with it under
``fp8_weight_cache=True``. Asserted: the same bits (losses, gradients, parameters), and, from a
dispatch mode that records every collective the compiled micro-batches call, each lowered
weight's gather moving half the bytes after one amax all-reduce (with the cache: one per
optimizer step, on its first micro-batch), the other gathers and the gradients' reduce-scatters
unchanged. The same under FP8 blockwise (16 sequences: 128 tokens a rank and micro-batch): the
weights whose shards are whole 128-row tiles gathered as FP8 bytes and tile scales, the others
in bf16, the same bits. Every run, on every torch version CI tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_distributed_gloo import WORLD, two_ranks

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
]

STEPS = 3
MICRO = 2  # micro-batches per optimizer step
# this rank's shard of each lowered weight (the tiny Llama's q, k, v, o, gate, up, down)
LINEAR_SHARDS = sorted([(128, 256), (64, 256), (64, 256), (128, 256), (256, 256), (256, 256),
                        (128, 512)])


@pytest.fixture(scope="module")
def ranks(request):
    """Every run (2 ranks x 5 compiles), on every torch version CI tests, in the session's 2-rank
    launch (``two_ranks``: the same 2 processes as the other gloo files' 2-rank scenarios)."""
    out = two_ranks(request)
    return [torch.load(out / f"simple_fsdp-{r}.pt") for r in range(WORLD)]


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks):
    """The FP8 gathers, cached or not, against bf16 gathers: every micro-batch's loss, every
    step's accumulated gradients, the parameters after the steps."""
    for r, rank in enumerate(ranks):
        off = rank["bf16"]
        for on in (rank["fp8"], rank["cached"]):
            for i in range(STEPS * MICRO):
                assert torch.equal(on["losses"][i], off["losses"][i]), (r, i)
            for step in range(STEPS):
                assert not _equal(on["grads"][step], off["grads"][step]), (r, step)
            assert not _equal(on["params"], off["params"]), r
        assert not _equal(rank["fp8"]["params"], ranks[0]["fp8"]["params"])  # ranks agree
    losses = [loss.item() for loss in ranks[0]["fp8"]["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains


def _gathers(calls: list) -> list:
    return [c for c in calls if c[0] == "all_gather_into_tensor"]


def test_fp8_weight_gathers_halve_the_lowered_weights_bytes(ranks):
    """Counted from the collectives the compiled micro-batches called (steps 2 and 3; the first
    compiles): the 7 lowered weights' gathers move uint8, half the bytes of the bf16 run's; the
    others (embedding, norms, output head) and the reduce-scatters are the same calls; one
    all-reduce of 7 fp32 amaxes per micro-batch."""
    for rank in ranks:
        for step in (1, 2):
            for m in range(MICRO):
                on, off = rank["fp8"]["calls"][step][m], rank["bf16"]["calls"][step][m]
                on_gathers, off_gathers = _gathers(on), _gathers(off)
                assert len(on_gathers) == len(off_gathers) == 12
                fp8 = [(a, b) for a, b in zip(on_gathers, off_gathers) if a[1] == "uint8"]
                assert sorted(a[2] for a, _ in fp8) == LINEAR_SHARDS
                for a, b in fp8:  # the same weight, in the same order: half the bytes
                    assert (a[2], a[3], b[1], b[2], b[3]) == (b[2], "uint8", "bfloat16", b[2],
                                                              "bfloat16")
                    assert 2 * a[4] == b[4], (a, b)
                others = [(a, b) for a, b in zip(on_gathers, off_gathers) if a[1] != "uint8"]
                assert len(others) == 5 and all(a == b for a, b in others), others
                assert sum(a[4] for a, _ in fp8) == 589824  # 1152 KiB in bf16, 576 KiB in FP8
                assert [c for c in on if c[0] == "all_reduce"] == [
                    ("all_reduce", "float32", (7,), "float32", 28)]
                assert not [c for c in off if c[0] == "all_reduce"]
                scatters = [[c for c in calls if c[0] == "reduce_scatter_tensor"]
                            for calls in (on, off)]
                assert scatters[0] == scatters[1] and len(scatters[0]) == 12
                assert {c[1] for c in scatters[0]} == {"float32"}  # the policy's reduce dtype


def test_the_weight_cache_reduces_and_quantizes_once_per_step(ranks):
    """``fp8_weight_cache=True``: the 7 shards' amax all-reduce runs inside the cache's op on the
    first micro-batch after each optimizer step only (the recorder sees it inside the op), the
    shards quantized once per step (7 per step by ``graphpass.weight_cache_stats()``, every other
    call a lookup: the second micro-batch's forward and each backward's); every micro-batch
    gathers the same FP8 bytes as the uncached run, and reduce-scatters the same. The report
    names the cache and its 7 shards; the step peak holds them (1 byte an element, and a
    scale)."""
    shards = sum(n * k for n, k in LINEAR_SHARDS)
    for rank in ranks:
        cached, fp8 = rank["cached"], rank["fp8"]
        for step in (1, 2):
            reduces = []
            for m in range(MICRO):
                calls = cached["calls"][step][m]
                assert _gathers(calls) == _gathers(fp8["calls"][step][m])
                assert [c for c in calls if c[0] == "reduce_scatter_tensor"] == [
                    c for c in fp8["calls"][step][m] if c[0] == "reduce_scatter_tensor"]
                ops = [c for c in calls if c[0] == "quantize_weight_shards"]
                assert ops and set(ops) == {("quantize_weight_shards", "float32", (7,), "", 0)}
                reduces.append([c for c in calls if c[0] == "all_reduce"])
            assert reduces == [[("all_reduce", "float32", (7,), "float32", 28)], []]
        calls_per_step = sum(c[0] == "quantize_weight_shards"
                             for m in range(MICRO) for c in cached["calls"][1][m])
        assert cached["stats"] == [(7, 7 * (calls_per_step - 1))] * STEPS
        assert fp8["stats"] == rank["bf16"]["stats"] == [(0, 0)] * STEPS
        assert cached["peak"]["by_kind"]["cached"] == shards + 7 * 4
        assert "cached" not in fp8["peak"]["by_kind"]
        notes = cached["notes"]
        assert sum(n.startswith("fp8_weight_cache: ") and "held between steps" in n
                   for n in notes) == 7
        assert sum("(one all-reduce (max) of the amaxes of 7 weights, by the weight cache: once "
                   "per optimizer step)" in n for n in notes) == 7
        assert any(n.startswith("collectives in the forward: ") and n.endswith(
            "all_reduce x1 (28 B out) in fp8_weight_cache's quantize_weight_shards, on the first "
            "micro-batch of each optimizer step") for n in notes), notes


def test_the_report_lists_what_the_step_gathered(ranks):
    """Each rank's report: the 7 FP8 all-gather notes, the one all-reduce, and per weight the
    gathered bytes, which sum to what the recorder counted."""
    for rank in ranks:
        for run in ("fp8", "bf16", "cached"):
            notes = rank[run]["notes"]
            weights = [n for n in notes if n.startswith("weight all-gather: ")]
            assert len(weights) == 12
            fp8 = [n for n in weights if "float8_e4m3fn (as uint8)" in n]
            assert len(fp8) == (0 if run == "bf16" else 7)
            moved = sum(c[4] for c in _gathers(rank[run]["calls"][1][0]))
            assert moved == sum(_bytes(n) for n in weights)
            assert sum("(one all-reduce (max) of the amaxes of 7 weights)" in n
                       for n in notes) == (7 if run == "fp8" else 0)


def _bytes(note: str) -> int:
    """The bytes of a ``weight all-gather`` note (``..., 128.00 KiB per step``)."""
    amount, unit = note.rsplit(", ", 1)[1].removesuffix(" per step").split()
    return round(float(amount) * {"B": 1, "KiB": 2**10, "MiB": 2**20}[unit])


# blockwise: this rank's shard of each lowered weight whose shards are whole 128-row tiles (k
# and v, 64-row shards, gather bf16), and its (rows/128, cols/128) tile scales
BLOCK_SHARDS = sorted([(128, 256), (128, 256), (256, 256), (256, 256), (128, 512)])


def test_blockwise_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks):
    """FP8 blockwise: q, o, gate, up and down (shards of 128 or 256 rows) gathered as FP8 bytes
    and tile scales, k and v (64-row shards) in bf16: losses, gradients and parameters are the
    bits of gathering every weight in bf16 and quantizing after."""
    for r, rank in enumerate(ranks):
        on, off = rank["blockwise"], rank["blockwise_bf16"]
        for i in range(STEPS * MICRO):
            assert torch.equal(on["losses"][i], off["losses"][i]), (r, i)
        for step in range(STEPS):
            assert not _equal(on["grads"][step], off["grads"][step]), (r, step)
        assert not _equal(on["params"], off["params"]), r
    losses = [loss.item() for loss in ranks[0]["blockwise"]["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses


def test_blockwise_fp8_weight_gathers_move_bytes_and_tile_scales(ranks):
    """Counted from the collectives the compiled steps called: each aligned weight's bf16
    gather becomes a uint8 gather of its bytes and a float32 gather of its tile scales; k, v and
    the other weights gather as before; no all-reduce. The report's notes sum to the bytes."""
    for rank in ranks:
        for step, m in ((1, 0), (1, 1), (2, 0), (2, 1)):
            on, off = rank["blockwise"]["calls"][step][m], rank["blockwise_bf16"]["calls"][step][m]
            on_gathers = [c for c in on if c[0] == "all_gather_into_tensor"]
            off_gathers = [c for c in off if c[0] == "all_gather_into_tensor"]
            assert len(off_gathers) == 12 and len(on_gathers) == 17
            data = sorted(c[2] for c in on_gathers if c[1] == "uint8")
            scales = sorted(c[2] for c in on_gathers if c[1] == "float32")
            assert data == BLOCK_SHARDS
            assert scales == sorted((r // 128, -(-k // 128)) for r, k in BLOCK_SHARDS)
            moved = [sum(c[4] for c in gathers) for gathers in (on_gathers, off_gathers)]
            # the aligned weights: 524,288 FP8 bytes and 128 of tile scales for 1,048,576 in bf16
            assert moved[1] - moved[0] == 1048576 - 524288 - 128, moved
            assert not [c for c in on if c[0] == "all_reduce"]
        notes = rank["blockwise"]["notes"]
        weights = [n for n in notes if n.startswith("weight all-gather: ")]
        assert sum("float32 tile scales" in n for n in weights) == 5
        moved = sum(c[4] for c in rank["blockwise"]["calls"][1][0]
                    if c[0] == "all_gather_into_tensor")
        # each note rounds to 0.01 KiB (64.02 KiB: 65,552 bytes)
        assert abs(sum(_bytes(n) for n in weights) - moved) <= 6 * len(weights)
