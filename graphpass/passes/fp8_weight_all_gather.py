"""All-gather SimpleFSDP's weights in FP8, inside the graph (``fp8_weight_all_gather``).

torchtitan's SimpleFSDP (``data_parallel(model, mesh, mode="fully_shard")``) keeps each
parameter as this rank's shard and all-gathers it inside the traced graph
(``_c10d_functional.all_gather_into_tensor`` and its ``wait_tensor``, DTensor's redistribution);
the lowering (``passes/lower_fp8.py``, ``graph/linears.py``) finds the linears through that
gather and quantizes the gathered weight. Where the gathered weight is read by tensorwise
quantizes only, this pass moves the quantize before the gather, as ``passes/fp8_all_gather.py``
does for sequence-parallel activations, with the amaxes of all such weights of the graph
reduced in one all-reduce (as torchao's precompute of float8 FSDP weights does):

    amax_i  = graphpass::amax(shard_i)                       each weight's shard on this rank
    amaxes  = all_reduce(stack(amax_0, ..., amax_n), "max")  one all-reduce for the group's weights
    data_i  = graphpass::quantize_amax(shard_i, amaxes[i])   the shard, the gathered weight's scale
    data_i  = all_gather(data_i as uint8)                    1 byte per element instead of 2
    ...DTensor's layout ops on the FP8 bytes; dgrad's columnwise copy is their transpose

The max of the shards' amaxes is the gathered weight's amax exactly, and tensorwise
quantization is elementwise under one scale, so the gathered FP8 bytes and the scale are
bit-identical to quantizing the gathered weight (``fp8_weight_all_gather=False``);
``tests/test_simple_fsdp_gloo.py`` checks losses, gradients and parameters on two ranks.

Left as a bf16 all-gather quantized after, each with a note: a weight whose gathered value
something other than a tensorwise quantize reads (an embedding, a linear kept in bf16), a
gather whose layout ops do not keep every element once (an uneven shard's padding sliced off),
and per-row or per-block scales (dgrad's columnwise copy scales along dim 0, which FSDP shards:
its blocks cross the shards). The backward's reduce-scatter of the gradients is not touched: a
sum of FP8 values is not the sum the bf16 reduce-scatter computes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import _compat
from ..config import Config
from ..decisions import Decision, Plan, What
from ..fp8.ops import AMAX, QUANTIZE
from ..graph.collectives import gathered_parameter
from ..graph.joint import Side, partition_side, set_partition_side
from ..graph.nodes import module_path, op_name
from ..graph.ops import CASTS, COLLECTIVE_GATHERS, COLLECTIVE_WAITS, GATHER_LAYOUT
from .fp8_all_gather import match_gather, quantize_before_gather
from .partitioner import TrialPartitioner

_PLUMBING = COLLECTIVE_GATHERS | COLLECTIVE_WAITS | GATHER_LAYOUT | {"getitem", "aten.slice"}
_Found = tuple[fx.Node, fx.Node, list[fx.Node], list[fx.Node]]  # gather, wait, path, quantizes


def fp8_weight_all_gather(joint: fx.GraphModule, plan: Plan, config: Config,
                          partitioner: TrialPartitioner) -> None:
    if config.fp8 is None:
        return
    graph = joint.graph
    gathers = [n for n in graph.nodes if op_name(n) in COLLECTIVE_GATHERS
               and gathered_parameter(n, plan.parameters) is not None]
    todo: list[_Found] = []
    for gather in gathers:
        padded = _padded(gather)
        if padded:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", padded, _module(gather)),
                        once=True)
            continue
        found = match_gather(gather)
        if isinstance(found, str):
            if found:  # "": no quantize reads it (a norm's weight): not a lowered weight
                plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", _why_not(gather, found),
                                     _module(gather)), once=True)
            continue
        wait, path, quantizes = found
        if not config.fp8_weight_all_gather:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", (
                f"weight: off (fp8_weight_all_gather=False): the all-gather moves "
                f"{_dtype(gather)}, quantized after it"), module_path(quantizes[0])), once=True)
            continue
        todo.append((gather, wait, path, quantizes))
    if not todo:
        return
    by_group: dict[Any, list[_Found]] = {}
    for found in todo:
        by_group.setdefault(found[0].args[2], []).append(found)
    for group, founds in by_group.items():
        batched, alone = _hoist(graph, founds)
        amaxes = _reduce_amaxes(graph, [f[0] for f in batched], group) if batched else []
        for (gather, wait, path, quantizes), amax in zip(batched, amaxes):
            quantize_before_gather(graph, gather, wait, path, quantizes, amax=amax)
            _decided(plan, quantizes, f"one all-reduce (max) of the amaxes of {len(batched)} "
                     f"weight{'s' if len(batched) > 1 else ''}")
        for gather, wait, path, quantizes in alone:
            quantize_before_gather(graph, gather, wait, path, quantizes)
            _decided(plan, quantizes, "its own all-reduce (max) of the amax: its shard is "
                     "computed after the first weight's all-gather")
    graph.lint()
    joint.recompile()


def _decided(plan: Plan, quantizes: list[fx.Node], reduced: str) -> None:
    dgrad = any(q.args[3] in ("columnwise", "both") for q in quantizes)
    plan.decide(Decision(What.FP8_ALL_GATHER, "fp8", (
        f"weight, forward: quantized shard by shard with the gathered weight's amax ({reduced}), "
        "the all-gather moves FP8 bytes" + ("; dgrad's columnwise copy is the gathered copy "
                                            "transposed" if dgrad else "")),
        module_path(quantizes[0])), once=True)


def _module(gather: fx.Node) -> str:
    """The module a gathered weight belongs to: that of the first of its readers past the
    collective and the layout ops (a quantize, a GEMM, an embedding; the gather itself belongs
    to SimpleFSDP's parametrization)."""
    todo, seen = [gather], {gather}
    while todo:
        node = todo.pop(0)
        if node is not gather and op_name(node) not in _PLUMBING:
            return module_path(node)
        for user in node.users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return ""


def _padded(gather: fx.Node) -> str:
    """Why not, where the gathered weight is read through a slice of its first rows: uneven
    shards, each padded to the largest, the padding sliced off after the gather (a tensorwise
    quantize of the shard would read the padding's zeros too; not done). "" otherwise, or where
    no quantize reads it."""
    wait = next(iter(gather.users), None)
    users = [u for u in wait.users] if wait is not None else []
    if (len(users) != 1 or op_name(users[0]) != "aten.slice"
            or tuple(users[0].args[1:3]) != (0, 0)
            or not any(u.target is QUANTIZE for u in users[0].users)):
        return ""
    rows, padded = users[0].meta["val"].shape[0], wait.meta["val"].shape[0]
    return (f"weight: uneven shards ({rows} rows over {gather.args[1]} ranks, gathered as "
            f"{padded} with each shard padded and the padding sliced off after the all-gather): "
            f"the all-gather moves {_dtype(gather)}, quantized after it")


def _why_not(gather: fx.Node, why: str) -> str:
    """The sequence-parallel matcher's reason, in a weight's terms where they differ."""
    if "scales: the FP8 all-gather is for tensorwise scaling only" in why:
        key = why.split(" scales:")[0]
        return (f"weight: {key} scales: dgrad's columnwise copy scales along dim 0, which FSDP "
                "shards, so its scale blocks cross the shards; the FP8 all-gather of weights is "
                f"tensorwise only: the all-gather moves {_dtype(gather)}, quantized after it")
    if why.startswith("a quantize reads part of") or why.startswith("the gathered pieces"):
        return (f"weight: {why.split(':')[0]} (an uneven shard's padding): the all-gather moves "
                f"{_dtype(gather)}, quantized after it")
    return f"weight: {why}"


def _dtype(node: fx.Node) -> str:
    return str(node.meta["val"].dtype).removeprefix("torch.")


def _hoist(graph: fx.Graph, founds: list[_Found]) -> tuple[list[_Found], list[_Found]]:
    """Split ``founds`` into the weights whose shard can be ready before the first of their
    gathers (a parameter, or its dtype cast, moved up: a pure function of the parameter), for one
    all-reduce there, and the others (their shard computed later), each reduced alone."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min((f[0] for f in founds), key=order.__getitem__)
    batched, alone = [], []
    for found in founds:
        chain, x = [], found[0].args[0]
        while x.op == "call_function" and order[x] > order[first] and op_name(x) in CASTS \
                and len(x.all_input_nodes) == 1:
            chain.append(x)
            x = x.args[0]
        if x.op == "call_function" and order[x] > order[first]:
            alone.append(found)
            continue
        for node in reversed(chain):  # the cast, just before the first gather
            first.prepend(node)
        batched.append(found)
    return batched, alone


def _reduce_amaxes(graph: fx.Graph, gathers: list[fx.Node], group: Any) -> list[fx.Node]:
    """Before the first of ``gathers``: each shard's amax, stacked, one all-reduce (max) over the
    group, and each weight's element of the result."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(gathers, key=order.__getitem__)
    side = partition_side(first) or Side.FORWARD

    def new(target: Callable[..., Any], args: tuple, val: Any = None) -> fx.Node:
        node = graph.call_function(target, args)
        if val is None:
            vals = fx.node.map_aggregate(
                args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
            with _fake_mode(gathers[0].args[0].meta["val"]):
                val = target(*vals)
        node.meta["val"] = val
        set_partition_side(node, side)
        return node

    with graph.inserting_before(first):
        amaxes = [new(AMAX, (g.args[0],)) for g in gathers]
        stacked = new(torch.ops.aten.stack.default, (amaxes,))
        reduced = new(_compat.functional_collective("all_reduce"), (stacked, "max", group),
                      val=stacked.meta["val"].new_empty(stacked.meta["val"].shape))
        reduced = new(_compat.functional_collective("wait_tensor"), (reduced,),
                      val=reduced.meta["val"])
        return [new(torch.ops.aten.select.int, (reduced, 0, i)) for i in range(len(gathers))]


def _fake_mode(val: Any) -> Any:
    mode = getattr(val, "fake_mode", None)
    return mode or contextlib.nullcontext()
