"""MoE experts in FP8 next to bf16, in one run: the shapes of expert-parallel training, the
DeepSeek-V3 layer, a kernel profile of each FP8 step, and PASS/FAIL lines for the targets.

    PYTHONPATH=. python benchmarks/experts_fp8.py                 # on an H100, a few minutes
    PYTHONPATH=. python benchmarks/experts_fp8.py --dry-run       # CPU, tiny sizes, ~1 min

Cases: the ``experts`` model (benchmarks/_experts.py: 16 DeepSeek-V3-shaped SwiGLU experts,
``torch._grouped_mm`` with offsets) over 8,192 and over 32,768 routed tokens (512 and 2,048 per
expert: one rank of EP=16), and one DeepSeek-V3 layer (graphpass/models/deepseek.py: 256 ``bmm`` experts,
seq 4096). Configs: graphpass bf16 (the experts on bf16 ``_grouped_mm`` / ``bmm``), FP8
``rowwise``, FP8 ``tensorwise`` with ``fp8_format="e4m3"`` (every expert GEMM one grouped kernel,
as rowwise) and FP8 ``tensorwise`` in its default HYBRID format (E5M2 gradients: dgrad and wgrad
one GEMM per expert), all on ``kernels="scaled_mm"``; speedups are against the bf16 row of the
same run. The FP8 ``rowwise`` row is what a user gets: the FP8 cost model keeps expert GEMMs
that read their weights in bf16 (its note in the report; the row's note gives the FP8 share of
the GEMM FLOPs); every other FP8 row lowers every GEMM (``fp8_cost_model="off"``). Rows a
``--configs`` filter runs only where it names them: ``every GEMM`` (the rowwise row so), the
token quantizes left to Inductor, every GEMM's accumulation fast, ``fp8_weight_once`` (each
expert weight quantized once a step, dgrad's copy held through the backward) and the CUDA-graph
rows. Each FP8 step is then profiled (``torch.profiler``): its kernel time, the GEMM
share, the GEMM launches and device copies per step (a per-expert loop shows as at least one
GEMM launch per expert, judged; its copies are reported beside), its top kernels, and the host
time of graphpass's graph ops (their CPU time under the profiler, with the allocations and
kernel launches they make: where it approaches the kernel time, the step waits on the host).
Where a ``CUDA graphs`` row is picked, bf16 and FP8 rowwise run again under Inductor's CUDA
graphs (``triton.cudagraphs``), the FP8 row against that bf16 row: the step without its launch
gaps.

``--dry-run`` runs the same code on the CPU at tiny sizes with Inductor replaced by eager code
generation, so the script cannot rot between GPU runs; its numbers are CPU numbers, it counts
graph ops instead of kernels (FP8 GEMM ops and ``_scaled_mm`` calls; ``index_copy_`` as copies),
and it judges no target. ``--cases`` picks some of ``experts_8k experts_32k deepseek``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import graphpass  # noqa: E402
from graphpass.backend import Backend  # noqa: E402
from _harness import (CUDAGRAPHS, GRAPHS, Result, cuda_graphs, is_gemm, measure, picked,  # noqa: E402
                      reason, step_ms)

# The speed targets: FP8 rowwise against bf16 in the same run.
TARGETS = {"experts, 32,768 tokens": 1.30, "experts, 8,192 tokens": 1.0, "DeepSeek-V3 layer": 0.9}
# ... and with 4 micro-batches per optimizer step and the weight cache, ms per micro-batch
TARGETS_ACCUMULATING = {"experts, 8,192 tokens": 1.15, "DeepSeek-V3 layer": 1.10}
ACCUMULATING = 4
ACCUMULATING_OPTIONS = {"fp8_weight_cache": True, "fp8_cost_model": "off"}
ACCUMULATING_LABEL = "weight cache, every GEMM"


@dataclass
class Case:
    key: str
    label: str
    module: str  # benchmarks/_experts or graphpass.models.deepseek
    size: str
    experts: int


CASE_KEYS = ("experts_8k", "experts_32k", "deepseek")


def cases(dry_run: bool, keys: list[str] | tuple[str, ...] = CASE_KEYS) -> list[Case]:
    tiny = "tiny" if dry_run else None
    every = [Case("experts_8k", "experts, 8,192 tokens", "_experts", tiny or "real", 4 if tiny else 16),
             Case("experts_32k", "experts, 32,768 tokens", "_experts", tiny or "real_32k",
                  4 if tiny else 16),
             Case("deepseek", "DeepSeek-V3 layer", "graphpass.models.deepseek", tiny or "real",
                  8 if tiny else 256)]
    return [c for c in every if c.key in keys]


INDUCTOR_TOKENS = "inductor_token_quantize"  # a benchmark switch, not a graphpass option
# Rows a --configs filter runs only where it names them: the launch-gap rows, the Inductor
# token quantize row (what the Triton kernels gain: measured, 1.5x to 2x on an H200), the
# fast-accumulation row and the row that lowers every GEMM whatever the cost model says
INDUCTOR_TOKEN_ROW = "Inductor token quantize"
FAST_ACCUMULATION = "fast accumulation"  # torchao's accumulation: opt-in, like for like
WEIGHT_ONCE = "weight once"  # fp8_weight_once: a memory decision, opt-in
EVERY_GEMM = "every GEMM"  # fp8_cost_model="off": the FP8 kernels where the default keeps bf16
OPT_IN = (GRAPHS, INDUCTOR_TOKEN_ROW, FAST_ACCUMULATION, WEIGHT_ONCE, EVERY_GEMM)
# The default row is what a user gets: the cost model (graphpass/fp8/cost.py) keeps in bf16 the
# expert GEMMs an H100's roofline estimates faster there (weight-bound experts quantized every
# step: the DeepSeek-V3 layer's, the 8,192-token experts'). Every other FP8 row measures FP8
# kernels and lowers every GEMM (ALL_FP8), the "every GEMM" row the default's options so.
ALL_FP8 = {"fp8_cost_model": "off"}
ROWWISE_OPTIONS = {"fp8": "rowwise", "kernels": "scaled_mm"}
ROWWISE_ALL = {**ROWWISE_OPTIONS, **ALL_FP8}
CONFIGS: list[tuple[str, dict[str, object]]] = [
    ("bf16", {"fp8": None}),
    ("FP8 rowwise/scaled_mm", ROWWISE_OPTIONS),
    (f"FP8 rowwise/scaled_mm, {EVERY_GEMM}", ROWWISE_ALL),
    # the same with the token-grouped quantizes left to Inductor's fusion of the recipe instead
    # of graphpass's Triton kernels (triton_grouped.py): what the kernels gain, in one run
    (f"FP8 rowwise/scaled_mm, {INDUCTOR_TOKEN_ROW}",
     {**ROWWISE_ALL, INDUCTOR_TOKENS: True}),
    # every GEMM with fast accumulation, as torchao's MoE training runs them (graphpass's
    # default is Transformer Engine's: fast for the forward GEMM, precise for dgrad and wgrad)
    (f"FP8 rowwise/scaled_mm, {FAST_ACCUMULATION}",
     {**ROWWISE_ALL, "fp8_accumulate": "fast"}),
    # each expert weight's two FP8 copies from one read in the forward, dgrad's kept for the
    # backward (fp8_weight_once, Transformer Engine's default): the backward's amax and cast
    # passes over the weights go, for 1 byte a weight element held through the step
    (f"FP8 rowwise/scaled_mm, {WEIGHT_ONCE}",
     {**ROWWISE_ALL, "fp8_weight_once": True}),
    ("FP8 tensorwise e4m3/scaled_mm", {"fp8": "tensorwise", "fp8_format": "e4m3",
                                       "kernels": "scaled_mm", **ALL_FP8}),
    ("FP8 tensorwise/scaled_mm", {"fp8": "tensorwise", "kernels": "scaled_mm", **ALL_FP8}),
    # the peer: torchao's MoE FP8 training (rowwise, its own Triton quantize kernels) on the
    # experts' _grouped_mm weights, under torch.compile's default Inductor
    ("torchao MoE FP8 rowwise", {"torchao_moe": True}),
    # launch gaps: bf16 and FP8 rowwise again under Inductor's CUDA graphs, the FP8 row judged
    # against the bf16 one above it (a --configs filter runs them where it says "CUDA graphs")
    ("bf16, CUDA graphs", {"fp8": None, CUDAGRAPHS: True}),
    ("FP8 rowwise/scaled_mm, CUDA graphs", {**ROWWISE_ALL, CUDAGRAPHS: True}),
]
# The configs whose expert GEMMs are one grouped kernel each: judged for a per-expert loop.
ROWWISE, TORCHAO = "FP8 rowwise/scaled_mm", "torchao MoE FP8 rowwise"
ROWWISE_EVERY = f"{ROWWISE}, {EVERY_GEMM}"
GROUPED = {ROWWISE_EVERY: "FP8 rowwise", "FP8 tensorwise e4m3/scaled_mm": "FP8 tensorwise e4m3"}


@dataclass
class Profile:
    kernel_ms: float
    gemm_ms: float
    gemm_launches: float  # per step
    copies: float  # per step
    top: list[tuple[float, float, str]]  # (ms per step, calls per step, name)
    # graphpass's graph ops on the host (CUDA): (ms per step, calls per step, op), their CPU
    # time under the profiler with what they call (allocations, kernel launches)
    host: list[tuple[float, float, str]] = field(default_factory=list)

    @property
    def host_ms(self) -> float:
        return sum(ms for ms, _, _ in self.host)


def kernel_events(averages) -> list:
    """The kernels of a profile recorded with CPU and CUDA activity: its device-side events.
    A CPU op's self device time is that of the kernels it launched itself (a Triton launch
    inside ``graphpass::quantize``, CUTLASS inside ``aten::_scaled_grouped_mm``): counting
    those ops too would count their kernels twice."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in averages if e.device_type == cuda and e.self_device_time_total > 0]


def profile(step, steps: int, device: torch.device, top: int = 12) -> Profile:
    """Kernel time and counts of ``steps`` calls of ``step`` (CUDA); on the CPU the graph ops'
    counts: FP8 GEMM ops and per-group ``_scaled_mm`` calls as GEMM launches, copies as copies."""
    cuda = device.type == "cuda"
    cpu = torch.profiler.ProfilerActivity.CPU
    activities = [cpu, torch.profiler.ProfilerActivity.CUDA] if cuda else [cpu]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    averages = prof.key_averages()
    if cuda:
        events = kernel_events(averages)
        time = lambda e: e.self_device_time_total  # noqa: E731
        gemm = [e for e in events if is_gemm(e.key)]
        # copies as kernels: ATen's copy kernels and memcpys (a per-expert loop's writes of each
        # expert's output into the whole); Inductor's fused kernels named after _to_copy are not
        copies = [e for e in events if not e.key.startswith("triton") and any(
            k in e.key.lower() for k in ("direct_copy", "batchedcopy", "memcpy"))]
    else:
        events = [e for e in averages if e.self_cpu_time_total > 0]
        time = lambda e: e.self_cpu_time_total  # noqa: E731
        # the CPU emulation of the grouped kernel loops over groups in aten::mm: count the graph's
        # FP8 GEMM ops and torch._scaled_mm calls (a per-group loop's) instead
        gemm = [e for e in events if e.key in ("graphpass::fp8_gemm", "aten::_scaled_mm")]
        copies = [e for e in events if e.key == "aten::index_copy_"]
    host = sorted(((e.cpu_time_total / steps / 1e3, e.count / steps, e.key)
                   for e in averages if cuda and e.key.startswith("graphpass::")),
                  reverse=True)
    events.sort(key=time, reverse=True)
    total = sum(time(e) for e in events) / steps / 1e3
    return Profile(total, sum(time(e) for e in gemm) / steps / 1e3,
                   sum(e.count for e in gemm) / steps, sum(e.count for e in copies) / steps,
                   [(time(e) / steps / 1e3, e.count / steps, e.key[:100]) for e in events[:top]],
                   host)


def run(case: Case, options: dict[str, object], device: torch.device, codegen: str, steps: int,
        warmup: int, with_profile: bool, micro: int = 1) -> tuple[Result, Profile | None]:
    if options.get(INDUCTOR_TOKENS) and case.module != "_experts":
        return Result(case.label, "", note="skipped: no token-grouped GEMMs in this model"), None
    options, graphs = cuda_graphs(options)
    with contextlib.ExitStack() as stack:
        stack.enter_context(graphs)
        if options.pop(INDUCTOR_TOKENS, False):
            stack.enter_context(mock.patch.object(graphpass.fp8.ops, "uses_triton_group_kernel",
                                                  lambda *args: False))
            # the compiled graphs differ by that switch alone, which no cache key sees: a
            # cached graph of the kernels' config would come back (on an H200 it did, its
            # quantizes then run as eager torch code)
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        return _run(case, options, device, codegen, steps, warmup, with_profile, micro)


def _run(case: Case, options: dict[str, object], device: torch.device, codegen: str,
         steps: int, warmup: int, with_profile: bool, micro: int
         ) -> tuple[Result, Profile | None]:
    result = Result(case.label, "")
    if micro > 1 and options.get("fp8") and not options.get("torchao_moe"):
        # what the cost model's note tells a user who accumulates: the weight cache, and every
        # GEMM lowered (the cost model counts a weight's quantize every micro-batch)
        options.update(ACCUMULATING_OPTIONS)
    torch._dynamo.reset()
    model, inputs = importlib.import_module(case.module).build(
        case.size, layers=1, device=device, dtype=torch.bfloat16)
    if options.get("torchao_moe"):
        backend, note = _torchao_moe(model, case, device)
        if note:
            result.note = f"skipped: {note}"
            return result, None
    else:
        try:
            backend = graphpass.backend(codegen=codegen, **options)
        except ValueError as e:
            result.note = f"skipped: {reason(e)}"
            return result, None
    compiled = torch.compile(model, backend=backend)
    if micro > 1:
        return _fp8_share(_accumulating(result, model, inputs, compiled, steps, warmup, micro),
                          backend), None
    measure(result, model, inputs, compiled, device, steps, warmup)
    _fp8_share(result, backend)
    if not with_profile or result.ms is None:
        return result, None
    grad: list[torch.Tensor] = []

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        out = compiled(*inputs)
        grad[:] = grad or [torch.ones_like(out)]
        out.backward(grad[0])

    try:
        return result, profile(step, max(1, min(steps, 3)), device)
    except Exception as e:  # a profiler failure leaves the timing standing
        result.note = f"profile failed: {reason(e)}"
        return result, None


def _fp8_share(result: Result, backend: object) -> Result:
    """``result`` with the FP8 share of the step's GEMM FLOPs in its note, where graphpass
    compiled it with FP8 on: what the cost model kept in bf16 shows there (the report's notes
    say which GEMMs and why)."""
    report = backend.report() if isinstance(backend, Backend) else None
    share = report.meta.get("fp8_coverage", {}).get("fp8_share") if report else None
    if share is not None and backend.config.recipe is not None:
        result.note = "; ".join(filter(None, [f"FP8 GEMM FLOPs {share:.0%}", result.note]))
        result.fp8_share = share
    return result


def _accumulating(result: Result, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                  compiled, steps: int, warmup: int, micro: int) -> Result:
    """Gradient accumulation: ``micro`` forward+backward passes per optimizer step, the median
    optimizer step's time over ``micro`` in ``result.ms`` (per micro-batch). The optimizer step
    itself is each parameter's version counter bumped, as its in-place update would (so the
    weight cache quantizes again), without the update's own time, the same for every config;
    the note gives the weight quantizes per optimizer step the cache counted."""
    params = list(model.parameters())
    grad: list[torch.Tensor] = []
    calls = [0]  # optimizer steps run after the warm-up

    def step() -> None:
        calls[0] += 1
        for p in params:
            p.grad = None
        for _ in range(micro):
            out = compiled(*inputs)
            grad[:] = grad or [torch.ones_like(out)]
            out.backward(grad[0])
        torch._C._autograd._unsafe_set_version_counter(
            tuple(params), tuple(p._version + 1 for p in params))

    try:
        for _ in range(warmup):
            step()
        graphpass.clear_weight_cache()
        calls[0] = 0
        result.ms = step_ms(step, steps) / micro
        stats = graphpass.weight_cache_stats()
        if stats.quantized:
            result.note = (f"weight cache: {stats.quantized / calls[0]:g} quantizes and "
                           f"{stats.reused / calls[0]:g} reuses per optimizer step")
    except Exception as e:  # an out-of-memory, a kernel error
        result.note = f"failed: {reason(e)}"
    return result


def _torchao_moe(model: torch.nn.Module, case: Case,
                 device: torch.device) -> tuple[object, str | None]:
    """Converts ``model``'s expert weights to torchao's FP8 rowwise MoE training tensors: the
    backend to compile with, or why it cannot run here."""
    if case.module != "_experts":
        return None, "torchao's MoE training converts torch._grouped_mm weights only"
    if device.type != "cuda":
        return None, "torchao's MoE FP8 kernels need CUDA"
    try:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_
    except Exception as e:  # not installed, or built for another torch
        return None, f"torchao.prototype.moe_training not importable ({reason(e)})"
    quantize_(model, Float8TrainingOpConfig(),
              filter_fn=lambda module, fqn: fqn.endswith("experts"))
    return "inductor", None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny sizes, eager code generation: checks the script, judges "
                             "nothing")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (median shown)")
    parser.add_argument("--cases", nargs="+", default=list(CASE_KEYS), choices=CASE_KEYS)
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[1, 4],
                        help="micro-batches per optimizer step (gradient accumulation); above 1, "
                             "bf16 against FP8 rowwise with fp8_weight_cache and every GEMM in "
                             "FP8, ms per micro-batch")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--tiles", type=Path, default=None,
                        help="the quantize kernels' tile configurations to run with: the JSON "
                             "`quantize_kernels.py --sweep --best-out` writes")
    parser.add_argument("--configs", nargs="+",
                        help="only the configs whose label contains one of these (bf16, the "
                             "baseline, always runs)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("experts_fp8.py: no CUDA device; run it on the GPU machine, or use "
                         "--dry-run to check the script on the CPU")
    device = torch.device("cpu" if args.dry_run else "cuda")
    tiles = use_tiles(args.tiles) if args.tiles else ""
    codegen = "eager" if args.dry_run else "inductor"
    steps, warmup = (args.steps or 1, 1) if args.dry_run else (args.steps or 10, 3)
    where = ("DRY RUN on CPU: tiny sizes, eager codegen; NOT GPU numbers" if args.dry_run
             else f"GPU: {torch.cuda.get_device_name(device)}")
    lines = [f"# MoE experts: FP8 against bf16", "",
             f"{where}; torch {torch.__version__}; one training step (fw+bw), median of {steps} "
             f"steps after {warmup} warm-up; speedup = bf16 median / this median, same run."
             + (f" Quantize kernels' tiles: {tiles}." if tiles else ""), "",
             "## Step time", "",
             "| case | config | median ms | vs bf16 | step peak MiB | kernel ms | GEMM ms "
             "| GEMM launches/step | copies/step | graphpass ops' host ms | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    speedups: dict[tuple[str, str], float] = {}
    profiles: dict[tuple[str, str], Profile] = {}
    peaks: dict[tuple[str, str], int] = {}
    shares: dict[tuple[str, str], float] = {}  # FP8 GEMM FLOPs over all, where FP8 was on

    def measured(key: tuple[str, str]) -> str:
        got, share = speedups.get(key), shares.get(key)
        return "not measured" if got is None else f"{got:.2f}x" + (
            "" if share is None else f", FP8 GEMM FLOPs {share:.0%}")
    for case in cases(args.dry_run, args.cases):
        for micro in args.micro_batches:
            baseline = None
            for label, options in CONFIGS:
                if label != "bf16" and not picked(label, args.configs, OPT_IN):
                    continue
                if micro > 1 and label != "bf16" and label != ROWWISE:
                    continue  # accumulation: bf16 against rowwise with the weight cache
                result, prof = run(case, options, device, codegen, steps, warmup,
                                   with_profile=(options.get("fp8") is not None
                                                 or bool(options.get("torchao_moe")))
                                   and not options.get(CUDAGRAPHS), micro=micro)
                if micro > 1:
                    label = f"{label}, {micro} micro-batches" + (
                        f", {ACCUMULATING_LABEL}" if options.get("fp8") else "")
                if label == "bf16" or label.startswith("bf16,"):
                    baseline = result.ms
                speedup = baseline / result.ms if baseline and result.ms else None
                if speedup is not None:
                    speedups[(case.label, label)] = speedup
                if prof is not None:
                    profiles[(case.label, label)] = prof
                if result.step_peak_bytes:
                    peaks[(case.label, label)] = result.step_peak_bytes
                if result.fp8_share is not None:
                    shares[(case.label, label)] = result.fp8_share
                cells = [case.label, label, f"{result.ms:.2f}" if result.ms else "-",
                         f"{speedup:.2f}x" if speedup else "-",
                         f"{result.step_peak_bytes / 2**20:.1f}" if result.step_peak_bytes
                         else "-",
                         *(([f"{prof.kernel_ms:.2f}", f"{prof.gemm_ms:.2f}",
                             f"{prof.gemm_launches:g}", f"{prof.copies:g}",
                             f"{prof.host_ms:.2f}" if prof.host else "-"]) if prof
                           else ["-"] * 5), result.note]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
                if prof is not None:  # in the log at once: a stage cut by its timeout keeps it
                    print("\n".join(f"    {ms:.3f} ms/step, {calls:g} calls: {name}"
                                     for ms, calls, name in prof.top), flush=True)
                    print("\n".join(f"    host {ms:.3f} ms/step, {calls:g} calls: {name}"
                                     for ms, calls, name in prof.host), flush=True)
    lines += ["", "## Top kernels of the FP8 rowwise steps", ""]
    for case, config in ((c, k) for c in cases(args.dry_run, args.cases)
                         for k in (ROWWISE, ROWWISE_EVERY)):
        prof = profiles.get((case.label, config))
        if prof is None:
            continue
        lines += [f"{case.label}, {config}: {prof.kernel_ms:.2f} ms of "
                  f"{'ops' if args.dry_run else 'kernels'} per step, GEMM {prof.gemm_ms:.2f} ms",
                  "", "| ms/step | calls/step | kernel |", "|---|---|---|"]
        lines += [f"| {ms:.3f} | {calls:g} | `{name}` |" for ms, calls, name in prof.top]
        lines.append("")
    lines += ["## Targets", ""]
    for case in cases(args.dry_run, args.cases):
        got = speedups.get((case.label, ROWWISE))
        target = TARGETS[case.label]
        line = f"- {case.label}: FP8 rowwise >= {target}x bf16"
        lines.append(_judged(line, None if got is None else got >= target,
                             measured((case.label, ROWWISE)), args.dry_run))
        if case.label in TARGETS_ACCUMULATING and ACCUMULATING in args.micro_batches:
            key = (case.label, f"{ROWWISE}, {ACCUMULATING} micro-batches, {ACCUMULATING_LABEL}")
            got = speedups.get(key)
            target = TARGETS_ACCUMULATING[case.label]
            line = (f"- {case.label}: FP8 rowwise with {ACCUMULATING} micro-batches and the "
                    f"weight cache >= {target}x bf16 with {ACCUMULATING}")
            lines.append(_judged(line, None if got is None else got >= target, measured(key),
                                 args.dry_run))
        peer = speedups.get((case.label, TORCHAO))
        if peer is not None:
            got = speedups.get((case.label, ROWWISE))
            line = f"- {case.label}: FP8 rowwise faster than torchao's MoE FP8 training"
            lines.append(_judged(line, None if got is None else got > peer,
                                 f"{got or 0:.2f}x against {peer:.2f}x bf16", args.dry_run))
        if case.module == "graphpass.models.deepseek":
            fp8, bf16 = peaks.get((case.label, ROWWISE)), peaks.get((case.label, "bf16"))
            line = f"- {case.label}: FP8 rowwise step peak <= bf16's (no weight cache)"
            ok = None if fp8 is None or bf16 is None else fp8 <= bf16
            detail = ("not measured" if ok is None else
                      f"{fp8 / 2**20:.1f} MiB against {bf16 / 2**20:.1f} MiB")
            lines.append(_judged(line, ok, detail, args.dry_run))
        for config, name in GROUPED.items():
            if config == ROWWISE_EVERY and not picked(config, args.configs, OPT_IN):
                config = ROWWISE  # the default row (its expert GEMMs may be bf16)
            if not picked(config, args.configs, OPT_IN):
                continue
            prof = profiles.get((case.label, config))
            # A per-expert loop launches a GEMM per expert for each GEMM it loops over; its
            # slicing copies come with it. Copies alone are no loop: the tensorwise e4m3 step
            # made 18 a step (16 experts) with its 12 grouped GEMM launches on an H200.
            line = (f"- {case.label}: no per-expert loop in the {name} step (GEMM launches per "
                    f"step < {case.experts} experts)")
            ok = None if prof is None else prof.gemm_launches < case.experts
            detail = ("not profiled" if prof is None else
                      f"{prof.gemm_launches:g} GEMM launches, {prof.copies:g} copies per step")
            lines.append(_judged(line, ok, detail, args.dry_run))
    text = "\n".join(lines) + "\n"
    print("\n".join(lines[lines.index("## Top kernels of the FP8 rowwise steps"):]))
    if args.out:
        args.out.write_text(text)
    return 0


def use_tiles(path: Path) -> str:
    """Makes the tile configurations in ``path`` (``{"experts": {...}, "grouped": {...}}``,
    changes to ``triton_quantize.KernelConfig`` and ``triton_grouped.GroupedKernelConfig``) the
    kernels' defaults for this run; says which."""
    from graphpass.fp8 import triton_grouped, triton_quantize

    changes = json.loads(path.read_text())
    unknown = set(changes) - {"experts", "grouped"}
    if unknown:
        raise SystemExit(f"experts_fp8.py --tiles: unknown kernel families {sorted(unknown)}")

    def config(cls, change: dict):
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in change.items()})

    triton_quantize.DEFAULT_CONFIG = config(triton_quantize.KernelConfig,
                                            changes.get("experts", {}))
    triton_grouped.DEFAULT_CONFIG = config(triton_grouped.GroupedKernelConfig,
                                           changes.get("grouped", {}))
    return f"expert weights {changes.get('experts') or 'default'}, token groups " \
           f"{changes.get('grouped') or 'default'}"


def _judged(line: str, ok: bool | None, detail: str, dry_run: bool) -> str:
    if dry_run:
        return f"{line}: not judged (dry run; {detail})"
    if ok is None:
        return f"{line}: FAIL ({detail})"
    return f"{line}: {'PASS' if ok else 'FAIL'} ({detail})"


if __name__ == "__main__":
    sys.exit(main())
