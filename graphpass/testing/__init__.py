"""Regression tests for what a training graph saves: snapshots, diffs and contract assertions.

The pytest plugin (``graphpass.testing.plugin``, registered as the ``pytest11`` entry point
``graphpass``) adds the ``graphpass_snapshot`` fixture and the ``--graphpass-update`` /
``--graphpass-ci`` options; everything here also works without pytest.
"""

from .assertions import (
    assert_activation_bytes_at_most,
    assert_activation_growth_at_most,
    assert_fp8_lowered,
    assert_matches_snapshot,
    assert_no_parameter_offloaded,
    assert_recomputed,
    assert_saved_in_one_dtype,
)
# the report's snapshot format, diffs and row predicates, for tests to use beside the assertions
from ..report import Change, Entry, Snapshot, SnapshotDiff, diff, is_offloaded, is_recomputed

__all__ = [
    "Change",
    "Entry",
    "Snapshot",
    "SnapshotDiff",
    "assert_activation_bytes_at_most",
    "assert_activation_growth_at_most",
    "assert_fp8_lowered",
    "assert_matches_snapshot",
    "assert_no_parameter_offloaded",
    "assert_recomputed",
    "assert_saved_in_one_dtype",
    "diff",
    "is_offloaded",
    "is_recomputed",
]
