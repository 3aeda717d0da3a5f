"""Saved activation bytes of real-size layers under each memory policy, planned on fake tensors.

    python benchmarks/memory.py                    # llama, gpt, deepseek at real size, tensorwise
    python benchmarks/memory.py --markdown         # the table for docs/numbers.md
    python benchmarks/memory.py --cache            # + the FP8 activation cache and torch's pass
    python benchmarks/memory.py --compare --models llama   # per tensor: fp8_cache=all vs torch's pass

Per layer and policy it prints the bytes the forward saves for the backward (parameters and
their views excluded, each storage counted once) and the recompute the policy adds, as a share
of the step's FLOPs. No GPU is needed: ``graphpass.plan`` traces and partitions under fake
tensors. The "lower bound" is torch's min-cut when every op but GEMMs, attention and random ops
may be recomputed, with no recompute budget: no plan that keeps those ops saved saves less.

``--cache`` adds the lossy rows: graphpass auto with ``fp8_cache`` at each level, and
torch's own activation quantization (``post_grad_fusion_options["activation_quantization_aten_pass"]``
with all sizes, e5m2, scaled), alone (behind torch's default partitioner, bf16) and behind
graphpass's exact plan. torch's pass runs inside the min-cut partitioner, so it works under fake
tensors too; its nodes carry no module path, so its rows have no inside-the-layer bytes. The
"in layer" column is the layer's own bytes (``layers.0``) in units of seq*hidden bytes.
"""

from __future__ import annotations

import argparse
import importlib
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import graphpass  # noqa: E402
from graphpass.report import format_bytes  # noqa: E402

# Megatron-Core sets save_original_input on these linears: the attention output projection
# always under FP8, the linears reading a recomputed norm
# (qkv, MLA down-projections, dense fc1, shared-expert fc1).
MEGATRON_SAVE_ORIGINAL = {
    "llama": ("*.o_proj", "*.q_proj", "*.k_proj", "*.v_proj", "*.mlp.gate_proj", "*.mlp.up_proj"),
    "gpt": ("*.attn.proj", "*.attn.qkv", "*.mlp.fc1"),
    "deepseek": ("*.o_proj", "*.q_a_proj", "*.kv_a_proj_with_mqa", "*.shared_experts.gate_proj",
                 "*.shared_experts.up_proj"),
}


@dataclass
class Result:
    policy: str
    bytes: int | None
    recompute: float | None
    note: str = ""
    fp8_coverage: float | None = None
    """Share of the step's GEMM FLOPs that run as FP8 GEMMs (None without fp8)."""
    in_layer: float | None = None
    """Bytes saved inside the layer (``layers.0``), in seq*hidden bytes (None: not attributed)."""
    report: object = None
    """The plan's report (for the per-tensor comparison of the lossy rows)."""


# torch's own activation quantization (torch/_functorch/partitioners.py): every saved tensor of
# an allowed dtype over size_in_mb cast to float8_e5m2, scaled by one amax per row of its last
# dimension, after the min-cut.
TORCH_AQ = {"size_in_mb": 0, "use_scaling": True, "quant_type": "torch.float8_e5m2",
            "allowed_dtypes": "torch.bfloat16;torch.float32"}
TORCH_AQ_KEY = "torch activation quantization"
CACHE_LEVELS = ("act_input", "attn", "layer_input", "all")
ALL_PER_TENSOR = "graphpass auto + fp8_cache=all, fp8_cache_format=e4m3_tensor"
# torchao's MoE FP8 training (torchao.prototype.moe_training) swaps torch._grouped_mm calls for its
# own quantize-then-scaled-grouped-GEMM; a row that says why it is not planned here.
TORCHAO_MOE = "torchao-moe"
TORCHAO_MOE_WHY = ("not planned: torchao.prototype.moe_training replaces torch._grouped_mm calls "
                   "(this layer's routed experts are bmm over 3-D weights, capacity-style) and "
                   "its kernels need CUDA SM89+ (its README), so it cannot run under fake "
                   "tensors on a CPU")


def policies(model: str, fp8: str, cache: bool = False) -> dict[str, dict | str | None]:
    # Transformer Engine and Megatron-Core run every linear they are given in FP8, the experts of
    # the one-GPU DeepSeek-V3 layer included, which graphpass's cost model keeps in bf16
    te = dict(fp8=fp8, fp8_cost_model="off", save_original="never", memory="default")
    exact = {
        "bf16, torch default partitioner": dict(memory="default"),
        "FP8, torch default partitioner": te,
        "torchao float8 + torch.compile": None,  # planned separately below
        "Megatron-style hand policy": dict(te, save_original_modules=MEGATRON_SAVE_ORIGINAL[model],
                                           recompute=("layernorm", "moe_act")),
        "graphpass auto": dict(fp8=fp8),
        "lower bound": dict(fp8=fp8, recompute_budget=None),
    }
    if model == "deepseek":
        exact["torchao MoE FP8 training"] = TORCHAO_MOE
    if not cache:
        return exact
    lossy = {f"graphpass auto + fp8_cache={level}": dict(fp8=fp8, fp8_cache=level)
             for level in CACHE_LEVELS}
    # all in the per-tensor E4M3 format, one of the cache's comparison formats: its bytes against
    # torch's pass, whose per-row scales sit between it and the 1x128 default in granularity
    lossy[ALL_PER_TENSOR] = dict(fp8=fp8, fp8_cache="all", fp8_cache_format="e4m3_tensor")
    lossy["torch's activation quantization (bf16, torch default partitioner)"] = dict(
        memory="default", **{TORCH_AQ_KEY: True})
    lossy["graphpass auto + torch's activation quantization"] = dict(fp8=fp8, **{TORCH_AQ_KEY: True})
    return {**exact, **lossy}


def _in_layer(model_name: str, report) -> float | None:
    config = importlib.import_module(f"graphpass.models.{model_name}").SIZES["real"]
    inside = report.bytes_by_layer().get("layers.0")
    return None if inside is None else inside / (config.seq * config.batch * config.hidden)


def plan(model_name: str, size: str, cfg: dict | None) -> Result:
    if cfg == TORCHAO_MOE:
        return Result("torchao MoE FP8 training", None, None, TORCHAO_MOE_WHY)
    build = importlib.import_module(f"graphpass.models.{model_name}").build
    model, inputs = build(size)
    if cfg is None:
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError:
            return Result("torchao float8 + torch.compile", None, None, "torchao not installed")
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: not fqn.endswith("gate"))
        cfg = dict(memory="default")
    cfg = dict(cfg)
    torch_aq = cfg.pop(TORCH_AQ_KEY, False)
    options = {"activation_quantization_aten_pass": TORCH_AQ} if torch_aq else {}
    with torch._inductor.config.patch(post_grad_fusion_options=options):
        report = graphpass.plan(model, *inputs, config=graphpass.Config(**cfg))
    share = report.meta["recompute_flops"] / report.meta["step_flops"]
    coverage = report.meta.get("fp8_coverage", {}).get("fp8_share")
    in_layer = None if torch_aq or size != "real" else _in_layer(model_name, report)
    return Result("", report.activation_bytes, share, fp8_coverage=coverage, in_layer=in_layer,
                  report=report)


def run(models: list[str], size: str, fp8: str, cache: bool = False) -> dict[str, list[Result]]:
    results: dict[str, list[Result]] = {}
    for model in models:
        results[model] = []
        chosen = policies(model, fp8, cache)
        for i, (name, cfg) in enumerate(chosen.items()):
            start = time.perf_counter()
            print(f"[{model} {i + 1}/{len(chosen)}] {name} ...", file=sys.stderr, end="", flush=True)
            result = plan(model, size, cfg)
            result.policy = name
            print(f" {time.perf_counter() - start:.1f}s", file=sys.stderr)
            results[model].append(result)
    return results


def table(results: dict[str, list[Result]], *, markdown: bool) -> str:
    head = ("layer", "policy", "saved activations", "vs bf16", "recompute (% step FLOPs)",
            "FP8 GEMM FLOPs", "in layer (seq*hidden B)")
    rows = []
    for model, res in results.items():
        bf16 = res[0].bytes
        for r in res:
            if r.bytes is None:
                rows.append((model, r.policy, r.note, "", "", "", ""))
                continue
            cov = "-" if r.fp8_coverage is None else f"{r.fp8_coverage:.1%}"
            inside = "-" if r.in_layer is None else f"{r.in_layer:.2f}"
            rows.append((model, r.policy, f"{format_bytes(r.bytes)} ({r.bytes:,} B)",
                         f"{r.bytes / bf16 - 1:+.1%}", f"{r.recompute:.3%}", cov, inside))
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in (head, *rows))


def check(results: dict[str, list[Result]]) -> list[str]:
    """The memory targets, each as a line saying whether it holds."""
    lines = []
    for model, res in results.items():
        by = {r.policy: r.bytes for r in res}
        auto, lb = by["graphpass auto"], by["lower bound"]
        checks = [
            (f"auto within 2% of the lower bound ({auto / lb - 1:+.2%})", auto <= 1.02 * lb),
            (f"auto <= Megatron-style ({auto / by['Megatron-style hand policy'] - 1:+.1%})",
             auto <= by["Megatron-style hand policy"]),
            (f"auto >= 30% below bf16 default ({auto / by['bf16, torch default partitioner'] - 1:+.1%})",
             auto <= 0.7 * by["bf16, torch default partitioner"]),
            (f"auto >= 20% below FP8 default ({auto / by['FP8, torch default partitioner'] - 1:+.1%})",
             auto <= 0.8 * by["FP8, torch default partitioner"]),
            ("auto recompute <= 1% of step FLOPs",
             next(r.recompute for r in res if r.policy == "graphpass auto") <= 0.01),
        ]
        lines += [f"{model}: {'PASS' if ok else 'MISS'} {text}" for text, ok in checks]
    return lines


# torch's pass names its nodes fp8_quant_pos_<i>_<source> and fp8_scale_pos_<i>_<source>.
_TORCH_AQ_NODE = re.compile(r"fp8_(quant|scale)_pos_\d+_(.+)")


def _tensors(report, *, torch_aq: bool) -> dict[str, dict]:
    """The saved activations of ``report`` per tensor they store: its name, numel and the bytes
    kept exact, as FP8 data and as scales."""
    out: dict[str, dict] = {}
    for r in report.rows:
        if not r.is_activation or not r.bytes:
            continue
        match = _TORCH_AQ_NODE.fullmatch(r.name) if torch_aq else None
        if match:
            source, part = match.group(2), "data" if match.group(1) == "quant" else "scale"
        elif r.kind in ("fp8_data", "fp8_scale") and r.copy_of:
            source, part = r.copy_of, r.kind.removeprefix("fp8_")
        else:
            source, part = r.name, "exact"
        t = out.setdefault(source, {"name": source, "numel": 0, "exact": 0, "data": 0, "scale": 0})
        t[part] += r.bytes
        if part != "scale":
            t["numel"] = max(t["numel"], math.prod(r.shape))
    return out


def byte_comparison(ours, theirs) -> list[tuple[str, dict, dict]]:
    """graphpass's saved tensors (``ours``, a report) next to torch's pass's (``theirs``), one row
    per stored tensor: matched by name, then (a view's name differs: graphpass names a cached
    view's base, torch the view) the rest pairwise in graph order by element count."""
    a, b = _tensors(ours, torch_aq=False), _tensors(theirs, torch_aq=True)
    empty = {"exact": 0, "data": 0, "scale": 0, "numel": 0}
    rows = [(name, a.pop(name), b.pop(name)) for name in list(a) if name in b]
    for name, t in list(a.items()):
        other = next((k for k, u in b.items() if u["numel"] == t["numel"]), None)
        if other is not None:
            rows.append((f"{name} / {other}", a.pop(name), b.pop(other)))
    rows += [(name, t, empty) for name, t in a.items()] + [(name, empty, t) for name, t in b.items()]
    return rows


def byte_comparison_table(rows: list[tuple[str, dict, dict]]) -> str:
    head = ("tensor (graphpass / torch's pass)", "elements", "graphpass: exact", "FP8 data",
            "scales", "torch's pass: exact", "FP8 data", "scales", "graphpass - torch's pass")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    total = [0] * 6
    for name, a, b in rows:
        cells = [a["exact"], a["data"], a["scale"], b["exact"], b["data"], b["scale"]]
        total = [t + c for t, c in zip(total, cells)]
        diff = sum(cells[:3]) - sum(cells[3:])
        lines.append(f"| {name} | {max(a['numel'], b['numel']):,} | "
                     + " | ".join(f"{c:,}" for c in cells) + f" | {diff:+,} |")
    lines.append("| **total** | | " + " | ".join(f"{c:,}" for c in total)
                 + f" | {sum(total[:3]) - sum(total[3:]):+,} |")
    return "\n".join(lines)


def byte_parts(rows: list[tuple[str, dict, dict]]) -> tuple[list[tuple[str, int]], int, int]:
    """graphpass's bytes minus torch's pass's in ``rows``, in three parts: per tensor graphpass
    keeps exact that torch's pass casts, the scales and the FP8 data of the tensors both cast."""
    kept = [(name, a["exact"] - b["exact"] - b["data"] - b["scale"]) for name, a, b in rows
            if a["exact"] and not b["exact"] and (b["data"] or b["scale"])]
    scales = sum(a["scale"] - b["scale"] for name, a, b in rows if not a["exact"])
    data = sum(a["data"] - b["data"] for name, a, b in rows if not a["exact"])
    return kept, scales, data


def least_difference_1x128(rows: list[tuple[str, dict, dict]]) -> int:
    """A lower bound on graphpass's bytes minus torch's pass's in ``rows`` (cached in a 1x128
    format) over every choice of what else to cache: each tensor graphpass keeps exact that
    torch's pass casts counts as the smaller of kept exact and cached, cached costing at least
    one byte per element and one scale byte per 128 elements (rows of fewer elements only add
    blocks). Uncaching a cached tensor adds bytes, so the cached ones count as they are."""
    kept, scales, data = byte_parts(rows)
    numel = {name: a["numel"] for name, a, _ in rows}
    theirs = {name: b["data"] + b["scale"] for name, _, b in rows}
    return scales + data + sum(min(d, numel[name] + -(-numel[name] // 128) - theirs[name])
                               for name, d in kept)


def byte_reason(rows: list[tuple[str, dict, dict]],
                scales_are: str = "one E8M0 byte per 1x128 block") -> str:
    """Why graphpass's ``all`` saves more (or less) than torch's pass behind the same exact plan,
    counted: the tensors graphpass keeps exact that torch's pass casts, and the scales
    (graphpass's are ``scales_are``)."""
    kept, scales, data = byte_parts(rows)
    parts = [f"{name} kept exact (torch's pass casts it to FP8): {d:+,} B" for name, d in kept]
    parts.append(f"scales (graphpass {scales_are}, torch's pass one fp32 per row): {scales:+,} B")
    parts.append(f"FP8 data: {data:+,} B")
    return "; ".join(parts)


def check_cache(results: dict[str, list[Result]]) -> list[str]:
    """The byte targets of the FP8 activation cache, each as a PASS/FAIL line."""
    lines = []
    for model, res in results.items():
        by = {r.policy: r for r in res}
        if "graphpass auto + fp8_cache=all" not in by:
            continue
        all_ = by["graphpass auto + fp8_cache=all"]
        checks, infos = [], []
        if model == "llama":
            act = by["graphpass auto + fp8_cache=act_input"]
            torch_aq = by["graphpass auto + torch's activation quantization"]
            rows = byte_comparison(all_.report, torch_aq.report)
            least = least_difference_1x128(rows)
            bound = (f"; no choice of cached tensors closes it in this format: caching the ones "
                     f"kept exact too leaves at least {least:+,} B" if least > 0 else "")
            checks += [
                (f"act_input <= 16.1 seq*hidden B in the layer ({act.in_layer:.2f})",
                 act.in_layer is not None and act.in_layer <= 16.1),
                (f"all <= 12.0 seq*hidden B in the layer ({all_.in_layer:.2f})",
                 all_.in_layer is not None and all_.in_layer <= 12.0),
                (f"torch's pass behind graphpass's exact plan saves more than all "
                 f"({torch_aq.bytes:,} B vs {all_.bytes:,} B; whole graph: torch's nodes have "
                 f"no module path; graphpass - torch's pass, counted: {byte_reason(rows)}{bound})",
                 torch_aq.bytes > all_.bytes),
            ]
            if ALL_PER_TENSOR in by:
                tensor = by[ALL_PER_TENSOR]
                reason = byte_reason(byte_comparison(tensor.report, torch_aq.report),
                                     "one fp32 per tensor")
                infos.append(f"{model}: info: all in e4m3_tensor saves {tensor.bytes:,} B, "
                             f"torch's pass {torch_aq.bytes:,} B (graphpass - torch's pass, "
                             f"counted: {reason})")
        else:
            lb = by["lower bound"].bytes
            checks.append((f"all >= 40% below the exact lower bound ({all_.bytes / lb - 1:+.1%})",
                           all_.bytes <= 0.6 * lb))
        lines += [f"{model}: {'PASS' if ok else 'FAIL'} {text}" for text, ok in checks] + infos
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["llama", "gpt", "deepseek"])
    p.add_argument("--size", default="real")
    p.add_argument("--fp8", default="tensorwise", choices=["tensorwise", "blockwise", "mxfp8"])
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--cache", action="store_true",
                   help="add the FP8 activation cache's levels and torch's activation quantization")
    p.add_argument("--compare", action="store_true",
                   help="only the per-tensor byte table: fp8_cache=all vs torch's pass behind "
                        "graphpass's exact plan, for each model")
    args = p.parse_args()
    if args.compare:
        for model in args.models:
            ours = plan(model, args.size, dict(fp8=args.fp8, fp8_cache="all")).report
            theirs = plan(model, args.size, dict(fp8=args.fp8, **{TORCH_AQ_KEY: True})).report
            rows = byte_comparison(ours, theirs)
            print(f"{model} ({args.size}, fp8={args.fp8}): saved bytes per tensor\n")
            print(byte_comparison_table(rows))
            print(f"\ngraphpass - torch's pass, counted: {byte_reason(rows)}\n")
        return
    results = run(args.models, args.size, args.fp8, args.cache)
    print(table(results, markdown=args.markdown))
    print()
    lines = check(results) + (check_cache(results) if args.cache and args.size == "real" else [])
    print("\n".join(("- " if args.markdown else "") + line for line in lines))


if __name__ == "__main__":
    main()
