"""One rank of ``tests/test_simple_fsdp_tp_gloo.py``: torchtitan's SimpleFSDP over tensor and
sequence parallelism on a (dp=2, tp=2) gloo mesh.

    python tests/_simple_fsdp_tp_worker.py OUT_DIR RANK WORLD STORE    (4 ranks)

One tiny Llama block (``llama.build("tiny", layers=1)``, float32 parameters) made tensor- and
sequence-parallel over the ``tp`` mesh dimension (``llama.parallelize``, torchtitan's plan), then
SimpleFSDP's ``data_parallel(mode="fully_shard")`` on the ``dp`` dimension with torchtitan's
mixed-precision policy (bf16 compute, fp32 gradient reduction); the loss (the block's output
against a fixed random probe) and the block compiled whole with graphpass FP8 (tensorwise,
reference kernels, eager codegen); SGD for 3 steps. Data-parallel rank d trains on row d of the
batch, tensor-parallel rank t holds sequence half t. Two runs: with the weights' FP8 all-gather
(``fp8_weight_all_gather=True``) and without it (bf16 gathers, quantized after). A dispatch mode
records every functional collective the compiled steps call (op, dtype, shape, bytes out, and
whether its group is the ``dp`` or the ``tp`` one). Writes ``OUT_DIR/simple_fsdp_tp-<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.monotonic()  # each process prints its times (in the test's failure output)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import _common, llama  # noqa: E402

DP, TP = 2, 2
STEPS = 3
LR = 2e-3  # the loss is a sum: a larger step diverges
COLLECTIVES = ("all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor")


class Recorder(TorchDispatchMode):
    """Every functional collective called while it is on: (op, input dtype, input shape, output
    dtype, output bytes, the mesh dimension of its group), in call order."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # dynamo runs the compiled code under it

    def __init__(self, groups: dict[frozenset, str]) -> None:
        super().__init__()
        self.groups = groups  # the ranks of a group -> "dp" or "tp"
        self.names: dict[str, str] = {}  # group name -> "dp" or "tp"
        self.calls: list[tuple[str, str, tuple, str, int, str]] = []

    def _dim(self, group: str) -> str:
        """The mesh dimension of a group, by its ranks (a process that built another mesh of
        the same shape before, as tests/_gloo_fsdp_tp_fp8_worker.py's does, may have its DTensors
        on that mesh's groups)."""
        if group not in self.names:
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = frozenset(dist.get_process_group_ranks(_resolve_process_group(group)))
            self.names[group] = self.groups.get(ranks, group)
        return self.names[group]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            x, group = args[0], args[-1]
            self.calls.append((name, str(x.dtype).removeprefix("torch."), tuple(x.shape),
                               str(out.dtype).removeprefix("torch."),
                               out.numel() * out.element_size(), self._dim(group)))
        return out


class Loss(torch.nn.Module):
    """The block and its loss, one graph."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x, cos, sin, probe):
        return (self.block(x, cos, sin).float() * probe).sum()


def _run(mesh, fp8_gather: bool) -> dict:
    from torchtitan.experiments.graph_trainer import simple_fsdp
    from torchtitan.experiments.graph_trainer.simple_fsdp import (MixedPrecisionPolicy,
                                                                   data_parallel)

    torch._dynamo.reset()
    simple_fsdp._wrap_class_cache.clear()  # its classes keep the first wrapping's properties
    model, (x,) = llama.build("tiny", layers=1, dtype=torch.float32)
    cfg = model.config
    cos, sin = _common.rope_cos_sin(cfg.seq, cfg.head_dim, cfg.rope_theta, x.device,
                                    torch.bfloat16)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    block = llama.parallelize(model.layers[0], mesh["tp"])
    block = data_parallel(block, mesh["dp"], mode="fully_shard", mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    backend = graphpass.backend(fp8="tensorwise", kernels="reference", codegen="eager",
                                fp8_weight_all_gather=fp8_gather)
    step = torch.compile(Loss(block), backend=backend)
    # data-parallel rank dp: batch row dp; tensor-parallel rank tp: sequence half tp
    local = [t[dp:dp + 1].chunk(TP, dim=1)[tp].contiguous() for t in (x.detach(), probe)]
    local[0] = local[0].to(torch.bfloat16)  # SimpleFSDP does not cast the inputs
    groups = {frozenset(dist.get_process_group_ranks(mesh[d].get_group())): d
              for d in ("dp", "tp")}
    opt = torch.optim.SGD(block.parameters(), lr=LR, foreach=True)
    losses, grads, calls = [], [], []
    for i in range(STEPS):
        opt.zero_grad()
        recorder = Recorder(groups)
        if i:  # the first step compiles, unrecorded; the others run the compiled code
            with recorder:
                loss = step(local[0], cos, sin, local[1])
                loss.backward()
        else:
            loss = step(local[0], cos, sin, local[1])
            loss.backward()
        calls.append(recorder.calls)
        losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() for n, p in block.named_parameters()})
        opt.step()
        print(f"step {i} fp8={fp8_gather}: {time.monotonic() - T0:.1f} s, cpu "
              f"{time.process_time():.1f} s", flush=True)
    params = {n: p.full_tensor() for n, p in block.named_parameters()}
    (report,) = backend.partitioner.reports
    return dict(losses=losses, grads=grads, params=params, calls=calls,
                notes=list(report.notes),
                placements={n: str(p.placements) for n, p in block.named_parameters()})


def simple_fsdp_tp(rank: int, out: str) -> None:
    """Both runs on this rank of the initialized 4-rank process group (also called by
    ``tests/_gloo_fsdp_tp_fp8_worker.py``, whose processes run these runs after FSDP2's):
    writes ``OUT_DIR/simple_fsdp_tp-<rank>.pt``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    results = {name: _run(mesh, fp8) for name, fp8 in (("fp8", True), ("bf16", False))}
    torch.save(results, os.path.join(out, f"simple_fsdp_tp-{rank}.pt"))


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)  # the ranks sum in the same order
    print(f"imported: {time.monotonic() - T0:.1f} s", flush=True)
    out, rank, world, store = argv[0], int(argv[1]), int(argv[2]), argv[3]
    assert world == DP * TP, world
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        simple_fsdp_tp(rank, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
