"""benchmarks/_memory_history.py: the replay of a caching-allocator trace to its peak, on traces
whose answer is computed by hand (the recording itself needs a GPU: benchmarks/profile_step.py)."""

from __future__ import annotations

from _benchmarks import load

history = load("_memory_history")

WRAPPER = "/tmp/torchinductor_u/ab/cabc.py"
TORCH = "/site-packages/torch/_ops.py"
USER = "/home/u/model.py"


def alloc(addr: int, size: int, *frames: tuple[str, int]) -> dict:
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": f, "line": n, "name": "call"} for f, n in frames]}


def free(addr: int, size: int, action: str = "free_requested") -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": []}


def test_peak_and_live_blocks():
    trace = [
        free(900, 300),                                     # allocated before: held -300
        alloc(1, 400, (TORCH, 5), (WRAPPER, 10)),           # 100
        alloc(2, 200, (TORCH, 5), (USER, 3)),               # 300
        free(1, 400), free(1, 400, "free_completed"),       # -100
        alloc(3, 500, (WRAPPER, 12)),                       # 400: the peak
        alloc(4, 50, (WRAPPER, 12)),                        # 450
        free(3, 500),                                       # -50
        alloc(5, 100, (WRAPPER, 20)),                       # 50
    ]
    peak, blocks = history.peak_blocks(trace)
    assert peak == 450
    assert [(b.size, b.where) for b in blocks] == [
        (500, f"{WRAPPER}:12"), (200, f"{USER}:3"), (50, f"{WRAPPER}:12")]
    lines = history.report(peak, blocks)
    assert "450 B" in lines[0] and "in 3 blocks" in lines[0]
    assert lines[2].split()[:3] == [f"{550 / 2**20:.2f}", "2", "cabc.py:12"]


def test_free_completed_alone_releases_and_request_is_not_counted_twice():
    trace = [alloc(1, 100, (USER, 1)), free(1, 100, "free_completed"),
             alloc(2, 60, (USER, 2)), free(2, 60), free(2, 60, "free_completed"),
             alloc(3, 70)]
    peak, blocks = history.peak_blocks(trace)
    assert peak == 100
    assert [(b.size, b.where) for b in blocks] == [(100, f"{USER}:1")]
    assert history.peak_blocks(trace[2:])[0] == 70  # alloc 3 after 2's release: 70, not 130


def test_frames_inside_torch_only_name_the_innermost():
    peak, blocks = history.peak_blocks([alloc(1, 8, (TORCH, 7), ("/x/triton/y.py", 2))])
    assert blocks[0].where == f"{TORCH}:7"
    assert history.peak_blocks([alloc(1, 8)])[1][0].where == "?"
