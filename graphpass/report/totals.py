"""Byte totals over saved values, shared by reports, snapshots and plots, and byte formatting."""

from __future__ import annotations

from typing import Any, Callable, Iterable

from ..paths import OUTSIDE_LAYERS, layer_of


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def layer(saved: Any) -> str:
    """The layer a saved value belongs to, ``(outside layers)`` for none."""
    return layer_of(saved.module) or OUTSIDE_LAYERS


def grouped(saved: Iterable[Any], key: Callable[[Any], str]) -> dict[str, int]:
    """Bytes of ``saved`` per ``key``, in the order each group is first seen."""
    totals: dict[str, int] = {}
    for s in saved:
        totals[key(s)] = totals.get(key(s), 0) + s.bytes
    return totals


class SavedTotals:
    """Byte totals over saved values (report rows or snapshot entries), each with ``bytes``,
    ``kind``, ``module``, ``offloaded`` and ``is_activation``."""

    def _saved(self) -> Iterable[Any]:
        raise NotImplementedError

    @property
    def activation_bytes(self) -> int:
        """Saved bytes excluding parameters and offloaded values, counted once per storage."""
        return sum(r.bytes for r in self._saved() if r.is_activation)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.bytes for r in self._saved() if r.kind == "parameter")

    @property
    def offloaded_bytes(self) -> int:
        return sum(r.bytes for r in self._saved() if r.offloaded)

    def bytes_by(self, key: str) -> dict[str, int]:
        """Activation bytes grouped by ``layer`` or by a field (``kind``, ``dtype``, ``module``),
        in the order each group is first seen."""
        by = layer if key == "layer" else (lambda r: getattr(r, key))
        return grouped((r for r in self._saved() if r.is_activation), by)
