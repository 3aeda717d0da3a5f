"""The step's memory peak, predicted from the partitioned forward and backward graphs.

A liveness walk over the two graphs in the order they run, sizes from each node's fake-tensor
metadata, bytes counted once per storage (views and multi-output ops share one), as the report
counts saved bytes. A storage is live from the node that allocates it to its last use; what the
forward returns (the user's outputs, the saved tensors) stays live into the backward, the
backward's outputs (the gradients) to its end. Parameters and the graph's other inputs are live
throughout: they exist before the step and after it.

How the backward frees its inputs depends on the code that runs it: Inductor's code clears its
argument list and frees each saved tensor after its last use (``runtime="inductor"``); the
graphs run as-is (``codegen="eager"``) hold every saved tensor until the backward returns
(``runtime="eager"``: the boxed call's argument list stays referenced while the graph runs;
measured with MemTracker, tests/test_peak.py).

Inductor's code also allocates far less than the graph shows: an elementwise node (a bf16 norm's
fp32 upcast, each op of a decomposed SiLU backward) is computed inside the kernels that read it
and is never a buffer; elementwise nodes that read the same buffers run as one kernel; a kernel
writes its result into a dying input of the same size. Under ``runtime="inductor"`` the walk
runs the graphs that way (``inductor_kernels``, from Inductor's own op tables). Read as-is, the
graphs of a bf16 Llama layer predicted 54% above the peak Inductor's code reached on the CPU (and
45% above the H100's for Llama-3-8B); with the model the CPU prediction is exact to a few bytes
for the Llama and GPT examples. Inductor's scheduler also reorders kernels (it may move a
norm's weight-gradient reduction later, keeping its inputs alive), which the walk does not
model: the DeepSeek example's peak is 5.9% above the prediction (docs/memory.md).

torch's ``_inductor.fx_passes.memory_estimator.get_peak_memory`` estimates the same kind of
forward/backward profile but counts accelerator storages only (nothing on a CPU run) and its
alias tracker's name and fields differ between the torch versions graphpass supports; this walk
counts every device and reports the peak of the compute device (the one holding the most
parameter and input bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .. import _compat
from .._compat import offloaded_source, size_hint, storage_id
from ..report.peak import peak_dict
from .nodes import module_path, op_name
from .ops import VIEWS


@dataclass
class _Storage:
    bytes: int
    device: str
    node: fx.Node
    kind: str


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int,
              parameter_names: set[str], runtime: str = "inductor",
              fused: bool | None = None) -> dict[str, Any]:
    """The step's predicted peak on the compute device (``report.peak.peak_dict``). ``fused``
    (default: under ``runtime="inductor"``) runs the graphs as Inductor's code does
    (``inductor_kernels``); ``False`` reads them node by node."""
    storages: dict[int, _Storage] = {}
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
            storages[sid] = _Storage(nbytes, str(val.device.type), node, kind)

    live: set[int] = set()
    fw_inputs = fw.graph.find_nodes(op="placeholder")
    for node in fw_inputs:
        allocate(node, "parameter" if node.name in parameter_names else "input")
        live.update(sids(node))
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
    return peak_dict(
        bytes=peak_bytes, device=device, phase="forward" if best is fw_best else "backward",
        node=node.name if node is not None else "-", module=module_path(node) if node else "",
        op=op_name(node) if node is not None else "-",
        live=[{"name": storages[s].node.name, "op": op_name(storages[s].node),
               "module": module_path(storages[s].node), "kind": storages[s].kind,
               "bytes": storages[s].bytes} for s in at if storages[s].device == device],
        forward_peak=fw_best[0], backward_peak=bw_best[0], runtime=runtime)


def _walk(gm: fx.GraphModule, storages: dict[int, _Storage], live: set[int], allocate: Any,
          sids: Any, device: str, *, frees: Any, kind: str, fused: bool,
          output_kind: str | None = None) -> tuple[int, fx.Node | None, set[int]]:
    """Run ``gm``'s nodes in order, updating ``live``: each node's new storages are live after it
    runs, storages are freed after their last use when ``frees`` allows. The peak on ``device``
    (bytes, the node, the live storages there).

    ``fused`` runs the graph as Inductor's code does (``inductor_kernels``): the nodes it
    computes inside the kernels of their users allocate nothing, elementwise nodes that read the
    same buffers run as one kernel, and one of its own kernels writes a result into an input
    that dies there where the sizes match (``inplace_buffers``)."""
    output = gm.graph.find_nodes(op="output")[0]
    if fused:
        kernels, reads = inductor_kernels(gm)
    else:
        kernels = [[n] for n in gm.graph.nodes if n.op == "call_function"]
        reads = lambda node: node.all_input_nodes  # noqa: E731
    last_use: dict[int, int] = {}  # storage -> the kernel that reads it last
    for k, kernel in enumerate([*kernels, [output]]):
        for node in kernel:
            for i in reads(node):
                for s in sids(i):
                    last_use[s] = k
    if output_kind is not None:  # the backward's outputs (gradients) live to its end
        for i in output.all_input_nodes:
            allocate(i, output_kind)

    def size(s: int) -> int:
        return storages[s].bytes if storages[s].device == device else 0

    now = sum(size(s) for s in live)
    best: tuple[int, fx.Node | None, set[int]] = (now, None, set(live))
    for k, kernel in enumerate(kernels):
        mine: set[int] = set()
        for node in kernel:
            allocate(node, kind)
            mine |= set(sids(node)) - live
        freed = {s for node in kernel for i in reads(node) for s in sids(i)
                 if last_use.get(s) == k and frees(s)} & live
        if fused and _inductor_kind(kernel[0]) != "extern":
            reused = _reused_inputs(kernel, freed, storages, reads, sids, live)
            live -= reused
            freed -= reused
            now -= sum(size(s) for s in reused)
        live |= mine
        now += sum(size(s) for s in mine)
        if now > best[0]:
            best = (now, kernel[-1], set(live))
        freed |= {s for s in mine if s not in last_use and frees(s)}  # never read: freed at once
        live -= freed
        now -= sum(size(s) for s in freed)
    return best


def _reused_inputs(kernel: list[fx.Node], dying: set[int], storages: dict[int, _Storage],
                   reads: Any, sids: Any, live: set[int]) -> set[int]:
    """The dying inputs whose memory the kernel's results take over: as Inductor's
    ``inplace_buffers``, a node writes its result into an input of the same size that only it,
    of the kernel's nodes, reads."""
    readers: dict[int, list[fx.Node]] = {}
    for node in kernel:
        for s in {s for i in reads(node) for s in sids(i)}:
            readers.setdefault(s, []).append(node)
    reused: set[int] = set()
    for node in kernel:
        for r in set(sids(node)) - live:
            for s in sorted(dying - reused):
                if readers.get(s) == [node] and (storages[s].bytes, storages[s].device) == (
                        storages[r].bytes, storages[r].device):
                    reused.add(s)
                    break
    return reused


# -- what Inductor's code materializes -------------------------------------------------------------

def inductor_buffers(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose values Inductor's generated code holds in memory, by its own op
    tables (``torch._inductor.lowering``): what an extern kernel computes (a GEMM, attention, a
    custom op) and its inputs; what Inductor's own non-elementwise kernels compute (reductions,
    concatenations, scatters); the graph's outputs; views of these. An elementwise node read
    only by other kernels is computed inside each of them (fused), in registers: its value is
    never a buffer, however many fp32 temporaries the decomposed graph shows.

    A model of Inductor's choices, not a run of its scheduler: Inductor may still materialize an
    elementwise value that many kernels read (``realize_reads_threshold``), and the scheduler
    removes a buffer whose readers all fuse with its producer; neither is modelled."""
    buffers: set[fx.Node] = set()

    def materialize(node: fx.Node) -> None:
        buffers.add(node)
        buffers.add(_base(node))

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            buffers.add(node)
        elif node.op == "output":
            for i in node.all_input_nodes:
                materialize(i)
        elif node.op == "call_function":
            kind = _inductor_kind(node)
            if kind in ("extern", "kernel"):
                buffers.add(node)
            if kind == "extern":
                for i in node.all_input_nodes:
                    materialize(i)
    # a view (or a multi-output op's element) is a buffer exactly when what it views is
    for node in gm.graph.nodes:
        if node.op == "call_function" and _inductor_kind(node) == "view":
            if _base(node) in buffers:
                buffers.add(node)
            else:
                buffers.discard(node)
    return buffers


def _base(node: fx.Node) -> fx.Node:
    """What a view (or a multi-output op's element) aliases, through views; any other node
    itself."""
    while node.op == "call_function" and _inductor_kind(node) == "view":
        node = node.all_input_nodes[0]
    return node


FUSION_WINDOW = 64
"""How far apart (in nodes) two elementwise nodes may be and still share a kernel: Inductor's
scheduler fuses only nodes this close (``max_fusion_size``-sized groups, proximity)."""


def inductor_kernels(gm: fx.GraphModule) -> tuple[list[list[fx.Node]], Any]:
    """``gm``'s nodes as the kernels of Inductor's code run them, in order, and each node's
    buffer reads (``reads(node)``): the buffers (``inductor_buffers``), each elementwise one
    grouped with the later elementwise buffers of the same size that read a buffer it reads and
    read nothing computed after it (Inductor's horizontal fusion: a SwiGLU's two input
    gradients, computed in one kernel that reads the saved inputs once and frees them)."""
    buffers = inductor_buffers(gm)
    memo: dict[fx.Node, list[fx.Node]] = {}
    reads = functools.partial(_buffer_reads, buffers=buffers, memo=memo)
    order = [n for n in gm.graph.nodes if n.op == "call_function" and n in buffers
             and _inductor_kind(n) != "view"]
    position = {n: i for i, n in enumerate(order)}
    kernels: list[list[fx.Node]] = []
    placed: set[fx.Node] = set()
    for i, node in enumerate(order):
        if node in placed:
            continue
        kernel = [node]
        placed.add(node)
        if _inductor_kind(node) == "elementwise":
            shared = set(reads(node))
            for later in order[i + 1:i + FUSION_WINDOW]:
                if (later in placed or _inductor_kind(later) != "elementwise"
                        or _numel(later) != _numel(node)):
                    continue
                ins = reads(later)
                if shared.isdisjoint(ins) or any(position.get(x, -1) > i for x in ins):
                    continue
                kernel.append(later)
                placed.add(later)
                shared.update(ins)
        kernels.append(kernel)
    return kernels, reads


def _numel(node: fx.Node) -> str | None:
    """The node's element count as an expression (a symbolic size compares as its formula, with
    no size assumed)."""
    val = node.meta.get("val")
    return str(val.numel()) if isinstance(val, torch.Tensor) else None


def _buffer_reads(node: fx.Node, *, buffers: set[fx.Node], memo: dict[fx.Node, list[fx.Node]]
                  ) -> list[fx.Node]:
    """The buffers ``node``'s kernel reads: its inputs that are buffers, and through each fused
    (inlined) input, what that one reads."""
    out: list[fx.Node] = []
    for i in node.all_input_nodes:
        if i in buffers:
            out.append(_base(i))
            continue
        if i not in memo:
            memo[i] = _buffer_reads(i, buffers=buffers, memo=memo)
        out += memo[i]
    return out


# Ops without the pointwise tag that Inductor lowers as elementwise loops (casts, fills, index
# loads), by ``op_name``.
_ELEMENTWISE = frozenset({
    "aten._to_copy", "aten.full", "aten.full_like", "aten.zeros", "aten.zeros_like", "aten.ones",
    "aten.ones_like", "aten.empty_like", "aten.scalar_tensor", "aten.arange", "prims.iota",
    "aten.index", "aten.gather", "aten.embedding", "aten.copy", "aten.lift_fresh_copy",
    "prims.inductor_random", "prims.inductor_randint", "aten.rand_like", "aten.randn_like",
})


def _inductor_kind(node: fx.Node) -> str:
    """How Inductor runs a call: ``view`` (an alias: views and a multi-output op's elements),
    ``elementwise`` (fused into its readers), ``kernel`` (its own loop nest, such as a
    reduction: its result is a buffer, its inputs fuse into it) or ``extern`` (a library or
    fallback kernel: its inputs and result are buffers)."""
    return _target_kind(node.target)


@functools.lru_cache(maxsize=None)
def _target_kind(target: Any) -> str:
    """``_inductor_kind`` of every call of ``target``, once per op (the budget's search walks
    the graphs once per partition it tries)."""
    name = _compat.op_name(target) or getattr(target, "__name__", str(target))
    if name == "getitem" or name in VIEWS:
        return "view"
    if not isinstance(target, torch._ops.OpOverload):
        return "extern"
    lowerings, fallbacks, realized_inputs = _compat.inductor_lowering_tables()
    if target in fallbacks or target in realized_inputs or target.overloadpacket in realized_inputs:
        return "extern"
    if torch.Tag.pointwise in target.tags or name in _ELEMENTWISE:
        return "elementwise"
    return "kernel" if target in lowerings else "extern"


def _raw_sids(node: fx.Node) -> Iterator[int]:
    for val in tree_leaves(node.meta.get("val")):
        if isinstance(val, torch.Tensor):
            sid = storage_id(val)
            if sid is not None:
                yield sid


def _compute_device(storages: dict[int, _Storage], resident: set[int]) -> str:
    by_device: dict[str, int] = {}
    for s in resident:
        by_device[storages[s].device] = by_device.get(storages[s].device, 0) + storages[s].bytes
    return max(by_device, key=by_device.__getitem__) if by_device else "cpu"
