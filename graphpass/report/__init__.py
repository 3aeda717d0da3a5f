"""The saved-tensor report and everything that reads it: rows and totals, the text table, JSON,
the snapshot format, diffs and plots. Pure data: nothing here reads a graph.

``graphpass.plan``/the backend build reports (``reporting.py``); ``graphpass.testing`` asserts on
them.
"""

from .diff import Change, SnapshotDiff, diff
from .rows import KINDS, Report, Row, is_offloaded, is_recomputed
from .snapshot import Entry, Snapshot, format_shape
from .totals import SavedTotals, format_bytes

__all__ = ["KINDS", "Change", "Entry", "Report", "Row", "SavedTotals", "Snapshot", "SnapshotDiff",
           "diff", "format_bytes", "format_shape", "is_offloaded", "is_recomputed"]
