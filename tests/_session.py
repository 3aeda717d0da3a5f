"""Work done once per pytest session, whichever xdist worker first needs it.

A module-scoped fixture runs once per xdist *worker* that runs a test of the module: an expensive
reference (a 200-step bf16 training run, a 2-process gloo scenario) would run once per worker.
:func:`once` runs it under a file lock in the directory the session's workers share; the others
wait for it and read what it wrote.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable

from filelock import FileLock


def once(tmp_path_factory, key: str, fill: Callable[[Path], None], *, timeout: float) -> Path:
    """The directory ``<session tmp>/<key>``, filled by ``fill(directory)`` exactly once per
    session: a worker that finds it done reads it; one that finds a failed attempt (no ``done``
    mark) runs ``fill`` again. ``timeout``: seconds to wait for another worker's ``fill``."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # shared by the session's workers
    out = root / key
    with FileLock(f"{out}.lock", timeout=timeout):
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            fill(out)
            (out / "done").touch()
    return out


def launch(label: str, commands: dict[str, list[str]], out: Path, timeout: float) -> None:
    """Run ``commands`` (name: argv) at once, each with one intra-op thread, its output in
    ``out/<name>.log``; kill every process still running ``timeout`` seconds after the start.
    A process that timed out or failed fails the test with each process's last 30 lines, so a
    stuck collective never hangs CI."""
    import signal
    import subprocess
    import sys
    import time

    import pytest

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    out.mkdir(exist_ok=True)
    procs, logs = {}, {}
    for name, argv in commands.items():
        logs[name] = out / f"{name.replace(' ', '')}.log"
        with open(logs[name], "w") as log:
            procs[name] = subprocess.Popen([sys.executable, *argv], env=env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    timed_out = []
    for name, proc in procs.items():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out.append(name)
    for name in timed_out:
        os.killpg(procs[name].pid, signal.SIGKILL)
        procs[name].wait()
    failed = {name: p.returncode for name, p in procs.items() if p.returncode != 0}
    if timed_out or failed:
        tails = "\n".join(f"--- {name} (exit {procs[name].returncode}):\n"
                          + "\n".join(logs[name].read_text().splitlines()[-30:]) for name in procs)
        pytest.fail(f"{label}: timed out after {timeout} s: {timed_out}; failed: {failed}\n{tails}",
                    pytrace=False)
