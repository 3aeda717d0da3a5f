"""torch's cuDNN for Transformer Engine's import.

A machine can hold two cuDNNs: torch's (the ``nvidia-cudnn`` wheel) and the system's (the H200
image has one in ``/lib/x86_64-linux-gnu``). Transformer Engine loads ``libcudnn`` from
``CUDNN_HOME`` or ``CUDNN_PATH`` first, then from ``CUDA_HOME`` and the system's library path; a
library that cuDNN loads by name later goes wherever the search finds it first. Once torch has
run cuDNN, its ``libcudnn_graph.so.9`` is loaded, and a system ``libcudnn_cnn.so.9`` or
``libcudnn_heuristic.so.9`` bound to it fails TE's import (``undefined symbol``).
``torch_cudnn_for_te`` keeps TE's import on torch's copy (``providers.te_status`` uses it).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

__all__ = ["preload", "torch_cudnn_dir", "torch_cudnn_for_te"]


def torch_cudnn_dir() -> str | None:
    """The folder of the cuDNN library this process has loaded (torch's: on Linux, in
    ``/proc/self/maps``), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libcudnn.so." in line}
    except OSError:
        return None
    return os.path.dirname(min(paths)) if paths else None


# cuDNN 9's libraries, each after those it needs (libcudnn.so.9, torch's, is loaded already)
ORDER = ("graph", "engines_runtime_compiled", "engines_precompiled", "heuristic", "ops",
                "cnn", "adv")


def preload(folder: str) -> list[str]:
    """Loads the cuDNN libraries of ``folder`` (torch's), each after those it needs, so that a
    later load of one by name (``libcudnn_cnn.so.9``, from a library without torch's search
    path) gets torch's copy, not another cuDNN's. Returns the names loaded (one that does not
    load here, e.g. without a GPU driver, is left to load as before)."""
    import ctypes

    loaded = []
    for part in ORDER:
        path = os.path.join(folder, f"libcudnn_{part}.so.9")
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded.append(os.path.basename(path))
    return loaded


@contextlib.contextmanager
def torch_cudnn_for_te() -> Iterator[None]:
    """While TE imports: ``CUDNN_PATH`` names torch's cuDNN, unless the user set ``CUDNN_HOME``
    or ``CUDNN_PATH``, and torch's cuDNN libraries loaded first (``preload``). TE loads
    ``libcudnn`` from those variables first, then from ``CUDA_HOME`` and the system's library
    path. A second cuDNN beside torch's breaks TE's import once torch has used cuDNN: on the
    H200 image the system's ``libcudnn_heuristic.so.9`` was bound to torch's
    ``libcudnn_graph.so.9`` ("undefined symbol: _ZTVN5cudnn7backend12OperationSetE"); with
    ``CUDNN_PATH`` alone, the system's ``libcudnn_cnn.so.9`` was."""
    folder = torch_cudnn_dir()
    if folder is None or "CUDNN_HOME" in os.environ or "CUDNN_PATH" in os.environ:
        yield
        return
    preload(folder)
    os.environ["CUDNN_PATH"] = folder
    try:
        yield
    finally:
        os.environ.pop("CUDNN_PATH", None)
