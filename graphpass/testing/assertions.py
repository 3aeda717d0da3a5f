"""Assertions for the memory contracts of a training graph, usable with or without pytest.

Each takes a :class:`~graphpass.Report` (``graphpass.plan(...)`` or ``graphpass.last_report()``)
and raises ``AssertionError`` naming the rows that break the contract.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from pathlib import Path
from typing import Literal, Sequence, Union

import torch.nn as nn

from ..decisions import What
from ..report import Report, Row, Snapshot, diff, format_bytes, format_shape, is_offloaded, is_recomputed

Baseline = Union[Report, Snapshot, str, "os.PathLike[str]"]
_SHOWN = 10  # offending rows listed in a message; more are counted


def assert_matches_snapshot(
    report: Report | None,
    path: Union[str, "os.PathLike[str]"],
    *,
    update: bool = False,
    write_missing: bool = True,
) -> Literal["matched", "written", "updated"]:
    """Compare ``report`` with the snapshot file at ``path``.

    A missing file is written when ``write_missing`` or ``update`` (the plugin turns
    ``write_missing`` off in CI mode) and is a failure otherwise; with ``update`` a differing file
    is rewritten. A mismatch raises with what grew, by how many bytes, from which module.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    text = Snapshot.from_report(_require(report)).render()
    path = Path(path)
    if not path.exists():
        if not (write_missing or update):
            raise AssertionError(f"graphpass snapshot {path} does not exist; run pytest once "
                                 "outside CI mode (or with --graphpass-update) and commit it")
        _write(path, text)
        return "written"
    old = path.read_text(encoding="utf-8")
    if old == text:
        return "matched"
    if update:
        _write(path, text)
        return "updated"
    try:
        changes = diff(Snapshot.parse(old), Snapshot.parse(text))
        detail = changes.lines() if changes else ["rows are equal but the text is not (edited totals?):"]
    except ValueError as e:  # a hand-edited or conflicted file: the text diff is all there is
        changes, detail = None, [f"the snapshot file does not parse ({e}):"]
    if not changes:
        detail += difflib.unified_diff(old.splitlines(), text.splitlines(), "snapshot", "now", lineterm="")
    raise AssertionError("\n".join([
        f"saved tensors differ from graphpass snapshot {path}",
        *detail,
        "if the change is intended, rerun with --graphpass-update and commit the snapshot",
    ]))


def assert_activation_bytes_at_most(report: Report | None, limit: int) -> None:
    """Activation bytes (parameters not counted) are at most ``limit``."""
    __tracebackhide__ = True
    report = _require(report)
    if report.activation_bytes > limit:
        over = report.activation_bytes - limit
        raise AssertionError(
            f"activation bytes {report.activation_bytes:,} exceed the limit {limit:,} by {over:,} B "
            f"({format_bytes(over)}); largest saved rows:\n"
            + _listing(sorted((r for r in report.rows if r.is_activation), key=lambda r: -r.bytes))
        )


def assert_activation_growth_at_most(report: Report | None, baseline: Baseline, percent: float) -> None:
    """Activation bytes are at most ``percent`` % above ``baseline``.

    ``baseline`` is a Report, a Snapshot, a snapshot file or a report JSON file
    (``graphpass report --json``).
    """
    __tracebackhide__ = True
    base = baseline if isinstance(baseline, (Report, Snapshot)) else Snapshot.load(baseline)
    changes = diff(base, _require(report))
    old, new = changes.before.activation_bytes, changes.after.activation_bytes
    if new > old * (1 + percent / 100):
        grown = [c for c in changes.changes if c.delta > 0]
        raise AssertionError("\n".join([
            f"activation bytes grew more than {percent}% over the baseline:",
            *changes.lines()[:1],
            *(f"  {c.describe()}" for c in grown[:_SHOWN]),
            *([f"  ... and {len(grown) - _SHOWN} more grown rows"] if len(grown) > _SHOWN else []),
        ]))


def assert_saved_in_one_dtype(report: Report | None) -> None:
    """No tensor is saved twice in two dtypes (say bf16 and its FP8 copy).

    Two signs of it: an FP8 copy saved next to the tensor it quantizes (``Row.copy_of``), and rows
    from the same module and producing op with the same shape in two floating dtypes. Integer and
    bool rows (top-k indices next to values) and FP8 scales are other tensors and not compared.
    """
    __tracebackhide__ = True
    rows = _require(report).rows
    by_name = {r.name: r for r in rows}
    twice = {frozenset((r.copy_of, r.name)): [by_name[r.copy_of], r] for r in rows if r.copy_of in by_name}
    groups: dict[tuple[str, str, tuple[int, ...]], list[Row]] = {}
    for r in rows:
        if r.kind in ("activation", "fp8_data") and r.dtype.startswith(("float", "bfloat")):
            groups.setdefault((r.module, r.op, r.shape), []).append(r)
    for group in groups.values():
        if len({r.dtype for r in group}) > 1:
            twice.setdefault(frozenset(r.name for r in group), group)
    if twice:
        raise AssertionError(
            f"{len(twice)} tensor(s) saved in more than one dtype (an FP8 copy next to its original, "
            "or the same module, op and shape):\n"
            + _listing([r for group in twice.values() for r in group])
        )


def assert_recomputed(
    report: Report | None, *targets: Union[str, type[nn.Module]], model: nn.Module | None = None
) -> None:
    """Nothing the given modules compute is saved: they are recomputed in backward.

    ``targets`` are module-path patterns (fnmatch: ``"*norm*"``, ``"layers.*.mlp"``; a module's
    submodules count as part of it) or module classes, which need ``model`` to find their paths.
    Parameters are kept by the optimizer anyway and are not checked; rows whose decision says
    ``recomputed`` are fine.
    """
    __tracebackhide__ = True
    if not targets:
        raise ValueError("name at least one module-path pattern or module class")
    patterns = [t for t in targets if isinstance(t, str)]
    classes = tuple(t for t in targets if not isinstance(t, str))
    if classes:
        if model is None:
            raise ValueError("module classes need model=: the report holds module paths, not classes")
        patterns += [path for path, m in model.named_modules() if path and isinstance(m, classes)]
    offending = [
        r for r in _require(report).rows
        if r.is_activation and not is_recomputed(r)
        and any(fnmatch.fnmatchcase(r.module, p) or fnmatch.fnmatchcase(r.module, p + ".*") for p in patterns)
    ]
    if offending:
        names = ", ".join(t if isinstance(t, str) else t.__name__ for t in targets)
        raise AssertionError(f"{len(offending)} saved row(s) come from modules that should be "
                             f"recomputed ({names}):\n" + _listing(offending))


def assert_no_parameter_offloaded(report: Report | None) -> None:
    """No parameter is offloaded to host memory: the optimizer step needs them on the device."""
    __tracebackhide__ = True
    offending = [r for r in _require(report).rows if r.kind == "parameter" and is_offloaded(r)]
    if offending:
        raise AssertionError(f"{len(offending)} parameter(s) offloaded:\n" + _listing(offending))


def assert_fp8_lowered(
    report: Report | None,
    *,
    allowed: Sequence[str] = ("excluded by pattern *", "the output head *"),
    model: nn.Module | None = None,
) -> None:
    """Every linear is lowered to FP8, or left in high precision for an allowed reason.

    Reads the FP8 pass's decisions (``lowered: <module> ...`` and
    ``not lowered: <module>: <reason>`` in the notes). ``allowed`` are fnmatch patterns of
    reasons (by default ``fp8_exclude``'s: a pattern, and the output head recognised from the
    graph); with ``model``, every ``nn.Linear`` in it must have a decision, so a linear the pass
    never saw fails too.
    """
    __tracebackhide__ = True
    lowered, not_lowered = set(), {}
    for decision in _require(report).decisions:
        if decision.what is What.LOWERED:
            lowered.add(decision.module or "<root>")
        elif decision.what is What.NOT_LOWERED:
            not_lowered[decision.module or "<root>"] = decision.why
    problems = [f"  {m}: {reason}" for m, reason in sorted(not_lowered.items())
                if not any(fnmatch.fnmatchcase(reason, a) for a in allowed)]
    if model is not None:
        seen = lowered | set(not_lowered)
        problems += [f"  {path}: no FP8 note (the pass did not see this linear)"
                     for path, m in model.named_modules() if isinstance(m, nn.Linear) and path not in seen]
    if not lowered and not not_lowered:
        problems.append("  the report has no FP8 lowering notes: was it planned with fp8 set?")
    if problems:
        raise AssertionError(f"linears not lowered to FP8 for a reason outside {list(allowed)}:\n"
                             + "\n".join(problems))


def _require(report: Report | None) -> Report:
    __tracebackhide__ = True
    if report is None:
        raise AssertionError(
            "no report: nothing was partitioned by graphpass in this process yet (compile with "
            "graphpass.backend() and run backward, or use graphpass.plan). A compile served from "
            "torch's compile cache skips the partitioner: use graphpass.plan, codegen='eager', or "
            "torch._functorch.config.enable_autograd_cache = False")
    return report


def _listing(rows: Sequence[Row]) -> str:
    lines = [f"  {r.module or '(no module)'}: {r.op} {r.dtype} {format_shape(r.shape)} {r.kind} "
             f"{r.bytes:,} B ({r.decision})" for r in rows[:_SHOWN]]
    if len(rows) > _SHOWN:
        lines.append(f"  ... and {len(rows) - _SHOWN} more")
    return "\n".join(lines)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # "\n" on every platform: the file is committed and compared byte for byte.
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
