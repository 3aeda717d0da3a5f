"""``graphpass.estimate`` of an FSDP2 model, one rank of two on torch's fake process group,
against the peak torch's ``FSDPMemTracker`` measures over the same real step on two gloo ranks
(``tests/_estimate_worker.py``, run last in the 2-rank launch of tests/test_distributed_gloo.py:
both ranks as subprocesses, killed at its limit)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import graphpass
from graphpass.distributed import fake_process_group
from graphpass.job.estimate import estimate
from graphpass.job.result import Part

import _estimate_worker as worker
from test_distributed_gloo import two_ranks

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")

WORLD = 2
TOLERANCE = 0.03


@pytest.fixture(scope="module")
def measured(request) -> list[dict[str, int]]:
    """Both ranks' measured peaks of the cases this session runs, measured last in the session's
    2-rank launch (``two_ranks``: the processes of the other gloo files' 2-rank scenarios)."""
    out = two_ranks(request)
    return [torch.load(out / f"peaks-{r}.pt") for r in range(WORLD)]


# one_version: two gloo ranks for a minute of CI; the estimate's FSDP2 path (FSDPMemTracker on
# the fake process group) runs on every version in test_fsdp_estimate_is_one_ranks below
@pytest.mark.one_version
@pytest.mark.parametrize("name", list(worker.CASES))
def test_fsdp_rank_matches_real_step(name, measured):
    options, optimizer, micro_batches = worker.CASES[name]
    torch._dynamo.reset()
    with fake_process_group(WORLD):
        model, (tokens,) = worker.build(device="meta")
        model = worker.shard(model, None, WORLD)  # the estimate compiles under config=
        est = estimate(model, tokens, optimizer=optimizer, loss_fn=worker.loss_fn,
                       config=graphpass.Config.from_options(**options) if options else None,
                       micro_batches=micro_batches)
    assert (est.world_size, est.rank) == (WORLD, 0)
    for rank in range(WORLD):
        real = measured[rank][name]
        assert abs(est.peak_bytes - real) <= TOLERANCE * real, (rank, est.peak_bytes, real, str(est))
    assert est.breakdown[Part.FSDP_BUFFERS] > 0
    assert sum(est.breakdown.values()) == est.peak_bytes


def test_fsdp_estimate_is_one_ranks():
    """On the fake process group alone: the estimate is rank 0's of 2, its parameters the local
    shards (a rank's FSDP2 shards, not the whole model), FSDP2's unsharded parameters and
    all-gather buffers counted as FSDP buffers, the peak in the blocks' backward."""
    torch._dynamo.reset()
    with fake_process_group(WORLD):
        model, (tokens,) = worker.build(device="meta")
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        model = worker.shard(model, None, WORLD)
        est = estimate(model, tokens, optimizer=worker.CASES["eager-adamw-2"][1],
                       loss_fn=worker.loss_fn)
    assert (est.world_size, est.rank) == (WORLD, 0)
    assert whole // WORLD <= est.breakdown[Part.PARAMETERS] < whole
    assert est.breakdown[Part.FSDP_BUFFERS] > 0
    # AdamW: two moments like each local shard, and a step count per parameter
    params = est.breakdown[Part.PARAMETERS]
    assert 2 * params <= est.breakdown[Part.OPTIMIZER_STATE] <= 2 * params + 8 * 64
    assert any("materialized in place" in n for n in est.notes)
