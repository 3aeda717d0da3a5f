"""A model of how Inductor's code reuses memory, over the storages of the step-peak walk
(``graph/peak.py``).

Contract: for one kernel of ``graph/inductor_kernels.py``, ``reused_inputs`` gives the dying
inputs its results are written into; for one graph, ``reuse_plan`` gives the buffers Inductor's
code keeps after their last use for a later allocation, each with the kernel that takes it
over. Storages are the walk's ids, each a :class:`Storage`; neither function changes them.

- A kernel of Inductor's writes its result into an input of the same size that dies there and
  that only it reads, element for element (``inplace_buffers``).
- Inductor's wrapper (``memory_plan_reuse``) keeps each buffer its code allocated and frees in
  a pool by dtype and size; a later allocation of the same takes the one freed last, which
  stays allocated in between, where Inductor's own peak estimate allows
  (``AllocateLine.should_reuse_buffer``). That estimate is reproduced here: it frees saved
  tensors after their last use but never parameters, inputs and tangents, and counts values
  Inductor realized before fusing them away.

Limits: the reuse pool follows torch 2.13's estimate; 2.11's is lower, and there a one-layer
DeepSeek example is predicted 2.6% over (DEVELOPERS.md). A GPU kernel's or a CPU kernel's
own scratch memory inside an op is no buffer of Inductor's and is not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from .inductor_kernels import inductor_kind
from .nodes import tensor_bytes


@dataclass
class Storage:
    """One storage of the step (views and a multi-output op's results share one): its bytes and
    device, the node that allocates it, what it is (``report.peak.LIVE_KINDS``) and its dtype."""

    bytes: int
    device: str
    node: fx.Node
    kind: str
    dtype: str = ""


def reused_inputs(kernel: list[fx.Node], dying: set[int], storages: dict[int, Storage],
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
        if i.op != "call_function" or inductor_kind(i) in ("extern", "kernel"):
            continue
        moved = moved or _compat.op_name(i.target) in _PERMUTES
        todo += [(j, moved) for j in i.all_input_nodes]
    return out


_PERMUTES = frozenset({"aten.permute", "aten.t", "aten.transpose"})


def reuse_plan(gm: fx.GraphModule, kernels: list[list[fx.Node]], reads: Any,
                events: list[tuple[list[int], dict[int, int], set[int]]],
                storages: dict[int, Storage], live: set[int], last_use: dict[int, int],
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
        return node.op == "placeholder" and node.name.startswith(NONFREEABLE)

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
    sigmoid in its backward; 2.11: exp and sigmoid only). Inductor's peak estimate counts them
    while their kernels run."""
    config = _compat.inductor_config()
    buffers = reads.keywords["buffers"]
    spans: dict[fx.Node, list[int]] = {}
    for k, kernel in enumerate(kernels):
        todo, seen = [i for n in kernel for i in n.all_input_nodes], set()
        while todo:
            n = todo.pop()
            if n in seen or n in buffers or n.op != "call_function" \
                    or inductor_kind(n) != "elementwise":
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


NONFREEABLE = ("primals_", "arg", "fwd_rng_state", "bwd_rng_state", "tangents")
"""The names of the graph inputs Inductor never frees (``is_nonfreeable_buffers``)."""


def _wrapper_allocates(node: fx.Node, externs: dict[fx.Node, fx.Node]) -> bool:
    """Whether Inductor's wrapper allocates (and may reuse) the node's result: its own kernels'
    results and the GEMMs it runs with ``out=``, not what a fallback kernel returns."""
    kind = inductor_kind(node)
    if node in externs or kind in ("elementwise", "kernel"):
        return True
    if kind != "extern" or not _compat.is_op_overload(node.target):
        return False
    lowerings, fallbacks, _ = _compat.inductor_lowering_tables()
    return node.target in lowerings and node.target not in fallbacks
