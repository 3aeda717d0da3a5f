"""torchtitan's SimpleFSDP under graphpass FP8 on two gloo ranks (``tests/_simple_fsdp_worker.py``,
through the harness of ``tests/test_distributed_gloo.py``: both ranks start as subprocesses and
are killed at its timeout).

The tiny Llama LM (1 block, fp32 parameters, torchtitan's mixed-precision policy: bf16 compute,
fp32 gradient reduction) under ``data_parallel(mode="fully_shard")``, compiled whole with graphpass
FP8 tensorwise, 3 SGD steps, with the weights' FP8 all-gather and without it
(``fp8_weight_all_gather=False``: bf16 gathers, quantized after). Asserted: the same bits
(losses, gradients, parameters), and, from a dispatch mode that records every collective the
compiled steps call, each lowered weight's gather moving half the bytes after one amax
all-reduce, the other gathers and the gradients' reduce-scatters unchanged. The same under FP8
blockwise (8 sequences: 128 tokens a rank): the weights whose shards are whole 128-row tiles
gathered as FP8 bytes and tile scales, the others in bf16, the same bits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _session import once
from test_distributed_gloo import TIMEOUT, WORLD, _run

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    # 2 ranks x 2 compiles, 60-90 s on 2 cores; tests/test_simple_fsdp.py covers the rewrite,
    # its collectives and notes on every torch version
    pytest.mark.one_version,
]

WORKER = Path(__file__).with_name("_simple_fsdp_worker.py")
STEPS = 3
# this rank's shard of each lowered weight (the tiny Llama's q, k, v, o, gate, up, down)
LINEAR_SHARDS = sorted([(128, 256), (64, 256), (64, 256), (128, 256), (256, 256), (256, 256),
                        (128, 512)])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = once(tmp_path_factory, "gloo-simple-fsdp",
               lambda out: _run("simple_fsdp", out, reference=False, worker=WORKER),
               timeout=3 * TIMEOUT)
    return [torch.load(out / f"simple_fsdp-{r}.pt") for r in range(WORLD)]


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks):
    for r, rank in enumerate(ranks):
        on, off = rank[True], rank[False]
        for step in range(STEPS):
            assert torch.equal(on["losses"][step], off["losses"][step]), (r, step)
            assert not _equal(on["grads"][step], off["grads"][step]), (r, step)
        assert not _equal(on["params"], off["params"]), r
        assert not _equal(on["params"], ranks[0][True]["params"])  # both ranks agree
    losses = [loss.item() for loss in ranks[0][True]["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses  # it trains: 5.64 -> 3.94 measured


def test_fp8_weight_gathers_halve_the_lowered_weights_bytes(ranks):
    """Counted from the collectives the compiled steps called (steps 2 and 3; the first
    compiles): the 7 lowered weights' gathers move uint8, half the bytes of the bf16 run's; the
    others (embedding, norms, output head) and the reduce-scatters are the same calls; one
    all-reduce of 7 fp32 amaxes per step."""
    for rank in ranks:
        for step in (1, 2):
            on, off = rank[True]["calls"][step], rank[False]["calls"][step]
            on_gathers = [c for c in on if c[0] == "all_gather_into_tensor"]
            off_gathers = [c for c in off if c[0] == "all_gather_into_tensor"]
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


def test_the_report_lists_what_the_step_gathered(ranks):
    """Each rank's report: the 7 FP8 all-gather notes, the one all-reduce, and per weight the
    gathered bytes, which sum to what the recorder counted."""
    for rank in ranks:
        for on in (True, False):
            notes = rank[on]["notes"]
            weights = [n for n in notes if n.startswith("weight all-gather: ")]
            assert len(weights) == 12
            fp8 = [n for n in weights if "float8_e4m3fn (as uint8)" in n]
            assert len(fp8) == (7 if on else 0)
            moved = sum(c[4] for c in rank[on]["calls"][1] if c[0] == "all_gather_into_tensor")
            assert moved == sum(_bytes(n) for n in weights)
            assert sum("(one all-reduce (max) of the amaxes of 7 weights)" in n
                       for n in notes) == (7 if on else 0)


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
        on, off = rank["blockwise", True], rank["blockwise", False]
        for step in range(STEPS):
            assert torch.equal(on["losses"][step], off["losses"][step]), (r, step)
            assert not _equal(on["grads"][step], off["grads"][step]), (r, step)
        assert not _equal(on["params"], off["params"]), r
    losses = [loss.item() for loss in ranks[0]["blockwise", True]["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses


def test_blockwise_fp8_weight_gathers_move_bytes_and_tile_scales(ranks):
    """Counted from the collectives the compiled steps called: each aligned weight's bf16
    gather becomes a uint8 gather of its bytes and a float32 gather of its tile scales; k, v and
    the other weights gather as before; no all-reduce. The report's notes sum to the bytes."""
    for rank in ranks:
        for step in (1, 2):
            on, off = rank["blockwise", True]["calls"][step], rank["blockwise", False]["calls"][step]
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
        notes = rank["blockwise", True]["notes"]
        weights = [n for n in notes if n.startswith("weight all-gather: ")]
        assert sum("float32 tile scales" in n for n in weights) == 5
        moved = sum(c[4] for c in rank["blockwise", True]["calls"][1]
                    if c[0] == "all_gather_into_tensor")
        # each note rounds to 0.01 KiB (64.02 KiB: 65,552 bytes)
        assert abs(sum(_bytes(n) for n in weights) - moved) <= 6 * len(weights)
