"""Where torch's separate-stream offloading puts its copies and waits, on every version graphpass
supports, read from partitioned graphs of fake CUDA tensors (no GPU needed to partition), and
what graphpass makes of them: the offloaded tensors, their copy windows and the step's peak.

torch 2.11 builds the separate stream from ``streams::`` fork/join/event ops around
``prims.device_put``; 2.13 from ``ao::offload``/``ao::reload``/``ao::wait_tensor``. Both issue a
tensor's copy out right after its last forward use, sink the waits to the forward's end, and
prefetch each reload in the backward ahead of its first use by as much compute as its copy takes
(timed here by the H100 roofline in place of torch's benchmark of each node on the GPU).
"""

from __future__ import annotations

import functools
import itertools
import re

import pytest
import torch
import torch.fx as fx
from torch._functorch.aot_autograd import aot_function

import graphpass
from graphpass import _compat
from graphpass.graph.joint import (is_offload_machinery, mark_for_offload, offload_issue,
                                   offloaded_source, reload_of)
from graphpass.decisions import What
from graphpass.graph.offload_copies import compute_seconds, offload_copies
from graphpass.graph.peak import step_peak
from test_peak import _smallest_peak

offloading = pytest.importorskip("torch._functorch._activation_offloading.activation_offloading")

N, LAYERS = 1024, 4
BIG = 4096
BYTES = N * N * 4  # one fp32 activation


def _layers(x, *ws):
    for w in ws:
        x = torch.relu(x @ w)
    return x.sum()


def _cuda_partition(monkeypatch, *, stream: bool, partitioner=None, n: int = N
                    ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward torch's min-cut makes of ``_layers`` with every relu output
    offloaded, its tensors on CUDA (the joint graph is traced on the CPU, then its metadata moved
    to CUDA: offloading reads devices from it); ``partitioner(joint, inputs, num_fwd_outputs=,
    static_lifetime_input_indices=)`` partitions it in place of the offloading min-cut."""
    # what needs a GPU at partition time: 2.11's stream and event handles, and the timing of
    # each backward node for the prefetch (the roofline here)
    counter = itertools.count(100)
    for name in ("get_current_stream", "new_stream", "new_event"):
        if hasattr(offloading, name):
            monkeypatch.setattr(offloading, name, lambda *a, **k: next(counter))
    monkeypatch.setattr(offloading, "benchmark_node", lambda n: compute_seconds(n) * 1e3)
    graphs = {}

    def partition(joint, inputs, **kwargs):
        mode = next(n.meta["val"].fake_mode for n in joint.graph.nodes
                    if isinstance(n.meta.get("val"), torch.Tensor))
        with mode:
            for n in joint.graph.nodes:
                v = n.meta.get("val")
                if isinstance(v, torch.Tensor):
                    n.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype,
                                                        device="cuda")
                if (partitioner is None and n.op == "call_function"
                        and n.target is torch.ops.aten.relu.default):
                    mark_for_offload(n)
        if partitioner is not None:
            graphs["fw"], graphs["bw"] = partitioner(
                joint, inputs, num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"))
            raise _Partitioned
        with _compat.min_cut_settings(relaxed=False, offload=True, offload_stream=stream):
            graphs["fw"], graphs["bw"] = _compat.min_cut_partition(
                joint, inputs, num_fwd_outputs=kwargs["num_fwd_outputs"],
                static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"),
                compiler="eager")
        raise _Partitioned

    args = [torch.randn(n, n, requires_grad=True) for _ in range(LAYERS + 1)]
    with pytest.raises(_Partitioned):  # the graphs run on CUDA only: stop once partitioned
        aot_function(_layers, fw_compiler=lambda gm, _: gm, partition_fn=partition)(*args)
    return graphs["fw"], graphs["bw"]


class _Partitioned(Exception):
    pass


def _name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else ""


def _offload_waits(fw: fx.GraphModule) -> list[fx.Node]:
    """The forward's waits for its copies out: 2.13's ``ao.wait_tensor`` of an ``ao.offload``;
    on 2.11 the compute stream's ``wait_event`` of the event recorded after each ``device_put``."""
    nodes = list(fw.graph.nodes)
    waits = [n for n in nodes if _name(n) == "ao.wait_tensor.default"]
    for i, node in enumerate(nodes):
        if offloaded_source(node) is not None and _name(node).startswith("prims."):
            after = nodes[i + 1] if i + 1 < len(nodes) else None
            if after is not None and _name(after) == "streams.record_event.default":
                waits += [n for n in nodes if _name(n) == "streams.wait_event.default"
                          and n.args[0] == after.args[0]]
    return waits


@pytest.mark.parametrize("stream", [True, False], ids=["separate stream", "default stream"])
def test_copies_out_start_after_the_last_use_and_waits_sink_to_the_forwards_end(monkeypatch, stream):
    fw, bw = _cuda_partition(monkeypatch, stream=stream)
    nodes = list(fw.graph.nodes)
    offloaded = {n: offloaded_source(n) for n in nodes if offloaded_source(n)}
    # every relu output but the last (which the loss reads, and the backward only as a mask)
    assert sorted(s.name for s in offloaded.values()) == ["relu", "relu_1", "relu_2"]
    computes = [i for i, n in enumerate(nodes) if compute_seconds(n) > 0]
    for wait, source in offloaded.items():
        issue = nodes.index(offload_issue(wait))
        last_use = max(nodes.index(u) for u in source.users if u is not wait
                       and nodes.index(u) < issue)
        # issued right after its last forward use: no compute in between
        assert not [i for i in computes if last_use < i < issue]
    waits = _offload_waits(fw)
    if stream:  # waited for at the forward's end: after all of its compute
        assert len(waits) == len(offloaded) and min(nodes.index(w) for w in waits) > max(computes)
    else:  # a synchronous device_put: the copy and the wait are one node
        assert waits == []
    # the backward reads each tensor back through torch's reload
    for wait in offloaded:
        placeholder = next(n for n in bw.graph.find_nodes(op="placeholder") if n.name == wait.name)
        assert reload_of(placeholder) is not None


def test_reloads_are_prefetched_by_the_compute_their_copy_takes(monkeypatch):
    """torch's prefetch, with each node timed by the H100 roofline and each copy at its default
    50 GiB/s: every reload starts early enough that the backward's compute between its start and
    the tensor's first use covers the copy, or at the backward's start; in the order they are
    used."""
    _, bw = _cuda_partition(monkeypatch, stream=True)
    nodes = list(bw.graph.nodes)
    copy_s = BYTES / (50 * 2**30)
    first_compute = min(i for i, n in enumerate(nodes) if compute_seconds(n) > 0)
    starts, uses = [], []
    for placeholder in bw.graph.find_nodes(op="placeholder"):
        reload = reload_of(placeholder)
        if reload is None:
            continue
        start = nodes.index(reload[0])
        use = min(nodes.index(u) for u in reload[1].users if not is_offload_machinery(u))
        hidden_under = sum(compute_seconds(n) for n in nodes[start:use])
        assert hidden_under >= copy_s or start < first_compute, (reload[0].name, hidden_under)
        assert start < use
        starts.append(start)
        uses.append(use)
    assert len(starts) == 3 and sorted(starts) == [s for _, s in sorted(zip(uses, starts))]
    # prefetched: at least one reload starts before compute that does not read it
    assert any(any(compute_seconds(n) > 0 for n in nodes[s:u]) for s, u in zip(starts, uses))


def test_the_peak_walk_counts_a_prefetched_reload_from_its_start(monkeypatch):
    """A reload moved ahead of its use is live from where it starts: at the backward's peak
    (its first layer's GEMMs), the reloads torch prefetched for the later layers are live
    already, and the peak is not below the same graph's with each reload moved back to just
    before its first use."""
    fw, bw = _cuda_partition(monkeypatch, stream=True)
    kwargs = dict(num_fwd_outputs=1, parameter_names=set())
    prefetched = step_peak(fw, bw, **kwargs)
    nodes = list(bw.graph.nodes)
    reloads = []
    for placeholder in bw.graph.find_nodes(op="placeholder"):
        reload = reload_of(placeholder)
        if reload is not None:
            reloads.append(reload[0].name)
            use = min((u for u in reload[1].users if not is_offload_machinery(u)),
                      key=nodes.index)
            use.prepend(reload[0])
    at_use = step_peak(fw, bw, **kwargs)
    assert prefetched.device == "cuda" and prefetched.phase == "backward"
    assert len(reloads) == 3
    assert set(reloads) <= {t.name for t in prefetched.live}
    assert prefetched.backward_peak >= at_use.backward_peak


def test_offload_copies_of_the_partitioned_graphs(monkeypatch):
    """graphpass reads each offloaded tensor's copies from torch's graphs on every version: the
    bytes, one copy's time at the roofline's host link (H100: 50 GB/s), and the compute in its
    windows (the forward after the issue, the backward before the first use)."""
    fw, bw = _cuda_partition(monkeypatch, stream=True)
    copies = offload_copies(fw, bw)
    assert [c.name for c in copies] == ["relu", "relu_1", "relu_2"]
    assert all(c.bytes == BYTES and c.seconds == pytest.approx(BYTES / 50e9) for c in copies)
    # the earlier a tensor's last forward use, the more forward compute its copy out has, and the
    # later its first backward use
    assert copies[0].out_window > copies[1].out_window > copies[2].out_window > 0
    assert copies[0].back_window > copies[1].back_window > copies[2].back_window
    # the last layer's output is read by the backward's first GEMMs: its copy back cannot hide
    assert copies[2].back_late > 0 and not copies[2].hidden


def test_copy_schedule_by_hand():
    """Two 50 MB copies (1 ms each way on the H100's 50 GB/s link) in a 3 ms forward and a 3 ms
    backward: ``a`` last used 2.5 ms before the forward's end and first used 2.5 ms into the
    backward, ``b`` 1.5 ms and 1.5 ms. Out, one at a time: a 0.5-1.5, b 1.5-2.5: hidden. Back,
    as late as each use allows: b 0.5-1.5, a 1.5-2.5: hidden. A third copy ``c`` used
    0.5 ms before the end and 0.5 ms into the backward runs out 2.5-3.5 (0.5 ms late) and would
    have to start back at -0.5 ms: it adds 1 ms, and only it is late."""
    from graphpass.graph.offload_copies import Windows

    w = Windows(forward=3e-3, backward=3e-3, out={"a": 2.5e-3, "b": 1.5e-3, "c": 0.5e-3},
                back={"a": 2.5e-3, "b": 1.5e-3, "c": 0.5e-3})
    mb50 = 50_000_000
    assert w.late([("a", mb50), ("b", mb50)]) == 0.0
    late = w.schedule([("a", mb50), ("b", mb50), ("c", mb50)])
    assert late["a"] == late["b"] == (0.0, 0.0)
    assert late["c"] == pytest.approx((0.5e-3, 0.5e-3))
    assert w.late([("a", mb50), ("b", mb50), ("c", mb50)]) == pytest.approx(1e-3)
    assert w.late([("c", mb50 // 2)]) == 0.0  # 0.5 ms each way fits its own windows


def _tiny_llama_step(**options):
    import graphpass
    from graphpass.models import llama

    torch._dynamo.reset()
    model, (x,) = llama.build("tiny", layers=2, seq=64)
    x = x.detach().requires_grad_()
    if options.get("offload"):
        options["offload_min_bytes"] = 32768
    backend = graphpass.backend(codegen="eager", fp8="tensorwise", **options)
    torch.compile(model, backend=backend)(x).float().pow(2).mean().backward()
    return [x.grad, *(p.grad for p in model.parameters())], backend.report()


def test_offload_hidden_only_keeps_the_offloads_whose_copies_hide():
    """Of what ``offload=True`` offloads, ``offload_hidden_only`` keeps the tensors whose copies
    the H100 roofline hides (on the tiny layer, a few microseconds of compute: some); every other
    one stays on the device and says why, with its copy time and windows; gradients are
    bit-identical to the step without offload."""
    base, _ = _tiny_llama_step()
    every_grads, every = _tiny_llama_step(offload=True)
    grads, hidden = _tiny_llama_step(offload=True, offload_hidden_only=True)
    assert all(torch.equal(a, b) for a, b in zip(grads, base))
    assert all(torch.equal(a, b) for a, b in zip(every_grads, base))
    offloaded = {r.name.removeprefix("cpu_offload_") for r in hidden.rows if r.offloaded}
    all_offloaded = {r.name.removeprefix("cpu_offload_") for r in every.rows if r.offloaded}
    kept = {r.name for r in hidden.rows if "offload: no (copy not hidden: " in r.decision}
    assert offloaded and kept and offloaded | kept == all_offloaded and not offloaded & kept
    assert [n for n in hidden.notes if n.startswith("offload copy not hidden")] == []
    assert len([n for n in hidden.notes if n.startswith("offload copy: ")]) == len(offloaded)
    assert [n for n in every.notes if n.startswith("offload copy not hidden")]
    row = next(r for r in hidden.rows if r.name in kept)
    assert re.search(r"copy not hidden: [\d.]+ us each way, under [\d.]+ us of forward compute "
                     r"after its last use and [\d.]+ us of backward compute before its first",
                     row.decision), row.decision


def test_offload_hidden_only_needs_offload():
    import graphpass

    assert [str(u) for u in graphpass.Config(offload_hidden_only=True).unused()] == [
        "offload_hidden_only=True has no effect without offload=True"]


def _budgeted(monkeypatch, budget, n):
    """graphpass's report of ``_layers`` on (n, n) CUDA tensors under ``memory_budget=budget``."""
    config = graphpass.Config(codegen="eager", memory_budget=budget)
    _cuda_partition(monkeypatch, stream=True, n=n, partitioner=functools.partial(
        graphpass.partition, config=config, compiler="eager"))
    return graphpass.last_report()


def test_a_budget_on_cuda_offloads_the_largest_longest_lived_tensors_whose_copies_hide(monkeypatch):
    """On a CUDA device the budget weighs offloads too. Four 64 MiB relu outputs in a chain of
    fp32 (4096, 4096) GEMMs (2.05 ms each by the H100 roofline, a copy 1.34 ms each way): a
    hidden offload costs nothing, so half a tensor below the unbudgeted peak the budget offloads
    one rather than recompute anything, the longest-lived, its decision giving the copy time, the
    compute of its two windows and that it hides; the summary adds nothing by the roofline."""
    unbudgeted = _budgeted(monkeypatch, None, BIG).meta["step_peak"]
    assert unbudgeted["device"] == "cuda"
    with pytest.raises(ValueError, match="cannot be met") as error:
        _budgeted(monkeypatch, 1, BIG)
    smallest = _smallest_peak(error.value)
    assert smallest < unbudgeted["bytes"]
    budget = unbudgeted["bytes"] - BIG * BIG * 2  # half a tensor
    report = _budgeted(monkeypatch, budget, BIG)
    assert report.meta["step_peak"]["bytes"] <= budget
    notes = [str(d) for d in report.decisions if d.what is What.BUDGETED]
    offloads = [n for n in notes if n.startswith("memory_budget: offload ")]
    assert offloads and len(offloads) == len(notes) - 1, notes
    # the first relu output: the longest-lived (the most compute to hide its copies under)
    assert offloads == [
        "memory_budget: offload relu (aten.relu, 64.00 MiB, 1.34 ms each way under 4.32 ms of "
        "forward and 8.55 ms of backward compute: hidden)"], notes
    assert "adding about 0.0 us by the roofline" in notes[-1], notes[-1]


def test_the_budgets_offloads_turn_torchs_offloading_on_and_the_report_says_so(monkeypatch):
    """With ``offload`` off, the budget's offload turns torch's activation offloading on for the
    partitions after it (``Plan.torch_offloading``), the final one included: its forward offloads
    the tensor, and the report says who turned the offloading on. No budget, no such note."""
    unbudgeted = _budgeted(monkeypatch, None, BIG)
    assert not [d for d in unbudgeted.decisions if d.what is What.TORCH_OFFLOADING]
    assert not any(r.decided(What.OFFLOADED) for r in unbudgeted.rows)
    report = _budgeted(monkeypatch, unbudgeted.meta["step_peak"]["bytes"] - BIG * BIG * 2, BIG)
    assert [str(d) for d in report.decisions if d.what is What.TORCH_OFFLOADING] == [
        "memory_budget: torch's activation offloading turned on (offload=False; for the tensors "
        "it marked for offload)"]
    offloaded = [r.name for r in report.rows if r.decided(What.OFFLOADED)]
    assert len(offloaded) == 1 and offloaded[0].endswith("relu"), offloaded  # cpu_offload_relu
    assert "memory_budget: torch's activation offloading turned on" in str(report)
