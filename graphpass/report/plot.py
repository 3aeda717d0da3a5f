"""Bar charts of saved bytes per layer and kind, policies side by side (needs ``graphpass[plot]``)."""

from __future__ import annotations

import os
from typing import Mapping, Sequence, Union

from ..paths import natural_key
from .rows import Report, Row, is_offloaded, is_recomputed
from .totals import format_bytes, grouped, layer

# Stacked bottom to top. Offloaded values (hatched) do not occupy device memory; recomputed ones
# (dotted) are what a recompute saves for itself: the RNG state a random op is replayed under.
CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("activation bfloat16", "#4c72b0", ""),
    ("activation float32", "#8fb3de", ""),
    ("activation other dtypes", "#b8b8b8", ""),
    ("FP8 data and scales", "#55a868", ""),
    ("offloaded", "#dd8452", "//"),
    ("recomputed", "#c44e52", ".."),
)


def category(row: Row) -> str:
    """The chart segment of an activation row: recompute and offload decisions win over dtype."""
    if is_recomputed(row):
        return "recomputed"
    if is_offloaded(row):
        return "offloaded"
    if row.kind in ("fp8_data", "fp8_scale"):
        return "FP8 data and scales"
    if row.dtype in ("bfloat16", "float32"):
        return f"activation {row.dtype}"
    return "activation other dtypes"


def bytes_by_layer_and_category(report: Report) -> dict[str, dict[str, int]]:
    # offloaded rows too: they are a segment of their own
    saved = [r for r in report.rows if r.kind != "parameter"]
    return {name: grouped((r for r in saved if layer(r) == name), category)
            for name in grouped(saved, layer)}


def plot_saved_bytes(
    panels: Mapping[str, Sequence[tuple[str, Report]]], path: Union[str, "os.PathLike[str]"]
) -> None:
    """One panel per model (title -> [(policy label, report)]), one bar group per layer."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    data = {title: [(label, bytes_by_layer_and_category(r)) for label, r in runs]
            for title, runs in panels.items()}
    widest = max(len({layer for _, d in runs for layer in d}) * len(runs) for runs in data.values())
    fig = Figure(figsize=(max(6.0, 1.5 + 0.9 * widest), 4.5 * len(data)), layout="constrained")
    FigureCanvasAgg(fig)  # Figure without pyplot: no global state, no GUI backend
    used: set[str] = set()
    group_axes = []
    for ax, (title, runs) in zip(fig.subplots(len(data), 1, squeeze=False)[:, 0], data.items()):
        layers = sorted({layer for _, d in runs for layer in d}, key=natural_key)
        peak = max(sum(d.get(layer, {}).values()) for _, d in runs for layer in layers)
        unit, scale = _unit(peak)
        width = 0.8 / len(runs)
        positions, labels = [], []
        for i, (label, per_layer) in enumerate(runs):
            xs = [g + (i - (len(runs) - 1) / 2) * width for g in range(len(layers))]
            bottoms = [0] * len(layers)
            for name, color, hatch in CATEGORIES:
                heights = [per_layer.get(layer, {}).get(name, 0) for layer in layers]
                if any(heights):
                    used.add(name)
                    ax.bar(xs, [h / scale for h in heights], width * 0.92,
                           bottom=[b / scale for b in bottoms], color=color, hatch=hatch,
                           edgecolor="white", linewidth=0.5)
                    bottoms = [b + h for b, h in zip(bottoms, heights)]
            for x, total in zip(xs, bottoms):
                ax.annotate(format_bytes(total), (x, total / scale), xytext=(0, 2),
                            textcoords="offset points", ha="center", va="bottom", fontsize=7)
            positions += xs
            labels += [label] * len(layers)
        if len(runs) > 1:
            # Policy under each bar, layer names on a second row below (placed once sizes are known).
            ax.set_xticks(positions, [_wrap(label) for label in labels], fontsize=7)
            group_axis = ax.secondary_xaxis("bottom")
            group_axis.set_xticks(range(len(layers)), layers, fontweight="bold")
            group_axis.spines["bottom"].set_visible(False)
            group_axes.append((ax, group_axis))
        else:
            ax.set_xticks(range(len(layers)), layers, fontweight="bold")
        ax.set_title(f"{title}: activation bytes saved for backward, per layer", loc="left")
        ax.set_ylabel(f"saved ({unit})")
        ax.margins(y=0.12)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    fig.legend(handles=[Patch(facecolor=c, hatch=h, edgecolor="white", label=n)
                        for n, c, h in CATEGORIES if n in used],
               loc="outside lower center", ncols=min(3, len(used)), fontsize=8, frameon=False)
    if group_axes:
        renderer = fig.canvas.get_renderer()
        for ax, group_axis in group_axes:
            tall = max(t.get_window_extent(renderer).height for t in ax.get_xticklabels())
            group_axis.tick_params(length=0, pad=tall * 72 / fig.dpi + 8)
    fig.savefig(path, dpi=120)


def _unit(peak: int) -> tuple[str, int]:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if peak >= scale:
            return unit, scale
    return "B", 1


def _wrap(label: str) -> str:
    return label.replace(" ", "\n")
