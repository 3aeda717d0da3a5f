"""The step's memory peak, predicted from the partitioned forward and backward graphs: a
liveness walk.

Contract: ``step_peak(fw, bw, ...)`` walks the two graphs in the order they run and returns the
peak of the compute device (the one holding the most parameter and input bytes) as a
``report.peak.StepPeak``: how many bytes, at which node, and what is live there. It reads the
graphs' fake-tensor metadata and changes nothing. Bytes are counted once per storage (views and
multi-output ops share one), as the report counts saved bytes. A storage is live from the node
that allocates it to its last use; what the forward returns (the user's outputs, the saved
tensors) stays live into the backward, the backward's outputs (the gradients) to its end.
Parameters and the graph's other inputs are live throughout: they exist before the step and
after it; so are the weight cache's copies (kind ``cached``).

How the backward frees its inputs depends on the code that runs it: Inductor's code clears its
argument list and frees each saved tensor after its last use (``runtime="inductor"``); the
graphs run as-is (``codegen="eager"``) hold every saved tensor until the backward returns
(``runtime="eager"``: the boxed call's argument list stays referenced while the graph runs;
measured with MemTracker, tests/test_peak.py).

Under ``runtime="inductor"`` the walk runs the graphs as Inductor's code does: its kernels, in
its order (``graph/inductor_kernels.py``: a fused elementwise value is never a buffer), results
written into dying inputs and freed buffers kept for a later allocation
(``graph/inductor_memory.py``); on a GPU, in the order Inductor's ``reorder_for_peak_memory``
keeps (``graph/inductor_reorder.py``: 46,960,308,224 B on a DeepSeek-V3 layer, bf16, as measured
on an H200; 48,441,896,968 B in the scheduler's order). Read as-is, the graphs of a bf16 Llama
layer hold every fp32 upcast a fused kernel never writes; with the model the CPU prediction is
exact to a few bytes for the Llama and GPT examples. An op's own copy of an operand that no
graph shows is counted where it is known (the CPU attention backward's copy of an output
gradient in (batch, heads, sequence, dim) order, while it runs).

Limits: what an op allocates inside itself is otherwise not counted: the DeepSeek example is
262,404 B under the allocator's peak, 0.9% at one layer and 0.5% at two (torch 2.13 and 2.15),
the CPU attention kernel's per-thread buffers (262,400 B on one thread;
docs/memory/step-peak.md, "Under Inductor"); for the limits of the model of Inductor, see its
two modules. torch's
``_inductor.fx_passes.memory_estimator.get_peak_memory`` estimates the same kind of
forward/backward profile but counts accelerator storages only (nothing on a CPU run) and its
alias tracker's name and fields differ between the torch versions graphpass supports; this walk
counts every device.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.fx as fx

from .._compat import size_hint, storage_id, tree_leaves
from ..report.peak import LiveTensor, StepPeak
from .inductor_kernels import addmm_adds, inductor_kernels, inductor_kind
from .inductor_memory import NONFREEABLE, Storage, reuse_plan, reused_inputs
from .inductor_reorder import reorder_for_peak
from .joint import is_offload_machinery, offloaded_source
from .nodes import module_path, op_name


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int,
              parameter_names: set[str], runtime: str = "inductor",
              fused: bool | None = None) -> StepPeak:
    """The step's predicted peak on the compute device. ``fused``
    (default: under ``runtime="inductor"``) runs the graphs as Inductor's code does
    (``inductor_kernels``); ``False`` reads them node by node."""
    storages: dict[int, Storage] = {}
    alias: dict[int, int] = {}  # a backward input's storage -> the forward's storage it is

    def sids(node: fx.Node) -> list[int]:
        out = []
        for val in tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor):
                sid = storage_id(val)
                if sid is not None:
                    out.append(alias.get(sid, sid))
        return out

    def allocate(node: fx.Node, kind: str) -> None:
        for val in tree_leaves(node.meta.get("val")):
            if not isinstance(val, torch.Tensor):
                continue
            sid = storage_id(val)
            sid = alias.get(sid, sid)
            if sid is None or sid in storages:
                continue
            nbytes = size_hint(val.untyped_storage().nbytes(), where=f"the step peak's {node.name}")
            storages[sid] = Storage(nbytes, str(val.device.type), node, kind, str(val.dtype))

    live: set[int] = set()
    fw_inputs = fw.graph.find_nodes(op="placeholder")
    for node in fw_inputs:
        allocate(node, "parameter" if node.name in parameter_names else "input")
        live.update(sids(node))
    _hold_cached(fw, bw, storages, alias, allocate, sids, live)
    resident = set(live)
    device = _compute_device(storages, resident)

    # forward
    fw_output = fw.graph.find_nodes(op="output")[0]
    outputs = list(fw_output.args[0])
    returned = {s for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node) for s in sids(n)}
    fused = runtime == "inductor" if fused is None else fused
    fw_best = _walk(fw, storages, live, allocate, sids, device, frees=lambda s: s not in resident,
                    kind="transient", fused=fused)
    for sid in live - resident:
        storages[sid].kind = "output" if sid in returned else "saved"
        if offloaded_source(storages[sid].node) is not None:
            storages[sid].kind = "offloaded"

    # backward: its inputs are the forward's saved values (same storages) and the tangents
    fw_by_name = {n.name: n for n in fw.graph.nodes}
    for node in bw.graph.find_nodes(op="placeholder"):
        source = fw_by_name.get(node.name)
        if source is not None:
            for bw_sid, fw_sid in zip(_raw_sids(node), sids(source)):
                if bw_sid != fw_sid:
                    alias[bw_sid] = fw_sid
        else:  # a tangent
            allocate(node, "transient")
            live.update(sids(node))
    user_outputs = returned - resident
    bw_inputs = {s for n in bw.graph.find_nodes(op="placeholder") for s in sids(n)}
    held = resident | user_outputs | (bw_inputs if runtime == "eager" else set())
    if runtime != "eager":  # saved values the backward never reads are freed as it starts
        read = {s for n in bw.graph.nodes if n.op != "placeholder"
                for i in n.all_input_nodes for s in sids(i)}
        live -= {s for s in live if s not in held and s not in read and storages[s].kind == "saved"}
    bw_best = _walk(bw, storages, live, allocate, sids, device, frees=lambda s: s not in held,
                    kind="transient", fused=fused, output_kind="gradient")

    best = max(fw_best, bw_best, key=lambda p: p[0])
    peak_bytes, node, at = best
    return StepPeak.of(
        bytes=peak_bytes, device=device, phase="forward" if best is fw_best else "backward",
        node=node.name if node is not None else "-", module=module_path(node) if node else "",
        op=op_name(node) if node is not None else "-",
        live=[LiveTensor(storages[s].node.name, op_name(storages[s].node),
                         module_path(storages[s].node), storages[s].kind, storages[s].bytes)
              for s in at if storages[s].device == device],
        forward_peak=fw_best[0], backward_peak=bw_best[0], runtime=runtime)


def _hold_cached(fw: fx.GraphModule, bw: fx.GraphModule, storages: dict[int, Storage],
                 alias: dict[int, int], allocate: Any, sids: Any, live: set[int]) -> None:
    """The weight cache's copies (``graphpass::quantize_weight``, ``fp8_weight_cache``; and
    SimpleFSDP's FP8 shards, ``graphpass::quantize_weight_shards``) are held between steps: live
    from the step's start to its end, kind ``cached``, each weight's copies counted once where
    the forward and the backward both look them up."""
    first: dict[tuple, fx.Node] = {}
    for gm in (fw, bw):
        for node in gm.graph.nodes:
            if op_name(node) not in ("graphpass.quantize_weight",
                                     "graphpass.quantize_weight_shards"):
                continue
            key = tuple(tuple(a.name for a in arg) if isinstance(arg, (list, tuple))
                        else arg.name if isinstance(arg, fx.Node) else arg for arg in node.args)
            if key not in first:
                first[key] = node
                allocate(node, "cached")
                live.update(sids(node))
            else:
                for sid, held in zip(_raw_sids(node), sids(first[key])):
                    if sid != held:
                        alias[sid] = held


def _walk(gm: fx.GraphModule, storages: dict[int, Storage], live: set[int], allocate: Any,
          sids: Any, device: str, *, frees: Any, kind: str, fused: bool,
          output_kind: str | None = None) -> tuple[int, fx.Node | None, set[int]]:
    """Run ``gm``'s nodes in order, updating ``live``: each node's new storages are live after it
    runs, storages are freed after their last use when ``frees`` allows. The peak on ``device``
    (bytes, the node, the live storages there).

    ``fused`` runs the graph as Inductor's code does (``inductor_kernels``): the nodes it
    computes inside the kernels of their users allocate nothing, elementwise nodes that read the
    same buffers run as one kernel, in Inductor's order; one of its own kernels writes a result
    into an input that dies there where the sizes match (``inplace_buffers``); and a buffer its
    code frees is kept for a later allocation of the same size where Inductor's own estimate
    allows (``reuse_plan``). On a device other than the CPU the kernels run in the order
    Inductor's ``reorder_for_peak_memory`` keeps (``_reordered``), except in a graph with torch's
    activation offloading: the model of that reorder knows nothing of its streams and events,
    and would move each reload from where torch's prefetch put it to just before its use, so
    such a graph keeps the scheduler's order (not measured on a GPU)."""
    output = gm.graph.find_nodes(op="output")[0]
    externs: dict[fx.Node, fx.Node] = {}
    if fused:
        kernels, reads = inductor_kernels(gm)
        externs = addmm_adds(gm)
    else:
        kernels = [[n] for n in gm.graph.nodes if n.op == "call_function"]
        reads = lambda node: node.all_input_nodes  # noqa: E731
    if output_kind is not None:  # the backward's outputs (gradients) live to its end
        for i in output.all_input_nodes:
            allocate(i, output_kind)
    if fused and device != "cpu" and not any(map(is_offload_machinery, gm.graph.nodes)):
        kernels = _reordered(gm, output, kernels, reads, storages, live, allocate, sids, kind)
    last_use: dict[int, int] = {}  # storage -> the kernel that reads it last
    for k, kernel in enumerate([*kernels, [output]]):
        for node in kernel:
            for i in reads(node):
                for s in sids(i):
                    last_use[s] = k

    def size(s: int) -> int:
        return storages[s].bytes if storages[s].device == device else 0

    # each kernel's new storages, the dying inputs its results take over, the storages it frees
    events: list[tuple[list[int], dict[int, int], set[int]]] = []
    shadow = set(live)
    for k, kernel in enumerate(kernels):
        mine: list[int] = []
        for node in kernel:
            allocate(node, kind)
            mine += [s for s in sids(node) if s not in shadow and s not in mine]
        freed = {s for node in kernel for i in reads(node) for s in sids(i)
                 if last_use.get(s) == k and frees(s)} & shadow
        taken: dict[int, int] = {}
        if fused and inductor_kind(kernel[0]) != "extern" and kernel[0] not in externs:
            taken = reused_inputs(kernel, freed, storages, reads, sids, shadow)
            freed -= taken.keys()
        freed |= {s for s in mine if s not in last_use and frees(s)}  # never read: freed at once
        shadow = ((shadow - taken.keys()) | set(mine)) - freed
        events.append((mine, taken, freed))
    held = reuse_plan(gm, kernels, reads, events, storages, live, last_use, device, externs) \
        if fused else {}

    now = sum(size(s) for s in live)
    best: tuple[int, fx.Node | None, set[int]] = (now, None, set(live))
    for k, (kernel, (mine, taken, freed)) in enumerate(zip(kernels, events)):
        gone = set(taken) | {s for s, until in held.items() if until == k}
        live -= gone
        live |= set(mine)
        now += sum(size(s) for s in mine) - sum(size(s) for s in gone)
        scratch = set()
        for node in kernel:  # an op's own copy of an operand, live while it runs
            nbytes = _operand_copy(node)
            if nbytes:
                scratch.add(-1 - len(storages))
                storages[-1 - len(storages)] = Storage(nbytes, device, node, "transient")
        at = now + sum(size(s) for s in scratch)
        if at > best[0]:
            best = (at, kernel[-1], live | scratch)
        freed = freed - held.keys()
        live -= freed
        now -= sum(size(s) for s in freed)
    return best


def _reordered(gm: fx.GraphModule, output: fx.Node, kernels: list[list[fx.Node]], reads: Any,
               storages: dict[int, Storage], live: set[int], allocate: Any, sids: Any,
               kind: str) -> list[list[fx.Node]]:
    """The kernels in the order Inductor's ``reorder_for_peak_memory`` keeps
    (``graph/inductor_reorder.py``): the inputs it may free are the graph's inputs other than
    parameters, inputs and tangents (in a backward, the saved tensors)."""
    for kernel in kernels:
        for node in kernel:
            allocate(node, kind)
    freeable = {s for n in gm.graph.find_nodes(op="placeholder")
                if not n.name.startswith(NONFREEABLE) for s in sids(n)} & live
    outputs = {s for i in output.all_input_nodes for s in sids(i)}
    return reorder_for_peak(kernels, reads, sids, lambda s: storages[s].bytes, live, freeable,
                            outputs)


def _operand_copy(node: fx.Node) -> int:
    """The bytes an extern op allocates inside itself for a copy of an operand, which no graph
    shows: the CPU flash attention backward copies its output gradient into (batch, sequence,
    heads, dim) order unless it is in that order already (a gradient Inductor computes is in
    (batch, heads, sequence, dim) order; measured with torch's profiler, torch 2.13). Other
    scratch (that kernel's per-thread buffers, a GPU kernel's own) is not counted."""
    if node.target is not _FLASH_CPU_BACKWARD or not isinstance(node.args[0], fx.Node):
        return 0
    grad = node.args[0].meta.get("val")
    if not isinstance(grad, torch.Tensor) or grad.dim() != 4:
        return 0
    where = f"the step peak's {node.name}"
    sizes = [size_hint(n, where=where) for n in grad.transpose(1, 2).shape]
    strides = [size_hint(n, where=where) for n in grad.transpose(1, 2).stride()]
    expected, step = [], 1
    for n in reversed(sizes):
        expected.insert(0, step)
        step *= n
    if all(n == 1 or a == b for n, a, b in zip(sizes, strides, expected)):
        return 0
    return step * grad.element_size()


_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                              None)
_FLASH_CPU_BACKWARD = getattr(_FLASH_CPU_BACKWARD, "default", None)

def _raw_sids(node: fx.Node) -> Iterator[int]:
    for val in tree_leaves(node.meta.get("val")):
        if isinstance(val, torch.Tensor):
            sid = storage_id(val)
            if sid is not None:
                yield sid


def _compute_device(storages: dict[int, Storage], resident: set[int]) -> str:
    by_device: dict[str, int] = {}
    for s in resident:
        by_device[storages[s].device] = by_device.get(storages[s].device, 0) + storages[s].bytes
    return max(by_device, key=by_device.__getitem__) if by_device else "cpu"
