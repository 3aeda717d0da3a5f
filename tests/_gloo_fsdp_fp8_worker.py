"""One rank of ``tests/test_fsdp_fp8_gather.py``: FSDP2's weight all-gathers in FP8.

    python tests/_gloo_fsdp_fp8_worker.py OUT_DIR RANK WORLD STORE

The tiny Llama language model of ``tests/_gloo_worker.py`` (2 blocks, vocabulary 256) in float32
under ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``fully_shard`` on each
block and the root, graphpass FP8 tensorwise, SGD for 3 steps; each rank its half of the batch.
Four runs: per-block compile and whole-model compile, each with the weights all-gathered in bf16
(as FSDP2 does) and in FP8 (``graphpass.fsdp_fp8_weights`` before ``fully_shard``,
``graphpass.precompute_fsdp_fp8_scales`` after it and after each optimizer step); then FP8
blockwise per block, with bf16 and FP8 gathers (keys ``("blockwise", fp8)``). A recorder
around torch.distributed's collectives counts what each step ran. Writes
``OUT_DIR/fsdp_fp8-<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import llama  # noqa: E402
from _gloo_worker import (BACKENDS, LR, STEPS, WORLD, _fsdp_model, _loss,  # noqa: E402
                          _report_summary)

# torch.distributed's collectives FSDP2 and graphpass call (the names differ across versions:
# all_gather_single from 2.13, all_gather_into_tensor before; the outermost call is counted)
_RECORDED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_reduce")


class Recorder:
    """Each collective call: (name, dtype, bytes of the tensor it writes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, torch.dtype, int]] = []
        self._depth = 0
        self._wrapped = {name: getattr(dist, name) for name in _RECORDED if hasattr(dist, name)}
        for name, fn in self._wrapped.items():
            setattr(dist, name, self._wrap(name, fn))

    def unwrap(self) -> None:
        """torch.distributed's own functions back (a process that runs other scenarios after)."""
        for name, fn in self._wrapped.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def recorded(*args, **kwargs):
            out = args[0] if args else next(iter(kwargs.values()))
            if self._depth == 0:
                self.calls.append((name.replace("_single", "_into_tensor")
                                   .replace("reduce_scatter_into_tensor", "reduce_scatter_tensor"),
                                   out.dtype, out.numel() * out.element_size()))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return recorded

    def take(self) -> list[tuple[str, torch.dtype, int]]:
        calls, self.calls = self.calls, []
        return calls


def _blockwise_model():
    """The same model with 8 sequences: 128 tokens a rank, a whole 1x128 activation block (the
    blockwise GEMMs need multiples of 128)."""
    model, (tokens,) = llama.build("tiny_lm", layers=2, batch=8, dtype=torch.float32)
    targets = torch.randint(0, 256, tokens.shape, generator=torch.Generator().manual_seed(1))
    return model, (tokens, targets)


def _run(rank: int, recorder: Recorder, *, fp8_gather: bool, whole: bool,
         recipe: str = "tensorwise") -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    model, x = _fsdp_model(torch.float32) if recipe == "tensorwise" else _blockwise_model()
    options = dict(BACKENDS["fp8"], fp8=recipe)
    config = graphpass.Config(**options)
    wrapped = graphpass.fsdp_fp8_weights(model, config) if fp8_gather else None
    mesh = init_device_mesh("cpu", (WORLD,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backend = graphpass.backend(**options)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
        if not whole:
            block.compile(backend=backend)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    run = torch.compile(model, backend=backend) if whole else model
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    if fp8_gather:
        graphpass.precompute_fsdp_fp8_scales(model)
    local = [t.chunk(WORLD)[rank] for t in x]
    trained = train(model, lambda: _loss(run, local), opt, recorder, fp8_gather)
    return dict(trained, reports=_report_summary(backend.partitioner.reports),
                wrapped=None if wrapped is None else (wrapped.fp8, wrapped.kept),
                shapes={n: tuple(p.shape) for n, p in model.named_parameters()})


def train(model: torch.nn.Module, loss: Callable[[], torch.Tensor], opt: torch.optim.Optimizer,
          recorder: Recorder, fp8_gather: bool) -> dict:
    """STEPS steps of ``loss()`` under FSDP2, the scales reduced after each optimizer step when
    the weights are FP8-gathered: each step's loss, gradients (full tensors) and collectives,
    the parameters after, and the FSDPFP8Warning messages."""
    recorder.take()
    losses, grads, calls = [], [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            opt.zero_grad()
            value = loss()
            value.backward()
            losses.append(value.detach())
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            opt.step()
            if fp8_gather:
                graphpass.precompute_fsdp_fp8_scales(model)
            calls.append(recorder.take())
    return dict(losses=losses, grads=grads, calls=calls,
                params={n: p.full_tensor() for n, p in model.named_parameters()},
                warnings=[str(w.message) for w in caught
                          if issubclass(w.category, graphpass.FSDPFP8Warning)])


def fsdp_fp8(rank: int, out: str) -> None:
    """The runs on this rank of the initialized 2-rank process group (``tests/_gloo_worker.py``
    calls it too, in the processes it shares between the 2-rank scenarios): writes
    ``OUT_DIR/fsdp_fp8-<rank>.pt``."""
    recorder = Recorder()
    try:
        results = {(whole, fp8): _run(rank, recorder, fp8_gather=fp8, whole=whole)
                   for whole in (False, True) for fp8 in (False, True)}
        # blockwise, per block: the 128-row shards of q, o, gate, up and down gathered in FP8
        # with their tile scales, k and v (64-row shards) in bf16
        results.update({("blockwise", fp8): _run(rank, recorder, fp8_gather=fp8, whole=False,
                                                 recipe="blockwise") for fp8 in (False, True)})
    finally:
        recorder.unwrap()
    torch.save(results, os.path.join(out, f"fsdp_fp8-{rank}.pt"))


def main(argv: list[str]) -> None:
    out, rank, world, store = argv[0], int(argv[1]), int(argv[2]), argv[3]
    assert world == WORLD, world
    torch.set_num_threads(1)  # the ranks sum in the same order
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fsdp_fp8(rank, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
