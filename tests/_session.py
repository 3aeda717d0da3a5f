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
