"""The saved-tensor report: one row per tensor the forward keeps alive for the backward, the
passes' decisions, and its JSON form."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..decisions import Decision, What
from ..paths import nested
from .coverage import merge_coverage
from .peak import merge_peaks
from .table import table
from .totals import SavedTotals

# Notes said once in a merged report, however many of its graphs say them.
_SAID_ONCE = frozenset({What.UNUSED, What.CHILD_FRAME})

KINDS = ("activation", "fp8_data", "fp8_scale", "rng_state", "symint", "parameter", "other")


@dataclass(frozen=True)
class Row:
    """One saved value.

    ``bytes`` is what this row adds to memory: the whole storage for the first saved value of a
    storage, 0 for further views of it (``alias_of`` names the first). ``tensor_bytes`` is the
    size of the view itself.
    """

    name: str
    op: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    tensor_bytes: int
    kind: str
    consumers: tuple[str, ...] = ()
    decisions: tuple[Decision, ...] = ()
    """What the passes decided for this value (FP8 copy, kept saved, offload, recompute)."""
    alias_of: str = ""
    copy_of: str = ""
    """For an FP8 copy: the name of the high-precision tensor it quantizes."""
    offloaded: bool = False
    """Kept in host memory between forward and backward (torch's activation offloading)."""

    @property
    def is_activation(self) -> bool:
        """Counted in device activation memory: not a parameter, not offloaded."""
        return self.kind != "parameter" and not self.offloaded

    @property
    def decision(self) -> str:
        """The decisions as the report shows them: ``fp8 copy (input); offload: no (parameter)``."""
        return "; ".join(map(str, self.decisions)) or "saved"

    def decided(self, *whats: What) -> bool:
        """Whether a pass decided one of ``whats`` for this value."""
        return any(d.what in whats for d in self.decisions)

    def to_dict(self) -> dict[str, Any]:
        """For JSON: the fields, with the decisions both as shown (``decision``) and typed."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "decisions":
                out["decision"] = self.decision
                out["decisions"] = [d.to_dict() for d in self.decisions]
            else:
                out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Row":
        fields = {k: v for k, v in data.items() if k not in ("decision", "decisions")}
        if "decisions" in data:
            decisions = tuple(Decision.from_dict(d) for d in data["decisions"])
        else:
            # a report JSON without typed decisions: its decision text, shown as written
            text = data.get("decision", "saved")
            decisions = () if text == "saved" else (Decision(What.SAVED, "", text),)
        return cls(**{**fields, "shape": tuple(data["shape"]), "consumers": tuple(data["consumers"]),
                      "decisions": decisions})


def is_offloaded(row: Row) -> bool:
    """Kept in host memory, or decided so (``offload: yes``); ``offload: no (...)`` and
    ``offload: eligible`` are not offloads."""
    return row.offloaded or row.decided(What.OFFLOAD, What.OFFLOADED)


def is_recomputed(row: Row) -> bool:
    """Saved for a recompute: the RNG state a recomputed random op (attention, dropout) is
    replayed under."""
    return row.decided(What.RECOMPUTED)


@dataclass
class Report(SavedTotals):
    """What one partitioned graph (or several, merged) saves for backward."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    graphs: int = 1
    meta: dict[str, Any] = field(default_factory=dict)
    decisions: list[Decision] = field(default_factory=list)
    """The passes' decisions behind ``notes`` (each note is one rendered), for code to read."""

    def _saved(self) -> list[Row]:
        return self.rows

    def bytes_by_layer(self) -> dict[str, int]:
        """Activation bytes per transformer layer (``bytes_by("layer")``)."""
        return self.bytes_by("layer")

    def find(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no saved tensor named {name!r}; saved: {[r.name for r in self.rows]}")

    @staticmethod
    def merge(reports: Iterable["Report"]) -> "Report":
        """One report of the graphs that run in one step. Graphs of different frames (a graph
        break splits a forward into several) all run: their rows, bytes and FLOPs add up, the
        rows prefixed ``g0.``, ``g1.``, .... A frame compiled again (``meta["compile_id"]``,
        ``[frame, compile]``, the same frame with a higher compile: a guard failed, or a shape
        changed under ``dynamic=False``) replaces its earlier compile's graphs, which run no
        more in that step: only the latest compile of each frame is merged, with a
        ``recompile:`` note saying what it replaced (``meta["replaced_graphs"]`` counts them).
        A note about the config (``unused:``), which every graph repeats, is kept once, as is
        a ``compiled frame:`` note of a child's forward broken into several graphs; so is an
        ``outside the graph`` note of a library's module, dropped where another graph holds the
        module's ops (``left to``)."""
        all_reports = list(reports)
        reports, replaced = _latest_compiles(all_reports)
        merged = Report(rows=[], notes=[], graphs=0, meta=dict(reports[0].meta) if reports else {})
        for i, rep in enumerate(reports):
            prefix = f"g{i}." if len(reports) > 1 else ""
            merged.rows += [
                dataclasses.replace(r, name=prefix + r.name,
                                    alias_of=prefix + r.alias_of if r.alias_of else "",
                                    copy_of=prefix + r.copy_of if r.copy_of else "")
                for r in rep.rows
            ]
            # The config's own notes (``unused:``) are about every graph alike, and a child's
            # forward is one note however many graphs its breaks cut it into: said once.
            said = {d for d in rep.decisions
                    if d.what in _SAID_ONCE and d in merged.decisions}
            said_text = {str(d) for d in said}
            merged.notes += [n for n in rep.notes if n not in said_text]
            merged.decisions += [d for d in rep.decisions if d not in said]
            merged.graphs += rep.graphs
            for key in ("step_flops", "recompute_flops"):
                if i and key in rep.meta:
                    merged.meta[key] = merged.meta.get(key, 0) + rep.meta[key]
        parts = [rep.meta["fp8_coverage"] for rep in reports if "fp8_coverage" in rep.meta]
        if parts:
            merged.meta["fp8_coverage"] = merge_coverage(parts)
        if reports and all("step_peak" in rep.meta for rep in reports):
            merged.meta["step_peak"] = merge_peaks(
                [rep.meta["step_peak"] for rep in reports], [rep.activation_bytes for rep in reports],
                [rep.meta["step_peak"]["by_kind"].get("parameter", 0) for rep in reports])
        _outside_once(merged)
        if replaced:
            merged.decisions += replaced
            merged.notes += [str(d) for d in replaced]
            merged.meta["replaced_graphs"] = len(all_reports) - len(reports)
        if len(reports) > 1:  # one graph's: the merged reports keep theirs
            merged.meta.pop("compile_id", None)
            merged.meta.pop("frame", None)
        return merged

    def to_dict(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "graphs": self.graphs,
            "activation_bytes": self.activation_bytes,
            "parameter_bytes": self.parameter_bytes,
            "rows": [r.to_dict() for r in self.rows],
            "notes": self.notes,
            "decisions": [d.to_dict() for d in self.decisions],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 1, **kw})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Report":
        return cls(rows=[Row.from_dict(r) for r in data["rows"]], notes=list(data.get("notes", [])),
                   graphs=data.get("graphs", 1), meta=dict(data.get("meta", {})),
                   decisions=[Decision.from_dict(d) for d in data.get("decisions", [])])

    @classmethod
    def from_json(cls, text: str) -> "Report":
        return cls.from_dict(json.loads(text))

    def table(self, *, max_consumers: int = 3) -> str:
        """An aligned text table with totals per kind and per layer."""
        return table(self, max_consumers=max_consumers)

    def __str__(self) -> str:
        return self.table()


def _latest_compiles(reports: list[Report]) -> tuple[list[Report], list[Decision]]:
    """``reports`` less those a later compile of the same frame replaced, in order, and one
    ``recompile:`` decision per frame compiled again. Reports
    without a compile id (``aot_function``, compiled autograd) are all kept."""
    def cid(rep: Report) -> tuple[int, int] | None:
        value = rep.meta.get("compile_id")
        return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else None

    latest: dict[int, int] = {}
    for rep in reports:
        if (c := cid(rep)) is not None:
            latest[c[0]] = max(latest.get(c[0], c[1]), c[1])
    kept = [rep for rep in reports if (c := cid(rep)) is None or c[1] == latest[c[0]]]
    notes = []
    for frame, last in latest.items():
        old = [rep for rep in reports if (c := cid(rep)) is not None and c[0] == frame
               and c[1] != last]
        if not old:
            continue
        where = next((rep.meta["frame"] for rep in reports if cid(rep) == (frame, last)
                      and rep.meta.get("frame")), "")
        earlier = ", ".join(sorted({f"{frame}/{cid(rep)[1]}" for rep in old}))
        notes.append(Decision(What.RECOMPILED, "report", (
            f"frame {frame}{f' ({where})' if where else ''} was compiled again (compile "
            f"{frame}/{last}: a guard failed, such as a new shape or a changed Python value); "
            f"its graph replaces the {len(old)} graph(s) of compile {earlier}, which this report "
            "leaves out (they run only for inputs that pass their guards)")))
    return kept, notes


def _outside_once(report: Report) -> None:
    """Drops from ``report``'s decisions and notes each ``outside the graph`` note said before, or
    of a module some of whose ops a graph holds (a ``left to`` note of it, of a module it is in or
    of one inside it)."""
    traced = [d.module for d in report.decisions if d.what is What.LIBRARY_OPS]
    kept: list[Decision] = []
    for d in report.decisions:
        if d.what is What.OUTSIDE_GRAPH and (
                d in kept or any(nested(module, d.module) for module in traced)):
            report.notes.remove(str(d))
            continue
        kept.append(d)
    report.decisions = kept
