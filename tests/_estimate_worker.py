"""One rank of ``tests/test_estimate_fsdp.py``: the peak torch's ``FSDPMemTracker`` measures over
one real training step of an FSDP2 model on two gloo ranks.

    python tests/_estimate_worker.py OUT_DIR RANK WORLD STORE [CASE ...]

Each case (``CASES``) builds the tiny Llama language model on the CPU in bf16, applies
``fully_shard`` to each block and to the root, compiles each block with graphpass where the case
has options, runs one step to warm up (the optimizer's state, the compiles) and measures the
second: zero_grad, forward, loss and backward per micro-batch, the optimizer's step. The peaks
go to ``OUT_DIR/peaks-<rank>.pt``.

Two things the tracker itself would add are left out: gloo's own scratch
(``_without_gloo_scratch``) and the gradient copies its ``ModTracker`` causes on a compiled
block (``_without_parameter_grad_hooks``).
"""

from __future__ import annotations

import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import llama  # noqa: E402

BATCH = 2  # each rank's rows

# name: (graphpass options or None (eager), optimizer, micro-batches); the estimates' side is
# the same table (tests/test_estimate_fsdp.py).
CASES = {
    "eager-adamw-2": (None, functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False), 2),
    "compiled-sgd": (dict(codegen="eager"),
                     functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9), 1),
}


def build(device=None):
    """The tiny Llama LM (2 blocks, vocabulary 256) in bf16, and this rank's token ids."""
    return llama.build("tiny_lm", layers=2, batch=BATCH, dtype=torch.bfloat16, device=device)


def loss_fn(logits, tokens):
    return F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())


def shard(model, options, world):
    """``fully_shard`` per block and at the root; each block compiled where ``options``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        if options is not None:
            block.compile(backend=graphpass.backend(**options), dynamic=False)
    fully_shard(model, mesh=mesh)
    return model


_IN_GLOO_COLLECTIVE = [False]


def _without_gloo_scratch() -> None:
    """gloo's reduce-scatter runs ops of its own on the CPU (it splits its input and reduces
    into a new tensor), which the tracker would count; NCCL's allocate nothing in torch's
    allocator and the fake process group runs none. The collectives FSDP2 calls run here to
    completion with the tracker looking away (``Measuring``)."""
    for name in ("reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                 "all_gather_single"):  # FSDP2 calls the *_single ones from torch 2.13
        collective = getattr(dist, name, None)
        if collective is None:
            continue

        def completed(*args, _collective=collective, **kwargs):
            _IN_GLOO_COLLECTIVE[0] = True
            try:
                work = _collective(*args, **kwargs)
                if work is not None:
                    work.wait()
                return work
            finally:
                _IN_GLOO_COLLECTIVE[0] = False

        setattr(dist, name, completed)


def _without_parameter_grad_hooks() -> None:
    """torch's ``ModTracker`` (inside ``FSDPMemTracker``) registers a multi-gradient hook on each
    module's inputs. On real tensors, a block compiled with ``Module.compile`` under FSDP2 gets
    its unsharded parameters among those inputs; the hook keeps each parameter's gradient in its
    buffer until all have arrived, so AccumulateGrad cannot take the gradient the compiled backward
    returns and copies it (``new_empty_strided`` + ``copy_``). The same step without the tracker
    takes them (no copy); the fake step the estimate runs registers no such hook. The hooks here
    see the inputs other than parameters, which is what the tracker's module bookkeeping needs."""
    from torch.distributed._tools import mod_tracker

    register = mod_tracker.register_multi_grad_hook

    def inputs_only(tensors, fn, *args, _register=register, **kwargs):
        kept = [t for t in tensors if not isinstance(t, torch.nn.Parameter)]
        if not kept:  # parameters alone (no module of this model): nothing to hook
            return None
        return _register(kept, fn, *args, **kwargs)

    mod_tracker.register_multi_grad_hook = inputs_only


def measure(name: str, world: int) -> int:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class Measuring(FSDPMemTracker):
        @classmethod
        def ignore_compile_internals(cls) -> bool:  # compiled code runs under the tracker
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if _IN_GLOO_COLLECTIVE[0] and not func.namespace.startswith("c10d"):
                return func(*args, **(kwargs or {}))  # gloo's own scratch: not counted
            return super().__torch_dispatch__(func, types, args, kwargs)

    options, optimizer, micro_batches = CASES[name]
    torch._dynamo.reset()
    model, (tokens,) = build()
    model = shard(model, options, world)
    opt = optimizer(list(model.parameters()))

    def step(tracker=None):
        opt.zero_grad(set_to_none=True)
        for k in range(micro_batches):
            if tracker is not None and k:
                tracker.reset_mod_stats()
            loss = loss_fn(model(tokens), tokens)
            loss.backward()
            del loss
        opt.step()

    step()
    tracker = Measuring(model, opt)
    tracker.track_inputs((tokens,))
    with tracker:
        step(tracker)
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    print(name, {getattr(k, "value", k): v for k, v in snap.items()})  # the breakdown, in the log
    return snap["Total"]


def estimate(rank: int, world: int, out: str, cases) -> None:
    """The peaks of ``cases`` on this rank of the initialized process group, written to
    ``OUT_DIR/peaks-<rank>.pt``. It patches torch.distributed's collectives and torch's
    ``ModTracker`` for good: the last thing a process runs (``tests/_gloo_worker.py`` runs it
    after the other 2-rank scenarios it shares the processes with)."""
    torch.manual_seed(0)
    _without_gloo_scratch()
    _without_parameter_grad_hooks()
    peaks = {name: measure(name, world) for name in (cases or CASES)}
    torch.save(peaks, os.path.join(out, f"peaks-{rank}.pt"))


def main(argv: list[str]) -> None:
    out, rank, world, store = argv[0], int(argv[1]), int(argv[2]), argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        estimate(rank, world, out, argv[4:])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
