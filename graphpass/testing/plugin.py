"""pytest plugin: the ``graphpass_snapshot`` fixture and ``--graphpass-update`` / ``--graphpass-ci``.

Active wherever graphpass is installed (``pytest11`` entry point ``graphpass``); from a source
tree that is not installed, load it with ``-p graphpass.testing.plugin``.

Missing snapshots follow jest: written on the first run (the test passes with a warning, and the
file is to be committed), but a failure in CI mode (``--graphpass-ci`` or a ``CI`` environment
variable), where a missing file means one was never committed.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest

from ..report import Report
from .assertions import assert_matches_snapshot

SNAPSHOT_DIR = "__graphpass_snapshots__"
_WRITTEN = pytest.StashKey[list[tuple[str, Path]]]()
_UNSAFE = re.compile(r"[^\w.\[\]=,+-]")


class GraphpassSnapshotWarning(UserWarning):
    """A snapshot file was written for the first time: review and commit it."""


class SnapshotFixture:
    """``graphpass_snapshot(report, key=None)``: compare a report with this test's snapshot file.

    The file is ``<test dir>/__graphpass_snapshots__/<test module>/<test name>[-<key>].txt``;
    a test that snapshots several reports gives each its own ``key``.
    """

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self._request = request
        self._keys: set[str | None] = set()

    def path(self, key: str | None = None) -> Path:
        node = self._request.node
        test = node.nodeid.split("::", 1)[-1].replace("::", ".")
        name = _UNSAFE.sub("_", test + (f"-{key}" if key else ""))
        return Path(node.path).parent / SNAPSHOT_DIR / Path(node.path).stem / f"{name}.txt"

    def __call__(self, report: Report | None, key: str | None = None) -> None:
        __tracebackhide__ = True
        if key in self._keys:
            raise ValueError(f"graphpass_snapshot called twice with key={key!r} in one test: "
                             "give each report its own key")
        self._keys.add(key)
        config = self._request.config
        path = self.path(key)
        outcome = assert_matches_snapshot(
            report, path, update=config.getoption("graphpass_update"), write_missing=not _ci(config)
        )
        if outcome != "matched":
            config.stash[_WRITTEN].append((outcome, path))
        if outcome == "written":
            warnings.warn(GraphpassSnapshotWarning(f"wrote new graphpass snapshot {path}; commit it"),
                          stacklevel=2)


@pytest.fixture
def graphpass_snapshot(request: pytest.FixtureRequest) -> SnapshotFixture:
    return SnapshotFixture(request)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("graphpass", "graphpass saved-tensor snapshots")
    group.addoption("--graphpass-update", action="store_true", dest="graphpass_update",
                    help="rewrite graphpass snapshots that differ from the current report")
    group.addoption("--graphpass-ci", action="store_true", dest="graphpass_ci",
                    help="fail on missing graphpass snapshots instead of writing them "
                         "(also on when the CI environment variable is set)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_WRITTEN] = []


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    written = config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.section("graphpass snapshots")
        for outcome, path in written:
            terminalreporter.write_line(f"{outcome}: {path}")


def _ci(config: pytest.Config) -> bool:
    flag = os.environ.get("CI", "").strip().lower()
    return config.getoption("graphpass_ci") or flag not in ("", "0", "false", "no")
