"""FP8 coverage, as the report keeps it: the FP8 share of a step's GEMM FLOPs per phase, merged
over graphs, and its lines in the report's text (``graph/gemms.py`` measures it on a graph)."""

from __future__ import annotations

PHASES = ("forward", "dgrad", "wgrad")


def merge_coverage(parts: list[dict]) -> dict:
    """The coverage of several graphs (a model split by graph breaks) as one step."""
    cov = {"gemm_flops": dict.fromkeys(PHASES, 0), "fp8_flops": dict.fromkeys(PHASES, 0),
           "high_precision_flops": {}}
    for part in parts:
        for key in ("gemm_flops", "fp8_flops", "high_precision_flops"):
            for k, v in part[key].items():
                cov[key][k] = cov[key].get(k, 0) + v
    return with_share(cov)


def with_share(cov: dict) -> dict:
    """``cov`` with its ``fp8_share``: FP8 FLOPs over all GEMM FLOPs (1.0 without GEMMs)."""
    total = sum(cov["gemm_flops"].values())
    cov["fp8_share"] = sum(cov["fp8_flops"].values()) / total if total else 1.0
    return cov


def coverage_lines(cov: dict) -> list[str]:
    """The report's text: one totals line, then one line per high-precision reason."""
    def share(phase: str) -> str:
        total = cov["gemm_flops"][phase]
        return f"{phase} {cov['fp8_flops'][phase] / total:.1%}" if total else f"{phase} -"

    total = sum(cov["gemm_flops"].values())
    lines = [f"fp8: {cov['fp8_share']:.1%} of {total:,} GEMM FLOPs run as FP8 GEMMs ("
             + ", ".join(map(share, PHASES)) + ")"]
    for reason, flops in sorted(cov["high_precision_flops"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  high precision: {flops / total:.1%} ({flops:,} FLOPs): {reason}")
    return lines
