"""``graphpass.estimate`` against a real step on CUDA: ``torch.cuda.max_memory_allocated`` over
one training step of the tiny Llama language model, compiled with graphpass (Inductor), within
5% of the estimate. Run on a GPU machine:

    PYTHONPATH=. python -m pytest -p no:xdist -q tests/test_estimate_gpu.py
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import graphpass
from graphpass.job.estimate import estimate

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCE = 0.05


def _loss(logits, tokens):
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("options", [dict(), dict(fp8="tensorwise")])
def test_estimate_matches_cuda_max_memory_allocated(options):
    from graphpass.models import llama

    optimizer = functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True)
    torch._dynamo.reset()
    meta_model, (meta_tokens,) = llama.build("tiny_lm", layers=4, batch=8, seq=1024,
                                             dtype=torch.bfloat16, device="meta")
    est = estimate(meta_model, meta_tokens.to("meta"), optimizer=optimizer, loss_fn=_loss,
                   config=graphpass.Config.from_options(**options))

    torch._dynamo.reset()
    model, (tokens,) = llama.build("tiny_lm", layers=4, batch=8, seq=1024, dtype=torch.bfloat16,
                                   device="cuda")
    compiled = torch.compile(model, backend=graphpass.backend(**options))
    opt = optimizer([p for p in model.parameters() if p.requires_grad])

    def step():
        opt.zero_grad(set_to_none=True)
        loss = _loss(compiled(tokens), tokens)
        loss.backward()
        del loss
        opt.step()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated()
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real, str(est))
