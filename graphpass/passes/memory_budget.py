"""The memory budget (``memory_budget``): recompute or offload saved tensors until the step's
predicted peak fits, at the least added step time.

Exact: it only recomputes ops that draw no random numbers and offloads through torch's
activation offloading, so gradients are bit-identical to the plan without a budget. The FP8
activation cache, which is lossy, is never chosen here: it is the user's ``fp8_cache`` setting,
applied before this pass, whose savings the budget then counts.

The plan is greedy against the predicted peak (``graph/peak.py``) of torch's min-cut: while the
peak is over budget, of the saved tensors live at the peak, take the choice (recompute its
producer, or offload it) that costs the least added time per byte, re-partition, and keep it if
the peak fell. Time is a roofline of the device the FP8 cost model uses too
(``graph/roofline.py``, an H100: graphpass measures nothing): a recompute costs its FLOPs at the
GEMM rate or its bytes at the memory bandwidth, whichever is slower; an offload costs its copy out
and back over the host link, nothing where torch's separate stream (CUDA, ``offload_stream``)
hides both copies: the copy out under the forward's compute after the tensor's last forward use,
the copy back under the backward's compute before its first backward use, the link taking one
copy at a time each way (``graph/offload_copies.py``). Of choices that cost the same per byte
(every hidden offload: nothing), the largest is taken first, then the longest-lived. Each chosen
offload's decision gives its bytes, its copy time and the compute it hides under, or what it
adds. On a CPU device an offload frees nothing (the host is the device), so only recomputes are
weighed there.

Before the greedy search, the smallest peak the budget can reach is computed once (everything
recomputable recomputed, everything eligible offloaded); a budget below it raises one ValueError
naming that peak and what holds it. When the greedy search stalls above the budget (a recompute
that lowers the peak alone may not), it starts from that all-in plan and prunes it: of the
choices, the costliest first, the longest run that can be given back together while the peak
fits (a binary search over its length), then again past the choice that ends it, which stays
(within ``MAX_PRUNE`` partitions; the decision says how many choices were kept, what they add by
the roofline, how many partitions it took, or that it stopped early).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _compat
from ..config import Config
from ..decisions import Decision, Plan, What
from ..graph.flops import node_flops
from ..graph.offload_copies import Windows, format_seconds
from ..graph.nodes import (is_backward, is_random, module_path, op_name, producer,
                           tensor_bytes)
from ..graph.regions import forward_calls
from ..graph.roofline import H100
from ..report import format_bytes
from .offload import why_not_offloaded
from .tags import user_policy

MAX_BATCH = 4
"""Choices tried together at most: more reach a far budget in fewer partitions, but a large
batch that fails (one bad recompute in it) rules all of them out."""

MAX_PRUNE = 48
"""Partitions the pruning of the all-in plan may take: enough to give back the costly choices of
a tiny example's ~100 (it needs a few per choice it keeps), bounded for real-size graphs."""

H100_MEMORY = 80 * 2**30
"""The device memory a fractional budget is a share of when no CUDA device is present."""




def memory_budget(joint: fx.GraphModule, plan: Plan, config: Config) -> None:
    if config.memory_budget is None:
        return
    assert plan.predict_peak is not None
    budget, of_what = budget_bytes(config.memory_budget, plan)
    peak, saved, windows = plan.predict_peak(joint)
    if peak["bytes"] <= budget:
        plan.decide(Decision(What.BUDGETED, "memory_budget", (
            f"the predicted peak {format_bytes(peak['bytes'])} fits {format_bytes(budget)}"
            f"{of_what} without a change")))
        return
    unbudgeted = peak["bytes"]
    on_device = peak["device"] != "cpu"
    overlap = on_device and config.offload_stream is not False

    saved_tags = {n: n.meta.get("recompute") for n in joint.graph.nodes}
    recomputable = [n for n in forward_calls(joint) if _recomputable(n)]
    offloadable = [n for n in forward_calls(joint) if on_device and not n.meta.get("should_offload")
                   and _offloadable(n, config, plan)]
    smallest = peak  # the smallest peak of every plan tried

    chosen: list[Decision] = []
    tried: set[tuple[str, str]] = set()
    offloaded: list[tuple[str, int]] = []  # the offloads chosen so far: saved name, bytes
    while peak["bytes"] > budget:
        options = []
        kept = set(saved.values()) | set(plan.primals)
        for live in peak["live"]:
            node = saved.get(live["name"])
            if live["kind"] != "saved" or node is None:
                continue
            source = producer(node)
            if (source.name, "recompute") not in tried and _recomputable(source):
                seconds = _recompute_seconds(source)
                # a recompute from tensors saved anyway frees its output; one that needs others
                # saved in its place may not: tried after
                needs_more = any(i not in kept for i in source.all_input_nodes)
                options.append((needs_more, seconds / live["bytes"], "recompute", source,
                                live["bytes"], live["name"]))
            if (node.name, "offload") not in tried and node in offloadable:
                adds = (windows.late([*offloaded, (live["name"], live["bytes"])])
                        - windows.late(offloaded)) if overlap else 2 * H100.copy(live["bytes"])
                options.append((False, max(adds, 0.0) / live["bytes"], "offload", node,
                                live["bytes"], live["name"]))
        if not options:
            break
        # the cheapest per byte; of equal cost (hidden offloads cost nothing) the largest, then
        # the longest-lived (the most compute to hide its copies under)
        options.sort(key=lambda o: (o[0], o[1], -o[4], -_lifetime(o[5], windows), o[3].name))
        options = [o[1:] for o in options]
        batch, covered = [], 0
        for option in options:
            if option[2] in {b[2] for b in batch}:
                continue
            batch.append(option)
            covered += option[3]
            if covered >= peak["bytes"] - budget or len(batch) == MAX_BATCH:
                break
        # the cheapest choices that cover the excess, tried together, then without the last
        # one and so on; a single choice that does not lower the peak is not tried again
        for size in (batch[:n] for n in range(len(batch), 0, -1)):
            undo = [_choose(action, node, plan) for _, action, node, _, _ in size]
            new_peak, new_saved, new_windows = plan.predict_peak(joint)
            smallest = min(smallest, new_peak, key=lambda p: p["bytes"])
            if new_peak["bytes"] < peak["bytes"]:
                break
            for restore in reversed(undo):
                restore()
        if new_peak["bytes"] >= peak["bytes"]:
            tried.add((size[0][2].name, size[0][1]))
            continue
        tried.update((node.name, action) for _, action, node, _, _ in size)
        for _, action, node, nbytes, name in size:
            what = f"{action} {node.name} ({op_name(node)}, {format_bytes(nbytes)}"
            if action == "offload":
                copy = H100.copy(nbytes)
                adds = (windows.late([*offloaded, (name, nbytes)]) - windows.late(offloaded)
                        if overlap else 2 * copy)
                offloaded.append((name, nbytes))
                what += (f", {format_seconds(copy)} each way under "
                         f"{format_seconds(windows.out.get(name, 0.0))} of forward and "
                         f"{format_seconds(windows.back.get(name, 0.0))} of backward compute: "
                         + ("hidden" if adds <= 0 else f"not hidden, adds {format_seconds(adds)}"))
            chosen.append(Decision(What.BUDGETED, "memory_budget", (
                f"{what}; step peak {format_bytes(peak['bytes'])} -> "
                f"{format_bytes(new_peak['bytes'])})"), module_path(node), node.name))
        peak, saved, windows = new_peak, new_saved, new_windows

    if peak["bytes"] > budget:  # the greedy search stalled: everything at once, if it fits
        _restore(joint, saved_tags, offloadable, plan)
        _apply_all(recomputable, offloadable, plan)
        everything, _, _ = plan.predict_peak(joint)
        smallest = min(smallest, everything, key=lambda p: p["bytes"])
        if everything["bytes"] > budget:
            _restore(joint, saved_tags, offloadable, plan)
            raise ValueError(_unmet(config.memory_budget, budget, of_what, smallest))
        peak, kept, seconds, partitions, done = _prune(
            joint, plan, recomputable, offloadable, saved_tags, budget, everything, overlap)
        chosen = [Decision(What.BUDGETED, "memory_budget", (
            f"no single change lowered the peak further: from every recomputable op recomputed "
            f"({len(recomputable)}) and every eligible tensor offloaded ({len(offloadable)}), "
            f"{len(kept)} choice(s) kept, adding about {format_seconds(seconds[0])} by the "
            f"roofline against {format_seconds(seconds[1])} for all, the others given back, in "
            f"{partitions} partition(s)"
            + ("" if done else f" (stopped at the limit of {MAX_PRUNE}; the rest kept)")))]
        chosen += [Decision(What.BUDGETED, "memory_budget", (
            f"{action} {node.name} ({op_name(node)}, {format_bytes(_bytes(node))}): kept"),
            module_path(node), node.name) for action, node in kept]
    for decision in chosen:
        plan.decide(decision)
    plan.decide(Decision(What.BUDGETED, "memory_budget", (
        f"predicted peak {format_bytes(unbudgeted)} -> {format_bytes(peak['bytes'])} within "
        f"{format_bytes(budget)}{of_what}; {len(chosen)} choice(s), roofline of an H100")))


def _prune(joint: fx.GraphModule, plan: Plan, recomputable: list[fx.Node],
           offloadable: list[fx.Node], tags: dict[fx.Node, Any], budget: int,
           everything: dict[str, Any], overlap: bool):
    """From the all-in plan (applied, its peak ``everything`` within ``budget``), give back the
    choices the budget does not need, the costliest first (a recompute by its roofline time, an
    offload by its copies, nothing where they may hide): the longest run of the costliest that
    can be given back together while the peak fits (a binary search over its length), then past
    the choice that ends it (which stays), again. Returns the final peak, the choices kept
    (action, node), their roofline time and that of every choice the backward would see, the
    partitions taken and whether the search finished."""
    # what the backward reads under the all-in plan: forward values it reads, and the inputs of
    # those it recomputes; a choice outside it changes nothing and is given back at once
    needed = {n for n in joint.graph.nodes if any(is_backward(u) for u in n.users)
              and not is_backward(n)}
    todo_nodes = list(needed)
    while todo_nodes:
        node = todo_nodes.pop()
        if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
            for i in node.all_input_nodes:
                if i not in needed:
                    needed.add(i)
                    todo_nodes.append(i)
    choices = [(_recompute_seconds(n), "recompute", n) for n in recomputable if n in needed]
    choices += [(0.0 if overlap else 2 * H100.copy(_bytes(n)), "offload", n) for n in offloadable
                if n in needed]
    choices.sort(key=lambda c: (-c[0], c[1], c[2].name))
    given_back: set[tuple[str, fx.Node]] = {
        *(("recompute", n) for n in recomputable if n not in needed),
        *(("offload", n) for n in offloadable if n not in needed)}
    partitions = 0

    def give_back(group: list[tuple[str, fx.Node]], on: bool) -> None:
        for action, node in group:
            if action == "recompute":
                if on:
                    _set_policy(node, tags.get(node))
                else:
                    node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            elif on:
                node.meta.pop("should_offload", None)
            else:
                _compat.mark_for_offload(node)
        plan.budget_offloads = any(n.meta.get("should_offload") for n in offloadable)

    give_back(sorted(given_back, key=lambda c: c[1].name), True)
    cost = {(a, n): c for c, a, n in choices}
    remaining = [(a, n) for _, a, n in choices]
    kept: list[tuple[str, fx.Node]] = []
    while remaining and partitions < MAX_PRUNE:
        # the longest run of the costliest choices that can be given back together
        lo, hi = 0, len(remaining)
        while lo < hi and partitions < MAX_PRUNE:
            mid = (lo + hi + 1) // 2
            give_back(remaining[:mid], True)
            new_peak, _, _ = plan.predict_peak(joint)
            partitions += 1
            give_back(remaining[:mid], False)
            if new_peak["bytes"] <= budget:
                lo = mid
            else:
                hi = mid - 1
        give_back(remaining[:lo], True)  # fits: verified by its own partition
        given_back.update(remaining[:lo])
        if lo < hi:  # out of partitions: what is not decided stays
            remaining = remaining[lo:]
            break
        kept += remaining[lo:lo + 1]  # the choice the budget needs
        remaining = remaining[lo + 1:]
    kept += remaining
    peak, _, _ = plan.predict_peak(joint)  # every change above, the choices no backward reads too
    partitions += 1
    if peak["bytes"] > budget:  # not expected: back to the all-in plan, which fits
        give_back(list(given_back), False)
        kept = [(a, n) for _, a, n in choices] + sorted(
            (c for c in given_back if c not in cost), key=lambda c: c[1].name)
        peak = everything
    seconds = (sum(cost.get(c, 0.0) for c in kept), sum(cost.values()))
    return peak, kept, seconds, partitions, not remaining


def _set_policy(node: fx.Node, policy: Any) -> None:
    if policy is None:
        node.meta.pop("recompute", None)
    else:
        node.meta["recompute"] = policy


def _lifetime(name: str, windows: Windows) -> float:
    """The compute a saved tensor outlives: after its last forward use and before its first
    backward one."""
    return windows.out.get(name, 0.0) + windows.back.get(name, 0.0)


def _unmet(value: int | float, budget: int, of_what: str, smallest: dict[str, Any]) -> str:
    holds = ", ".join(f"{t['kind']} {t['name']} ({format_bytes(t['bytes'])})"
                      for t in smallest["live"][:5])
    return (f"memory_budget={value!r} ({format_bytes(budget)}{of_what}) cannot be met: the "
            f"smallest predicted step peak graphpass reaches is {format_bytes(smallest['bytes'])} "
            f"({smallest['bytes']:,} B), in the {smallest['phase']} at {smallest['node']}; live "
            "there: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in smallest["by_kind"].items())
            + f"; biggest: {holds}")


def _choose(action: str, node: fx.Node, plan: Plan):
    """Tag ``node`` for ``action``; returns the function that undoes it."""
    policy, offloads = node.meta.get("recompute"), plan.budget_offloads
    if action == "recompute":
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    else:
        _compat.mark_for_offload(node)
        plan.budget_offloads = True

    def undo() -> None:
        _set_policy(node, policy)
        if action == "offload":
            node.meta.pop("should_offload", None)
            plan.budget_offloads = offloads

    return undo


def _recompute_seconds(node: fx.Node) -> float:
    """What recomputing ``node`` takes by an H100's roofline: its FLOPs or the bytes it reads and
    writes, whichever is slower (``offload_copies.compute_seconds`` of a single-tensor node, with
    the budget's own size notes)."""
    nbytes = _bytes(node) + sum(_bytes(i) for i in node.all_input_nodes)
    return H100.compute(node_flops(node), nbytes, _dtype(node))


def _dtype(node: fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def budget_bytes(budget: int | float, plan: Plan) -> tuple[int, str]:
    """The budget in bytes, and for a fraction what it is a fraction of."""
    if isinstance(budget, int):
        return budget, ""
    devices = {p.meta["val"].device for p in plan.primals if isinstance(p.meta.get("val"), torch.Tensor)}
    cuda = next((d for d in devices if d.type == "cuda"), None)
    if cuda is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(cuda).total_memory
        return int(budget * total), f" ({budget:.0%} of {format_bytes(total)}, this GPU)"
    return int(budget * H100_MEMORY), f" ({budget:.0%} of an H100's 80 GiB: no CUDA device here)"


def _recomputable(node: fx.Node) -> bool:
    """Exact to recompute: a forward op that draws no random numbers, outside the user's own
    checkpoint policy, not already recomputed."""
    return (node.op == "call_function" and not is_random(node) and user_policy(node) is None
            and node.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE
            and op_name(node) != "getitem")


def _offloadable(node: fx.Node, config: Config, plan: Plan) -> bool:
    return why_not_offloaded(node, config, is_parameter=node in plan.parameters) is None


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return tensor_bytes(val, where=f"the budget's size of {node.name}")


def _apply_all(recomputable: list[fx.Node], offloadable: list[fx.Node], plan: Plan) -> None:
    for node in recomputable:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    for node in offloadable:
        _compat.mark_for_offload(node)
    plan.budget_offloads = plan.budget_offloads or bool(offloadable)


def _restore(joint: fx.GraphModule, tags: dict[fx.Node, Any], offloadable: list[fx.Node],
             plan: Plan) -> None:
    for node, policy in tags.items():
        _set_policy(node, policy)
    for node in offloadable:  # none was marked before the budget
        node.meta.pop("should_offload", None)
    plan.budget_offloads = False
