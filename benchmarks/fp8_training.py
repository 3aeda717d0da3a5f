"""Final loss of the tiny Llama trained 200 steps per FP8 recipe, next to bf16.

    python benchmarks/fp8_training.py [--steps 200] [--codegen eager]

The same task and model as tests/test_fp8_training.py (which asserts each recipe within 3% of
bf16); this prints the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import graphpass  # noqa: E402
from examples import llama, train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--codegen", default="eager", choices=["eager", "inductor"])
    args = p.parse_args()
    data = train.batches(vocab=256, batch=2, seq=64, steps=args.steps)
    rows = []
    for recipe in (None, "tensorwise", "blockwise", "mxfp8"):
        torch._dynamo.reset()
        model, _ = llama.build("tiny_lm", seq=64, layers=1)
        compiled = torch.compile(model, backend=graphpass.backend(codegen=args.codegen, fp8=recipe))
        losses = train.train(model, compiled, data)
        rows.append((recipe or "bf16", statistics.mean(losses[-20:])))
        print(f"{rows[-1][0]}: done", file=sys.stderr)
    base = rows[0][1]
    print("| recipe | final loss (mean of last 20 steps) | vs bf16 |\n|---|---|---|")
    for name, loss in rows:
        print(f"| {name} | {loss:.4f} | {'' if name == 'bf16' else f'{loss / base - 1:+.2%}'} |")
    print(f"\ntask floor (best possible loss): {train.loss_floor(256):.4f}")


if __name__ == "__main__":
    main()
