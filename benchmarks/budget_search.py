"""How the memory budget's search spends its partitions, and what its plans add by the roofline.

    CI=true PYTHONPATH=. python benchmarks/budget_search.py [--shares 0.1,0.3,0.5,0.7,0.9]
        [--examples llama,gpt,deepseek] [--real]

Each tiny example is compiled with ``graphpass.backend(codegen="eager")`` and one training step
``model(x).sum().backward()`` runs; the unbudgeted predicted peak is the report's, the smallest
one the ValueError of a 1-byte budget names. Each budget is a share of the way from the smallest
to the unbudgeted peak. A row gives the predicted peak, the partitions the search took, the
choices it kept and what they add by the H100 roofline (all read from the budget's summary in
the report), and the wall time of the compile. ``--real`` adds the 4-layer Llama-3-8B FP8
tensorwise step at seq 8192 on fake tensors (``graphpass.plan``), at 98%, 95% and 90% of its
unbudgeted peak, with every choice the budget kept and its summary.
docs/memory/memory-budget.md#memory_budget has the numbers.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.models import deepseek, gpt, llama  # noqa: E402
from graphpass.decisions import What  # noqa: E402
from graphpass.report import format_bytes  # noqa: E402

EXAMPLES = {"llama": llama, "gpt": gpt, "deepseek": deepseek}


def compiled_report(name: str, **options):
    """The report of one compiled training step of the tiny ``name``, or the error it raised."""
    torch.manual_seed(0)
    model, (x,) = EXAMPLES[name].build("tiny")
    torch._dynamo.reset()
    backend = graphpass.backend(codegen="eager", **options)
    try:
        torch.compile(lambda x: model(x).sum(), backend=backend)(x).backward()
    except Exception as error:  # noqa: BLE001 - dynamo wraps the budget's ValueError
        return error
    return backend.report()


def smallest_peak(error: BaseException) -> int:
    match = re.search(r"reaches is [^(]*\(([\d,]+) B\)", str(error))
    if match is None:
        raise error
    return int(match.group(1).replace(",", ""))


def summary(report) -> str:
    notes = [str(d) for d in report.decisions if d.what is What.BUDGETED]
    return notes[-1]


def row(report, budget: int, seconds: float) -> str:
    note = summary(report)
    choices = re.search(r"; (\d+) choice\(s\), adding about ([\d.]+ \w+)", note)
    partitions = re.search(r"; (\d+) partition\(s\)", note)
    read = re.search(r"everything at once \((\d+) choice\(s\) the backward reads\)", note)
    peak = report.meta["step_peak"]["bytes"]
    return (f"peak {peak:,} B ({'fits' if peak <= budget else 'OVER'}), "
            f"{partitions.group(1)} partitions, {choices.group(1)} choices kept"
            + (f" of {read.group(1)} the backward reads" if read else "")
            + f", adding {choices.group(2)}, {seconds:.1f} s")


def tiny(names: list[str], shares: list[float]) -> None:
    for name in names:
        unbudgeted = compiled_report(name).meta["step_peak"]["bytes"]
        smallest = smallest_peak(compiled_report(name, memory_budget=1))
        print(f"{name}: unbudgeted {unbudgeted:,} B, smallest {smallest:,} B", flush=True)
        for share in shares:
            budget = int(smallest + (unbudgeted - smallest) * share)
            start = time.perf_counter()
            report = compiled_report(name, memory_budget=budget)
            print(f"  {share:.0%}: budget {budget:,} B: "
                  f"{row(report, budget, time.perf_counter() - start)}", flush=True)


def real(shares: list[float]) -> None:
    model, (x,) = llama.build("real", layers=4)
    unbudgeted = graphpass.plan(model, x, config=graphpass.Config(fp8="tensorwise"))
    full = unbudgeted.meta["step_peak"]["bytes"]
    print(f"Llama-3-8B, 4 layers, FP8 tensorwise, seq 8192: unbudgeted {format_bytes(full)}",
          flush=True)
    for share in shares:
        budget = int(share * full)
        start = time.perf_counter()
        try:
            report = graphpass.plan(model, x, config=graphpass.Config(fp8="tensorwise",
                                                                      memory_budget=budget))
        except ValueError as error:
            print(f"  {share:.0%}: {error}", flush=True)
            continue
        print(f"  {share:.0%}: budget {format_bytes(budget)}: "
              f"{row(report, budget, time.perf_counter() - start)}", flush=True)
        for note in (str(d) for d in report.decisions if d.what is What.BUDGETED):
            print(f"    {note}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shares", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--examples", default="llama,gpt,deepseek")
    parser.add_argument("--real", action="store_true")
    args = parser.parse_args()
    tiny([n for n in args.examples.split(",") if n], [float(s) for s in args.shares.split(",")])
    if args.real:
        real([0.98, 0.95, 0.9])


if __name__ == "__main__":
    main()
