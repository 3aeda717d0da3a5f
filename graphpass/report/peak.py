"""The step's predicted memory peak: how many bytes, where in the step, and what is live there.
Pure data; ``graph/peak.py`` computes it from the partitioned graphs as a :class:`StepPeak`,
which the passes read; the report keeps its JSON form (``StepPeak.to_dict``,
``report.meta["step_peak"]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .totals import format_bytes

# What a live tensor at the peak is, in the order the text lists the totals.
LIVE_KINDS = ("parameter", "input", "cached", "saved", "output", "gradient", "transient",
              "offloaded")


class LiveTensor(NamedTuple):
    """A storage live at the peak: the node that allocated it, and what it is (``LIVE_KINDS``)."""

    name: str
    op: str
    module: str
    kind: str
    bytes: int


@dataclass(frozen=True)
class StepPeak:
    """The step's predicted peak on the compute device."""

    bytes: int
    device: str
    phase: str
    """``forward`` or ``backward``."""
    node: str
    """The node running at the peak (``-`` where it is before the first)."""
    module: str
    op: str
    live: tuple[LiveTensor, ...]
    """What is live there, biggest first."""
    forward_peak: int
    backward_peak: int
    runtime: str
    """``inductor`` or ``eager``: the code whose freeing the walk follows."""

    @classmethod
    def of(cls, *, live: list[LiveTensor], **fields: Any) -> "StepPeak":
        """The peak, ``live`` sorted biggest first (then by name), as the JSON form lists it."""
        return cls(live=tuple(sorted(live, key=lambda t: (-t.bytes, t.name))), **fields)

    @property
    def by_kind(self) -> dict[str, int]:
        """The bytes live at the peak per kind, in the order of ``LIVE_KINDS``."""
        by_kind: dict[str, int] = {}
        for t in self.live:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + t.bytes
        return {k: by_kind[k] for k in LIVE_KINDS if k in by_kind}

    def to_dict(self) -> dict[str, Any]:
        """The JSON form the report keeps (``peak_dict``)."""
        return peak_dict(bytes=self.bytes, device=self.device, phase=self.phase, node=self.node,
                         module=self.module, op=self.op, live=[t._asdict() for t in self.live],
                         forward_peak=self.forward_peak, backward_peak=self.backward_peak,
                         runtime=self.runtime)


def peak_dict(*, bytes: int, device: str, phase: str, node: str, module: str, op: str,
              live: list[dict[str, Any]], forward_peak: int, backward_peak: int,
              runtime: str) -> dict[str, Any]:
    """The JSON form: ``live`` lists ``{name, op, module, kind, bytes}`` biggest first."""
    by_kind: dict[str, int] = {}
    for t in live:
        by_kind[t["kind"]] = by_kind.get(t["kind"], 0) + t["bytes"]
    return {"bytes": bytes, "device": device, "phase": phase, "node": node, "module": module,
            "op": op, "forward_peak": forward_peak, "backward_peak": backward_peak,
            "by_kind": {k: by_kind[k] for k in LIVE_KINDS if k in by_kind},
            "live": sorted(live, key=lambda t: (-t["bytes"], t["name"])), "runtime": runtime}


def merge_peaks(peaks: list[dict[str, Any]], saved: list[int], params: list[int]) -> dict[str, Any]:
    """The peak of several graphs run as one step (a model split by graph breaks): graph ``i``'s
    forward and backward run while graphs ``0..i-1`` hold their saved bytes (``saved``), and every
    graph's parameters (``params``) are counted once for all. The result is the graph whose peak,
    so offset, is highest; its ``bytes`` include the offset and the other graphs' parameters."""
    if len(peaks) == 1:
        return peaks[0]
    total_params = sum(params)
    best, best_bytes = peaks[0], -1
    for i, p in enumerate(peaks):
        offset = sum(saved[:i]) + total_params - params[i]
        if p["bytes"] + offset > best_bytes:
            best, best_bytes = {**p, "bytes": p["bytes"] + offset, "held_by_other_graphs": offset}, \
                p["bytes"] + offset
    return best


def peak_lines(peak: dict[str, Any], *, top: int = 5) -> list[str]:
    """The report's text: the peak, where, the totals per kind and the biggest live tensors."""
    where = f"{peak['phase']} at {peak['node']} ({peak['op']}"
    where += f" in {peak['module']})" if peak["module"] else ")"
    lines = [f"step peak (predicted, {peak['device']}): {format_bytes(peak['bytes'])} "
             f"({peak['bytes']:,} B), {where}; forward peak {format_bytes(peak['forward_peak'])}, "
             f"backward peak {format_bytes(peak['backward_peak'])}"]
    lines.append("  live at the peak: " + ", ".join(
        f"{kind} {format_bytes(n)}" for kind, n in peak["by_kind"].items())
        + (f", other graphs {format_bytes(peak['held_by_other_graphs'])}"
           if peak.get("held_by_other_graphs") else ""))
    for t in peak["live"][:top]:
        lines.append(f"  {format_bytes(t['bytes'])}: {t['kind']} {t['name']} ({t['op']}"
                     + (f" in {t['module']})" if t["module"] else ")"))
    return lines
