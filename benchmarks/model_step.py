"""A model, not a layer: N Llama-3-8B layers trained with AdamW, bf16 against torchao float8 and
graphpass FP8 in one run, with tokens/s and the step's peak.

    PYTHONPATH=. python benchmarks/model_step.py                   # GPU: 8 real-size layers
    PYTHONPATH=. python benchmarks/model_step.py --layers 4 --steps 5
    PYTHONPATH=. python benchmarks/model_step.py --dry-run         # CPU, tiny, ~1 min

``graphpass/models/llama.py``'s layers at seq 8192, bf16 weights, one training step each time:
``zero_grad(set_to_none=True)``, the compiled forward, a backward seeded with ones (allocated once,
before the measurement), then ``AdamW.step()`` (``fused=True`` on CUDA). Configs, each on a fresh
model: bf16 under ``torch.compile``'s default (Inductor, torch's partitioner), graphpass FP8
tensorwise (the default options, scaled_mm), torchao float8 training under ``torch.compile``
(where torchao imports). Per config:

* median step milliseconds after the warm-up (the first steps compile and allocate AdamW's
  state), timed as every benchmark here times a step (``_harness.step_ms``: the accelerator
  synchronized around each), and tokens/s (sequence x batch / step);
* the step peak above weights, gradients and optimizer state: ``torch.cuda.max_memory_allocated``
  during one step, less what is allocated before it (weights, AdamW's two moments, the input and
  the seed gradient: gradients are None then), less the gradients that exist after it. What is
  left is the activations and the backward's and the optimizer's transients, the part of memory
  a training recipe changes.

Targets (``TARGETS``), printed PASS/FAIL: graphpass FP8's peak at most 0.8x bf16's and at most
torchao's, at 1.25x bf16's tokens/s or more. ``--dry-run`` runs the same code on the CPU at the
tiny size (reference kernels, aot_eager in place of Inductor, 2 layers); its numbers are not GPU
numbers and memory is not measured there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from graphpass.report import format_bytes  # noqa: E402
from _harness import reason, step_ms, storage_bytes  # noqa: E402
from step_time import backend_for  # noqa: E402

# graphpass FP8 against bf16 and torchao: peak ratios at most, tokens/s ratio at least
TARGETS = {"peak_vs_bf16": 0.8, "peak_vs_torchao": 1.0, "speed_vs_bf16": 1.25}
BF16, FP8, TORCHAO = "bf16, torch.compile default", "graphpass FP8 tensorwise", "torchao float8"


@dataclass
class ModelRun:
    config: str
    ms: float | None = None
    tokens_per_s: float | None = None
    peak_bytes: int | None = None
    """The step's peak above weights, gradients and optimizer state (None: not measured)."""
    note: str = ""


def configs(dry_run: bool) -> list[tuple[str, dict[str, Any] | None]]:
    """(label, options): None is torch.compile's default; ``{"torchao": True}`` torchao float8."""
    kernels = "reference" if dry_run else "scaled_mm"
    return [(BF16, None), (FP8, {"fp8": "tensorwise", "kernels": kernels}),
            (TORCHAO, {"torchao": True})]


def measure(label: str, options: dict[str, Any] | None, *, layers: int, size: str,
            device: torch.device, steps: int, warmup: int) -> ModelRun:
    """One config: a fresh ``layers``-layer model, AdamW, ``warmup`` + ``steps`` steps."""
    run = ModelRun(label)
    torch._dynamo.reset()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU bf16 GEMMs crawl
    codegen = "inductor" if device.type == "cuda" else "eager"
    model, (x,) = importlib.import_module("graphpass.models.llama").build(
        size, layers=layers, device=device, dtype=dtype)
    try:
        backend = backend_for(options, model, codegen)
    except (ImportError, ValueError) as e:
        run.note = f"skipped: {reason(e)}"
        return run
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, **(
        {"fused": True} if device.type == "cuda" else {"foreach": True}))
    compiled = torch.compile(model, backend=backend)
    seed: list[torch.Tensor] = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        out = compiled(x)
        if not seed:
            seed.append(torch.ones_like(out))
        out.backward(seed[0])
        del out
        optimizer.step()

    try:
        for _ in range(warmup):
            step()
        run.ms = step_ms(step, steps)
        tokens = x.numel() // x.shape[-1]
        run.tokens_per_s = tokens / (run.ms / 1e3)
        if device.type == "cuda":
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)  # weights, AdamW state, x, the seed
            step()
            torch.cuda.synchronize(device)
            grads = sum(storage_bytes(p.grad) for p in params if p.grad is not None)
            run.peak_bytes = torch.cuda.max_memory_allocated(device) - before - grads
    except Exception as e:  # an out-of-memory, a kernel a device refuses
        run.note = f"failed: {reason(e)}"
    return run


def judge(runs: dict[str, ModelRun]) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when not measured, detail) for graphpass FP8's three targets."""
    fp8, bf16, torchao = runs.get(FP8), runs.get(BF16), runs.get(TORCHAO)

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out = []
    for name, other, key, limit, at_most in (
            ("peak at most 0.8x bf16's", bf16, "peak_bytes", TARGETS["peak_vs_bf16"], True),
            ("peak at most torchao's", torchao, "peak_bytes", TARGETS["peak_vs_torchao"], True),
            ("tokens/s at least 1.25x bf16's", bf16, "tokens_per_s", TARGETS["speed_vs_bf16"],
             False)):
        r = ratio(getattr(fp8, key, None), getattr(other, key, None))
        ok = None if r is None else (r <= limit if at_most else r >= limit)
        out.append((f"graphpass FP8 {name}", ok, f"{r:.3f}x" if r is not None else "not measured"))
    return out


def plural(layers: int) -> str:
    return f"{layers} Llama-3-8B layer{'' if layers == 1 else 's'}"


def table(runs: dict[str, ModelRun], *, layers: int, device_label: str, dry_run: bool,
          targets: bool = True) -> str:
    """The markdown section: one row per config and (``targets``) the targets' lines."""
    bf16 = runs.get(BF16)
    lines = [f"## {plural(layers)} with AdamW", "",
             f"_{device_label}._ One training step of the model (forward, backward, "
             "`AdamW.step()`); step peak: the step's peak allocation above weights, gradients "
             "and optimizer state.", "",
             "| config | median ms | tokens/s | vs bf16 | step peak | vs bf16 | note |",
             "|---|---|---|---|---|---|---|"]
    for run in runs.values():
        speed = (run.tokens_per_s / bf16.tokens_per_s
                 if bf16 and bf16.tokens_per_s and run.tokens_per_s else None)
        peak = (run.peak_bytes / bf16.peak_bytes
                if bf16 and bf16.peak_bytes and run.peak_bytes is not None else None)
        lines.append(
            f"| {run.config} | {f'{run.ms:.2f}' if run.ms else '-'} | "
            f"{f'{run.tokens_per_s:,.0f}' if run.tokens_per_s else '-'} | "
            f"{f'{speed:.2f}x' if speed else '-'} | "
            f"{format_bytes(run.peak_bytes) if run.peak_bytes is not None else '-'} | "
            f"{f'{peak:.2f}x' if peak else '-'} | {run.note} |")
    lines.append("")
    for name, ok, detail in judge(runs) if targets else ():
        verdict = ("NOT MEASURED" if ok is None else
                   f"DRY RUN ({'would pass' if ok else 'would fail'})" if dry_run else
                   "PASS" if ok else "FAIL")
        lines.append(f"- {verdict}: {name} ({detail})")
    return "\n".join(lines) + "\n"


def run_all(*, layers: int, dry_run: bool, steps: int | None = None,
            picked: Callable[[str], bool] = lambda label: True) -> tuple[dict[str, ModelRun], str]:
    """Every config (bf16 always, the others where ``picked``), and the device's label."""
    if dry_run:
        device, size = torch.device("cpu"), "tiny"
        label = "DRY RUN on CPU: tiny sizes, reference kernels; NOT GPU numbers"
    elif not torch.cuda.is_available():
        raise SystemExit("model_step.py: no CUDA device; use --dry-run on the CPU")
    else:
        device, size = torch.device("cuda"), "real"
        label = f"GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    steps = steps or (2 if dry_run else 10)
    warmup = 1 if dry_run else 3
    runs: dict[str, ModelRun] = {}
    for i, (name, options) in enumerate(configs(dry_run)):
        if i and not picked(name):
            continue
        runs[name] = measure(name, options, layers=layers, size=size, device=device, steps=steps,
                             warmup=warmup)
        print(f"[model] {name}: {runs[name]}", file=sys.stderr, flush=True)
    return runs, label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="default: 8 (2 dry run)")
    parser.add_argument("--steps", type=int, default=None, help="default: 10 (2 dry run)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--out", default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    layers = args.layers or (2 if args.dry_run else 8)
    runs, label = run_all(layers=layers, dry_run=args.dry_run, steps=args.steps)
    text = table(runs, layers=layers, device_label=label, dry_run=args.dry_run)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
