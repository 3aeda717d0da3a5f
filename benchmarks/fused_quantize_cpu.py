"""What inlining the quantizes changes in Inductor's CPU code for one FP8 training step of the
tiny Llama layer (bf16, seq 64): the generated kernels and buffers, fused against opaque.

    python benchmarks/fused_quantize_cpu.py                      # fp8="blockwise"
    python benchmarks/fused_quantize_cpu.py --recipe tensorwise --pow2-scales false

Counts, in the forward and backward code Inductor writes (``run_and_get_code``): extern calls of
``graphpass.quantize``, C++ kernels, buffers Inductor allocates (the opaque op allocates its
outputs itself: they are not in the count), and those of them that hold an fp32 copy of a whole
activation, weight or gradient (as many elements as the smallest one, 128 x 128). It also checks
that the two steps' outputs and gradients are bit-identical (``emulate_precision_casts`` on in
both, as ``fuse_quantize`` sets it). No timing: a CPU says nothing about FP8 speed on a GPU.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # graphpass from a checkout
import graphpass  # noqa: E402
from graphpass.models import llama  # noqa: E402

_BUFFER = re.compile(r"empty_strided_cpu\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)")


def step(recipe: str, fuse: bool, **options) -> tuple[list[torch.Tensor], dict[str, int],
                                                      list[str]]:
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs = llama.build("tiny", layers=1, seq=64, dtype=torch.bfloat16)
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    compiled = torch.compile(model, backend=graphpass.backend(
        codegen="inductor", fp8=recipe, fuse_quantize=fuse, **options))

    def run():
        out = compiled(*xs)
        out.float().pow(2).mean().backward()
        return out.detach()

    with inductor_config.patch(emulate_precision_casts=True, fx_graph_cache=False):
        out, code = run_and_get_code(run)
    code = "\n".join(code)
    buffers = _BUFFER.findall(code)
    whole = [f"({shape})" for shape, d in buffers
             if d == "float32" and _numel(shape) >= 128 * 128]
    counts = {"quantize calls": len(re.findall(r"torch\.ops\.graphpass\.quantize\.default\(", code)),
              "kernels": len(re.findall(r"^cpp_fused_\w+ = async_compile", code, re.M)),
              "buffers": len(buffers), "whole fp32 buffers": len(whole)}
    return [out, xs[0].grad, *(p.grad.clone() for p in model.parameters())], counts, whole


def _numel(shape: str) -> int:
    n = 1
    for size in filter(None, (p.strip() for p in shape.split(","))):
        n *= int(size)
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="blockwise", choices=("tensorwise", "rowwise",
                                                                  "blockwise"))
    parser.add_argument("--pow2-scales", choices=("true", "false"), default=None)
    args = parser.parse_args(argv)
    options = {} if args.pow2_scales is None else {"fp8_pow2_scales": args.pow2_scales == "true"}
    opaque, a, _ = step(args.recipe, False, **options)
    fused, b, whole = step(args.recipe, True, **options)
    print(f"torch {torch.__version__}, fp8={args.recipe!r} {options or ''}, tiny Llama layer, "
          "bf16, seq 64, one step")
    print(f"{'':22} {'opaque':>8} {'fused':>8}")
    for key in a:
        print(f"{key:22} {a[key]:>8} {b[key]:>8}")
    print(f"fused: whole fp32 buffers {', '.join(whole) or 'none'}")
    same = all(torch.equal(x, y) for x, y in zip(opaque, fused))
    print(f"outputs and gradients bit-identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
