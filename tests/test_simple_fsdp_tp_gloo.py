"""torchtitan's SimpleFSDP over tensor and sequence parallelism on a (dp=2, tp=2) mesh of 4 gloo
ranks, trained under graphpass FP8 (``tests/_simple_fsdp_tp_worker.py``, run by the 4 processes of
``tests/test_fsdp_tp_fp8_gather.py``, which start as subprocesses and are killed at its
``TIMEOUT``).

A tiny Llama block (float32 parameters, bf16 compute, fp32 gradient reduction) under torchtitan's
TP+SP plan on ``tp`` and ``data_parallel(mode="fully_shard")`` on ``dp``, compiled whole with
graphpass FP8 tensorwise, 3 SGD steps, with the weights' FP8 all-gather and without it (bf16
gathers, quantized after). Asserted on every rank: the same bits (losses, gradients, parameters);
from a dispatch mode that records the collectives the compiled steps call, each lowered weight's
TP shard gathered over ``dp`` as uint8, half the bytes, after one all-reduce of the 7 amaxes over
``dp``, every other collective (the norms' gathers, the sequence-parallel FP8 gathers over ``tp``,
the reduce-scatters) unchanged; the loss falls.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from test_fsdp_tp_fp8_gather import four_ranks

pytest.importorskip("torchtitan.experiments.graph_trainer.simple_fsdp")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
]

DP, TP = 2, 2
STEPS = 3
# this rank's dp shard of each lowered weight's TP shard (q, k, v, o, gate, up, down)
LINEAR_SHARDS = sorted([(64, 256), (32, 256), (32, 256), (128, 128), (128, 256), (128, 256),
                        (128, 256)])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The runs of ``tests/_simple_fsdp_tp_worker.py``, made by the 4 processes of
    tests/test_fsdp_tp_fp8_gather.py's run (after its FSDP2+TP runs: one start and import of
    4 processes for both files, on every torch version)."""
    out = four_ranks(tmp_path_factory)
    return [torch.load(out / f"simple_fsdp_tp-{r}.pt") for r in range(DP * TP)]


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks):
    """Every rank: each step's loss, its gradients (full tensors over both mesh dimensions) and
    the parameters after the steps are the bits of gathering the weights in bf16; the ranks
    agree on the parameters; the loss falls on every rank."""
    for r, rank in enumerate(ranks):
        on, off = rank["fp8"], rank["bf16"]
        for i in range(STEPS):
            assert torch.equal(on["losses"][i], off["losses"][i]), (r, i)
            assert not _differ(on["grads"][i], off["grads"][i]), (r, i)
        assert not _differ(on["params"], off["params"]), r
        assert not _differ(on["params"], ranks[0]["fp8"]["params"]), r
        losses = [loss.item() for loss in on["losses"]]
        assert losses[-1] < losses[0] - 50, (r, losses)  # it trains (the loss is a sum)


def _gathers(calls: list, group: str) -> list:
    return [c for c in calls if c[0] == "all_gather_into_tensor" and c[5] == group]


def test_fp8_weight_gathers_halve_the_lowered_weights_bytes(ranks):
    """Counted from the collectives the compiled steps 2 and 3 called: over ``dp``, the 7 lowered
    weights' TP shards gather uint8, half the bytes of the bf16 run's (576 KiB in bf16, 288 KiB
    in FP8), after one all-reduce of 7 fp32 amaxes; the norms' gathers, everything over ``tp``
    (the sequence-parallel FP8 gathers of both runs) and the reduce-scatters are the same
    calls."""
    for rank in ranks:
        for step in (1, 2):
            on, off = rank["fp8"]["calls"][step], rank["bf16"]["calls"][step]
            on_dp, off_dp = _gathers(on, "dp"), _gathers(off, "dp")
            assert len(on_dp) == len(off_dp) == 9
            fp8 = [(a, b) for a, b in zip(on_dp, off_dp) if a[1] == "uint8"]
            assert sorted(a[2] for a, _ in fp8) == LINEAR_SHARDS
            for a, b in fp8:  # the same weight, in the same order: half the bytes
                assert (a[2], a[3], b[1], b[2], b[3]) == (b[2], "uint8", "bfloat16", b[2],
                                                          "bfloat16")
                assert 2 * a[4] == b[4], (a, b)
            assert sum(a[4] for a, _ in fp8) == 294912
            assert sum(b[4] for _, b in fp8) == 589824
            others = [(a, b) for a, b in zip(on_dp, off_dp) if a[1] != "uint8"]
            assert len(others) == 2 and all(a == b for a, b in others), others
            assert [c for c in on if c[0] == "all_reduce" and c[5] == "dp"] == [
                ("all_reduce", "float32", (7,), "float32", 28, "dp")]
            assert not [c for c in off if c[0] == "all_reduce" and c[5] == "dp"]
            tp = [[c for c in calls if c[5] == "tp"] for calls in (on, off)]
            assert tp[0] == tp[1] and len(_gathers(on, "tp")) == 4
            assert {c[1] for c in _gathers(on, "tp")} == {"uint8"}  # SP inputs/grads in FP8
            scatters = [[c for c in calls if c[0] == "reduce_scatter_tensor"]
                        for calls in (on, off)]
            assert scatters[0] == scatters[1]
            assert {c[1] for c in scatters[0] if c[5] == "dp"} == {"float32"}  # reduce dtype
