"""Quantize each lowered weight once per optimizer step (``fp8_weight_cache``).

Every weight quantize of the forward whose input is a parameter becomes one
``graphpass::quantize_weight`` (``graphpass/fp8/weight_cache.py``): both of the weight's copies
(fprop's and dgrad's) from one read of the weight, kept by the cache until the parameter's
version changes, so with gradient accumulation the weight is read and quantized on the first
micro-batch after each optimizer step and looked up on the others. The node is tagged
must-recompute: the backward looks dgrad's copy up again instead of saving it, so the step saves
nothing for the weights and the copies live in the cache alone.

A memory decision: the cache holds 1 byte per element and copy (for a weight with dgrad, as
many bytes as the bf16 weight itself) between steps, which the report lists per weight and the
step peak counts (live kind ``cached``). Gradients are bit-identical to quantizing every
micro-batch: the copies are the same op's outputs. A weight quantize whose input is not a
parameter (a computed weight) is left as it is, with a note. SimpleFSDP's weights, all-gathered
in the graph, are cached as their FP8 shards by ``passes/fp8_weight_all_gather.py``, which
notes each; under ``"auto"`` the op of a graph's shards is one more candidate here.

``fp8_weight_cache=True`` caches every such weight here. ``"auto"`` leaves the choice to the
memory budget (``passes/memory_budget.py``, the last pass), which calls :func:`within_budget`
once its plan fits: the weights that save the most quantize work per cached byte first, each
kept where the predicted peak, with its copies counted, stays within ``memory_budget``. Without
a budget, ``"auto"`` caches nothing and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import Decision, Plan, What
from ..fp8.ops import QUANTIZE
from ..fp8.weight_cache import (QUANTIZE_SHARDS, QUANTIZE_WEIGHT, QUANTIZE_WEIGHT_SHARDS)
from ..graph.collectives import shard_parameter
from ..graph.linears import gathered_from
from ..graph.nodes import is_backward, module_path, tensor_bytes
from ..graph.offload_copies import format_seconds
from ..graph.roofline import H100
from ..report import format_bytes
from ..report.peak import StepPeak
from .partitioner import TrialPartitioner
from .save_original import merge_usages
from .tags import overruled_by_user, tag, user_policy

BY = "fp8_weight_cache"
_SAVED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)

MAX_TRIES = 16
"""Partitions ``"auto"`` may take, after the bisection over the longest run that fits, trying
the weights after that run one by one (each one partition)."""


@dataclass
class Candidate:
    """A lowered weight that is a parameter, and its forward quantizes: one per usage (fprop's
    rowwise, dgrad's columnwise) or one of both usages (``fp8_save_quantized_weight``)."""

    weight: fx.Node
    quantizes: list[fx.Node]
    bytes: int
    """What the cache would hold: every copy and scale of its quantizes."""
    work: int
    """Bytes its quantizes read and write per micro-batch, which the cache saves on every
    micro-batch after the first of an optimizer step (each quantize reads the weight once)."""

    @property
    def module(self) -> str:
        return module_path(self.quantizes[0])

    @property
    def shape(self) -> str:
        return "x".join(map(str, self.weight.meta["val"].shape))

    @property
    def what(self) -> str:
        """The weight, in the notes."""
        if self.weight.target in (QUANTIZE_SHARDS, QUANTIZE_WEIGHT_SHARDS):
            return f"the {len(self.weight.args[0])} SimpleFSDP weight shards'"
        return f"the {self.shape} weight's"

    @property
    def seconds(self) -> float:
        """The quantize work it saves per micro-batch, by an H100's roofline."""
        return H100.compute(0, self.work)


def fp8_weight_cache(joint: fx.GraphModule, plan: Plan, config: Config,
                     partitioner: TrialPartitioner) -> None:
    if config.fp8 is None or not config.fp8_weight_cache:
        return
    candidates, overruled = candidates_of(joint, plan, notes=True)
    if overruled:
        plan.decide(overruled_by_user(BY, overruled, CheckpointPolicy.MUST_RECOMPUTE))
    if config.fp8_weight_cache == "auto":
        if config.memory_budget is None:
            held = sum(c.bytes for c in candidates)
            plan.decide(Decision(What.WEIGHT_CACHE, BY, (
                "'auto' caches weights within memory_budget, and none is set: no weight cached "
                f"({len(candidates)} could be, {held:,} B; set memory_budget, or "
                "fp8_weight_cache=True to cache every one)")))
        return  # the memory budget chooses (within_budget), after its own plan fits
    for c in candidates:
        node = cache(joint.graph, c)
        plan.decide(Decision(What.WEIGHT_CACHED, BY, _cached_text(c, node), c.module,
                             c.weight.name))
    plan.count(BY, "weights", len(candidates))  # none in any graph: an EmptySelectionWarning
    joint.graph.lint()
    joint.recompile()


def candidates_of(joint: fx.GraphModule, plan: Plan, *, notes: bool = False
                  ) -> tuple[list[Candidate], list[fx.Node]]:
    """The weights the cache can take, in graph order, and the quantizes the user's checkpoint
    policy saves (a saved copy could be a donated buffer the backward writes into: those weights
    are quantized every step). With ``notes``, a note per weight that is not a parameter."""
    weights: dict[fx.Node, dict[str, fx.Node]] = {}
    for node in joint.graph.nodes:
        if (node.target is QUANTIZE and not is_backward(node) and node.args[2] == "weight"
                and len(node.args) == 4):
            weights.setdefault(node.args[0], {})[node.args[3]] = node
    out: list[Candidate] = []
    overruled: list[fx.Node] = []
    for w, by_usage in weights.items():
        quantizes = list(by_usage.values())
        if w not in plan.parameters:
            # SimpleFSDP's gathered weights: passes/fp8_weight_all_gather.py caches their FP8
            # shards, and notes each weight
            if notes and shard_parameter(gathered_from(w), plan.parameters) is None:
                shape = "x".join(map(str, w.meta["val"].shape))
                plan.decide(Decision(What.WEIGHT_NOT_CACHED, BY, (
                    f"the {shape} weight is not a parameter (a gathered or computed weight is "
                    "new every step), so it is quantized every step"),
                    module_path(quantizes[0]), w.name))
            continue
        saved = [q for q in quantizes if user_policy(q) in _SAVED]
        if saved:
            overruled += saved
            continue
        held = sum(_bytes(v, w) for q in quantizes for v in q.meta["val"])
        out.append(Candidate(w, quantizes, held, held + len(quantizes) * _bytes(w.meta["val"], w)))
    # SimpleFSDP's shards under "auto" (passes/fp8_weight_all_gather.py): one candidate per op
    for node in joint.graph.find_nodes(op="call_function", target=QUANTIZE_SHARDS):
        held = sum(_bytes(v, node) for v in node.meta["val"])
        out.append(Candidate(node, [node], held,
                             held + sum(_bytes(p.meta["val"], p) for p in node.args[0])))
    return out, overruled


def cache(graph: fx.Graph, c: Candidate) -> fx.Node:
    """Cache ``c``: its two usages merged into one quantize (both copies from one read), which
    becomes the cache's op, tagged must-recompute (the backward looks its copy up). The node."""
    by_usage = {q.args[3]: q for q in c.quantizes}
    if "rowwise" in by_usage and "columnwise" in by_usage:
        node = merge_usages(graph, by_usage["rowwise"], by_usage["columnwise"])
    else:
        node = c.quantizes[0]
    node.target = _CACHED[node.target]
    tag(node, CheckpointPolicy.MUST_RECOMPUTE)  # under the user's recompute policy: theirs
    c.quantizes = [node]
    return node


_CACHED = {QUANTIZE: QUANTIZE_WEIGHT, QUANTIZE_SHARDS: QUANTIZE_WEIGHT_SHARDS}
"""Each quantize op the cache takes, and its cached op."""
_UNCACHED = {v: k for k, v in _CACHED.items()}


def _cached_text(c: Candidate, node: fx.Node) -> str:
    if node.target is QUANTIZE_WEIGHT_SHARDS:
        return (f"{c.what} FP8 copies and the all-reduce of their amaxes once per optimizer "
                f"step, held between steps ({c.bytes:,} B), all-gathered every micro-batch")
    copies = "both FP8 copies" if node.args[3] == "both" else "its FP8 copy"
    return (f"the {c.shape} weight's {copies} quantized once per optimizer step and held between "
            f"steps ({c.bytes:,} B)")


class _Toggles:
    """Caching candidates and giving them back, for the budget's search: each quantize becomes
    the cache's op (must-recompute) as it is, one per usage, and returns to its own op and tag."""

    def __init__(self) -> None:
        self.tags: dict[fx.Node, Any] = {}

    def set(self, chosen: list[Candidate], *, on: bool) -> None:
        for c in chosen:
            for q in c.quantizes:
                if on:
                    self.tags.setdefault(q, q.meta.get("recompute"))
                    q.target = _CACHED.get(q.target, q.target)
                    tag(q, CheckpointPolicy.MUST_RECOMPUTE)
                else:
                    q.target = _UNCACHED.get(q.target, q.target)
                    if self.tags.get(q) is None:
                        q.meta.pop("recompute", None)
                    else:
                        q.meta["recompute"] = self.tags[q]


def within_budget(joint: fx.GraphModule, plan: Plan, partitioner: TrialPartitioner, budget: int,
                  of_what: str, peak: StepPeak) -> None:
    """``fp8_weight_cache="auto"``, once the budget's plan fits (its predicted ``peak``): cache
    the weights that save the most quantize work per cached byte first (of equal saving per
    byte, the largest first), while the predicted peak, their copies counted, stays within
    ``budget``: the longest run of that order that fits (a bisection), then each later weight
    that fits on top (one partition each, at most ``MAX_TRIES``), each try a peak predicted by
    ``partitioner``. A note per weight, cached or not, and a summary."""
    candidates, _ = candidates_of(joint, plan)  # the pass noted the overruled ones
    order = sorted(candidates, key=lambda c: (-c.work / max(c.bytes, 1), -c.bytes,
                                              c.weight.name))
    toggles = _Toggles()
    partitions = 0
    fitting = peak

    def fits(chosen: list[Candidate]) -> StepPeak | None:
        nonlocal partitions
        toggles.set(chosen, on=True)
        partitions += 1
        got = partitioner.predict_peak(joint).peak
        if got.bytes <= budget:
            return got
        toggles.set(chosen, on=False)
        return None

    # the longest run of the order that fits
    good, bad = 0, len(order) + 1
    if order:
        every = fits(order)
        if every is not None:
            good, fitting = len(order), every
        else:
            bad = len(order)
    while bad - good > 1:
        mid = (good + bad) // 2
        got = fits(order[:mid])
        if got is not None:
            toggles.set(order[:mid], on=False)
            good, fitting = mid, got
        else:
            bad = mid
    toggles.set(order[:good], on=True)
    kept = order[:good]
    untried: list[Candidate] = []
    tries = 0
    for c in order[good + 1:]:  # order[good] did not fit on top of the run
        if tries == MAX_TRIES:
            untried.append(c)
            continue
        tries += 1
        got = fits([c])
        if got is not None:
            kept.append(c)
            fitting = got
    # the kept weights' usages merged into one quantize each (both copies from one read: the
    # same bytes held, the same peak), the final plan predicted once more
    toggles.set(kept, on=False)
    nodes = {c.weight.name: cache(joint.graph, c) for c in kept}
    joint.graph.lint()
    joint.recompile()
    if kept:
        partitions += 1
        fitting = partitioner.predict_peak(joint).peak
    for c in order:
        if c.weight.name in nodes:
            plan.decide(Decision(What.WEIGHT_CACHED, BY, (
                _cached_text(c, nodes[c.weight.name]) + f"; chosen within memory_budget, saving "
                f"about {format_seconds(c.seconds)} of quantize per micro-batch by the roofline"),
                c.module, c.weight.name))
        elif any(c is u for u in untried):
            plan.decide(Decision(What.WEIGHT_NOT_CACHED, BY, (
                f"{c.what} copies ({c.bytes:,} B) not tried: the search's limit of "
                f"{MAX_TRIES} partitions"), c.module, c.weight.name))
        else:
            plan.decide(Decision(What.WEIGHT_NOT_CACHED, BY, (
                f"{c.what} copies ({c.bytes:,} B) would take the predicted peak "
                f"over memory_budget ({format_bytes(budget)}{of_what})"), c.module, c.weight.name))
    held = sum(c.bytes for c in kept)
    plan.decide(Decision(What.WEIGHT_CACHE, BY, (
        f"'auto' under memory_budget: {len(kept)} of {len(order)} weight(s) cached ({held:,} B), "
        f"saving about {format_seconds(sum(c.seconds for c in kept))} of quantize per "
        f"micro-batch by the roofline of an H100; predicted peak {format_bytes(peak.bytes)} "
        f"-> {format_bytes(fitting.bytes)} within {format_bytes(budget)}{of_what}; "
        f"{partitions} partition(s)")))


def _bytes(val: Any, w: fx.Node) -> int:
    return tensor_bytes(val, where=f"{BY}'s size of {w.name}")
