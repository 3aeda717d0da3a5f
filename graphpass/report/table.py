"""The report as an aligned text table, with its totals and notes."""

from __future__ import annotations

from typing import Any, Protocol

from ..config import Config
from ..paths import OUTSIDE_LAYERS
from .coverage import coverage_lines
from .peak import peak_lines
from .totals import format_bytes


class Report(Protocol):
    """What the table reads of a report (``rows.Report``, which calls ``table``)."""

    rows: list
    notes: list[str]
    meta: dict[str, Any]
    activation_bytes: int
    parameter_bytes: int
    offloaded_bytes: int

    def bytes_by(self, key: str) -> dict: ...

_DEFAULTS = Config().as_dict()
HEADER = ("name", "op", "module", "shape", "dtype", "bytes", "kind", "backward use", "decision")


def table(report: Report, *, max_consumers: int = 3) -> str:
    """One line per row, then totals per kind, recompute, FP8 coverage, per layer, and notes."""
    body = []
    for r in report.rows:
        uses = ", ".join(r.consumers[:max_consumers]) + (", ..." if len(r.consumers) > max_consumers else "")
        size = format_bytes(r.bytes) if not r.alias_of else f"(view of {r.alias_of})"
        body.append((r.name, r.op, r.module or "-", "x".join(map(str, r.shape)) or "-",
                     r.dtype, size, r.kind, uses or "-", r.decision))
    widths = [max(len(str(c)) for c in col) for col in zip(HEADER, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (HEADER, *body)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    kinds = report.bytes_by("kind")
    lines.append(f"activation bytes: {format_bytes(report.activation_bytes)} ({report.activation_bytes:,} B)"
                 + "".join(f"; {k} {format_bytes(v)}" for k, v in sorted(kinds.items())))
    lines.append(f"parameters saved (not counted): {format_bytes(report.parameter_bytes)}")
    if report.offloaded_bytes:
        lines.append(f"offloaded to host (not counted): {format_bytes(report.offloaded_bytes)}")
    if report.meta.get("step_flops"):
        lines.append(f"recompute: {report.meta['recompute_flops'] / report.meta['step_flops']:.3%} "
                     "of the step's FLOPs")
    if "fp8_coverage" in report.meta:
        lines += coverage_lines(report.meta["fp8_coverage"])
    if "step_peak" in report.meta:
        lines += peak_lines(report.meta["step_peak"])
    layers = report.bytes_by("layer")
    if len(layers) > 1 or OUTSIDE_LAYERS not in layers:
        lines += [f"  {layer}: {format_bytes(b)}" for layer, b in layers.items()]
    if report.meta.get("options_from"):
        changed = ", ".join(f"{k}={v!r}" for k, v in report.meta.get("config", {}).items()
                            if v != _DEFAULTS.get(k))
        lines.append(f"options: {changed or 'defaults'} (from {report.meta['options_from']})")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)
