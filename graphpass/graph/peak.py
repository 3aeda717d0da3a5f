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
runs the graphs that way (``inductor_kernels``, from Inductor's own op tables): read as-is,
the graphs of a bf16 Llama layer hold every fp32 upcast a fused kernel never writes; with the
model the CPU prediction is exact to a few bytes for the Llama and GPT examples.

The walk also follows what Inductor does beyond fusion. Its kernels run in the order Inductor's
scheduler gives a fused node: reductions of the same sizes that read a common buffer are one
kernel, run where the first stood, after what the later ones read, and the kernels in between
that it does not need run after it (two norms' weight gradients reading the layer's input move
past the attention backward, the layer's weight-gradient GEMMs after them, keeping their
inputs alive; ``order_backward``, ``graph/backward_order.py``, moves such groups where nothing
waits for them, from ``fused_reductions``, before this walk reads the graph). A GEMM plus a
tensor is one ``addmm``. A buffer Inductor's code frees is kept
for a later allocation of its dtype and size where Inductor's wrapper keeps it (its reuse pool,
bounded by Inductor's own peak estimate, which this walk reproduces). And the CPU attention
backward's copy of an output gradient in (batch, heads, sequence, dim) order is counted while
it runs. With these the DeepSeek example is 262,404 B under the allocator's
peak, 0.9% at one layer and 0.5% at two (torch 2.13 and 2.15): that kernel's per-thread buffers,
inside the op (262,400 B on one thread), which no graph shows (docs/memory.md, "Under
Inductor"). The reuse pool follows 2.13's estimate; 2.11's is lower, and there the one-layer
example is 2.6% over (DEVELOPERS.md).

torch's ``_inductor.fx_passes.memory_estimator.get_peak_memory`` estimates the same kind of
forward/backward profile but counts accelerator storages only (nothing on a CPU run) and its
alias tracker's name and fields differ between the torch versions graphpass supports; this walk
counts every device and reports the peak of the compute device (the one holding the most
parameter and input bytes).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import torch
import torch.fx as fx

from .. import _compat
from .._compat import size_hint, storage_id, tree_leaves
from ..report.peak import LiveTensor, StepPeak
from .joint import offloaded_source
from .nodes import module_path, op_name, tensor_bytes
from .ops import VIEWS


@dataclass
class _Storage:
    bytes: int
    device: str
    node: fx.Node
    kind: str
    dtype: str = ""


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int,
              parameter_names: set[str], runtime: str = "inductor",
              fused: bool | None = None) -> StepPeak:
    """The step's predicted peak on the compute device. ``fused``
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
            storages[sid] = _Storage(nbytes, str(val.device.type), node, kind, str(val.dtype))

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


def _hold_cached(fw: fx.GraphModule, bw: fx.GraphModule, storages: dict[int, _Storage],
                 alias: dict[int, int], allocate: Any, sids: Any, live: set[int]) -> None:
    """The weight cache's copies (``graphpass::quantize_weight``, ``fp8_weight_cache``) are held
    between steps: live from the step's start to its end, kind ``cached``, each weight's copies
    counted once where the forward and the backward both look them up."""
    first: dict[tuple, fx.Node] = {}
    for gm in (fw, bw):
        for node in gm.graph.nodes:
            if op_name(node) != "graphpass.quantize_weight":
                continue
            key = (node.args[0].name, *node.args[1:])
            if key not in first:
                first[key] = node
                allocate(node, "cached")
                live.update(sids(node))
            else:
                for sid, held in zip(_raw_sids(node), sids(first[key])):
                    if sid != held:
                        alias[sid] = held


def _walk(gm: fx.GraphModule, storages: dict[int, _Storage], live: set[int], allocate: Any,
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
    allows (``_reuse_plan``)."""
    output = gm.graph.find_nodes(op="output")[0]
    externs: dict[fx.Node, fx.Node] = {}
    if fused:
        kernels, reads = inductor_kernels(gm)
        externs = _addmm_adds(gm)
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
        if fused and _inductor_kind(kernel[0]) != "extern" and kernel[0] not in externs:
            taken = _reused_inputs(kernel, freed, storages, reads, sids, shadow)
            freed -= taken.keys()
        freed |= {s for s in mine if s not in last_use and frees(s)}  # never read: freed at once
        shadow = ((shadow - taken.keys()) | set(mine)) - freed
        events.append((mine, taken, freed))
    held = _reuse_plan(gm, kernels, reads, events, storages, live, last_use, device, externs) \
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
                storages[-1 - len(storages)] = _Storage(nbytes, device, node, "transient")
        at = now + sum(size(s) for s in scratch)
        if at > best[0]:
            best = (at, kernel[-1], live | scratch)
        freed = freed - held.keys()
        live -= freed
        now -= sum(size(s) for s in freed)
    return best


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


def _reused_inputs(kernel: list[fx.Node], dying: set[int], storages: dict[int, _Storage],
                   reads: Any, sids: Any, live: set[int]) -> dict[int, int]:
    """The dying inputs whose memory the kernel's results take over, each with the result: as
    Inductor's ``inplace_buffers``, a node writes its result into an input of the same size that
    only it, of the kernel's nodes, reads, element for element (not through a transpose: a write
    at the index it reads from)."""
    readers: dict[int, list[fx.Node]] = {}
    for node in kernel:
        for s in {s for i in reads(node) for s in sids(i)}:
            readers.setdefault(s, []).append(node)
    reused: dict[int, int] = {}
    for node in kernel:
        moved = {s for i in _permuted_reads(node, set(reads(node))) for s in sids(i)}
        for r in [r for r in sids(node) if r not in live]:
            for s in [s for i in reads(node) for s in sids(i)]:  # in the order it reads them
                if (s in dying and s not in reused and s not in moved
                        and readers.get(s) == [node]
                        and (storages[s].bytes, storages[s].device)
                        == (storages[r].bytes, storages[r].device)):
                    reused[s] = r
                    break
    return reused


def _permuted_reads(node: fx.Node, buffers: set[fx.Node]) -> set[fx.Node]:
    """The buffers (of ``buffers``) that ``node`` reads through a transpose or permute, directly
    or through the elementwise nodes computed inside it."""
    out: set[fx.Node] = set()
    todo, seen = [(i, False) for i in node.all_input_nodes], set()
    while todo:
        i, moved = todo.pop()
        if (i, moved) in seen:
            continue
        seen.add((i, moved))
        if i in buffers:
            if moved:
                out.add(i)
            continue
        if i.op != "call_function" or _inductor_kind(i) in ("extern", "kernel"):
            continue
        moved = moved or _compat.op_name(i.target) in _PERMUTES
        todo += [(j, moved) for j in i.all_input_nodes]
    return out


_PERMUTES = frozenset({"aten.permute", "aten.t", "aten.transpose"})


def _reuse_plan(gm: fx.GraphModule, kernels: list[list[fx.Node]], reads: Any,
                events: list[tuple[list[int], dict[int, int], set[int]]],
                storages: dict[int, _Storage], live: set[int], last_use: dict[int, int],
                device: str, externs: dict[fx.Node, fx.Node]) -> dict[int, int]:
    """The buffers Inductor's code keeps after their last use for a later allocation, each with
    the kernel that takes it over. Inductor's wrapper (``memory_plan_reuse``) puts each buffer
    its code allocated and frees into a pool by dtype and size; an allocation takes the one
    freed last, which stays allocated in between, where that kernel directly follows the free or
    the buffer's size added to the most Inductor estimates between them stays within the most
    it estimates for the graph (``AllocateLine.should_reuse_buffer``). Its estimate
    (``memory.estimate_peak_memory``) frees the saved tensors after their last use but never the
    parameters, inputs and tangents (``is_nonfreeable_buffers``, by name), knows nothing of
    results written into dying inputs, and counts the values Inductor realized before fusing
    them away (``_realized_in_kernels``); so does this one."""
    def planned(s: int) -> bool:
        node = storages[s].node
        return (storages[s].device == device and node.graph is gm.graph
                and node.op == "call_function" and _wrapper_allocates(node, externs))

    def kept(s: int) -> bool:  # ``is_nonfreeable_buffers``: by the names AOTAutograd gives
        node = storages[s].node
        return node.op == "placeholder" and node.name.startswith(_NONFREEABLE)

    # Inductor's estimate: the bytes live while each kernel runs
    estimate: list[int] = []
    alive = {s for s in live if storages[s].device == device}
    for k, (mine, taken, freed) in enumerate(events):
        alive |= {s for s in mine if storages[s].device == device}
        estimate.append(sum(storages[s].bytes for s in alive))
        alive -= {s for s in alive if last_use.get(s, k) == k and not kept(s)}
    for nbytes, first, last in _realized_in_kernels(kernels, reads, device):
        for k in range(first, last + 1):
            estimate[k] += nbytes
    most = max(estimate, default=0)

    # a kernel's dead buffers enter the pool in the order their nodes were made (Inductor: by name)
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    pool: dict[tuple[str, int], list[tuple[int, int]]] = {}
    held: dict[int, int] = {}
    for k, (mine, taken, freed) in enumerate(events):
        for r in mine:
            if r in taken.values() or not planned(r):
                continue
            stack = pool.get((storages[r].dtype, storages[r].bytes))
            if not stack:
                continue
            at, s = stack.pop()
            nbytes = storages[r].bytes
            if at + 1 == k or nbytes + max(estimate[at + 1:k], default=0) <= most:
                held[s] = k
                for t in range(at + 1, k):
                    estimate[t] += nbytes
            else:
                stack.append((at, s))
        for s in sorted((s for s in freed if planned(s)), key=lambda s: index[storages[s].node]):
            pool.setdefault((storages[s].dtype, storages[s].bytes), []).append((k, s))
    return held


def _realized_in_kernels(kernels: list[list[fx.Node]], reads: Any, device: str
                         ) -> list[tuple[int, int, int]]:
    """The values Inductor's lowering realizes as buffers that its scheduler then fuses away, each
    as (bytes, the first and the last kernel that compute it inside): an elementwise value read
    by more than one node that reads more than ``realize_reads_threshold`` buffers or, on a CPU,
    applies an exp, log, sigmoid or tanh (``StorageBox.should_realize_on_reuse``; a SiLU's
    sigmoid in its backward; 2.11: exp and sigmoid only). Inductor's peak estimate counts them while their kernels run."""
    config = _compat.inductor_config()
    buffers = reads.keywords["buffers"]
    spans: dict[fx.Node, list[int]] = {}
    for k, kernel in enumerate(kernels):
        todo, seen = [i for n in kernel for i in n.all_input_nodes], set()
        while todo:
            n = todo.pop()
            if n in seen or n in buffers or n.op != "call_function" \
                    or _inductor_kind(n) != "elementwise":
                continue
            seen.add(n)
            spans.setdefault(n, [k, k])[1] = k
            todo += n.all_input_nodes
    out = []
    for n, (first, last) in spans.items():
        val = n.meta.get("val")
        if len(n.users) < 2 or not isinstance(val, torch.Tensor) or val.device.type != device:
            continue
        heavy, todo, seen = False, [n], set()
        while todo and not heavy:
            m = todo.pop()
            if m in seen or m in buffers or m.op != "call_function":
                continue
            seen.add(m)
            heavy = _compat.op_name(m.target) in _compat.INDUCTOR_REALIZE_HEAVY_OPS
            todo += m.all_input_nodes
        if (heavy and device == "cpu") or len(set(reads(n))) > config.realize_reads_threshold:
            out.append((tensor_bytes(val, where=f"the step peak's {n.name}"), first, last))
    return out


_NONFREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")


def _wrapper_allocates(node: fx.Node, externs: dict[fx.Node, fx.Node]) -> bool:
    """Whether Inductor's wrapper allocates (and may reuse) the node's result: its own kernels'
    results and the GEMMs it runs with ``out=``, not what a fallback kernel returns."""
    kind = _inductor_kind(node)
    if node in externs or kind in ("elementwise", "kernel"):
        return True
    if kind != "extern" or not _compat.is_op_overload(node.target):
        return False
    lowerings, fallbacks, _ = _compat.inductor_lowering_tables()
    return node.target in lowerings and node.target not in fallbacks


# -- what Inductor's code materializes -------------------------------------------------------------

def inductor_buffers(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose values Inductor's generated code holds in memory, by its own op
    tables (``torch._inductor.lowering``): what an extern kernel computes (a GEMM, attention, a
    custom op) and its inputs; what Inductor's own non-elementwise kernels compute (reductions,
    concatenations, scatters); the graph's outputs; views of these. An elementwise node read
    only by other kernels is computed inside each of them (fused), in registers: its value is
    never a buffer, however many fp32 temporaries the decomposed graph shows.

    A sum of a GEMM and another tensor is one GEMM that adds it (``addmm``, Inductor's post-grad
    pattern, ``_addmm_adds``): the sum is the GEMM's result, the tensor added is its input, and
    the GEMM alone is never a buffer.

    A model of Inductor's choices, not a run of its scheduler: Inductor may still materialize an
    elementwise value that many kernels read (``realize_reads_threshold``), and the scheduler
    removes a buffer whose readers all fuse with its producer; neither is modelled."""
    buffers: set[fx.Node] = set()
    addmm = _addmm_adds(gm)

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
            kind = "extern" if node in addmm else _inductor_kind(node)
            if kind in ("extern", "kernel"):
                buffers.add(node)
            if kind == "extern":
                for i in node.all_input_nodes:
                    if i is not addmm.get(node):
                        materialize(i)
    buffers -= set(addmm.values())  # computed into the sum
    # a view (or a multi-output op's element) is a buffer exactly when what it views is
    for node in gm.graph.nodes:
        if node.op == "call_function" and _inductor_kind(node) == "view":
            if _base(node) in buffers:
                buffers.add(node)
            else:
                buffers.discard(node)
    return buffers


def _addmm_adds(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """The additions Inductor computes as one ``addmm`` (its post-grad ``addmm`` pattern: a 2-D
    ``mm`` read only by an ``add`` of a tensor of the same dtype that broadcasts to the GEMM's
    shape), each with the ``mm`` it takes in. On a GPU the pattern is left out where every reader
    of the sum is elementwise (``should_prefer_unfused_addmm``: the add fuses into them)."""
    out: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor):
        if len(node.args) != 2 or node.kwargs:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        for mm, inp in ((node.args[1], node.args[0]), (node.args[0], node.args[1])):
            if (isinstance(mm, fx.Node) and mm.target is torch.ops.aten.mm.default
                    and len(mm.users) == 1 and isinstance(inp, fx.Node)
                    and _is_addmm_input(inp, mm)):
                break
        else:
            continue
        if val.device.type != "cpu" and all(_pointwise_use(u) for u in node.users):
            continue
        out[node] = mm
    return out


def _is_addmm_input(inp: fx.Node, mm: fx.Node) -> bool:
    """``is_valid_addmm_fusion``: a tensor of the GEMM operands' dtype that broadcasts to its
    result's shape."""
    val, result = inp.meta.get("val"), mm.meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(result, torch.Tensor):
        return False
    if any(a.meta["val"].dtype != val.dtype for a in mm.args[:2]):
        return False
    if val.dim() > result.dim():
        return False
    return all(str(s) == "1" or str(s) == str(r)
               for s, r in zip(reversed(val.shape), reversed(result.shape)))


def _pointwise_use(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if _inductor_kind(node) == "view":
        return all(_pointwise_use(u) for u in node.users)
    return _inductor_kind(node) == "elementwise"


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
    """``gm``'s nodes as the kernels of Inductor's code run them, in the order they run, and
    each node's buffer reads (``reads(node)``): the buffers (``inductor_buffers``), grouped as
    Inductor's horizontal fusion groups them, and ordered as its scheduler orders fused kernels.

    - An elementwise buffer is grouped with the later elementwise buffers of the same size that
      read a buffer it reads and read nothing computed after it (a SwiGLU's two input
      gradients, computed in one kernel that reads the saved inputs once and frees them).
    - A reduction is grouped with the later reductions of the same sizes (elements out, elements
      reduced into each) that read a buffer it reads and do not depend on it (two norms'
      weight gradients, both reading the layer's input), however much runs in between.
    - The kernels run in the order of their first nodes, each after everything it reads, as
      Inductor's ``Scheduler.topological_sort_schedule`` places a fused node (sorted by its
      first node, its dependencies visited first): a reduction group runs where its first
      reduction stood, after pulling ahead what its later reductions read, and the kernels in
      between that it does not need run after it (a layer's weight-gradient GEMMs, which keep
      their inputs alive until then)."""
    buffers = inductor_buffers(gm)
    addmm = _addmm_adds(gm)
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
        if _inductor_kind(node) == "elementwise" and node not in addmm:
            shared = set(reads(node))
            for later in order[i + 1:i + FUSION_WINDOW]:
                if (later in placed or _inductor_kind(later) != "elementwise"
                        or later in addmm or _numel(later) != _numel(node)):
                    continue
                ins = reads(later)
                if shared.isdisjoint(ins) or any(position.get(x, -1) > i for x in ins):
                    continue
                kernel.append(later)
                placed.add(later)
                shared.update(ins)
        elif (key := _reduction_sizes(node)) is not None:
            shared = set(reads(node))
            for later in order[i + 1:i + FUSION_WINDOW]:
                if later in placed or _reduction_sizes(later) != key:
                    continue
                ins = reads(later)
                if shared.isdisjoint(ins) or _depends_on(later, set(kernel), reads, position):
                    continue
                kernel.append(later)
                placed.add(later)
                shared.update(ins)
        kernels.append(kernel)
    scheduled = _schedule(kernels, reads)
    if scheduled is None:  # the reduction groups would wait on each other: Inductor refuses
        # such a fusion (``will_fusion_create_cycle``); the model then fuses no reductions
        kernels = [part for kernel in kernels
                   for part in ([[n] for n in kernel] if _reduction_sizes(kernel[0]) else [kernel])]
        scheduled = _schedule(kernels, reads)
    assert scheduled is not None
    return scheduled, reads


class FusedReductions(NamedTuple):
    """Reductions Inductor runs as one kernel (its horizontal fusion, ``inductor_kernels``)."""

    members: list[fx.Node]
    """The reductions, in the order of ``inductor_kernels``."""
    reads: set[fx.Node]
    """The buffers they read (through the elementwise nodes computed inside them)."""
    kernels: set[fx.Node]
    """Every node of the graph that runs in a kernel of its own (its buffers, views apart)."""


def fused_reductions(gm: fx.GraphModule) -> list[FusedReductions]:
    """The groups of reductions ``inductor_kernels`` runs as one kernel, in its order."""
    kernels, reads = inductor_kernels(gm)
    every = {n for kernel in kernels for n in kernel}
    return [FusedReductions(kernel, {b for n in kernel for b in reads(n)}, every)
            for kernel in kernels if len(kernel) > 1 and _reduction_sizes(kernel[0]) is not None]


def _depends_on(node: fx.Node, targets: set[fx.Node], reads: Any,
                position: dict[fx.Node, int]) -> bool:
    """Whether ``node``'s value needs one of ``targets`` (through the buffers it reads)."""
    first = min(position[t] for t in targets)
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for i in reads(todo.pop()):
            if i in targets:
                return True
            if i not in seen and position.get(i, -1) > first:
                seen.add(i)
                todo.append(i)
    return False


def _schedule(kernels: list[list[fx.Node]], reads: Any) -> list[list[fx.Node]] | None:
    """The kernels in the order of their first nodes, each after the kernels it reads from,
    depth first (dependencies in the order of their first nodes; Inductor visits them by buffer
    name); ``None`` where two kernels wait on each other."""
    owner = {n: k for k, kernel in enumerate(kernels) for n in kernel}
    deps = [sorted({owner[i] for n in kernel for i in reads(n) if i in owner} - {k})
            for k, kernel in enumerate(kernels)]
    state = [0] * len(kernels)  # 0 unvisited, 1 on the stack, 2 placed
    out: list[list[fx.Node]] = []
    for k in range(len(kernels)):
        if state[k]:
            continue
        state[k] = 1
        stack = [(k, iter(deps[k]))]
        while stack:
            top, todo = stack[-1]
            for d in todo:
                if state[d] == 1:
                    return None
                if state[d] == 0:
                    state[d] = 1
                    stack.append((d, iter(deps[d])))
                    break
            else:
                stack.pop()
                state[top] = 2
                out.append(kernels[top])
    return out


def _numel(node: fx.Node) -> str | None:
    """The node's element count as an expression (a symbolic size compares as its formula, with
    no size assumed)."""
    val = node.meta.get("val")
    return str(val.numel()) if isinstance(val, torch.Tensor) else None


def _reduction_sizes(node: fx.Node) -> tuple[str, str] | None:
    """A reduction's sizes as Inductor groups its loops (elements out, elements of its input),
    as expressions; ``None`` for any other node."""
    if _inductor_kind(node) != "kernel" or _compat.op_name(node.target) not in _REDUCTIONS:
        return None
    val = node.meta.get("val")
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(source, torch.Tensor):
        return None
    return str(val.numel()), str(source.numel())


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
# loads, pads and slice scatters: ``Pointwise.create`` with a mask), by ``op_name``.
_ELEMENTWISE = frozenset({
    "aten._to_copy", "aten.full", "aten.full_like", "aten.zeros", "aten.zeros_like", "aten.ones",
    "aten.ones_like", "aten.empty_like", "aten.scalar_tensor", "aten.arange", "prims.iota",
    "aten.index", "aten.gather", "aten.embedding", "aten.copy", "aten.lift_fresh_copy",
    "prims.inductor_random", "prims.inductor_randint", "aten.rand_like", "aten.randn_like",
    "aten.constant_pad_nd", "aten.slice_scatter", "aten.select_scatter",
})


# Ops Inductor lowers as reductions (``make_reduction``), by ``op_name``: what its horizontal
# fusion groups with other reductions of the same sizes.
_REDUCTIONS = frozenset({
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.prod",
    "aten.any", "aten.all", "aten.argmax", "aten.argmin", "prims.sum", "prims.amax", "prims.amin",
    "prims.prod", "prims.xor_sum",
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
    if not _compat.is_op_overload(target):
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
