"""A model of Inductor's reordering of a graph's kernels for a lower memory peak
(``torch._inductor.memory.reorder_for_peak_memory``), over the kernels of
``graph/inductor_kernels.py`` and the storages of the step-peak walk (``graph/peak.py``).

Contract: ``reorder_for_peak(kernels, ...)`` returns the same kernels in the order Inductor's
scheduler keeps: the given (baseline) order or one of three other topological orders of the
kernels' dependency graph, whichever Inductor's own peak estimate puts lowest (the baseline on
ties, the first of the others otherwise). It reads the kernels and changes nothing.

- The orders: least peak memory first (``topological_sort_lpmf``: a greedy that runs, of the
  kernels ready, one whose results fit under the peak so far and that leaves the least live,
  else the one that allocates least), breadth first (``topological_sort_bfs``: the kernel whose
  inputs were computed earliest) and depth first (``topological_sort_dfs``: kernels taken by
  the bytes they read and write, smallest first, each after what it reads).
- The estimate (``estimate_peak_memory``): each storage a kernel computes is allocated when it
  runs and freed after the last kernel that reads it (at once where none does), the graph's
  outputs never; the storages of the inputs Inductor may free (saved tensors, not parameters,
  inputs or tangents: ``is_nonfreeable_buffers``) are live from the start to their last read.
  It knows nothing of results written into dying inputs nor of the reuse of freed buffers.

Inductor applies the reorder on every device (``config.reorder_for_peak_memory``, on by
default); ``graph/peak.py`` applies it to the graphs of a GPU only, where it is measured: a
DeepSeek-V3 layer (bf16, real size) peaks at 46,960,308,224 B on an H200, which Inductor's CUDA
code reaches with the reorder and exceeds by 1,481,589,248 B without it. On the CPU the model
without it is exact for the Llama, GPT and DeepSeek examples.

The dependency graph's nodes are the model's kernels, except that the quantizes inlined on a GPU
that read the same buffers are one node, as Inductor's horizontal fusion runs them: without
that the model's estimate of a Llama layer's FP8 tensorwise backward keeps each quantize's input
live to its last quantize, picks the least-peak-first order where Inductor keeps its scheduler's
(its log), and the step's peak falls to 2,215,796,772 B, under the 2,266,035,712 B of
Inductor's CUDA code; with it the scheduler's order stays (2,449,702,920 B; 2.278 GiB measured
on an H200).

Under ``order_backward`` on a GPU a backward's quantizes that make an FP8 GEMM's operand run
after the GEMM before it (``fp8.gemm_order.planned_order``, the control dependencies
``fp8/gemm_order.py`` gives Inductor): the baseline is the scheduler's order with those
dependencies, every order keeps them, and quantizes that run after different GEMMs are not one
node (the Llama-3-8B FP8 layer: 1.051 of its CUDA code's step peak).

Limits: the kernels are the model's, not Inductor's scheduler nodes (a multi-output op's
results are allocated with it and freed together with what reads any of them; a quantize's
amax and cast are one kernel); Inductor's
option to pick by successors above a size (``size_threshold_for_succ_based_strategy``, off by
default) is not modelled.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

import torch.fx as fx

from ..fp8.gemm_order import planned_order
from ..fp8.inductor import computes_input_in_loops


def reorder_for_peak(kernels: list[list[fx.Node]], reads: Any, sids: Callable[[fx.Node], list],
                     nbytes: Callable[[int], int], live: set[int], freeable: set[int],
                     outputs: set[int]) -> list[list[fx.Node]]:
    """``kernels`` in the order Inductor keeps (see the module). ``reads(node)`` are the nodes a
    kernel node reads, ``sids(node)`` its storages, ``nbytes(s)`` a storage's bytes; ``live`` the
    storages live as the graph starts, ``freeable`` those of them Inductor may free, ``outputs``
    the graph's outputs' storages."""
    after = _after_gemms(kernels)
    groups = _fused_quantizes(kernels, reads, sids, after)
    merged = [[n for k in group for n in kernels[k]] for group in groups]
    group_of = {k: g for g, group in enumerate(groups) for k in group}
    constraints: dict[int, set[int]] = {}
    for k, gemm in after.items():
        constraints.setdefault(group_of[k], set()).add(group_of[gemm])
    plan = _Plan(merged, reads, sids, nbytes, live, freeable, outputs, constraints)
    best = plan.scheduled() if constraints else None
    best_peak = plan.peak(best if best is not None else range(len(merged)))
    for sort in (plan.lpmf, plan.bfs, plan.dfs):
        order = sort()
        peak = plan.peak(order)
        if peak < best_peak:
            best, best_peak = order, peak
    if best is None:
        return kernels
    return [kernels[k] for g in best for k in groups[g]]


def _after_gemms(kernels: list[list[fx.Node]]) -> dict[int, int]:
    """Under ``order_backward`` on a GPU (``fp8.gemm_order.planned_order``): each kernel of an
    FP8 GEMM operand's quantize, by index, with the kernel of the FP8 GEMM it runs after (the
    control dependency Inductor's scheduler and reorder keep)."""
    if not kernels:
        return {}
    planned = planned_order(kernels[0][0].graph)
    if not planned:
        return {}
    owner = {n: k for k, kernel in enumerate(kernels) for n in kernel}
    return {owner[q]: owner[gemm] for q, gemm in planned.items() if q in owner and gemm in owner}


def _fused_quantizes(kernels: list[list[fx.Node]], reads: Any, sids: Any,
                     after: dict[int, int] | None = None) -> list[list[int]]:
    """The kernels as Inductor's scheduler nodes, by index, in the order of their first: the
    quantizes inlined on a GPU (``fp8.inductor.computes_input_in_loops``) that read the same
    buffers and write as many elements are one node there (its horizontal fusion runs their
    amaxes as one kernel and their casts as one), unless they run after different GEMMs
    (``after``); the other kernels one each."""
    after = after or {}
    groups: list[list[int]] = []
    by_key: dict[tuple, list[int]] = {}
    for k, kernel in enumerate(kernels):
        node = kernel[0]
        if len(kernel) == 1 and computes_input_in_loops(node):
            key = (tuple(sorted({s for i in reads(node) for s in sids(i)})),
                   str(node.args[0].meta["val"].numel()), after.get(k))
            if key in by_key:
                by_key[key].append(k)
                continue
            by_key[key] = [k]
            groups.append(by_key[key])
        else:
            groups.append([k])
    return groups


class _Plan:
    """The kernels' dependency graph and buffers, by kernel index (the baseline order)."""

    def __init__(self, kernels: list[list[fx.Node]], reads: Any, sids: Any, nbytes: Any,
                 live: set[int], freeable: set[int], outputs: set[int],
                 constraints: dict[int, set[int]] | None = None) -> None:
        n = len(kernels)
        producer: dict[int, int] = {}
        self.made: list[list[int]] = [[] for _ in range(n)]  # each kernel's new storages
        for k, kernel in enumerate(kernels):
            for node in kernel:
                for s in sids(node):
                    if s not in live and s not in producer:
                        producer[s] = k
                        self.made[k].append(s)
        self.readers: dict[int, set[int]] = {}  # a buffer -> the other kernels that read it
        self.pred_bufs: list[set[int]] = [set() for _ in range(n)]
        self.preds: list[set[int]] = [set() for _ in range(n)]
        for k, kernel in enumerate(kernels):
            for node in kernel:
                for i in reads(node):
                    for s in sids(i):
                        p = producer.get(s)
                        if p == k or (p is None and s not in freeable):
                            continue
                        self.readers.setdefault(s, set()).add(k)
                        self.pred_bufs[k].add(s)
                        if p is not None:
                            self.preds[k].add(p)
        for k, ps in (constraints or {}).items():  # kernels that run after others, no buffer
            self.preds[k] |= ps - {k}
        self.succs: list[set[int]] = [set() for _ in range(n)]
        for k, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].add(k)
        self.inputs = [s for s in freeable if s in self.readers]
        self.size = {s: nbytes(s) for s in [*producer, *self.inputs]}
        self.outputs = outputs
        self.alloc = [sum(self.size[s] for s in made) for made in self.made]
        self.n = n

    def peak(self, order: Any) -> int:
        """Inductor's estimate of the peak of ``order`` (``estimate_peak_memory``)."""
        order = list(order)
        step = {k: t for t, k in enumerate(order)}
        delta = [0] * (len(order) + 1)
        for s in self.inputs:
            if s not in self.outputs:
                delta[0] += self.size[s]
                delta[max(step[r] for r in self.readers[s]) + 1] -= self.size[s]
        for k in order:
            for s in self.made[k]:
                delta[step[k]] += self.size[s]
                if s not in self.outputs:
                    end = max((step[r] for r in self.readers.get(s, ())), default=step[k])
                    delta[end + 1] -= self.size[s]
        most = now = 0
        for d in delta:
            now += d
            most = max(most, now)
        return most

    def scheduled(self) -> list[int]:
        """The scheduler's order: the kernels in the baseline's order, each after what it
        depends on, those first in the baseline's order (``topological_sort_schedule``)."""
        return _depth_first(range(self.n), [sorted(p) for p in self.preds])

    def lpmf(self) -> list[int]:
        """Least peak memory first (``topological_sort_lpmf``)."""
        indegree = [len(p) for p in self.preds]
        ready = {k for k in range(self.n) if indegree[k] == 0}
        outdegree = {s: len(self.readers.get(s, ())) + (s in self.outputs) for s in self.size}
        to_free = [0] * self.n
        for k in range(self.n):
            to_free[k] += sum(self.size[s] for s in self.pred_bufs[k] if outdegree[s] == 1)
            to_free[k] += sum(self.size[s] for s in self.made[k] if outdegree[s] == 0)
        now = sum(self.size[s] for s in self.inputs)
        most = max(now, sum(self.size[s] for s in self.outputs if s in self.size))
        gap = most - now
        order: list[int] = []
        while ready:
            k = min(ready, key=lambda k: (self.alloc[k] if self.alloc[k] > gap else 0,
                                          self.alloc[k] - to_free[k], k))
            ready.remove(k)
            order.append(k)
            now += self.alloc[k]
            most = max(most, now)
            now -= to_free[k]
            gap = most - now
            for succ in self.succs[k]:
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    ready.add(succ)
            for s in self.pred_bufs[k]:
                outdegree[s] -= 1
                if outdegree[s] == 1:
                    for r in self.readers[s]:
                        to_free[r] += self.size[s]
        return order

    def bfs(self) -> list[int]:
        """Breadth first (``topological_sort_bfs``): the ready kernel whose inputs' kernels ran
        earliest (their steps, sorted), then the baseline's order."""
        indegree = [len(p) for p in self.preds]
        ran = [-1] * self.n
        heap = [([], k) for k in range(self.n) if indegree[k] == 0]
        heapq.heapify(heap)
        order: list[int] = []
        while heap:
            _, k = heapq.heappop(heap)
            ran[k] = len(order)
            order.append(k)
            for succ in sorted(self.succs[k]):
                indegree[succ] -= 1
                if indegree[succ] == 0:
                    heapq.heappush(heap, (sorted({ran[p] for p in self.preds[succ]}), succ))
        return order

    def dfs(self) -> list[int]:
        """Depth first (``topological_sort_dfs``): kernels by the bytes they write and read,
        smallest first, each after the kernels it reads from, taken in the same order."""
        weight = [(self.alloc[k] + sum(self.size[s] for s in self.pred_bufs[k]), k)
                  for k in range(self.n)]
        deps = [sorted(self.preds[k], key=weight.__getitem__) for k in range(self.n)]
        return _depth_first(sorted(range(self.n), key=weight.__getitem__), deps)


def _depth_first(roots: Any, deps: list[list[int]]) -> list[int]:
    """The kernels from ``roots`` in turn, each after its ``deps`` (visited in their order,
    depth first)."""
    seen = [False] * len(deps)
    order: list[int] = []
    for root in roots:
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, iter(deps[root]))]
        while stack:
            top, todo = stack[-1]
            for d in todo:
                if not seen[d]:
                    seen[d] = True
                    stack.append((d, iter(deps[d])))
                    break
            else:
                stack.pop()
                order.append(top)
    return order
