"""Every GPU measurement graphpass's targets need, in one command and one markdown report.

    PYTHONPATH=. python benchmarks/gpu_report.py                  # on the GPU machine, < 9 min
    PYTHONPATH=. python benchmarks/gpu_report.py --dry-run        # CPU, tiny sizes, ~1 min

Sections: the ``pytest -m gpu`` results; the step time of the real-size Llama-3-8B layer
(seq 8192) and GPT-3 layer per config (bf16 under Inductor's default, graphpass bf16, graphpass
FP8 tensorwise with scaled_mm as by default (every quantize fused, fast forward accumulation),
with opaque quantizes, with precise accumulation everywhere, blockwise, torchao float8 +
compile, bf16 and the FP8 default again under Inductor's CUDA graphs, all in the same run), each
with its measured activation memory next to ``graphpass.plan``'s prediction and its step peak;
the 4-layer Llama at seq 8192 without offload, offloading every eligible tensor, and offloading
only what hides under compute
(``offload_hidden_only``; the targets judge that one); PASS/FAIL lines for the targets
(``TARGETS`` below). ``--sections model`` (not run by default: it needs a lease of its own) adds
8 Llama layers trained with AdamW, bf16 against graphpass FP8 and torchao, with tokens/s and the
peak above weights, gradients and optimizer state (``benchmarks/model_step.py``).

``--dry-run`` runs the same code on the CPU at tiny sizes with graphpass's reference kernels and
aot_eager in place of Inductor (and 2 offload layers instead of 4), so the script cannot rot
between GPU runs. Its numbers are CPU
numbers and every section says so; memory is not measured on the CPU.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import graphpass  # noqa: E402
from graphpass.report import format_bytes  # noqa: E402
from _harness import CUDAGRAPHS, Result, cuda_graphs, picked, reason  # noqa: E402
from step_time import run_config  # noqa: E402

SECTIONS = ("## Machine", "## pytest -m gpu", "## Step time and activation memory",
            "## Offload: ", "## Step peak: ", "## Targets")

# The targets: FP8 tensorwise (the default) against bf16 Inductor and torchao float8 in the same
# run, per model; FP8 blockwise against bf16 (Llama); every FP8 recipe's one-layer step peak at
# most bf16's (weights, inputs and gradients are the same bf16 tensors in every config, so the
# peaks above them compare as the whole peaks do).
TARGETS = {"llama": {"bf16": 1.25, "torchao": 1.05, "blockwise": 1.15},
           "gpt": {"bf16": 1.35, "torchao": 1.0}}
MODEL_NAMES = {"llama": "Llama-3-8B layer, seq 8192", "gpt": "GPT-3 175B layer"}
SECTION_KEYS = ("steps", "offload", "peak", "model")
# "model" (8 layers with AdamW, benchmarks/model_step.py) needs a lease of its own: asked by name
DEFAULT_SECTIONS = ("steps", "offload", "peak")
PLAN_TOLERANCE = 0.05
OFFLOAD_PEAK_CUT = 0.30
OFFLOAD_SLOWDOWN = 0.05


@dataclass
class Mode:
    """What differs between a GPU run and a dry run; everything else is one code path."""
    dry_run: bool
    device: torch.device
    size: str
    codegen: str
    kernels: str
    steps: int
    warmup: int
    offload_min_bytes: int | None  # None: graphpass's default
    offload_layers: int  # the offload section's Llama layers

    @property
    def label(self) -> str:
        if self.dry_run:
            return "DRY RUN on CPU: tiny sizes, reference kernels; NOT GPU numbers"
        return f"GPU: {torch.cuda.get_device_name(self.device)}"


@dataclass
class Row:
    result: Result
    predicted: int | None = None
    extra: dict[str, str] = field(default_factory=dict)


def mode_for(dry_run: bool, steps: int | None) -> Mode:
    if dry_run:
        # aot_eager for Inductor: Inductor's C++ compile of every config takes minutes on 2 cores.
        # Offload every saved tensor: at tiny sizes none reaches the default 1 MiB floor. Two
        # layers: the same code path as four, half the tracing (one layer is too few: no
        # offloaded copy hides under the H100 roofline there, and the hidden-copies-only rows
        # would offload nothing).
        return Mode(True, torch.device("cpu"), "tiny", "eager", "reference", steps or 2, 1, 0, 2)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_report.py: no CUDA device; run it on the GPU machine, or use "
                         "--dry-run to check the script on the CPU")
    return Mode(False, torch.device("cuda"), "real", "inductor", "scaled_mm", steps or 10, 3, None,
                4)


def step_configs(mode: Mode) -> list[tuple[str, dict[str, object] | None]]:
    k = mode.kernels
    inductor = "Inductor" if mode.codegen == "inductor" else "aot_eager (dry run)"
    return [
        (f"bf16, torch.compile default ({inductor})", None),
        ("graphpass bf16", {"fp8": None}),
        (f"graphpass FP8 tensorwise/{k}, default", {"fp8": "tensorwise", "kernels": k}),
        # Transformer Engine's GEMMs beside torch's, where TE imports (else the row says why)
        *([("graphpass FP8 tensorwise/te", {"fp8": "tensorwise", "kernels": "te"})]
          if k != "te" else []),
        # the backward ordered for memory (off by default): what it changes on the GPU
        (f"graphpass FP8 tensorwise/{k}, order_backward=True",
         {"fp8": "tensorwise", "kernels": k, "order_backward": True}),
        (f"graphpass FP8 tensorwise/{k}, opaque quantize",
         {"fp8": "tensorwise", "kernels": k, "fuse_quantize": False}),
        (f"graphpass FP8 tensorwise/{k}, precise accumulation",
         {"fp8": "tensorwise", "kernels": k, "fp8_accumulate": "precise"}),
        # scaled_mm runs tensorwise only (Config refuses it); auto picks what this torch and GPU
        # support, and the row's note says when nothing does.
        ("graphpass FP8 blockwise (kernels=auto)",
         {"fp8": "blockwise", "kernels": "reference" if mode.dry_run else "auto"}),
        (f"torchao float8 + torch.compile ({inductor})", {"torchao": True}),
        # launch gaps: Inductor's CUDA graphs (cudagraph trees) for the baseline and the default
        (f"bf16, torch.compile default ({inductor}), CUDA graphs", {CUDAGRAPHS: True}),
        (f"graphpass FP8 tensorwise/{k}, CUDA graphs",
         {"fp8": "tensorwise", "kernels": k, CUDAGRAPHS: True}),
    ]


def predicted_bytes(model_name: str, options: dict[str, object] | None, mode: Mode,
                    layers: int = 1) -> tuple[int | None, str]:
    """``graphpass.plan``'s activation bytes for the same model, size and config, less the saved
    model inputs."""
    report, why = planned(model_name, options, mode, layers)
    return (None, why) if report is None else (_activation_bytes(report), "")


# The plans of this report, by (model, size, layers, options less the CUDA-graphs switch):
# a CUDA-graphs row plans as its row without them does (the partition is the same), once.
_PLANS: dict[tuple, tuple[graphpass.Report | None, str]] = {}


def planned(model_name: str, options: dict[str, object] | None, mode: Mode,
            layers: int = 1) -> tuple[graphpass.Report | None, str]:
    """``graphpass.plan``'s report for the same model, size and config, or why there is none."""
    options, _ = cuda_graphs(options)
    key = (model_name, mode.size, layers, tuple(sorted((options or {}).items())))
    if key not in _PLANS:
        _PLANS[key] = _plan(model_name, options, mode, layers)
    return _PLANS[key]


def _plan(model_name: str, options: dict[str, object] | None, mode: Mode,
          layers: int) -> tuple[graphpass.Report | None, str]:
    build = importlib.import_module(f"graphpass.models.{model_name}").build
    model, inputs = build(mode.size, layers=layers, dtype=torch.bfloat16,
                          device="meta" if mode.size == "real" else "cpu")
    if options is None:  # torch's own partitioner, which graphpass's memory="default" runs
        cfg = graphpass.Config(memory="default")
    elif options.get("torchao"):
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError:
            return None, "torchao not importable"
        convert_to_float8_training(model)
        cfg = graphpass.Config(memory="default")
    else:
        try:
            cfg = graphpass.Config(**options)
        except ValueError as e:
            return None, reason(e)
    try:
        return graphpass.plan(model, *inputs, config=cfg), ""
    except Exception as e:  # planning is a CPU trace: a failure here is a graphpass bug to report
        return None, f"plan failed: {reason(e)}"


def _activation_bytes(report: graphpass.Report) -> int:
    # The measurement starts with the model's inputs allocated; the plan counts a saved input
    # (the layer input the first norm needs) as an activation. Compare what the forward creates.
    inputs = sum(r.bytes for r in report.rows if r.op == "input" and r.is_activation)
    return report.activation_bytes - inputs


def copies_planned(report: graphpass.Report) -> str:
    """How many offloaded tensors the plan's copy notes find hidden under compute (H100
    roofline), and how many not."""
    hidden = sum(d.what is graphpass.What.OFFLOAD_COPY for d in report.decisions)
    not_hidden = sum(d.what is graphpass.What.OFFLOAD_NOT_HIDDEN for d in report.decisions)
    return (f"planned: {hidden + not_hidden} offloaded ({_bytes(report.offloaded_bytes)}), copies "
            f"of {hidden} hidden, {not_hidden} not (H100 roofline)")


def run_pytest_gpu(timeout_s: int) -> tuple[str, str]:
    """``pytest -m gpu`` in a subprocess: its summary line and its tail. Only the test files
    that mark a test ``gpu`` are collected: collecting the whole suite imports every test
    module (transformers, torchtitan), minutes of the GPU's time for nothing."""
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_*.py")
                   if "mark.gpu" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"TIMEOUT after {timeout_s} s", out[-3000:]
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else f"no output (exit {done.returncode})"
    return f"exit {done.returncode}: {summary}", "\n".join(lines[-40:])


def _ms(r: Result) -> str:
    return f"{r.ms:.2f}" if r.ms is not None else "-"


def _bytes(n: int | None) -> str:
    return format_bytes(n) if n is not None else "-"


def _notes(*notes: str) -> str:
    """Non-empty notes joined, each said once (a missing torchao fails both run and plan)."""
    kept: list[str] = []
    for n in notes:
        if n and not any(n in k for k in kept):
            kept.append(n)
    return "; ".join(kept)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


class Report:
    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.lines: list[str] = []
        self.targets: list[tuple[str, bool | None, str]] = []

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def target(self, name: str, ok: bool | None, detail: str) -> None:
        self.targets.append((name, ok, detail))

    def verdict(self, ok: bool | None) -> str:
        if ok is None:
            return "NOT MEASURED"
        if self.mode.dry_run:
            return f"DRY RUN ({'would pass' if ok else 'would fail'}; CPU numbers, not judged)"
        return "PASS" if ok else "FAIL"

    def markdown(self) -> str:
        lines = list(self.lines)
        lines += ["## Targets", ""]
        if self.mode.dry_run:
            lines += ["_Dry run: the targets are for an H100; these lines only show the checks run._",
                      ""]
        for name, ok, detail in self.targets:
            lines.append(f"- {self.verdict(ok)}: {name} ({detail})")
        return "\n".join(lines) + "\n"


def step_section(report: Report, mode: Mode, models: list[str], deadline: float,
                 configs: list[str] | None = None) -> dict:
    """Step time and memory per model and config (those whose label contains one of ``configs``,
    with the bf16 baseline always; every config when None); returns the rows by model for the
    targets."""
    m = mode
    report.add("## Step time and activation memory", "",
               f"_{m.label}._ One training step (forward + backward, gradients seeded with ones), "
               f"1 layer, bf16, median of {m.steps} steps after {m.warmup} warm-up; `vs bf16` is "
               "the bf16 row's median over this row's, both from this run. Measured activations: "
               "bytes allocated after the forward minus before it, minus the output. Step peak: "
               "the step's peak allocation minus weights, inputs and gradients. Predicted: "
               "`graphpass.plan` of the same model and config on fake tensors, without the saved "
               "model inputs (allocated before the forward, so not in the measurement).", "")
    by_model: dict[str, list[Row]] = {}
    for model_name in models:
        report.add(f"### {model_name} ({m.size} size)", "",
                   "| config | median ms | vs bf16 | measured activations | predicted | "
                   "measured / predicted | step peak | note |",
                   "|---|---|---|---|---|---|---|---|")
        rows: list[Row] = []
        for i, (label, options) in enumerate(step_configs(m)):
            if i and not picked(label, configs):  # the first, bf16, is the baseline
                continue
            if time.monotonic() > deadline:
                r = Result(model_name, label, note="skipped: the report's time budget ran out")
            else:
                r = run_config(model_name, label, options, m.size, m.codegen, m.device, m.steps,
                               warmup=m.warmup)
            predicted, why = predicted_bytes(model_name, options, m)
            row = Row(r, predicted)
            rows.append(row)
            base = rows[0].result.ms
            speed = _ratio(base, r.ms)
            match = _ratio(r.activation_bytes, predicted)
            note = _notes(r.note, why)
            if m.dry_run and r.activation_bytes is None and not r.note:
                note = "; ".join(x for x in ("memory not measured on CPU", note) if x)
            report.add(f"| {label} | {_ms(r)} | {f'{speed:.2f}x' if speed else '-'} | "
                       f"{_bytes(r.activation_bytes)} | {_bytes(predicted)} | "
                       f"{f'{match:.3f}' if match else '-'} | {_bytes(r.step_peak_bytes)} | "
                       f"{note} |")
            print(f"[{model_name}] {label}: {_ms(r)} ms {note}", file=sys.stderr, flush=True)
        report.add("")
        by_model[model_name] = rows
    return by_model


def offload_section(report: Report, mode: Mode, deadline: float) -> tuple[Result, Result, Result]:
    m = mode
    layers = m.offload_layers
    report.add(f"## Offload: {layers}-layer Llama", "",
               f"_{m.label}._ graphpass FP8 tensorwise/{m.kernels}, {layers} Llama layers "
               f"({m.size} size), without and with `offload=True, offload_stream=True`, every "
               "eligible tensor or with `offload_hidden_only=True` (the tensors whose copies the "
               "H100 roofline hides). Peak: the step's peak above weights, inputs and "
               "gradients.", "",
               "| config | median ms | measured activations | predicted | step peak | note |",
               "|---|---|---|---|---|---|")
    base = {"fp8": "tensorwise", "kernels": m.kernels}
    offload = {**base, "offload": True, "offload_stream": True}
    if m.offload_min_bytes is not None:
        offload["offload_min_bytes"] = m.offload_min_bytes
    hidden = {**offload, "offload_hidden_only": True}
    out = []
    for label, options in (("without offload", base), ("offload + stream", offload),
                           ("offload + stream, hidden copies only", hidden)):
        if time.monotonic() > deadline:
            r = Result("llama", label, note="skipped: the report's time budget ran out")
        else:
            r = run_config("llama", label, options, m.size, m.codegen, m.device, m.steps,
                           layers=layers, warmup=m.warmup)
        plan, why = planned("llama", options, m, layers=layers)
        predicted = None if plan is None else _activation_bytes(plan)
        copies = copies_planned(plan) if plan is not None and options.get("offload") else ""
        note = _notes(r.note, why, copies)
        report.add(f"| {label} | {_ms(r)} | {_bytes(r.activation_bytes)} | {_bytes(predicted)} | "
                   f"{_bytes(r.step_peak_bytes)} | {note} |")
        print(f"[offload] {label}: {_ms(r)} ms {note}", file=sys.stderr, flush=True)
        out.append(r)
    report.add("")
    return out[0], out[1], out[2]


def _speed_target(report: Report, name: str, base: Row | None, row: Row | None,
                  at_least: float) -> None:
    """``row`` at least ``at_least`` times as fast as ``base`` (both from this run)."""
    s = _ratio(base.result.ms, row.result.ms) if base and row else None
    missing = next((r.result.note or f"{r.result.config}: did not run" for r in (base, row)
                    if r is not None and r.result.ms is None), "a row is missing")
    report.target(f"{name} >= {at_least:.2f}x", None if s is None else s >= at_least,
                  f"measured {s:.2f}x" if s else missing)


def judge(report: Report, by_model: dict[str, list[Row]],
          off: tuple[Result, Result, Result] | None) -> None:
    for model_name, model_rows in by_model.items():
        rows = {row.result.config: row for row in model_rows}
        bf16 = next((r for c, r in rows.items() if c.startswith("bf16")), None)
        fp8 = next((r for c, r in rows.items() if "tensorwise" in c and c.endswith("default")),
                   None)
        block = next((r for c, r in rows.items() if "blockwise" in c), None)
        ao = next((r for c, r in rows.items() if c.startswith("torchao")), None)
        targets, name = TARGETS.get(model_name, {}), MODEL_NAMES.get(model_name, model_name)
        if "bf16" in targets:
            _speed_target(report, f"{name}: FP8 tensorwise default vs bf16 Inductor", bf16, fp8,
                          targets["bf16"])
        if "torchao" in targets:
            _speed_target(report, f"{name}: FP8 tensorwise default vs torchao float8 + compile",
                          ao, fp8, targets["torchao"])
        if "blockwise" in targets:
            _speed_target(report, f"{name}: FP8 blockwise default vs bf16 Inductor", bf16, block,
                          targets["blockwise"])
        for row in (fp8, block):
            if row is None or bf16 is None:
                continue
            peak, base = row.result.step_peak_bytes, bf16.result.step_peak_bytes
            report.target(f"{name}: step peak of {row.result.config} <= bf16 Inductor's",
                          None if peak is None or base is None else peak <= base,
                          f"{_bytes(peak)} vs {_bytes(base)}" if peak is not None and
                          base is not None else "peak not measured" +
                          (" on CPU" if report.mode.dry_run else ""))
    for model_name, model_rows in by_model.items():
        for row in model_rows:
            match = _ratio(row.result.activation_bytes, row.predicted)
            report.target(f"measured activations within {PLAN_TOLERANCE:.0%} of the plan: "
                          f"{model_name}, {row.result.config}",
                          None if match is None else abs(match - 1) <= PLAN_TOLERANCE,
                          f"measured / predicted = {match:.3f}" if match else
                          "memory not measured" + (" on CPU" if report.mode.dry_run else ""))
    if off is None:  # the offload section was not asked for
        return
    without, _, with_ = off  # the targets are for the offload that pays: hidden copies only
    cut = None if without.step_peak_bytes is None or with_.step_peak_bytes is None else \
        1 - with_.step_peak_bytes / without.step_peak_bytes
    slow = _ratio(with_.ms, without.ms)
    report.target(f"offload (hidden copies only): activation peak >= {OFFLOAD_PEAK_CUT:.0%} lower",
                  None if cut is None else cut >= OFFLOAD_PEAK_CUT,
                  f"{cut:.1%} lower" if cut is not None else "peak not measured")
    report.target(f"offload (hidden copies only): step <= {OFFLOAD_SLOWDOWN:.0%} longer",
                  None if slow is None else slow <= 1 + OFFLOAD_SLOWDOWN,
                  f"{slow - 1:+.1%}" if slow else "a row did not run")


# -- the step's predicted peak and the memory budget ------------------------------------

PEAK_TOLERANCE = 0.05
BUDGET_SHARE = 0.60  # of the unbudgeted peak
DRY_RUN_BUDGET_SHARE = 0.95
BUDGET_SLOWDOWN = 0.10
OFFLOAD_ALONE_PEAK_CUT = 0.30


def peak_configs(mode: Mode) -> list[tuple[str, int, dict[str, object]]]:
    """(label, Llama layers, graphpass options): every memory policy on one layer, then the
    4-layer FP8 step without offload, with every eligible tensor offloaded and with hidden copies
    only; the budget row is added from the measurement."""
    k = mode.kernels
    fp8 = {"fp8": "tensorwise", "kernels": k}
    layers = mode.offload_layers
    offload = {**fp8, "offload": True, "offload_stream": True}
    if mode.offload_min_bytes is not None:
        offload["offload_min_bytes"] = mode.offload_min_bytes
    one_layer = [
        ("bf16, default", 1, {"fp8": None, "memory": "default"}),
        ("bf16, auto", 1, {"fp8": None, "memory": "auto"}),
        (f"FP8 tensorwise/{k}", 1, fp8),
        (f"FP8 tensorwise/{k}, recompute layernorm", 1, {**fp8, "recompute": ("layernorm",)}),
        (f"FP8 tensorwise/{k}, recompute mlp", 1, {**fp8, "recompute": ("mlp",)}),
        (f"FP8 tensorwise/{k}, recompute full", 1, {**fp8, "recompute": ("full",)}),
    ]
    if mode.dry_run:  # the code path, at a third of the cost
        one_layer = one_layer[:1]
    return [
        *one_layer,
        (f"FP8 tensorwise/{k}, {layers} layers", layers, fp8),
        (f"FP8 tensorwise/{k}, {layers} layers, offload + stream", layers, offload),
        (f"FP8 tensorwise/{k}, {layers} layers, offload + stream, hidden copies only", layers,
         {**offload, "offload_hidden_only": True}),
    ]


class _CompiledMemTracker:
    """torch's MemTracker, letting torch.compile's code run under it (the CPU measurement)."""

    def __new__(cls):
        from torch.distributed._tools.mem_tracker import MemTracker

        class Tracker(MemTracker):
            @classmethod
            def ignore_compile_internals(cls) -> bool:
                return True

        return Tracker()


def measure_peak(layers: int, options: dict[str, object], mode: Mode
                 ) -> tuple[int | None, int | None, float | None, str]:
    """(predicted, measured, median ms, note) of one compiled Llama step ``model(x).sum()``
    backward. Measured: ``torch.cuda.max_memory_allocated`` of the step on CUDA (weights and
    inputs allocated, no gradients before it); MemTracker's peak on the CPU, less the ``.grad``
    buffers it is given before the step (autograd accumulates into them in place)."""
    torch._dynamo.reset()
    dtype = torch.float32 if mode.dry_run else torch.bfloat16  # CPU bf16 GEMMs are 70x slower
    try:
        backend = graphpass.backend(codegen=mode.codegen, **options)
    except ValueError as e:
        return None, None, None, f"skipped: {reason(e)}"
    model, (x,) = importlib.import_module("graphpass.models.llama").build(
        mode.size, layers=layers, device=mode.device, dtype=dtype)
    step = torch.compile(lambda x: model(x).sum(), backend=backend)
    try:
        for _ in range(mode.warmup):
            step(x).backward()
    except Exception as e:  # a budget no plan meets: dynamo wraps graphpass's ValueError
        return None, None, None, f"failed: {reason(e)}"
    predicted = backend.report().meta["step_peak"]["bytes"]
    times = []
    for _ in range(mode.steps):
        model.zero_grad(set_to_none=True)
        if mode.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        step(x).backward()
        if mode.device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    if mode.device.type == "cuda":
        measured = torch.cuda.max_memory_allocated()
    else:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        tracker = _CompiledMemTracker()
        tracker.track_external(model, x)
        with tracker:
            step(x).backward()
        peak = sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
        measured = peak - sum(p.grad.untyped_storage().nbytes() for p in params)
    times.sort()
    return predicted, measured, times[len(times) // 2], ""


def peak_section(report: Report, mode: Mode, deadline: float) -> None:
    """Predicted step peak against the measured one per config, the budget at
    ``BUDGET_SHARE`` of the unbudgeted 4-layer peak, and their targets."""
    m = mode
    measure = "torch.cuda.max_memory_allocated" if m.device.type == "cuda" else "MemTracker"
    report.add(f"## Step peak: predicted vs {measure}", "",
               f"_{m.label}._ One compiled Llama step (`model(x).sum()` backward, {m.size} size), "
               f"codegen {m.codegen}; measured: the step's peak of every allocation (weights, "
               "inputs, activations, the backward's transients, gradients), predicted: the "
               "report's `step_peak` of the same compile.", "",
               "| config | predicted peak | measured peak | measured / predicted | median ms | note |",
               "|---|---|---|---|---|---|")
    results: dict[str, tuple[int | None, int | None, float | None]] = {}

    def row(label: str, layers: int, options: dict[str, object]) -> None:
        if time.monotonic() > deadline:
            predicted, measured, ms, note = None, None, None, "skipped: time budget ran out"
        else:
            predicted, measured, ms, note = measure_peak(layers, options, m)
        results[label] = (predicted, measured, ms)
        match = _ratio(measured, predicted)
        report.add(f"| {label} | {_bytes(predicted)} | {_bytes(measured)} | "
                   f"{f'{match:.3f}' if match else '-'} | {f'{ms:.2f}' if ms else '-'} | {note} |")
        report.target(f"step peak within {PEAK_TOLERANCE:.0%} of the prediction: {label}",
                      None if match is None else abs(match - 1) <= PEAK_TOLERANCE,
                      f"measured / predicted = {match:.3f}" if match else note or "not measured")
        print(f"[peak] {label}: {note or 'ok'}", file=sys.stderr, flush=True)

    configs = peak_configs(m)
    for label, layers, options in configs:
        row(label, layers, options)
    base_label, layers, base = configs[-3]
    offload_label = configs[-1][0]  # offload alone that pays: hidden copies only
    unbudgeted = results[base_label][0]
    # a tiny model's peak is mostly weights and gradients: 60% is out of reach there
    share = DRY_RUN_BUDGET_SHARE if m.dry_run else BUDGET_SHARE
    budget_label = f"{base_label}, memory_budget {share:.0%} of its peak"
    if unbudgeted is not None:
        row(budget_label, layers, {**base, "memory_budget": int(share * unbudgeted)})
    report.add("")
    _, base_measured, base_ms = results[base_label]
    _, budget_measured, budget_ms = results.get(budget_label, (None, None, None))
    fits = (None if budget_measured is None or unbudgeted is None
            else budget_measured <= share * unbudgeted)
    report.target(f"memory_budget {share:.0%}: the measured peak fits", fits,
                  f"measured {_bytes(budget_measured)} vs budget "
                  f"{_bytes(int(share * unbudgeted)) if unbudgeted else '-'}")
    slow = _ratio(budget_ms, base_ms)
    report.target(f"memory_budget {share:.0%}: step <= {BUDGET_SLOWDOWN:.0%} longer",
                  None if slow is None else slow <= 1 + BUDGET_SLOWDOWN,
                  f"{slow - 1:+.1%}" if slow else "a row did not run")
    _, off_measured, off_ms = results[offload_label]
    cut = (None if off_measured is None or base_measured is None
           else 1 - off_measured / base_measured)
    report.target(f"offload alone (hidden copies only): step peak >= {OFFLOAD_ALONE_PEAK_CUT:.0%} lower",
                  None if cut is None else cut >= OFFLOAD_ALONE_PEAK_CUT,
                  f"{cut:.1%} lower" if cut is not None else "not measured")
    slow = _ratio(off_ms, base_ms)
    report.target(f"offload alone (hidden copies only): step <= {OFFLOAD_SLOWDOWN:.0%} longer",
                  None if slow is None else slow <= 1 + OFFLOAD_SLOWDOWN,
                  f"{slow - 1:+.1%}" if slow else "a row did not run")


def build_report(*, dry_run: bool, models: list[str], steps: int | None = None,
                 budget_s: float = 480.0, pytest_timeout_s: int = 150,
                 run_pytest: bool = True, peak_budget_s: float = 240.0,
                 peak_only: bool = False, configs: list[str] | None = None,
                 sections: tuple[str, ...] = DEFAULT_SECTIONS, layers: int | None = None) -> str:
    """The markdown report. ``budget_s`` bounds the whole run: configs still waiting when it is
    spent are listed as skipped, so the report always comes out. ``configs`` and ``sections``
    pick a part of it (a GPU lease too short for the whole)."""
    start = time.monotonic()
    mode = mode_for(dry_run, steps)
    report = Report(mode)
    _PLANS.clear()
    report.add("# graphpass GPU report", "",
               f"**{mode.label}**", "",
               "## Machine", "",
               f"- device: {mode.label}",
               f"- torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}, Python "
               f"{platform.python_version()}, {platform.platform()}",
               f"- command: `PYTHONPATH=. python benchmarks/gpu_report.py"
               f"{' --dry-run' if dry_run else ''}`", "")

    if peak_only:  # the step-peak section alone
        peak_section(report, mode, start + peak_budget_s)
        report.add(f"_Report written in {time.monotonic() - start:.0f} s._", "")
        return report.markdown()
    report.add("## pytest -m gpu", "")
    if run_pytest:
        summary, tail = run_pytest_gpu(pytest_timeout_s)
        if dry_run:
            summary += " (CPU: the gpu-marked tests skip without CUDA)"
        report.add(f"- {summary}", "", "```", tail, "```", "")
    else:
        report.add("- not run (--no-pytest)", "")

    deadline = start + budget_s
    by_model = step_section(report, mode, models, deadline, configs) if "steps" in sections else {}
    if "offload" in sections:
        judge(report, by_model, offload_section(report, mode, deadline))
    else:
        judge(report, by_model, None)
    if "peak" in sections:
        peak_section(report, mode, deadline + peak_budget_s)
    if "model" in sections:
        model_step = importlib.import_module("model_step")
        layers = layers or (2 if dry_run else 8)
        runs, label = model_step.run_all(layers=layers, dry_run=dry_run, steps=steps,
                                         picked=lambda name: picked(name, configs))
        report.add(model_step.table(runs, layers=layers, device_label=label, dry_run=dry_run,
                                    targets=False))
        for name, ok, detail in model_step.judge(runs):
            report.target(f"{model_step.plural(layers)} with AdamW: {name}", ok, detail)
    report.add(f"_Report written in {time.monotonic() - start:.0f} s._", "")
    return report.markdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, tiny sizes, reference kernels: checks the script, not the GPU")
    parser.add_argument("--out", default="gpu_report.md", help="markdown file to write")
    parser.add_argument("--models", nargs="+", default=["llama", "gpt"], choices=["llama", "gpt"])
    parser.add_argument("--steps", type=int, help="timed steps (default: 10 on GPU, 2 dry run)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="time budget; configs left when it is spent are reported skipped")
    parser.add_argument("--no-pytest", action="store_true", help="skip the pytest -m gpu section")
    parser.add_argument("--peak-only", action="store_true",
                        help="only the step-peak section: predicted vs measured peak, the budget")
    parser.add_argument("--peak-budget-s", type=float, default=240.0,
                        help="time budget of the step-peak section, after --budget-s")
    parser.add_argument("--configs", nargs="+",
                        help="only the step configs whose label contains one of these (the bf16 "
                             "baseline always runs)")
    parser.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS),
                        choices=SECTION_KEYS,
                        help="the sections to run after pytest ('model': N Llama layers with "
                             "AdamW, benchmarks/model_step.py, not run by default)")
    parser.add_argument("--layers", type=int, default=None,
                        help="the model section's Llama layers (default 8, 2 dry run)")
    args = parser.parse_args(argv)
    text = build_report(dry_run=args.dry_run, models=args.models, steps=args.steps,
                        budget_s=args.budget_s, run_pytest=not args.no_pytest,
                        peak_only=args.peak_only, peak_budget_s=args.peak_budget_s,
                        configs=args.configs, sections=tuple(args.sections),
                        layers=args.layers)
    Path(args.out).write_text(text)
    print(text)
    print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
