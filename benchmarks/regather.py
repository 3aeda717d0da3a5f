"""Quantize before dispatch on the real-size DeepSeek-V3 layer: saved bytes without and with the
``regather`` pass (passes/regather.py), planned on fake tensors (no GPU).

    python benchmarks/regather.py                 # tensorwise and mxfp8
    python benchmarks/regather.py tensorwise

"Without" runs the pipeline with the pass left out of ``pipeline.PASSES``; nothing else differs.
Blockwise does not lower this layer's experts (capacity 160 is not a multiple of 128). Every
linear is lowered (``fp8_cost_model="off"``): the pass is about FP8 experts, which the default
cost model keeps in bf16 at this one-GPU size (160 tokens an expert read their weights).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import graphpass  # noqa: E402
from graphpass.models import deepseek  # noqa: E402
from graphpass import pipeline  # noqa: E402

POLICIES = {
    'memory="default"': dict(memory="default"),
    'memory="default", save_original="always"': dict(memory="default", save_original="always"),
    'memory="auto" (default)': dict(),
}


def saved(recipe: str, policy: dict, regather: bool) -> tuple[int, list[str]]:
    passes = pipeline.PASSES
    if not regather:
        pipeline.PASSES = tuple(p for p in passes if p.__name__ != "regather")
    try:
        model, inputs = deepseek.build("real")
        report = graphpass.plan(model, *inputs, config=graphpass.Config(
            fp8=recipe, fp8_cost_model="off", **policy))
    finally:
        pipeline.PASSES = passes
    return report.activation_bytes, [n for n in report.notes if n.startswith("dispatch:")]


def main(recipes: list[str]) -> None:
    print("| policy | recipe | without | with | saved |\n| --- | --- | --- | --- | --- |")
    for recipe in recipes:
        for name, policy in POLICIES.items():
            without, _ = saved(recipe, policy, regather=False)
            with_it, notes = saved(recipe, policy, regather=True)
            print(f"| `{name}` | {recipe} | {without:,} B | {with_it:,} B | {without - with_it:,} B |",
                  flush=True)
            for note in notes:
                print(f"    {note}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:] or ["tensorwise", "mxfp8"])
