"""What holds a step's memory peak on the GPU: the CUDA caching allocator's history of one step,
replayed to its peak, each block live there named by the line of code that allocated it.

``record(step)`` runs ``step`` once under ``torch.cuda.memory._record_memory_history`` (Python
stacks only) and returns the snapshot's event trace; ``peak_blocks(trace)`` replays it and
returns the peak (bytes above what was allocated when recording began) and the blocks the step
allocated that are live there; ``report(...)`` prints them summed by allocating line, largest
first. The allocating line is the first frame in Inductor's generated code (its wrapper's
``buf7 = empty_strided_cuda(...)``, or the extern op it calls, an ATen op allocating inside
itself: a GEMM's or attention's workspace), else the first frame outside torch. Inductor's
buffer names are the ones ``benchmarks/cuda_peak.py --live N`` lists for the same graphs
generated without a GPU, so the two can be set side by side.
"""

from __future__ import annotations

import linecache
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

GENERATED = "torchinductor"  # Inductor's code cache: /tmp/torchinductor_<user>/<xx>/<hash>.py
_TORCH_DIRS = ("/torch/", "/triton/")


@dataclass(frozen=True)
class Block:
    """One allocation live at the peak: its bytes and the line that made it."""

    size: int
    where: str  # "file:line" of the allocating frame, or "?" without frames
    code: str  # that line's source, where the file is readable here


def record(step: Callable[[], None], max_entries: int = 500_000) -> list[dict[str, Any]]:
    """The caching allocator's events of one ``step()`` on the current CUDA device."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=max_entries)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    return list(snapshot["device_traces"][device])


def _allocating_frame(frames: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    frames = list(frames)
    for frame in frames:
        if GENERATED in frame.get("filename", ""):
            return frame
    for frame in frames:
        name = frame.get("filename", "")
        if name and not any(d in name for d in _TORCH_DIRS) and not name.startswith("<"):
            return frame
    return frames[0] if frames else None


def _block(event: dict[str, Any]) -> Block:
    frame = _allocating_frame(event.get("frames") or ())
    if frame is None:
        return Block(event["size"], "?", "")
    code = linecache.getline(frame["filename"], frame["line"]).strip()
    return Block(event["size"], f"{frame['filename']}:{frame['line']}", code)


def peak_blocks(trace: Iterable[dict[str, Any]]) -> tuple[int, list[Block]]:
    """(peak, blocks): the most bytes allocated at once during the trace, counted from where it
    begins (a free of a block allocated before it lowers the count), and the blocks allocated in
    the trace that are live at that point, largest first. A block is released at its
    ``free_requested`` event (when ``memory_allocated`` drops), or at ``free_completed`` where a
    trace has no request for it."""
    live: dict[int, dict[str, Any]] = {}
    requested: set[int] = set()
    held = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in trace:
        action, addr = event.get("action"), event.get("addr")
        if action == "alloc":
            live[addr] = event
            held += event["size"]
            if held > peak:
                peak, at_peak = held, list(live.values())
        elif action == "free_requested" or (action == "free_completed"
                                             and addr not in requested):
            if action == "free_requested":
                requested.add(addr)
            live.pop(addr, None)
            held -= event["size"]
        elif action == "free_completed":
            requested.discard(addr)
    blocks = sorted((_block(e) for e in at_peak), key=lambda b: b.size, reverse=True)
    return peak, blocks


def report(peak: int, blocks: list[Block], top: int = 30) -> list[str]:
    """Lines: the peak, then its blocks summed by allocating line, largest first."""
    by_line: dict[tuple[str, str], list[int]] = {}
    for b in blocks:
        by_line.setdefault((b.where, b.code), []).append(b.size)
    rows = sorted(by_line.items(), key=lambda kv: sum(kv[1]), reverse=True)
    lines = [f"step peak above the allocations before it: {peak:,} B ({peak / 2**20:.2f} MiB), "
             f"{sum(b.size for b in blocks) / 2**20:.2f} MiB of it in {len(blocks)} blocks the "
             "step allocated (the rest: blocks allocated before the step, freed in it, "
             "counted negative)",
             f"{'MiB':>9} {'blocks':>6}  allocated at"]
    for (where, code), sizes in rows[:top]:
        short = where.rsplit("/", 1)[-1]
        lines.append(f"{sum(sizes) / 2**20:9.2f} {len(sizes):6d}  {short}  {code[:110]}")
    return lines


def copy_generated(blocks: list[Block], to: Path) -> list[Path]:
    """Copy the generated files the blocks were allocated in (Inductor's wrappers) to ``to``."""
    to.mkdir(parents=True, exist_ok=True)
    out = []
    for name in sorted({b.where.rsplit(":", 1)[0] for b in blocks if GENERATED in b.where}):
        target = to / Path(name).name
        shutil.copyfile(name, target)
        out.append(target)
    return out
