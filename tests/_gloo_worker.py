"""One process of the multi-process tests in ``tests/test_distributed_gloo.py``.

    python tests/_gloo_worker.py SCENARIO[,SCENARIO...] OUT_DIR [RANK WORLD STORE]

Each rank is its own process (spawned by the test with a hard timeout); ranks meet through a
``FileStore`` in the test's ``tmp_path`` (no port to pick) and talk over gloo on the CPU. Every
rank writes what it measured to ``OUT_DIR/<scenario>-<rank>.pt``, the scenario's single-process
reference (``<scenario>_ref``, no process group) to ``OUT_DIR/<scenario>_ref.pt``; the test
compares. Several scenarios run in the same processes one after the other (``main``), the 2-rank
scenarios of the other gloo test files too (``fsdp_fp8``, ``simple_fsdp``, ``estimate``), and
the references in the ranks' processes once their collectives are done.
"""

from __future__ import annotations

import copy
import os
import sys
import time

T0 = time.monotonic()  # each process prints its times (in the test's failure output)

if __name__ == "__main__" and sys.argv[1] == "hang":
    # The harness's own test (tests/test_distributed_gloo.py): rank 1 says so and never joins;
    # rank 0 imports torch.distributed alone and waits in the rendezvous until the harness
    # kills both (neither needs graphpass: no 14 s import).
    if sys.argv[3] == "1":
        print("rank 1 never joins", flush=True)
        time.sleep(3600)
    import torch.distributed as dist

    print("rank 0 waits for rank 1", flush=True)
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[5]}", rank=0, world_size=2)
    sys.exit("rank 1 joined")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import _common, llama  # noqa: E402

WORLD = 2
STEPS = 3
LR = 0.5
BATCH = 2 * WORLD  # the global batch; each FSDP rank takes its BATCH // WORLD rows

# graphpass without FP8 and with FP8 (the reference kernels, exact on the CPU); eager codegen:
# Inductor's C++ compiles are not what these tests are about.
BACKENDS = {
    "bf16": dict(codegen="eager"),
    "fp8": dict(codegen="eager", fp8="tensorwise", kernels="reference"),
}


def _report_summary(reports):
    return [dict(rows=[(r.module, r.op, r.kind, tuple(r.shape), r.dtype, r.bytes) for r in rep.rows],
                 notes=list(rep.notes), activation_bytes=rep.activation_bytes) for rep in reports]


# --- FSDP2 ----------------------------------------------------------------------------------


def _fsdp_model(dtype):
    """The tiny Llama language model (2 blocks, vocabulary 256), its token ids and targets."""
    model, (tokens,) = llama.build("tiny_lm", layers=2, batch=BATCH, dtype=dtype)
    targets = torch.randint(0, 256, tokens.shape, generator=torch.Generator().manual_seed(1))
    return model, (tokens, targets)


def _loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).float().flatten(0, 1), targets.flatten())


def fsdp(rank: int, out: str) -> None:
    results = {mode: _fsdp(mode, rank) for mode in BACKENDS}
    results["whole_model"] = _fsdp_whole_model(rank)
    torch.save(results, os.path.join(out, f"fsdp-{rank}.pt"))


def _fsdp_whole_model(rank: int) -> dict:
    """``torch.compile(model)`` of the FSDP2 model as a whole, FP8: dynamo breaks the graph at
    FSDP's hooks and compiles each block's forward, one graph shared by both blocks. Counted with
    the profiler: the graphpass FP8 GEMMs every block runs in the second step (after compiling)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    model, x = _fsdp_model(torch.bfloat16)
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    backend = graphpass.backend(**BACKENDS["fp8"])
    compiled = torch.compile(model, backend=backend)
    local = [t.chunk(WORLD)[rank] for t in x]
    losses, gemms = [], []
    for _ in range(2):
        with torch.profiler.profile() as prof:
            loss = _loss(compiled, local)
            loss.backward()
        losses.append(loss.detach())
        gemms.append(sum(e.name == "graphpass::fp8_gemm" for e in prof.events()))
    reports = list(backend.partitioner.reports)  # the graphs compiled so far
    return dict(losses=losses, fp8_gemms=gemms, reports=_report_summary(reports))


def _fsdp(mode: str, rank: int) -> dict:
    """FSDP2 over both ranks, each block sharded and compiled per block, SGD for STEPS steps;
    rank r trains on rows [r * BATCH/WORLD, (r+1) * BATCH/WORLD) of the global batch."""
    torch._dynamo.reset()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, x = _fsdp_model(torch.bfloat16)
    mesh = init_device_mesh("cpu", (WORLD,))
    backend = graphpass.backend(**BACKENDS[mode])
    for block in model.layers:
        fully_shard(block, mesh=mesh)
        block.compile(backend=backend)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    local = [t.chunk(WORLD)[rank] for t in x]
    losses, grads = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, local)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
    reports = list(backend.partitioner.reports)  # the graphs compiled so far
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return dict(losses=losses, grads=grads, params=params, reports=_report_summary(reports))


def fsdp_ref(out: str) -> None:
    torch.save({mode: _fsdp_ref(mode) for mode in BACKENDS}, os.path.join(out, "fsdp_ref.pt"))


def _fsdp_ref(mode: str) -> dict:
    """The same model in one process, compiled per block with the same backend: the loss and
    gradient of each rank's rows separately, their gradients averaged as FSDP2 reduces them
    (a sum of two in the parameter dtype, then / 2, exact), and SGD on the full parameters. Then
    the same from the same start on the whole batch at once, and uncompiled in float32."""
    torch._dynamo.reset()
    model, x = _fsdp_model(torch.bfloat16)
    backend = graphpass.backend(**BACKENDS[mode])
    for block in model.layers:
        block.compile(backend=backend)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, grads = [], []
    for _ in range(STEPS):
        per_rank, step_losses = [], []
        for local in zip(*(t.chunk(WORLD) for t in x)):
            opt.zero_grad()
            loss = _loss(model, local)
            loss.backward()
            step_losses.append(loss.detach())
            per_rank.append({n: p.grad.clone() for n, p in model.named_parameters()})
        losses.append(step_losses)
        avg = {n: (per_rank[0][n] + per_rank[1][n]) / WORLD for n in per_rank[0]}
        for n, p in model.named_parameters():
            p.grad = avg[n].clone()
        grads.append(avg)
        opt.step()
    reports = list(backend.partitioner.reports)  # the graphs compiled so far
    params = {n: p.detach().clone() for n, p in model.named_parameters()}

    def whole_batch(dtype, compiled: bool):
        m, _ = _fsdp_model(dtype)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(start[n])
        if compiled:
            for block in m.layers:
                block.compile(backend=backend)
        loss = _loss(m, x)
        loss.backward()
        return loss.detach(), {n: p.grad.float() for n, p in m.named_parameters()}

    torch._dynamo.reset()
    whole = whole_batch(torch.bfloat16, True)
    fp32 = whole_batch(torch.float32, False)
    return dict(losses=losses, grads=grads, params=params, reports=_report_summary(reports),
                whole=whole, fp32=fp32)


# --- tensor + sequence parallel -------------------------------------------------------------

# Memory passes on the sharded block: each variant's gradients must be bit-identical to the
# unoptimised plan's (torch's default min-cut, FP8 copies saved, nothing recomputed).
PLANS = {
    "unoptimised": dict(memory="default", save_original="never"),
    # the same without the FP8 all-gather (passes/fp8_all_gather.py): the bf16 sequence is
    # gathered and quantized after; outputs and gradients must be the same bits
    "bf16_gather": dict(memory="default", save_original="never", fp8_sequence_all_gather=False),
    "planner": dict(memory="auto", save_original="always", recompute=("layernorm", "act")),
    "mlp": dict(memory="auto", recompute=("mlp",)),
}


def _tp_probe(dtype):
    """A fixed random projection of the block's output: the loss is <out, probe>, so every
    output element gets a gradient of its own (no cancellation as in a squared norm)."""
    cfg = llama.SIZES["tiny"]
    return torch.randn(cfg.batch, cfg.seq, cfg.hidden,
                       generator=torch.Generator().manual_seed(2)).to(dtype)


def _tp_step(block, x, cos, sin, probe):
    out = block(x, cos, sin)
    loss = (out.float() * probe.float()).sum()
    loss.backward()
    return out.detach()


def _grads(block):
    from graphpass._compat import is_dtensor

    return {n: (p.grad.full_tensor() if is_dtensor(p.grad) else p.grad).detach().clone()
            for n, p in block.named_parameters()}


def tp(rank: int, out: str) -> None:
    """One Llama block, TP+SP over both ranks (torchtitan's plan, ``llama.build_tp``), compiled
    with graphpass FP8 under each memory plan in PLANS."""
    dtype = torch.bfloat16
    probe = _tp_probe(dtype).chunk(WORLD, dim=1)[rank]
    results = {}
    for plan, options in PLANS.items():
        torch._dynamo.reset()
        block, (x, cos, sin) = llama.build_tp("tiny", tp=WORLD, dtype=dtype)
        backend = graphpass.backend(**BACKENDS["fp8"], **options)
        compiled = torch.compile(block, backend=backend)
        y = _tp_step(compiled, x, cos, sin, probe)
        reports = list(backend.partitioner.reports)  # the graphs compiled so far
        results[plan] = dict(out=y, x_grad=x.grad.clone(), grads=_grads(block),
                             reports=_report_summary(reports))
    torch.save(results, os.path.join(out, f"tp-{rank}.pt"))


def tp_ref(out: str) -> None:
    """The same block unsharded in one process: compiled with the same FP8 backend, and the
    same weights and input in float32, uncompiled. (Copied, not rebuilt in float32: on torch
    2.11 the tiny model's initialisation draws differently per dtype.)"""
    model, (x,) = llama.build("tiny", layers=1, dtype=torch.bfloat16)
    cfg = model.config
    results = {}
    for name, block, dtype, options in (
            ("fp8", model.layers[0], torch.bfloat16, BACKENDS["fp8"]),
            ("fp32", copy.deepcopy(model.layers[0]).float(), torch.float32, None)):
        torch._dynamo.reset()
        cos, sin = _common.rope_cos_sin(cfg.seq, cfg.head_dim, cfg.rope_theta, x.device, dtype)
        x_in = x.detach().to(dtype).requires_grad_()
        run = torch.compile(block, backend=graphpass.backend(**options)) if options else block
        y = _tp_step(run, x_in, cos, sin, _tp_probe(torch.bfloat16))  # one probe for both
        results[name] = dict(out=y, x_grad=x_in.grad.clone(), grads=_grads(block))
    torch.save(results, os.path.join(out, "tp_ref.pt"))


# --- entry point ----------------------------------------------------------------------------


# The 2-rank scenarios of the other gloo test files: one launch runs every 2-rank scenario a
# session needs in the same 2 processes (``tests/test_distributed_gloo.py``'s ``two_ranks``), as
# a process's start and import of torch and graphpass costs about 14 s of CPU and its first
# compile's imports a few more. ``estimate`` patches torch.distributed for good: it runs last.


def fsdp_fp8(rank: int, out: str) -> None:
    from _gloo_fsdp_fp8_worker import fsdp_fp8 as run

    run(rank, out)


def simple_fsdp(rank: int, out: str) -> None:
    from _simple_fsdp_worker import simple_fsdp as run

    run(rank, WORLD, out)


def estimate(rank: int, out: str, cases: list[str]) -> None:
    from _estimate_worker import estimate as run

    run(rank, WORLD, out, cases)


def _scenarios(rank: int, out: str, scenarios: list[str]) -> None:
    """The collective scenarios in order; then the references (``<scenario>_ref``, one process
    each: shared out between the ranks, which run them at once); ``estimate:CASE+CASE`` last."""
    refs = [s for s in scenarios if s.endswith("_ref")]
    last = [s for s in scenarios if s.startswith("estimate")]
    for scenario in [s for s in scenarios if s not in refs and s not in last]:
        globals()[scenario](rank, out)
        print(f"{scenario}: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s",
              flush=True)
    for scenario in refs[rank::WORLD]:
        globals()[scenario](out)
        print(f"{scenario}: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s",
              flush=True)
    for scenario in last:
        estimate(rank, out, [c for c in scenario.partition(":")[2].split("+") if c])
        print(f"{scenario}: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s",
              flush=True)


def main(argv: list[str]) -> None:
    """``SCENARIO`` may be a comma-separated list (``_scenarios``)."""
    scenarios, out = argv[0].split(","), argv[1]
    # One thread in every process: the ranks and the reference then sum in the same order.
    torch.set_num_threads(1)
    print(f"imported: {time.monotonic() - T0:.1f} s, cpu {time.process_time():.1f} s", flush=True)
    if len(argv) == 2:  # a reference alone, no process group
        for scenario in scenarios:
            globals()[scenario](out)
        return
    rank, world, store = int(argv[2]), int(argv[3]), argv[4]
    assert world == WORLD, world
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _scenarios(rank, out, scenarios)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
