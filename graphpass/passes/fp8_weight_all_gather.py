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

Blockwise (128x128 weight tiles), where each rank's shard is whole 128-row tiles (even
shards, the shard rows a multiple of 128) and the quantizes read the gathered weight as it is:
no reduction, each shard quantized alone, and both its bytes and its tile scales gathered
(dim 0, two all-gathers):

    data_i, scale_i = graphpass::quantize(shard_i, blockwise, "weight", "rowwise")
    data_i  = all_gather(data_i as uint8)                    1 byte per element
    scale_i = all_gather(scale_i)                            4 bytes per 128x128 tile
    dgrad's columnwise copy: the gathered bytes and scales transposed

A tile's amax, scale and cast read that tile only, and the shard's tiles are the gathered
weight's tiles of its rows, so the bits are those of quantizing the gathered weight; the tiles
of ``w.t()`` are ``w``'s transposed, so dgrad's copy is the transpose, bit for bit. A shard that
is not whole tiles keeps the bf16 gather with a note naming its rows and the block.

Under ``fp8_weight_cache`` (``True``, or ``"auto"`` with a memory budget), the amaxes, the
all-reduce and the quantizes of the weights whose shard is a parameter (or its dtype cast) are
one ``graphpass::quantize_weight_shards`` (``fp8/weight_cache.py``) before the first gather:
computed on the first micro-batch after each optimizer step and looked up on the others (the
ranks hit and miss together: the op's docstring says why), the all-gathers still run every
micro-batch on its cached bytes (:func:`_cache_shards`).

Left as a bf16 all-gather quantized after, each with a note: a weight whose gathered value
something other than a tensorwise or blockwise weight quantize reads (an embedding, a linear
kept in bf16), a gather whose layout ops do not keep every element once (an uneven shard's
padding sliced off), a blockwise shard that cuts a tile, and rowwise and mxfp8 scales: dgrad's
columnwise copy scales along dim 0 (rowwise: one scale per column of the whole weight, across
the shards; mxfp8: 32-row blocks, not the rowwise copy transposed), so the joint graph's one
gather for both GEMMs would move both FP8 copies, no fewer bytes than bf16
(``fp8/fsdp.py``'s docstring). The backward's reduce-scatter of the gradients is not touched: a
sum of FP8 values is not the sum the bf16 reduce-scatter computes.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _compat
from ..config import Config
from ..decisions import Decision, Plan, What
from ..fp8 import recipes
from ..fp8.fsdp import columnwise_across_shards
from ..fp8.ops import AMAX, QUANTIZE
from ..fp8.weight_cache import QUANTIZE_SHARDS, QUANTIZE_WEIGHT_SHARDS
from ..graph.collectives import gathered_parameter
from ..graph.joint import Side, partition_side, set_partition_side
from ..graph.nodes import module_path, op_name, tensor_bytes
from ..graph.ops import CASTS, COLLECTIVE_GATHERS, COLLECTIVE_WAITS, GATHER_LAYOUT
from .fp8_all_gather import match_gather, quantize_before_gather
from .partitioner import TrialPartitioner
from .tags import tag

WEIGHT_CACHE_BY = "fp8_weight_cache"

# layout ops that keep a 2-D tensor's elements where they are (same shape: the same tiles)
_SAME_ELEMENTS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.alias"}
_PLUMBING = COLLECTIVE_GATHERS | COLLECTIVE_WAITS | GATHER_LAYOUT | {"getitem", "aten.slice"}
_Found = tuple[fx.Node, fx.Node, list[fx.Node], list[fx.Node]]  # gather, wait, path, quantizes


def fp8_weight_all_gather(joint: fx.GraphModule, plan: Plan, config: Config,
                          partitioner: TrialPartitioner) -> None:
    if config.fp8 is None:
        return
    graph = joint.graph
    gathers = [n for n in graph.nodes if op_name(n) in COLLECTIVE_GATHERS
               and gathered_parameter(n, plan.parameters) is not None]
    cache = config.fp8_weight_cache is True or (config.fp8_weight_cache == "auto"
                                                 and config.memory_budget is not None)
    bf16 = (f"in {{}}, quantized after the all-gather every micro-batch (the weight cache "
            "keeps FP8-gathered shards only)")
    todo: list[_Found] = []
    rewritten = False
    for gather in gathers:
        padded = _padded(gather)
        if padded:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", padded, _module(gather)),
                        once=True)
            if cache:
                _not_cached(plan, gather, gather, _module(gather),
                            bf16.format(_dtype(gather)))
            continue
        found = match_gather(gather, blocks=True)
        if isinstance(found, str):
            if found:  # "": no quantize reads it (a norm's weight): not a lowered weight
                plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", _why_not(gather, found),
                                     _module(gather)), once=True)
                if cache and any(u.target is QUANTIZE for u in _readers(gather)):
                    _not_cached(plan, gather, gather, _module(gather),
                                bf16.format(_dtype(gather)))
            continue
        wait, path, quantizes = found
        if not config.fp8_weight_all_gather:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", (
                f"weight: off (fp8_weight_all_gather=False): the all-gather moves "
                f"{_dtype(gather)}, quantized after it"), module_path(quantizes[0])), once=True)
            if cache:
                _not_cached(plan, gather, wait, module_path(quantizes[0]),
                            bf16.format(_dtype(gather)))
            continue
        if recipes.get_recipe(quantizes[0].args[1]).per_tensor:
            todo.append((gather, wait, path, quantizes))
            continue
        why = _cut_tiles(gather, wait, path, quantizes)
        if why:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", why, module_path(quantizes[0])),
                        once=True)
            if cache:
                _not_cached(plan, gather, wait, module_path(quantizes[0]),
                            bf16.format(_dtype(gather)))
            continue
        rows = gather.args[0].meta["val"].shape[0]
        quantize_before_gather(graph, gather, wait, path, quantizes, blocks=True)
        dgrad = any(q.args[3] in ("columnwise", "both") for q in quantizes)
        plan.decide(Decision(What.FP8_ALL_GATHER, "fp8", (
            f"weight, forward: each {rows}-row shard quantized alone in whole 128x128 tiles (no "
            "reduction), the all-gathers move FP8 bytes and the tile scales" + (
                "; dgrad's columnwise copy is the gathered copy and scales transposed"
                if dgrad else "")), module_path(quantizes[0])), once=True)
        rewritten = True
        if cache:
            _not_cached(plan, gather, wait, module_path(quantizes[0]), (
                "blockwise: each shard quantized alone in its tiles every micro-batch (the "
                "weight cache keeps tensorwise FP8-gathered shards only)"))
    if not todo:
        if rewritten:
            graph.lint()
            joint.recompile()
        return
    by_group: dict[Any, list[_Found]] = {}
    for found in todo:
        by_group.setdefault(found[0].args[2], []).append(found)
    for group, founds in by_group.items():
        if cache:
            founds = _cache_shards(graph, plan, config, founds, group)
            if not founds:
                continue
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
        if cache:
            for gather, wait, _, quantizes in batched + alone:
                _not_cached(plan, gather, wait, module_path(quantizes[0]), (
                    "from a shard computed in the step, not a parameter's: quantized every "
                    "micro-batch"))
    graph.lint()
    joint.recompile()


def _cache_shards(graph: fx.Graph, plan: Plan, config: Config, founds: list[_Found],
                  group: Any) -> list[_Found]:
    """``fp8_weight_cache``: the weights of ``founds`` whose shard is a parameter (or its dtype
    cast) get their amaxes, all-reduce and quantize from one ``graphpass::quantize_weight_shards``
    (``fp8/weight_cache.py``) before the first of their gathers, one per cast dtype: computed on
    the first micro-batch after each optimizer step, looked up on the others; their all-gathers
    still run every micro-batch, on the cached FP8 bytes. Tagged must-recompute: a backward that
    gathers again looks the shards up, and nothing of the op is saved. Under ``"auto"`` the op
    is ``graphpass::quantize_shards`` (the same, uncached) until the memory budget chooses
    (``passes/fp8_weight_cache.py``, ``within_budget``). The other weights, returned."""
    by_dtype: dict[Any, list[tuple[_Found, fx.Node]]] = {}
    rest: list[_Found] = []
    for found in founds:
        shard = _parameter_shard(found[0].args[0], plan.parameters)
        if shard is None:
            rest.append(found)
        else:
            by_dtype.setdefault(shard[1], []).append((found, shard[0]))
    order = {n: i for i, n in enumerate(graph.nodes)}
    target = QUANTIZE_WEIGHT_SHARDS if config.fp8_weight_cache is True else QUANTIZE_SHARDS
    for dtype, items in by_dtype.items():
        first = min((f[0] for f, _ in items), key=order.__getitem__)
        params = [p for _, p in items]
        _, recipe, role, _ = items[0][0][3][0].args
        with graph.inserting_before(first):
            op = graph.call_function(target, (params, dtype, recipe, role, group))
            with _fake_mode(params[0].meta["val"]):
                op.meta["val"] = target([p.meta["val"] for p in params], dtype, recipe, role,
                                        group)
            set_partition_side(op, Side.FORWARD)
            if target is QUANTIZE_WEIGHT_SHARDS:  # a lookup in the backward; the twin's tag
                tag(op, CheckpointPolicy.MUST_RECOMPUTE)  # is the budget's (_Toggles)
            outputs = []
            for i, ((_, _, _, quantizes), _) in enumerate(items):
                pair = []
                for j in (2 * i, 2 * i + 1):
                    item = graph.call_function(operator.getitem, (op, j))
                    item.meta["val"] = op.meta["val"][j]
                    for key in ("nn_module_stack", "fwd_nn_module_stack"):
                        if key in quantizes[0].meta:
                            item.meta[key] = quantizes[0].meta[key]
                    set_partition_side(item, Side.FORWARD)
                    pair.append(item)
                outputs.append(tuple(pair))
        n = len(items)
        if target is QUANTIZE_WEIGHT_SHARDS:
            plan.count(WEIGHT_CACHE_BY, "weights", n)
        for ((gather, wait, path, quantizes), param), shard in zip(items, outputs):
            cast = gather.args[0]
            quantize_before_gather(graph, gather, wait, path, quantizes, shard=shard)
            while cast is not param and not cast.users:  # now inside the op
                up = cast.args[0]
                graph.erase_node(cast)
                cast = up
            _decided(plan, quantizes, f"one all-reduce (max) of the amaxes of {n} "
                     f"weight{'s' if n > 1 else ''}, " + (
                         "by the weight cache: once per optimizer step"
                         if target is QUANTIZE_WEIGHT_SHARDS else
                         "in one op the memory budget may cache (fp8_weight_cache='auto')"))
            if target is QUANTIZE_WEIGHT_SHARDS:
                plan.decide(Decision(What.WEIGHT_CACHED, WEIGHT_CACHE_BY, (
                    f"the {_shape(wait)} weight is all-gathered in the graph (SimpleFSDP): its "
                    f"{_shape(param)} shard's FP8 copy quantized once per optimizer step with "
                    "the gathered weight's amax (one all-reduce of the graph's weights' amaxes) "
                    f"and held between steps ({shard_bytes(shard):,} B), all-gathered every "
                    "micro-batch"), module_path(quantizes[0]), param.name))
    return rest


def shard_bytes(shard: tuple[fx.Node, fx.Node]) -> int:
    """What the cache holds for one shard: its FP8 data and its scale."""
    return sum(tensor_bytes(n.meta["val"], where=f"{WEIGHT_CACHE_BY}'s size of {n.name}")
               for n in shard)


def _parameter_shard(x: fx.Node, parameters: set[fx.Node]) -> tuple[fx.Node, Any] | None:
    """The parameter ``x`` is, or is one dtype cast of (the mixed-precision policy's), and the
    cast's dtype (None: no cast); None for anything else (the cache keys on the parameter)."""
    if x in parameters:
        return x, None
    if (op_name(x) in ("prims.convert_element_type", "aten._to_copy")
            and isinstance(x.args[0], fx.Node) and x.args[0] in parameters
            and len(x.all_input_nodes) == 1 and set(x.kwargs) <= {"dtype"}):
        return x.args[0], x.meta["val"].dtype
    return None


def _not_cached(plan: Plan, gather: fx.Node, wait: fx.Node, module: str, why: str) -> None:
    """``fp8_weight_cache``'s note for a SimpleFSDP weight it does not cache."""
    shard = gathered_parameter(gather, plan.parameters)
    plan.decide(Decision(What.WEIGHT_NOT_CACHED, WEIGHT_CACHE_BY, (
        f"the {_shape(wait)} weight is all-gathered in the graph (SimpleFSDP) {why}"), module,
        shard.name if shard is not None else gather.args[0].name), once=True)


def _shape(node: fx.Node) -> str:
    return "x".join(map(str, node.meta["val"].shape))


def _decided(plan: Plan, quantizes: list[fx.Node], reduced: str) -> None:
    dgrad = any(q.args[3] in ("columnwise", "both") for q in quantizes)
    plan.decide(Decision(What.FP8_ALL_GATHER, "fp8", (
        f"weight, forward: quantized shard by shard with the gathered weight's amax ({reduced}), "
        "the all-gather moves FP8 bytes" + ("; dgrad's columnwise copy is the gathered copy "
                                            "transposed" if dgrad else "")),
        module_path(quantizes[0])), once=True)


def _cut_tiles(gather: fx.Node, wait: fx.Node, path: list[fx.Node],
               quantizes: list[fx.Node]) -> str:
    """Why a blockwise weight's gather stays in high precision: a shard that is not whole
    128-row tiles (a tile would cross a shard boundary), or a quantize that reads the gathered
    weight other than as it is (the gathered tile scales are the whole weight's only as is);
    "" where each shard can be quantized alone."""
    block = recipes.block_shape(quantizes[0].args[1], "weight")[0]
    rows, world = gather.args[0].meta["val"].shape[0], gather.args[1]
    moved = f"the all-gather moves {_dtype(gather)}, quantized after it"
    if quantizes[0].args[2] != "weight" or gather.args[0].meta["val"].dim() != 2:
        return f"weight: blockwise, quantized as {quantizes[0].args[2]}: {moved}"
    if rows % block:
        return (f"weight: blockwise: its shards are {rows} rows ({rows * world} rows over "
                f"{world} ranks), not a multiple of the {block}x{block} scale block: a block "
                f"would cross a shard boundary, so its scale needs rows of two shards; {moved}")
    if not all(_as_gathered(q.args[0], wait) for q in quantizes):
        return (f"weight: blockwise, quantized through a layout change of the gathered weight "
                f"(its tiles are not the shards' tiles): {moved}")
    return ""


def _as_gathered(x: fx.Node, wait: fx.Node) -> bool:
    """Whether ``x`` is the gathered weight ``wait`` as it is: ``wait`` itself or views of it
    in its shape (every element where it was, so the same tiles)."""
    shape = wait.meta["val"].shape
    while x is not wait:
        if op_name(x) not in _SAME_ELEMENTS or x.meta["val"].shape != shape:
            return False
        x = x.args[0]
    return True


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


def _readers(gather: fx.Node) -> list[fx.Node]:
    """The nodes that read the gathered weight past the collective and the layout ops."""
    todo, seen, out = [gather], {gather}, []
    while todo:
        node = todo.pop(0)
        if node is not gather and op_name(node) not in _PLUMBING:
            out.append(node)
            continue
        for user in node.users:
            if user not in seen:
                seen.add(user)
                todo.append(user)
    return out


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
        return (f"weight: {key} scales: {columnwise_across_shards(recipes.get_recipe(key))}; "
                f"the all-gather moves {_dtype(gather)}, quantized after it")
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
