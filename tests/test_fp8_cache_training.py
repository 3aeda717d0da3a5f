"""The FP8 activation cache's loss cost, on a short run of the tiny Llama (issue 12's bounds;
benchmarks/fp8_training.py --cache prints the 200-step numbers)."""

import statistics

import pytest
import torch

import graphpass
from examples import train
from graphpass.models import llama

STEPS = 5


@pytest.fixture(scope="module")
def data():
    return train.batches(vocab=256, batch=2, seq=64, steps=STEPS)


def _loss(data, **options):
    torch._dynamo.reset()
    model, _ = llama.build("tiny_lm", seq=64, layers=1)
    compiled = torch.compile(model, backend=graphpass.backend(codegen="eager", fp8="tensorwise",
                                                              **options))
    losses = train.train(model, compiled, data)
    return statistics.mean(losses[-3:]), graphpass.last_report()


@pytest.mark.slow
def test_cache_levels_stay_within_the_issues_loss_gaps(data):
    exact, _ = _loss(data)
    act_input, report = _loss(data, fp8_cache="act_input")
    assert any(r.op == "graphpass.cache_quantize" for r in report.rows)  # it did cache
    everything, report = _loss(data, fp8_cache="all")
    assert sum(r.bytes for r in report.rows if r.op == "graphpass.cache_quantize") > 0
    assert abs(act_input / exact - 1) <= 0.0025, (act_input, exact)
    assert abs(everything / exact - 1) <= 0.01, (everything, exact)
