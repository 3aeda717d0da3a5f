"""The rowwise FP8 quantize of 3-D expert weights: the Triton kernels
(``graphpass.fp8.triton_quantize``) against the torch code compiled by Inductor
(``torch.compile(ops.experts_rowwise_torch)``), on CUDA.

    python benchmarks/quantize_kernels.py                    # the three default shapes, bf16
    python benchmarks/quantize_kernels.py --shapes 16x4096x7168 --sweep
    python benchmarks/quantize_kernels.py --dry-run          # CPU, Triton's interpreter, no timing
    python benchmarks/quantize_kernels.py --sections grouped --grouped-shapes 8192x7168x16

For each shape (E, N, K) and usage (both copies, rowwise only, columnwise only): the median time
of ``triton.testing.do_bench`` of each, the bandwidth that time gives against the byte floor of
reading the weight and writing one byte per element for each copy (s + 1 bytes per element per
copy, s = 2 for bf16; the two-pass kernels move 2s + 1 per copy, the rowwise-only kernel s + 1
from memory when its second read hits the cache), and whether the kernels' outputs equal the
eager torch code's bit for bit ("-" above 2**30 elements, whose fp32 copies in the torch code
take tens of GB; plain ``torch.compile`` of the torch code gave other bits than eager on an
H200 with torch 2.11, so it is no reference).
``--sweep`` also times tile configurations of the kernels on the first shape, each checked
against the eager torch code, and the default configuration's amax and cast passes alone;
``--best-out FILE`` writes the fastest bit-identical configuration of each kernel family (least
time summed over the usages timed) as JSON, for ``benchmarks/experts_fp8.py --tiles FILE`` to
run the training steps with, in the same GPU call.
``--dry-run`` runs tiny shapes on the CPU under the interpreter, checks the kernels' outputs
against the torch code's, and times nothing.
``--resources`` (CPU, no GPU needed) compiles the kernels of every ``--sweep`` configuration for
sm_90 as Triton's launcher specialises them on the first shapes (``benchmarks/_sm90.py``) and
prints what ptxas gives each (registers, spill stores, shared memory), the programs an SM holds
and the input bytes they have in flight, the quantity a memory-bound loop's bandwidth follows.

Measured on an H200 (torch 2.11, Triton 3.6), bf16, ms, kernels / Inductor:

| shape | both | rowwise | columnwise |
| --- | --- | --- | --- |
| 16x4096x7168 | 1.279 / 1.400 | 0.574 / 0.631 | 0.786 / 0.776 |
| 16x7168x2048 | 0.669 / 0.796 | 0.288 / 0.350 | 0.408 / 0.451 |
| 256x4096x7168 | 19.68 / 21.67 | 9.058 / 9.855 | 11.61 / 11.82 |
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_SHAPES = ("16x4096x7168", "16x7168x2048", "256x4096x7168")
DRY_SHAPES = ("2x40x72", "1x17x33")
GROUPED_SHAPES = ("8192x7168x16", "32768x7168x16", "32768x2048x16")  # TxKxG
DRY_GROUPED_SHAPES = ("100x64x5", "37x40x3")
SECTIONS = ("experts", "grouped")
USAGES = ("both", "rowwise", "columnwise")
COPIES = {"both": 2, "rowwise": 1, "columnwise": 1}
EAGER_CHECK_LIMIT = 2**30  # elements: the torch code's fp32 copies of larger weights take GBs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=None, help="ExNxK, e.g. 16x4096x7168")
    p.add_argument("--grouped-shapes", nargs="+", default=None,
                   help="TxKxG token-grouped activations, e.g. 8192x7168x16")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="expert weights (experts), token-grouped activations (grouped)")
    p.add_argument("--recipe", default="rowwise", help="rowwise or rowwise_pow2")
    p.add_argument("--sweep", action="store_true", help="also time tile configurations")
    p.add_argument("--best-out", type=Path, default=None,
                   help="with --sweep: write each kernel family's fastest configuration here")
    p.add_argument("--resources", action="store_true",
                   help="CPU: each sweep configuration's kernels compiled for sm_90: registers, "
                        "shared memory, programs an SM, bytes in flight")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU under Triton's interpreter; no timing")
    return p.parse_args()


def identical(a: list, b: list) -> bool:
    import torch

    return all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(
        x.view(torch.uint8) if x.dtype != torch.float32 else x.view(torch.int32),
        y.view(torch.uint8) if y.dtype != torch.float32 else y.view(torch.int32))
        for x, y in zip(a, b)) and len(a) == len(b)


def main() -> int:
    args = parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.resources:
        return resources(args)
    import torch

    from graphpass.fp8 import ops
    from graphpass.fp8 import triton_quantize as tq

    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        print("needs CUDA (or --dry-run)")
        return 1
    why = tq.interpreter_unsupported() if args.dry_run else None
    if why:
        print(f"--dry-run runs the kernels under Triton's interpreter: {why}")
        return 1
    shapes = [tuple(int(d) for d in s.split("x"))
              for s in (args.shapes or (DRY_SHAPES if args.dry_run else DEFAULT_SHAPES))]
    best: dict[str, dict] = {}
    if args.dry_run:
        bench = None
    else:
        import triton.testing

        def bench(fn) -> float:
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"triton {tq.triton.__version__}")
    if "grouped" in args.sections:
        grouped_shapes = [tuple(int(d) for d in s.split("x")) for s in (
            args.grouped_shapes or (DRY_GROUPED_SHAPES if args.dry_run else GROUPED_SHAPES))]
        grouped(grouped_shapes, args.recipe, device, bench)
        if args.sweep and bench is not None:
            best["grouped"] = grouped_sweep(grouped_shapes[0], args.recipe, bench)
            write_best(args.best_out, best)
    if "experts" not in args.sections:
        return 0
    print(f"| shape | usage | kernels ms | GB/s | Inductor ms | GB/s | speed-up | = eager |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for shape in shapes:
        torch._dynamo.reset()
        reference = ops.experts_rowwise_torch if args.dry_run else torch.compile(
            ops.experts_rowwise_torch, dynamic=False)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        for usage in USAGES:
            def ours():
                return tq.quantize_experts_rowwise_for(x, args.recipe, "weight", usage)

            def theirs():
                return reference(x, args.recipe, "weight", usage)

            same = identical(ours(), ops.experts_rowwise_torch(
                x, args.recipe, "weight", usage)) if x.numel() <= EAGER_CHECK_LIMIT else "-"
            floor = x.numel() * COPIES[usage] * (x.element_size() + 1)
            print_row(f"| {'x'.join(map(str, shape))} | {usage} |", ours, theirs, floor, same,
                      bench)
        del x
        torch.cuda.empty_cache() if device == "cuda" else None
    if args.sweep and bench is not None:
        best["experts"] = sweep(shapes[0], args.recipe, bench)
        write_best(args.best_out, best)
    return 0


def resources(args: argparse.Namespace) -> int:
    """``--resources``: the table of each sweep configuration's kernels as compiled for sm_90,
    on the first weight shape and the first token-grouped shape."""
    import torch

    import _sm90
    from graphpass.fp8 import triton_grouped as tg
    from graphpass.fp8 import triton_quantize as tq

    shape = tuple(int(d) for d in (args.shapes or DEFAULT_SHAPES)[0].split("x"))
    t, k, groups = (int(d) for d in (args.grouped_shapes or GROUPED_SHAPES)[0].split("x"))
    weight = torch.empty(shape, dtype=torch.bfloat16)  # nothing reads them: launches recorded
    tokens, offs = torch.empty((t, k), dtype=torch.bfloat16), group_ends(t, groups, "cpu")
    print(f"sm_90 as launched, triton {tq.triton.__version__}, bf16; in flight: the input bytes "
          "the programs an SM holds have loaded or are loading")
    print("| kernels | config | usage | kernel | registers | spill B | shared KiB | programs/SM "
          "| in flight KiB/SM |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    compiled: dict = {}
    families = [("experts " + "x".join(map(str, shape)), SWEEP, USAGES,
                 lambda cfg, usage: tq.quantize_experts_rowwise_for(
                     weight, args.recipe, "weight", usage, config=tq.KernelConfig(**cfg))),
                (f"grouped {t}x{k}x{groups}", GROUPED_SWEEP, ("both", "columnwise"),
                 lambda cfg, usage: tg.quantize_groups_rowwise_for(
                     tokens, args.recipe, "input", usage, offs,
                     config=tg.GroupedKernelConfig(**cfg)))]
    for family, configs, usages, quantize in families:
        for change in configs:
            for usage in usages:
                for fn, a, kw in _sm90.launches(lambda: quantize(change, usage)):
                    key = (fn, _sm90.source(fn, a, kw, specialise=True)[0].hash(),
                           tuple(sorted((n, v) for n, v in kw.items() if n not in fn.arg_names)))
                    if key not in compiled:
                        compiled[key] = _sm90.resources(
                            _sm90.compile_launch(fn, a, kw, specialise=True))
                    r = compiled[key]
                    print(f"| {family} | {change or 'default'} | {usage} | {fn.__name__} | "
                          f"{r.registers} | {r.spill_bytes} | {r.shared / 1024:.1f} | "
                          f"{_sm90.programs_per_sm(r)} | {_sm90.in_flight(r, kw, 2) / 1024:.0f} |")
    return 0


def write_best(path: Path | None, best: dict[str, dict]) -> None:
    """The fastest configurations found so far, as JSON (tuples as lists): written after each
    sweep, so a stage cut by its timeout keeps the first."""
    if path is not None:
        path.write_text(json.dumps(best, indent=1) + "\n")
        print(f"fastest configurations: {best} (written to {path})")


def fastest(timed: list[tuple[float, dict]]) -> dict:
    """The change to the defaults of least total time among ``timed`` (the bit-identical
    configurations); the defaults where there is none."""
    return min(timed, key=lambda row: row[0])[1] if timed else {}


def print_row(row: str, ours, theirs, floor: int, same: str, bench) -> None:
    """One table row: the kernels' and Inductor's medians, their GB/s against ``floor`` bytes,
    the speed-up and the bit-identity check; dashes where nothing is timed (``bench`` None)."""
    if bench is None:
        print(f"{row} - | - | - | - | - | {same} |")
        return
    t_ours, t_theirs = bench(ours), bench(theirs)
    print(f"{row} {t_ours:.3f} | {floor / t_ours / 1e6:.0f} | {t_theirs:.3f} | "
          f"{floor / t_theirs / 1e6:.0f} | {t_theirs / t_ours:.2f}x | {same} |")


def group_ends(tokens: int, groups: int, device: str):
    """int32 group ends of ``tokens`` tokens routed to ``groups`` experts at random (sizes from a
    fixed seed; every token in a group)."""
    import torch

    gen = torch.Generator().manual_seed(tokens + groups)
    sizes = torch.multinomial(torch.ones(groups), tokens, replacement=True, generator=gen)
    return torch.cumsum(torch.bincount(sizes, minlength=groups), 0).to(torch.int32).to(device)


def grouped(shapes: list[tuple[int, int, int]], recipe: str, device: str, bench) -> None:
    """The token-grouped section: both rowwise copies of (T, K) bf16 tokens in G groups, the
    kernels against the torch code compiled by Inductor, and whether they are bit-identical."""
    import torch

    from graphpass.fp8 import ops
    from graphpass.fp8 import triton_grouped as tg

    print("token-grouped activations, both copies (rowwise and 16-aligned columnwise):")
    print("| T x K x G | kernels ms | GB/s | Inductor ms | GB/s | speed-up | = eager |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for t, k, groups in shapes:
        torch._dynamo.reset()
        reference = ops.groups_torch if bench is None else torch.compile(
            lambda x, offs: ops.groups_torch(x, recipe, "input", "both", offs), dynamic=False)
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn((t, k), generator=gen, device=device, dtype=torch.bfloat16)
        offs = group_ends(t, groups, device)

        def ours():
            return tg.quantize_groups_rowwise_for(x, recipe, "input", "both", offs)

        def theirs():
            return reference(x, offs) if bench is not None else reference(
                x, recipe, "input", "both", offs)

        same = identical(ours(), ops.groups_torch(x, recipe, "input", "both", offs)) \
            if x.numel() <= EAGER_CHECK_LIMIT else "-"
        floor = x.numel() * 2 * (x.element_size() + 1)
        print_row(f"| {t}x{k}x{groups} |", ours, theirs, floor, same, bench)
        del x
        torch.cuda.empty_cache() if device == "cuda" else None
    print()


# The tile configurations --sweep times, as changes to the defaults. Measured on an H200 and
# left out: tiles of fewer elements a thread (8 to 32; slower although they do not spill), and
# most configurations of one tile a program, the way torchao's MoE quantize kernels work (both
# copies of a weight 1.30 to 2.00 ms against 1.246): one of each family is kept.
# ``*_stages``: how deep Triton pipelines each loop's loads (cp.async into shared memory); the
# kernels timed before these settings existed ran every loop unpipelined (1, the default).
GROUPED_SWEEP = [
    dict(),
    dict(cast_block=(32, 128)),  # the default before (0.258 against 0.238 ms at 8192x7168x16)
    dict(amax_t_chunk=32, cast_k_chunk=128),  # both passes one tile a program
    dict(cast_block=(8, 128)),
    dict(cast_k_chunk=512),
    dict(amax_t_chunk=256),
    dict(cast_stages=2),
    dict(cast_stages=3),
    dict(cast_stages=3, cast_block=(32, 128)),
    # programs of 2 warps: 8 an SM where 4 warps take 4 (about 120 registers either way)
    dict(cast_stages=3, cast_warps=2),
    dict(cast_stages=4, cast_warps=2),
    # the amax pass's tile narrower, pipelined: 3 programs an SM instead of 2 (242 registers)
    dict(amax_block=(32, 256), amax_stages=3, cast_stages=3),
    dict(amax_block=(32, 256), amax_stages=3, cast_stages=4, cast_warps=2),
]


def grouped_sweep(shape: tuple[int, int, int], recipe: str, bench) -> dict:
    """Median times of tile configurations of the grouped kernels: both copies, and the
    columnwise copy alone (the wgrad operand of a layer's input, whose rowwise copy the forward
    made)."""
    import torch

    from graphpass.fp8 import ops
    from graphpass.fp8 import triton_grouped as tg

    t, k, groups = shape
    x = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
    offs = group_ends(t, groups, "cuda")
    usages = ("both", "columnwise")
    eager = {u: ops.groups_torch(x, recipe, "input", u, offs) for u in usages}
    print(f"grouped tile configurations, {t}x{k}x{groups}:")
    print("| config | both ms | columnwise ms | identical |")
    print("| --- | ---: | ---: | --- |")
    timed: list[tuple[float, dict]] = []
    for change in GROUPED_SWEEP:
        cfg = tg.GroupedKernelConfig(**change)

        def run(usage):
            return tg.quantize_groups_rowwise_for(x, recipe, "input", usage, offs, config=cfg)

        try:
            same = all(identical(run(u), eager[u]) for u in usages)
            times = [bench(lambda: run(u)) for u in usages]
        except Exception as error:  # one configuration that fails to compile is one row
            print(f"| {change} | {type(error).__name__}: {str(error)[:200]!r} | | |")
            continue
        print(f"| {change or 'default'} | " + " | ".join(f"{ms:.3f}" for ms in times)
              + f" | {same} |")
        if same:
            timed.append((sum(times), change))
    print()
    return fastest(timed)


SWEEP = [
    dict(),
    dict(cast_k_chunk=128),  # one tile a program
    dict(cast_k_chunk=2048),
    dict(cast_block=(64, 128)),  # the default before (1.276 against 1.246 ms, both copies)
    dict(cast_block=(16, 128)),
    dict(rows_block=(4, 1024)),
    dict(rows_block=(2, 2048), rows_warps=8),
    # the rowwise kernel's second read from the rows' last tile (the one read last)
    dict(rows_reverse=True),
    dict(cast_stages=2, rows_stages=2),
    dict(cast_stages=3, rows_stages=3),
    dict(cast_stages=4, rows_stages=4),
    dict(cast_stages=3, rows_stages=3, cast_block=(64, 128), rows_block=(4, 1024)),
    dict(cast_stages=3, rows_stages=3, rows_reverse=True),
    # the amax pass's tile narrower, pipelined: 4 to 7 programs an SM instead of 2 (226 registers)
    dict(amax_block=(32, 256), amax_stages=3, cast_stages=3, rows_stages=3),
    dict(amax_block=(16, 256), amax_stages=4, cast_stages=3, rows_stages=3),
]


def sweep(shape: tuple[int, int, int], recipe: str, bench) -> dict:
    """Median times of tile configurations of the kernels (each usage), then of the default
    configuration's amax and cast passes alone."""
    import torch

    from graphpass.fp8 import recipes
    from graphpass.fp8 import triton_quantize as tq

    from graphpass.fp8 import ops

    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    eager = {u: ops.experts_rowwise_torch(x, recipe, "weight", u) for u in USAGES}
    print(f"\ntile configurations, {'x'.join(map(str, shape))}:")
    print("| config | both ms | rowwise ms | columnwise ms | identical |")
    print("| --- | ---: | ---: | ---: | --- |")
    timed: list[tuple[float, dict]] = []
    for change in SWEEP:
        cfg = tq.KernelConfig(**change)

        def run(usage):
            return tq.quantize_experts_rowwise_for(x, recipe, "weight", usage, config=cfg)

        try:
            same = all(identical(run(u), eager[u]) for u in USAGES)
            times = [bench(lambda: run(u)) for u in USAGES]
        except Exception as error:  # one configuration that fails to compile is one row
            print(f"| {change} | {type(error).__name__}: {str(error)[:200]!r} | | | |")
            continue
        print(f"| {change or 'default'} | " + " | ".join(f"{t:.3f}" for t in times)
              + f" | {same} |")
        if same:
            timed.append((sum(times), change))
    del eager
    cfg = tq.DEFAULT_CONFIG
    xs = x.view(torch.int16)
    r = recipes.get_recipe(recipe)
    print("\n| pass | both ms | rowwise ms | columnwise ms |")
    print("| --- | ---: | ---: | ---: |")
    amax = {u: tq._amax_pass(xs, COPIES[u] == 2 or u == "rowwise", u != "rowwise", cfg)
            for u in USAGES}
    outs = {u: tq._outputs(x, recipes.E4M3, *(a is not None for a in amax[u])) for u in USAGES}
    t_amax = [bench(lambda: tq._amax_pass(xs, *(a is not None for a in amax[u]), cfg))
              for u in USAGES]
    t_cast = [bench(lambda: tq._cast_pass(
        xs, *amax[u], outs[u], fp8_max=448.0, power_2_scales=r.power_2_scales,
        amax_epsilon=r.amax_epsilon, e5m2=False, cast="ptx", cfg=cfg)) for u in USAGES]
    print("| amax | " + " | ".join(f"{t:.3f}" for t in t_amax) + " |")
    print("| cast | " + " | ".join(f"{t:.3f}" for t in t_cast) + " |")
    return fastest(timed)


if __name__ == "__main__":
    sys.exit(main())
