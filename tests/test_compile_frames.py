"""The merged report knows a recompile (a guard failed: the frame's new graph replaces the old)
from a graph break (one forward split into graphs that all run), and a partition torch's min-cut
cannot make fails with one first line naming the modules, the options and the policy, leaving
no files in the working directory."""

from __future__ import annotations

import os
import shutil

import networkx as nx
import pytest
import torch
import torch._functorch.partitioners as partitioners
import torch.nn as nn

import graphpass
from graphpass.decisions import Decision, What
from graphpass.min_cut import PartitionError
from graphpass.report import Report, Row


class Net(nn.Module):
    def __init__(self, brk: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.scale = 1.0
        self.brk = brk

    def forward(self, x):
        h = self.a(x).relu() * self.scale
        if self.brk:
            torch._dynamo.graph_break()
        return self.b(h)


def _step(compiled, x):
    compiled(x).sum().backward()


def test_a_recompile_replaces_the_graph_it_recompiles():
    x = torch.randn(32, 64)
    model, backend = Net(), graphpass.backend(codegen="eager")
    compiled = torch.compile(model, backend=backend, dynamic=False)
    _step(compiled, x)
    once = backend.report()
    model.scale = 2.0  # a guard on a Python attribute fails: frame 0 compiles again
    _step(compiled, x)
    assert [r.meta["compile_id"] for r in backend.partitioner.reports] == [[0, 0], [0, 1]]
    merged = backend.report()
    assert merged.graphs == 1 and merged.meta["replaced_graphs"] == 1
    assert merged.meta["compile_id"] == [0, 1]  # the one graph merged: its compile
    assert merged.activation_bytes == once.activation_bytes
    assert [r.name for r in merged.rows] == [r.name for r in once.rows]  # no g0./g1. prefixes
    assert merged.meta["step_flops"] == once.meta["step_flops"]
    recompiles = [d for d in merged.decisions if d.what is What.RECOMPILED]
    assert len(recompiles) == 1
    assert str(recompiles[0]).startswith("recompile: frame 0 (forward (test_compile_frames.py:")
    assert "its graph replaces the 1 graph(s) of compile 0/0" in str(recompiles[0])
    # a new shape under dynamic=False recompiles too: still one graph
    _step(compiled, torch.randn(48, 64))
    merged = backend.report()
    assert merged.graphs == 1 and merged.meta["replaced_graphs"] == 2
    assert merged.activation_bytes == once.activation_bytes * 48 // 32
    assert "graph(s) of compile 0/0, 0/1" in merged.notes[-1]


def test_a_graph_break_splits_one_forward_into_graphs_that_all_run():
    x = torch.randn(32, 64)
    whole, backend = graphpass.backend(codegen="eager"), graphpass.backend(codegen="eager")
    _step(torch.compile(Net(), backend=whole, dynamic=False), x)
    torch._dynamo.reset()
    _step(torch.compile(Net(brk=True), backend=backend, dynamic=False), x)
    frames = [r.meta["compile_id"] for r in backend.partitioner.reports]
    assert len(frames) == 2 and frames[0][0] != frames[1][0]  # two frames: the resume function
    merged = backend.report()
    assert merged.graphs == 2 and "replaced_graphs" not in merged.meta
    parts = backend.partitioner.reports
    assert merged.activation_bytes == sum(p.activation_bytes for p in parts)
    assert merged.meta["step_flops"] == whole.report().meta["step_flops"]
    assert not any(d.what is What.RECOMPILED for d in merged.decisions)
    assert all(r.name.startswith(("g0.", "g1.")) for r in merged.rows)


def _report(frame: int, compile_: int, nbytes: int) -> Report:
    row = Row("x", "aten.relu", "a", (nbytes // 4,), "float32", nbytes, nbytes, "activation")
    return Report(rows=[row], meta={"compile_id": [frame, compile_], "frame": f"f{frame}"})


def test_merge_keeps_the_latest_compile_of_each_frame():
    merged = Report.merge([_report(0, 0, 400), _report(1, 0, 40), _report(0, 1, 800),
                           _report(1, 1, 80), _report(2, 0, 8)])
    assert merged.graphs == 3 and merged.activation_bytes == 800 + 80 + 8
    assert merged.meta["replaced_graphs"] == 2
    assert "compile_id" not in merged.meta and "frame" not in merged.meta  # several graphs
    notes = [d for d in merged.decisions if d.what is What.RECOMPILED]
    assert [d.why.split(" was")[0] for d in notes] == ["frame 0 (f0)", "frame 1 (f1)"]
    # reports without a compile id (aot_function) all count
    plain = Report.merge([Report(rows=_report(0, 0, 4).rows), Report(rows=_report(0, 0, 4).rows)])
    assert plain.graphs == 2 and plain.activation_bytes == 8
    assert Decision.from_dict(notes[0].to_dict()) == notes[0]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, x):
        return self.mlp(x)


@pytest.fixture
def failing_min_cut(monkeypatch, tmp_path):
    """torch's min-cut fails as it does on a graph it cannot cut (networkx's unbounded flow),
    in an empty working directory."""
    def unbounded(*args, **kwargs):
        raise nx.NetworkXUnbounded("Infinite capacity path, flow unbounded above.")

    monkeypatch.setattr(nx, "minimum_cut", unbounded)  # torch 2.11 and 2.13 call nx.minimum_cut
    if hasattr(partitioners, "minimum_cut"):  # 2.15 imports its own
        monkeypatch.setattr(partitioners, "minimum_cut", unbounded)
    monkeypatch.chdir(tmp_path)
    return tmp_path


FIRST_LINE = ("graphpass could not partition the graph of mlp.0, mlp.1, mlp.2 under "
              "graphpass.backend({options}): torch's min-cut found a value the backward needs "
              "that can be neither saved nor recomputed (policy: MUST_RECOMPUTE by recompute mlp "
              "(9 node(s): ")


def _dumps(first_line: str) -> str:
    assert "; torch's debug files are in " in first_line
    return first_line.rsplit("; torch's debug files are in ", 1)[1]


def test_a_failed_partition_names_modules_options_and_policy(failing_min_cut):
    with pytest.raises(PartitionError) as caught:
        graphpass.plan(MLP(), torch.randn(8, 64, requires_grad=True),
                       config=graphpass.Config(recompute=("mlp",)))
    first, *rest = str(caught.value).splitlines()
    assert first.startswith(FIRST_LINE.format(options="recompute=('mlp',)")), first
    assert "NetworkXUnbounded: Infinite capacity path" in "\n".join(rest)  # torch's, after
    assert os.listdir(failing_min_cut) == []  # nothing in the working directory
    directory = _dumps(first)
    try:
        assert "min_cut_failed_graph.txt" in os.listdir(directory)
    finally:
        shutil.rmtree(directory)


def test_a_failed_partition_under_the_backend(failing_min_cut):
    backend = graphpass.backend(codegen="eager", recompute=("mlp",))
    with pytest.raises(Exception) as caught:
        _step(torch.compile(MLP(), backend=backend), torch.randn(8, 64, requires_grad=True))
    # dynamo's first line names the backend with its options; graphpass's line follows
    lines = str(caught.value).splitlines()
    assert lines[0] == f"backend={repr(backend)!r} raised:"
    assert lines[1].startswith("PartitionError: " + FIRST_LINE.format(
        options="codegen='eager', recompute=('mlp',)")), lines[1]
    assert os.listdir(failing_min_cut) == []
    shutil.rmtree(_dumps(lines[1]))
