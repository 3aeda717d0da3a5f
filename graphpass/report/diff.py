"""What changed between two reports: rows added, removed or changed, matched by snapshot identity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from ..paths import natural_key
from .rows import Report
from .snapshot import Entry, Snapshot

Comparable = Union[Report, Snapshot]


@dataclass(frozen=True)
class Change:
    """One row that appeared, disappeared, or changed bytes, decision or placement."""

    before: Entry | None
    after: Entry | None

    @property
    def entry(self) -> Entry:
        return self.after or self.before  # type: ignore[return-value]

    @property
    def delta(self) -> int:
        """Change in counted activation bytes: parameters and offloaded rows count 0."""
        return _counted(self.after) - _counted(self.before)

    def describe(self) -> str:
        """``layers.0.mlp.up_proj: +29,360,128 B (aten.mm bfloat16 8192x14336 now saved)``."""
        e, before, after = self.entry, self.before, self.after
        if before is None:
            what = "now saved" + (f", {e.decision}" if e.decision != "saved" else "")
        elif after is None:
            what = "no longer saved"
        else:
            parts = []
            if before.bytes != after.bytes:
                parts.append(f"{before.bytes:,} -> {after.bytes:,} B")
            if before.offloaded != after.offloaded:
                parts.append("now offloaded" if after.offloaded else "no longer offloaded")
            if before.decision != after.decision:
                parts.append(f"decision {before.decision!r} -> {after.decision!r}")
            if before.view_of != after.view_of:
                parts.append(f"view of {before.view_of or '-'} -> {after.view_of or '-'}")
            what = "; ".join(parts)
        if e.kind == "parameter":  # listed for what it is, never counted
            size = f"{(after.bytes if after else 0) - (before.bytes if before else 0):+,} B not counted"
        else:
            size = f"{self.delta:+,} B"
        return f"{e.module or '(no module)'}: {size} ({e.describe()} {what})"


def _counted(entry: Entry | None) -> int:
    return entry.bytes if entry is not None and entry.is_activation else 0


@dataclass(frozen=True)
class SnapshotDiff:
    before: Snapshot
    after: Snapshot
    changes: tuple[Change, ...]
    notes_added: tuple[str, ...]
    notes_removed: tuple[str, ...]

    @property
    def activation_delta(self) -> int:
        return self.after.activation_bytes - self.before.activation_bytes

    @property
    def grew(self) -> bool:
        """Whether activation bytes grew: the regression that ``graphpass diff`` exits 1 on."""
        return self.activation_delta > 0

    def __bool__(self) -> bool:
        return bool(self.changes or self.notes_added or self.notes_removed
                    or self.before.graphs != self.after.graphs)

    def lines(self) -> list[str]:
        old, new = self.before.activation_bytes, self.after.activation_bytes
        pct = f", {self.activation_delta / old:+.2%}" if old else ""
        out = [f"activation bytes: {old:,} -> {new:,} B ({self.activation_delta:+,} B{pct})"]
        for name in ("parameter", "offloaded"):
            old_bytes, new_bytes = (getattr(s, f"{name}_bytes") for s in (self.before, self.after))
            if old_bytes != new_bytes:
                out.append(f"{name} bytes (not counted): {old_bytes:,} -> {new_bytes:,} B")
        if self.before.graphs != self.after.graphs:
            out.append(f"graphs: {self.before.graphs} -> {self.after.graphs} (graph breaks changed)")
        out += [f"  {c.describe()}" for c in self.changes]
        out += [f"  note added: {n}" for n in self.notes_added]
        out += [f"  note removed: {n}" for n in self.notes_removed]
        if not self:
            out.append("  no rows changed")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def diff(before: Comparable, after: Comparable) -> SnapshotDiff:
    """Rows matched by (module, op, shape, dtype, kind, occurrence): node names play no part.

    Changes are listed largest growth first, so the first line answers "what grew".
    """
    old, new = _snapshot(before), _snapshot(after)
    old_rows = {e.identity: e for e in old.entries}
    new_rows = {e.identity: e for e in new.entries}
    changes = [Change(old_rows.get(k), new_rows.get(k)) for k in {**old_rows, **new_rows}
               if old_rows.get(k) != new_rows.get(k)]
    changes.sort(key=lambda c: (-c.delta, natural_key(c.entry.module), c.entry.describe()))
    return SnapshotDiff(
        before=old,
        after=new,
        changes=tuple(changes),
        notes_added=tuple(n for n in new.notes if n not in old.notes),
        notes_removed=tuple(n for n in old.notes if n not in new.notes),
    )


def _snapshot(value: Comparable) -> Snapshot:
    return value if isinstance(value, Snapshot) else Snapshot.from_report(value)
