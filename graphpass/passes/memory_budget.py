"""The memory budget (``memory_budget``): recompute or offload saved tensors until the step's
predicted peak fits, at the least added step time.

Exact: it only recomputes ops that draw no random numbers and offloads through torch's
activation offloading, so gradients are bit-identical to the plan without a budget. The FP8
activation cache, which is lossy, is never chosen here: it is the user's ``fp8_cache`` setting,
applied before this pass, whose savings the budget then counts.

Each try is one partition with torch's min-cut and one prediction of its peak
(``graph/peak.py``), a second or more for a real graph, so the search is built to take few:

1. **Greedy**: of the saved tensors live at the peak, the cheapest choices per byte that cover
   the excess, kept where the peak fell. At real sizes a few such choices reach the budget
   (a 4-layer Llama-3-8B FP8 step: 95% with five). After ``GREEDY_MISSES`` tries that did not
   lower the peak (a saving that needs several recomputes together, as on the tiny two-layer
   examples) it hands over to:
2. **Everything at once**: every recomputable op recomputed, every eligible tensor offloaded;
   the choices the backward never reads then are dropped (they change nothing). Where that fits:
   the shortest run of the choices, cheapest per byte first, that fits (a bisection over its
   length), then the costliest of that run given back while the peak fits (the longest run that
   can go back together, found by doubling then bisection, then past the choice that ends it,
   which stays; within ``MAX_PRUNE`` partitions, the rest kept), and the final plan's peak
   predicted once more, everything at once kept if it misses (the search assumes that more
   choices never raise the peak, which torch's min-cut does not promise).
3. Where everything at once is over budget too (recomputing every op can raise the backward's
   peak), the greedy search goes on without a limit; where nothing fits, one ValueError names
   the smallest peak of the plans tried and what holds it.

Time is a roofline of the device the FP8 cost model uses too (``graph/roofline.py``, an H100:
graphpass measures nothing): a recompute costs its FLOPs at the GEMM rate or its bytes at the
memory bandwidth, whichever is slower; an offload costs its copy out and back over the host link,
nothing where torch's separate stream (CUDA, ``offload_stream``) hides both copies: the copy out
under the forward's compute after the tensor's last forward use, the copy back under the
backward's compute before its first backward use, the link taking one copy at a time each way
(``graph/offload_copies.py``). On a CPU device an offload frees nothing (the host is the device),
so only recomputes are weighed there. Each choice kept is a decision with what it adds; a summary
gives the peak, the choices and their roofline time against that of every choice, and the
partitions taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import Decision, Plan, What
from ..graph.flops import node_flops
from ..graph.joint import mark_for_offload
from ..graph.offload_copies import Windows, format_seconds
from ..graph.nodes import (is_backward, is_random, module_path, op_name, producer,
                           tensor_bytes)
from ..graph.regions import forward_calls
from ..graph.roofline import H100
from ..report import format_bytes
from ..report.peak import StepPeak
from .fp8_weight_cache import within_budget
from .offload import why_not_offloaded
from .partitioner import TrialPartitioner
from .tags import user_policy

MAX_BATCH = 4
"""Choices the greedy search tries together at most: more reach a far budget in fewer
partitions, but a batch that fails (one bad recompute in it) rules all of them out."""

GREEDY_MISSES = 12
"""Tries the greedy search may spend on choices that do not lower the peak before it hands over
to the search from everything at once."""


MAX_PRUNE = 32
"""Partitions the pruning may take: enough to give back the costly choices of a tiny example's
~100-300 (about two per run it gives back and one per choice it keeps), bounded for real-size
graphs, where one partition takes seconds."""

H100_MEMORY = 80 * 2**30
"""The device memory a fractional budget is a share of when no CUDA device is present."""


@dataclass
class _Choice:
    action: str
    """``"recompute"`` (the node's op, in the backward) or ``"offload"`` (its output)."""
    node: fx.Node
    bytes: int
    seconds: float
    """What it adds to the step by the roofline (an offload: what its copies add to those of the
    larger offloads, nothing while they hide)."""
    lifetime: float
    """The compute its saved output outlives (the unbudgeted plan's windows)."""

    def text(self) -> str:
        return f"{self.action} {self.node.name} ({op_name(self.node)}, {format_bytes(self.bytes)}"


def memory_budget(joint: fx.GraphModule, plan: Plan, config: Config,
                  partitioner: TrialPartitioner) -> None:
    if config.memory_budget is None:
        return
    budget, of_what = budget_bytes(config.memory_budget, plan)
    peak, saved, windows = partitioner.predict_peak(joint)
    if peak.bytes <= budget:
        plan.decide(Decision(What.BUDGETED, "memory_budget", (
            f"the predicted peak {format_bytes(peak.bytes)} fits {format_bytes(budget)}"
            f"{of_what} without a change")))
        _cache_weights(joint, plan, config, partitioner, budget, of_what, peak)
        return
    unbudgeted = peak.bytes
    on_device = peak.device != "cpu"
    overlap = on_device and config.offload_stream is not False
    tags = {n: n.meta.get("recompute") for n in joint.graph.nodes}
    recomputable = [n for n in forward_calls(joint) if _recomputable(n)]
    offloadable = [n for n in forward_calls(joint) if on_device and not n.meta.get("should_offload")
                   and _offloadable(n, config, plan)]
    search = _Search(joint, plan, partitioner, tags, offloadable, peak, saved, windows,
                     torch_offloads=config.offload)

    # 1. the cheapest choices live at the peak, while they lower it; 2. where that stalls,
    # everything at once, pruned; 3. where everything at once does not fit either (its
    # recomputes can raise the backward's peak), the greedy search without a limit
    resident = peak.by_kind.get("parameter", 0) + peak.by_kind.get("input", 0)
    reachable = budget >= resident  # below what no plan frees, no search without a limit
    tried: set[tuple[str, str]] = set()  # (node, action) that alone did not lower the peak
    offloaded: list[tuple[str, int]] = []  # the offloads chosen so far: saved name, bytes
    chosen = _greedy(search, budget, offloadable, overlap, GREEDY_MISSES, tried, offloaded)
    greedy = search.partitions
    how = f"{greedy} trying the cheapest choices live at the peak"
    every = None
    if search.peak.bytes <= budget:
        final, kept = search.peak, chosen
    else:
        search.set(chosen, on=False)
        found = _all_in(search, budget, recomputable, offloadable, overlap, how)
        if found is not None:
            final, kept, every, how = found
        else:
            if reachable:
                search.set(chosen, on=True)
                search.predict()
                chosen += _greedy(search, budget, offloadable, overlap, None, tried, offloaded)
            if search.peak.bytes > budget:
                search.set(chosen, on=False)
                raise ValueError(_unmet(config.memory_budget, budget, of_what, search.smallest))
            final, kept = search.peak, chosen
            how += (", 1 for everything at once (over budget: its recomputes raise the peak), "
                    f"{search.partitions - greedy - 1} more trying the cheapest "
                    "choices live at the peak")
    for c in sorted(kept, key=lambda c: (-c.seconds, c.node.name)):
        plan.decide(Decision(What.BUDGETED, "memory_budget", _kept_text(c, search.windows),
                             module_path(c.node), c.node.name))
    plan.decide(Decision(What.BUDGETED, "memory_budget", (
        f"predicted peak {format_bytes(unbudgeted)} -> {format_bytes(final.bytes)} within "
        f"{format_bytes(budget)}{of_what}; {len(kept)} choice(s), adding about "
        f"{format_seconds(sum(c.seconds for c in kept))} by the roofline of an H100"
        + ("" if every is None else
           f" against {format_seconds(every)} for every choice the backward reads")
        + f"; {search.partitions} partition(s): {how}")))
    _cache_weights(joint, plan, config, partitioner, budget, of_what, final)


def _cache_weights(joint: fx.GraphModule, plan: Plan, config: Config,
                   partitioner: TrialPartitioner, budget: int, of_what: str,
                   peak: StepPeak) -> None:
    """``fp8_weight_cache="auto"``: the weights cached within what the plan leaves of the
    budget (``fp8_weight_cache.within_budget``)."""
    if config.fp8 is not None and config.fp8_weight_cache == "auto":
        within_budget(joint, plan, partitioner, budget, of_what, peak)


def _greedy(search: _Search, budget: int, offloadable: list[fx.Node], overlap: bool,
            max_misses: int | None, tried: set[tuple[str, str]],
            offloaded: list[tuple[str, int]]) -> list[_Choice]:
    """While the peak is over budget: of the saved tensors live at the peak, the cheapest choices
    per byte that cover the excess (at most ``MAX_BATCH`` together; a recompute from tensors saved
    anyway first, since one that needs others saved in its place may free nothing), kept if the
    peak fell, else fewer of them; a choice that alone does not lower the peak is not tried again.
    Stops after ``max_misses`` tries that did not lower it (None: when no choice is left).
    Returns the choices kept (applied); ``tried`` and ``offloaded`` carry on to a later call."""
    chosen: list[_Choice] = []
    misses = 0
    while search.peak.bytes > budget and (max_misses is None or misses < max_misses):
        peak, saved, windows = search.peak, search.saved, search.windows
        options = []
        kept = set(saved.values()) | set(search.plan.primals)
        for live in peak.live:
            node = saved.get(live.name)
            if live.kind != "saved" or node is None:
                continue
            source = producer(node)
            if (source.name, "recompute") not in tried and _recomputable(source):
                c = _Choice("recompute", source, live.bytes, _recompute_seconds(source), 0.0)
                # a recompute from tensors saved anyway frees its output; one that needs others
                # saved in its place may not: tried after
                needs_more = any(i not in kept for i in source.all_input_nodes)
                options.append((needs_more, c, live.name))
            if (node.name, "offload") not in tried and node in offloadable:
                adds = (windows.late([*offloaded, (live.name, live.bytes)])
                        - windows.late(offloaded)) if overlap else 2 * H100.copy(live.bytes)
                options.append((False, _Choice("offload", node, live.bytes, max(adds, 0.0),
                                               _lifetime(live.name, windows)), live.name))
        if not options:
            break
        # the cheapest per byte; of equal cost (hidden offloads cost nothing) the largest, then
        # the longest-lived (the most compute to hide its copies under)
        options.sort(key=lambda o: (o[0], o[1].seconds / max(o[1].bytes, 1), -o[1].bytes,
                                    -o[1].lifetime, o[1].node.name))
        batch: list[tuple[_Choice, str]] = []
        covered = 0
        for _, c, name in options:
            if c.node in {b.node for b, _ in batch}:
                continue
            batch.append((c, name))
            covered += c.bytes
            if covered >= peak.bytes - budget or len(batch) == MAX_BATCH:
                break
        # the cheapest choices that cover the excess, tried together, then without the last
        # one and so on
        for size in (batch[:n] for n in range(len(batch), 0, -1)):
            search.set([c for c, _ in size], on=True)
            if search.predict().bytes < peak.bytes:
                break
            search.set([c for c, _ in size], on=False)
            search.peak, search.saved, search.windows = peak, saved, windows
            misses += 1
        else:
            tried.add((batch[0][0].node.name, batch[0][0].action))
            continue
        tried.update((c.node.name, c.action) for c, _ in size)
        chosen += [c for c, _ in size]
        offloaded += [(name, c.bytes) for c, name in size if c.action == "offload"]
    return chosen


def _all_in(search: _Search, budget: int, recomputable: list[fx.Node],
            offloadable: list[fx.Node], overlap: bool, how: str
            ) -> tuple[StepPeak, list[_Choice], float, str] | None:
    """From the plan without choices: everything at once, then the shortest run of the
    cheapest per byte that fits, then the costliest of it given back. Returns the final peak,
    the choices kept, the roofline time of every choice the backward reads, and how the
    partitions were spent; None (no choice applied) where everything at once is over budget."""
    choices = [_Choice("recompute", n, _bytes(n), _recompute_seconds(n), 0.0)
               for n in recomputable]
    choices += [_Choice("offload", n, _bytes(n), 2 * H100.copy(_bytes(n)), 0.0)
                for n in offloadable]
    names = {node: name for name, node in search.saved.items()}
    windows = search.windows
    everyone = list(choices)
    search.set(everyone, on=True)
    everything = search.predict()
    if everything.bytes > budget:
        search.set(everyone, on=False)
        return None
    needed = _read_by_backward(search.joint)
    search.set([c for c in choices if c.node not in needed], on=False)
    choices = [c for c in choices if c.node in needed]
    _cost_offloads(choices, windows, names, overlap)
    start = search.partitions

    # the shortest run of the cheapest per byte that fits
    order = sorted(choices, key=lambda c: (c.seconds / max(c.bytes, 1), -c.bytes, -c.lifetime,
                                           c.action, c.node.name))
    fits = len(order)  # everything fits
    short = 0  # no choice: the unbudgeted plan, over budget
    while fits - short > 1:
        mid = (short + fits) // 2
        search.set(order[:mid], on=True)
        search.set(order[mid:], on=False)
        if search.predict().bytes <= budget:
            fits = mid
        else:
            short = mid
    search.set(order[:fits], on=True)
    search.set(order[fits:], on=False)
    prefix = search.partitions

    # the costliest of that run given back while the peak fits
    kept, done = _prune(search, order[:fits], budget)
    pruning = search.partitions - prefix
    final = search.predict()
    if final.bytes > budget:  # not expected: back to everything at once, which fits
        search.set(everyone, on=True)
        kept, final = everyone, search.predict()
    how += (f", 1 for everything at once ({len(choices)} choice(s) the backward reads), "
            f"{prefix - start} to find the cheapest {fits} that fit, {pruning} to give back the "
            f"costliest of them"
            + ("" if done else f" (stopped at the limit of {MAX_PRUNE}; the rest kept)")
            + f", {search.partitions - prefix - pruning} to check the plan")
    return final, kept, sum(c.seconds for c in choices), how


class _Search:
    """The joint graph's tags under a set of choices, the last prediction (peak, saved tensors by
    name, copy windows), the smallest peak predicted and the partitions taken."""

    def __init__(self, joint: fx.GraphModule, plan: Plan, partitioner: TrialPartitioner,
                 tags: dict[fx.Node, Any], offloadable: list[fx.Node], peak: StepPeak,
                 saved: dict[str, fx.Node], windows: Windows, *, torch_offloads: bool) -> None:
        self.joint, self.plan, self.tags, self.offloadable = joint, plan, tags, offloadable
        self.partitioner = partitioner
        self.torch_offloads = torch_offloads  # torch's offloading is on without the budget
        self.peak, self.saved, self.windows = peak, saved, windows
        self.smallest = peak
        self.partitions = 1

    def set(self, choices: list[_Choice], *, on: bool) -> None:
        for c in choices:
            if c.action == "recompute":
                if on:
                    c.node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                else:
                    _set_policy(c.node, self.tags.get(c.node))
            elif on:
                mark_for_offload(c.node)
            else:
                c.node.meta.pop("should_offload", None)
        # offloads of its own turn torch's offloading on, for every partition after this one
        offloads = any(n.meta.get("should_offload") for n in self.offloadable)
        self.plan.torch_offloading = "memory_budget" if offloads and not self.torch_offloads else ""

    def predict(self) -> StepPeak:
        self.peak, self.saved, self.windows = self.partitioner.predict_peak(self.joint)
        self.partitions += 1
        self.smallest = min(self.smallest, self.peak, key=lambda p: p.bytes)
        return self.peak


def _read_by_backward(joint: fx.GraphModule) -> set[fx.Node]:
    """The forward values the backward reads under the joint graph's tags: those its own nodes
    read, and the inputs of those it recomputes. A choice outside the set changes nothing."""
    needed = {n for n in joint.graph.nodes if any(is_backward(u) for u in n.users)
              and not is_backward(n)}
    todo = list(needed)
    while todo:
        node = todo.pop()
        # a multi-output op is read through its getitems
        reads = (node.all_input_nodes if op_name(node) == "getitem"
                 or node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE else [])
        for i in reads:
            if i not in needed:
                needed.add(i)
                todo.append(i)
    return needed


def _cost_offloads(choices: list[_Choice], windows: Windows, names: dict[fx.Node, str],
                   overlap: bool) -> None:
    """Each offload's lifetime, and with copies on a side stream, what it adds to those of the
    larger and longer-lived offloads before it (``Windows.late``: nothing while they hide)."""
    offloads = [c for c in choices if c.action == "offload"]
    for c in offloads:
        c.lifetime = _lifetime(names.get(c.node, c.node.name), windows)
    if not overlap:
        return
    copies: list[tuple[str, int]] = []
    for c in sorted(offloads, key=lambda c: (-c.bytes, -c.lifetime, c.node.name)):
        before = windows.late(copies)
        copies.append((names.get(c.node, c.node.name), c.bytes))
        c.seconds = max(windows.late(copies) - before, 0.0)


def _prune(search: _Search, run: list[_Choice], budget: int) -> tuple[list[_Choice], bool]:
    """Of ``run`` (applied, its peak within ``budget``), give back the choices the budget does
    not need, the costliest first: the longest run of the costliest that can be given back
    together while the peak fits (doubling its length, then halving the step), then past the
    choice that ends it, which stays. Returns the choices kept and whether the search finished
    within ``MAX_PRUNE`` partitions (what it did not reach is kept)."""
    remaining = sorted(run, key=lambda c: (-c.seconds, c.action, c.node.name))
    limit = search.partitions + MAX_PRUNE
    kept: list[_Choice] = []

    def fits_without(k: int) -> bool:
        search.set(remaining[:k], on=False)
        fits = search.predict().bytes <= budget
        search.set(remaining[:k], on=True)
        return fits

    while remaining and search.partitions < limit:
        # the longest run of the costliest that can be given back: 1, 2, 4, ... then bisect
        good, bad, step = 0, None, 1
        while bad is None and good < len(remaining) and search.partitions < limit:
            k = min(good + step, len(remaining))
            if fits_without(k):
                good, step = k, 2 * step
            else:
                bad = k
        while bad is not None and bad - good > 1 and search.partitions < limit:
            mid = (good + bad) // 2
            if fits_without(mid):
                good = mid
            else:
                bad = mid
        search.set(remaining[:good], on=False)  # fits: verified by its own partition
        remaining = remaining[good:]
        if bad is None or bad - good > 1:  # all given back, or out of partitions
            break
        kept.append(remaining[0])  # the choice the budget needs
        remaining = remaining[1:]
    return kept + remaining, not remaining


def _lifetime(name: str, windows: Windows) -> float:
    """The compute a saved tensor outlives: after its last forward use and before its first
    backward one."""
    return windows.out.get(name, 0.0) + windows.back.get(name, 0.0)


def _kept_text(c: _Choice, windows: Windows) -> str:
    """A kept choice's decision: what it is, and what it adds (an offload: its copies against
    the final plan's ``windows``)."""
    if c.action == "recompute":
        return f"{c.text()}): adds about {format_seconds(c.seconds)} by the roofline"
    copy = H100.copy(c.bytes)
    out = windows.out.get(c.node.name, 0.0)
    back = windows.back.get(c.node.name, 0.0)
    return (f"{c.text()}, {format_seconds(copy)} each way under {format_seconds(out)} of forward "
            f"and {format_seconds(back)} of backward compute: "
            + ("hidden" if c.seconds <= 0 else f"not hidden, adds {format_seconds(c.seconds)}")
            + ")")


def _set_policy(node: fx.Node, policy: Any) -> None:
    if policy is None:
        node.meta.pop("recompute", None)
    else:
        node.meta["recompute"] = policy


def _unmet(value: int | float, budget: int, of_what: str, smallest: StepPeak) -> str:
    holds = ", ".join(f"{t.kind} {t.name} ({format_bytes(t.bytes)})"
                      for t in smallest.live[:5])
    return (f"memory_budget={value!r} ({format_bytes(budget)}{of_what}) cannot be met: the "
            f"smallest predicted step peak graphpass reaches is {format_bytes(smallest.bytes)} "
            f"({smallest.bytes:,} B), in the {smallest.phase} at {smallest.node}; live "
            "there: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in smallest.by_kind.items())
            + f"; biggest: {holds}")


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
