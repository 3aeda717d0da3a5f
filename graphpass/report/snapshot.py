"""The snapshot format: a saved-tensor report as diff-friendly text that is stable across runs.

torch's node names (``mm_3``, ``primals_7``) change between processes' compile histories and
between torch versions, so a row is identified by what it is instead: module path, producing op,
shape, dtype and kind, plus an occurrence index among rows that agree on all of those. Rows are
sorted by that identity (module paths in natural order, so ``layers.10`` follows ``layers.9``)
and written one per line; totals, recomputed from the rows, close the file.
"""

from __future__ import annotations

import json
import os
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

from ..paths import natural_key
from .rows import Report, Row
from .totals import SavedTotals

MAGIC = "# graphpass saved-tensor snapshot"
HEADER = f"{MAGIC} v1 (regenerate: pytest --graphpass-update)"
COLUMNS = "# module | op | shape | dtype | kind | bytes | decision"
SEP = " | "

Identity = tuple[str, str, tuple[int, ...], str, str, int]


@dataclass(frozen=True)
class Entry:
    """One snapshot row: a saved value named by what it is rather than by its node name."""

    module: str
    op: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    bytes: int
    decision: str = "saved"
    view_of: str = ""
    offloaded: bool = False
    """Kept in host memory between forward and backward: not counted, as in the report."""
    index: int = 0
    """0 for the first row with this module, op, shape, dtype and kind; 1, 2... for the others."""

    @property
    def identity(self) -> Identity:
        return (self.module, self.op, self.shape, self.dtype, self.kind, self.index)

    @property
    def is_activation(self) -> bool:
        """Counted in device activation memory, as ``Row.is_activation``."""
        return self.kind != "parameter" and not self.offloaded

    @property
    def op_label(self) -> str:
        return self.op + (f"#{self.index + 1}" if self.index else "")

    @property
    def shape_label(self) -> str:
        return format_shape(self.shape)

    def describe(self) -> str:
        """``aten.mm bfloat16 8192x14336`` (kind added when it is not a plain activation)."""
        kind = "" if self.kind == "activation" else f" {self.kind}"
        return f"{self.op_label} {self.dtype} {self.shape_label}{kind}"

    def line(self) -> str:
        size = (f"{self.bytes:,}" + (" (offloaded)" if self.offloaded else "")
                + (f" (view of {self.view_of})" if self.view_of else ""))
        return SEP.join((self.module or "-", self.op_label, self.shape_label, self.dtype, self.kind,
                         size, self.decision))


@dataclass(frozen=True)
class Snapshot(SavedTotals):
    """The stable, comparable form of a :class:`~graphpass.Report`."""

    entries: tuple[Entry, ...]
    notes: tuple[str, ...] = ()
    graphs: int = 1

    @classmethod
    def from_report(cls, report: Report) -> "Snapshot":
        by_name = {r.name: r for r in report.rows}
        entries = [_entry(r, by_name.get(r.alias_of)) for r in report.rows]
        return cls(entries=_indexed(entries), notes=tuple(sorted(report.notes)), graphs=report.graphs)

    @classmethod
    def parse(cls, text: str) -> "Snapshot":
        """Read :meth:`render`'s output back; totals are recomputed from the rows, not trusted."""
        if not text.startswith(MAGIC):
            raise ValueError("not a graphpass snapshot: the first line is not its header")
        entries, notes, graphs = [], [], 1
        for number, line in enumerate(text.splitlines(), 1):
            if SEP in line and not line.startswith(("#", "note: ")):
                try:
                    entries.append(_parse_entry(line))
                except ValueError as e:
                    raise ValueError(f"line {number} is not a snapshot row ({e}): {line!r}") from None
            elif line.startswith("note: "):
                notes.append(line.removeprefix("note: "))
            elif line.startswith("graphs: "):
                graphs = int(line.removeprefix("graphs: "))
        return cls(entries=tuple(entries), notes=tuple(notes), graphs=graphs)

    @classmethod
    def load(cls, path: Union[str, os.PathLike[str]]) -> "Snapshot":
        """A snapshot file, or a report saved with ``Report.to_json`` / ``graphpass report --json``."""
        text = Path(path).read_text(encoding="utf-8")
        if text.lstrip().startswith("{"):
            return cls.from_report(Report.from_dict(json.loads(text)))
        return cls.parse(text)

    def _saved(self) -> tuple[Entry, ...]:
        return self.entries

    def bytes_by(self, key: str) -> dict[str, int]:
        """Activation bytes grouped by ``kind``, ``dtype``, ``module`` or ``layer``, in natural
        order (a snapshot's order may not depend on the graph's)."""
        return dict(sorted(super().bytes_by(key).items(), key=lambda kv: natural_key(kv[0])))

    def render(self) -> str:
        lines = [HEADER, COLUMNS, *(e.line() for e in self.entries), ""]
        lines += [f"note: {n}" for n in self.notes]
        lines += [
            "# totals: activation bytes (parameters and offloaded rows are listed above, not counted)",
            f"graphs: {self.graphs}",
            f"activation: {self.activation_bytes:,} B",
            f"parameters: {self.parameter_bytes:,} B",
            f"offloaded: {self.offloaded_bytes:,} B",
        ]
        for key in ("kind", "dtype", "layer"):
            lines += [f"{key} {group}: {n:,} B" for group, n in self.bytes_by(key).items()]
        return "\n".join(lines) + "\n"


def format_shape(shape: Iterable[int]) -> str:
    return "x".join(map(str, shape)) or "()"


def _entry(row: Row, base: Row | None) -> Entry:
    view_of = f"{base.module or '-'} {base.op} {format_shape(base.shape)}" if base else ""
    return Entry(module=row.module, op=row.op, shape=tuple(row.shape), dtype=row.dtype, kind=row.kind,
                 bytes=row.bytes, decision=row.decision, view_of=view_of, offloaded=row.offloaded)


def _indexed(entries: list[Entry]) -> tuple[Entry, ...]:
    """Sorted by identity and the remaining fields, with occurrence indices assigned in that order.

    Everything a row shows takes part in the order, so rows that agree on their identity but not
    on bytes or decision are numbered the same way in every process, whatever the graph order.
    """
    ordered = sorted(entries, key=lambda e: (natural_key(e.module), e.op, e.shape, e.dtype, e.kind,
                                             -e.bytes, e.offloaded, e.decision, e.view_of))
    seen: dict[tuple[object, ...], int] = {}
    out = []
    for e in ordered:
        group = e.identity[:5]
        out.append(dataclasses.replace(e, index=seen.get(group, 0)))
        seen[group] = seen.get(group, 0) + 1
    return tuple(out)


def _parse_entry(line: str) -> Entry:
    module, op_label, shape, dtype, kind, size, decision = line.split(SEP, 6)
    op, _, index = op_label.partition("#")
    size, _, view = size.partition(" (view of ")
    nbytes = size.removesuffix(" (offloaded)")
    return Entry(
        module="" if module == "-" else module,
        op=op,
        shape=() if shape == "()" else tuple(int(s) for s in shape.split("x")),
        dtype=dtype,
        kind=kind,
        bytes=int(nbytes.replace(",", "")),
        decision=decision,
        view_of=view.removesuffix(")"),
        offloaded=nbytes != size,
        index=int(index) - 1 if index else 0,
    )
