"""A model of how Inductor runs an FX graph: which values its code holds in memory (the
buffers), which nodes run as one kernel, and the order the kernels run in.

Contract: ``inductor_buffers(gm)`` is the set of nodes whose values Inductor's generated code
holds in memory; ``inductor_kernels(gm)`` the nodes that do, grouped into the kernels Inductor's
code runs, in the order they run, with each node's buffer reads; ``fused_reductions(gm)`` the
groups of reductions among them. Each reads the graph only (node targets and fake-tensor
metadata) and changes nothing.

- An elementwise node (a bf16 norm's fp32 upcast, each op of a decomposed SiLU backward) is
  computed inside the kernels that read it and is never a buffer; what counts as elementwise,
  a reduction or a library call comes from Inductor's own op tables
  (``torch._inductor.lowering``, through ``_compat``).
- Elementwise nodes of the same size that read the same buffers run as one kernel, and so do
  reductions of the same sizes that read a common buffer (Inductor's horizontal fusion); a
  GEMM plus a tensor is one ``addmm``.
- The kernels run in the order Inductor's scheduler gives a fused node: a reduction group runs
  where its first reduction stood, after what the later ones read, and the kernels in between
  that it does not need run after it (two norms' weight gradients reading the layer's input
  move past the attention backward, the layer's weight-gradient GEMMs after them).

Limits: a model of Inductor's choices, not a run of its scheduler. Fusion is looked for within
``FUSION_WINDOW`` nodes; Inductor may still materialize an elementwise value that many kernels
read (``realize_reads_threshold``), and its scheduler removes a buffer whose readers all fuse
with its producer, neither of which is modelled; fusions that depend on a device's code
generator (templates, epilogues) are not modelled either. ``graph/peak.py`` walks the kernels;
``graph/backward_order.py`` moves the fused reductions.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from .. import _compat
from ..fp8.inductor import computes_input_in_loops
from .ops import VIEWS


def inductor_buffers(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes of ``gm`` whose values Inductor's generated code holds in memory, by its own op
    tables (``torch._inductor.lowering``): what an extern kernel computes (a GEMM, attention, a
    custom op) and its inputs; what Inductor's own non-elementwise kernels compute (reductions,
    concatenations, scatters); the graph's outputs; views of these. An elementwise node read
    only by other kernels is computed inside each of them (fused), in registers: its value is
    never a buffer, however many fp32 temporaries the decomposed graph shows.

    A sum of a GEMM and another tensor is one GEMM that adds it (``addmm``, Inductor's post-grad
    pattern, ``addmm_adds``): the sum is the GEMM's result, the tensor added is its input, and
    the GEMM alone is never a buffer.

    A model of Inductor's choices, not a run of its scheduler: Inductor may still materialize an
    elementwise value that many kernels read (``realize_reads_threshold``), and the scheduler
    removes a buffer whose readers all fuse with its producer; neither is modelled."""
    buffers: set[fx.Node] = set()
    addmm = addmm_adds(gm)

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
            kind = "extern" if node in addmm else inductor_kind(node)
            if kind in ("extern", "kernel"):
                buffers.add(node)
            if kind == "extern":
                for i in node.all_input_nodes:
                    if i is not addmm.get(node):
                        materialize(i)
    buffers -= set(addmm.values())  # computed into the sum
    # a view (or a multi-output op's element) is a buffer exactly when what it views is
    for node in gm.graph.nodes:
        if node.op == "call_function" and inductor_kind(node) == "view":
            if _base(node) in buffers:
                buffers.add(node)
            else:
                buffers.discard(node)
    return buffers


def addmm_adds(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
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
    if inductor_kind(node) == "view":
        return all(_pointwise_use(u) for u in node.users)
    return inductor_kind(node) == "elementwise"


def _base(node: fx.Node) -> fx.Node:
    """What a view (or a multi-output op's element) aliases, through views; any other node
    itself."""
    while node.op == "call_function" and inductor_kind(node) == "view":
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
    addmm = addmm_adds(gm)
    memo: dict[fx.Node, list[fx.Node]] = {}
    reads = functools.partial(_buffer_reads, buffers=buffers, memo=memo)
    order = [n for n in gm.graph.nodes if n.op == "call_function" and n in buffers
             and inductor_kind(n) != "view"]
    position = {n: i for i, n in enumerate(order)}
    kernels: list[list[fx.Node]] = []
    placed: set[fx.Node] = set()
    for i, node in enumerate(order):
        if node in placed:
            continue
        kernel = [node]
        placed.add(node)
        if inductor_kind(node) == "elementwise" and node not in addmm:
            shared = set(reads(node))
            for later in order[i + 1:i + FUSION_WINDOW]:
                if (later in placed or inductor_kind(later) != "elementwise"
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
    if inductor_kind(node) != "kernel" or _compat.op_name(node.target) not in _REDUCTIONS:
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


def inductor_kind(node: fx.Node) -> str:
    """How Inductor runs a call: ``view`` (an alias: views and a multi-output op's elements),
    ``elementwise`` (fused into its readers), ``kernel`` (its own loop nest, such as a
    reduction: its result is a buffer, its inputs fuse into it) or ``extern`` (a library or
    fallback kernel: its inputs and result are buffers). A quantize graphpass inlines on a GPU
    is a kernel (``fp8.inductor.computes_input_in_loops``); elsewhere an extern call, its input
    stored."""
    if computes_input_in_loops(node):
        return "kernel"
    return _target_kind(node.target)


@functools.lru_cache(maxsize=None)
def _target_kind(target: Any) -> str:
    """``inductor_kind`` of every call of ``target``, once per op (the budget's search walks
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
