"""One process of ``tests/test_fsdp_tp_fp8_gather.py``: FSDP2 + tensor parallelism on a 2-D mesh
with FSDP2's weight all-gathers in FP8.

    python tests/_gloo_fsdp_tp_fp8_worker.py OUT_DIR RANK WORLD STORE [simple_fsdp_tp] [ref]
                                                                  (4 ranks: dp=2 x tp=2)
    python tests/_gloo_fsdp_tp_fp8_worker.py OUT_DIR ref          (one process, unsharded)

``simple_fsdp_tp``: the same processes then run ``tests/_simple_fsdp_tp_worker.py``'s runs
(SimpleFSDP over TP+SP on the same mesh shape), so both 4-rank tests share one start and import
of 4 processes; ``ref``: the last rank then runs the one-process reference too (a process
importing torch and graphpass costs about 14 s of CPU, the reference about 8).

One tiny Llama block (``llama.build("tiny", layers=1)``, float32) made tensor- and
sequence-parallel over the ``tp`` mesh dimension (``llama.parallelize``, torchtitan's plan), then
``fully_shard`` on the ``dp`` dimension for the block (q_proj's TP shard sharded on dim 1 by a
``shard_placement_fn``, the others on dim 0) and the root, under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; the block compiled with graphpass
FP8 tensorwise; SGD for 3 steps. Data-parallel rank d trains on row d of the batch, tensor-parallel
rank t holds sequence half t; the loss is the block's output against a fixed random probe.
Two runs: the weights all-gathered in bf16, and in FP8 (``graphpass.fsdp_fp8_weights`` between
``parallelize_module`` and ``fully_shard``, ``graphpass.precompute_fsdp_fp8_scales`` after
``fully_shard`` and after each optimizer step); a recorder around torch.distributed's collectives
(``tests/_gloo_fsdp_fp8_worker.py``'s) counts what each step ran. The reference: the same block
unsharded in bf16, compiled the same way, one step on the whole batch (the loss halved: FSDP2
averages the two data-parallel gradients), and in float32 uncompiled. Writes
``OUT_DIR/fsdp_tp-<rank>.pt`` or ``OUT_DIR/fsdp_tp_ref.pt``.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.monotonic()  # each process prints its times (in the test's failure output)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import _common, llama  # noqa: E402

from _gloo_fsdp_fp8_worker import Recorder, train  # noqa: E402
from _gloo_worker import BACKENDS, _report_summary  # noqa: E402

DP, TP = 2, 2
LR = 2e-3  # the loss is a sum: a larger step diverges
LAYERS = 1
# FSDP2 shards this weight's TP shard on dim 1 (a shard_placement_fn), the others on dim 0
DIM1 = "self_attn.q_proj.weight"


def _blocks():
    """The blocks (float32, seed 0), the whole batch of hidden states, the RoPE tables and
    the probe the loss projects the output on."""
    model, (x,) = llama.build("tiny", layers=LAYERS, dtype=torch.float32)
    cfg = model.config
    cos, sin = _common.rope_cos_sin(cfg.seq, cfg.head_dim, cfg.rope_theta, x.device, x.dtype)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    return model.layers, (x.detach(), cos, sin, probe)


class Stack(torch.nn.Module):
    def __init__(self, layers) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x, cos, sin):
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def _loss(model, x, cos, sin, probe):
    return (model(x, cos, sin).float() * probe).sum()


def _run(rank: int, recorder: Recorder, *, fp8_gather: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch._dynamo.reset()
    layers, (x, cos, sin, probe) = _blocks()
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    for block in layers:
        llama.parallelize(block, mesh["tp"])
    model = Stack(layers)
    config = graphpass.Config(**BACKENDS["fp8"])
    wrapped = graphpass.fsdp_fp8_weights(model, config) if fp8_gather else None
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    backend = graphpass.backend(**BACKENDS["fp8"])
    from torch.distributed.tensor import Shard

    def placement(p):
        return Shard(1) if p is layers[0].get_parameter(DIM1) else None

    for block in layers:
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp, shard_placement_fn=placement)
        # static shapes: the second block's recompile would otherwise make the sizes dynamic
        block.compile(backend=backend, dynamic=False)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    if fp8_gather:
        graphpass.precompute_fsdp_fp8_scales(model)
    # data-parallel rank dp: batch row dp; tensor-parallel rank tp: sequence half tp
    local = [t[dp:dp + 1].chunk(TP, dim=1)[tp].contiguous() for t in (x, probe)]
    trained = train(model, lambda: _loss(model, local[0], cos, sin, local[1]), opt, recorder,
                    fp8_gather)
    return dict(trained, reports=_report_summary(backend.partitioner.reports),
                wrapped=None if wrapped is None else (wrapped.fp8, wrapped.kept),
                local_shapes={n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
                placements={n: str(p.placements) for n, p in model.named_parameters()})


def reference(out: str) -> None:
    """One process: the same block in bf16, compiled with the same backend, the whole batch,
    one step's loss (halved, as FSDP2 averages the two data-parallel ranks' gradients) and
    gradients; and the same in float32, uncompiled."""
    layers, (x, cos, sin, probe) = _blocks()
    results = {}
    for name, dtype, compiled in (("fp8", torch.bfloat16, True), ("fp32", torch.float32, False)):
        torch._dynamo.reset()
        model = Stack(layers).to(dtype) if dtype != torch.float32 else Stack(_blocks()[0])
        if compiled:
            backend = graphpass.backend(**BACKENDS["fp8"])
            for block in model.layers:
                block.compile(backend=backend, dynamic=False)
        loss = _loss(model, x.to(dtype), cos.to(dtype), sin.to(dtype), probe) / DP
        loss.backward()
        print(f"reference {name}: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s",
              flush=True)
        results[name] = dict(loss=loss.detach(),
                             grads={n: p.grad.float() for n, p in model.named_parameters()})
    torch.save(results, os.path.join(out, "fsdp_tp_ref.pt"))


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)  # the ranks sum in the same order
    print(f"imported: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s", flush=True)
    out = argv[0]
    if argv[1] == "ref":
        reference(out)
        return
    rank, world, store, also = int(argv[1]), int(argv[2]), argv[3], argv[4:]
    assert world == DP * TP, world
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    recorder = Recorder()
    try:
        results = {fp8: _run(rank, recorder, fp8_gather=fp8) for fp8 in (False, True)}
        torch.save(results, os.path.join(out, f"fsdp_tp-{rank}.pt"))
        print(f"fsdp2+tp: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s",
              flush=True)
        if "simple_fsdp_tp" in also:  # the same 4 processes: no second start and import
            from _simple_fsdp_tp_worker import simple_fsdp_tp

            simple_fsdp_tp(rank, out)
        if rank == world - 1 and "ref" in also:  # the reference in a rank's process, not a 5th
            reference(out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
