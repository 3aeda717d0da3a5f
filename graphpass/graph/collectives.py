"""The collectives a partitioned graph runs (tensor/sequence-parallel communication), for the
report.

Tensor- and sequence-parallel blocks (DTensor) trace into graphs with torch's functional
collectives (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ...) and
per-rank shapes; graphpass partitions them like any other graph, so its report is that rank's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from ..decisions import Decision, What
from ..report import format_bytes
from .joint import FSDP_FP8_BLOCK_SCALES, FSDP_FP8_DATA, is_fsdp_fp8_scale
from .nodes import normalize_path, op_name
from .ops import CASTS, COLLECTIVE_GATHERS, VIEWS


def gathered_parameter(gather: fx.Node, parameters: set[fx.Node]) -> fx.Node | None:
    """The parameter an ``all_gather_into_tensor`` gathers (its shard, through dtype casts: a
    SimpleFSDP weight, cast to the mixed-precision policy's dtype before or after), else None."""
    return shard_parameter(gather.args[0], parameters)


def shard_parameter(x: Any, parameters: set[fx.Node]) -> fx.Node | None:
    """The parameter ``x`` is, through dtype casts, else None."""
    while isinstance(x, fx.Node) and x.op == "call_function" and op_name(x) in CASTS:
        x = x.args[0]
    return x if isinstance(x, fx.Node) and x in parameters else None


def collective_notes(fw: fx.GraphModule, bw: fx.GraphModule) -> list[Decision]:
    """One note per graph with collectives: which, how many, and the bytes each rank receives.
    The all-reduce of SimpleFSDP's shards op (``SHARDS_OPS``) counts as the graph's; the cached
    op's apart, once per optimizer step (a backward's lookup of it reduces nothing)."""
    notes = []
    for name, gm in (("forward", fw), ("backward", bw)):
        counts: Counter[str] = Counter()
        received: Counter[str] = Counter()
        once: list[int] = []  # the cached shards ops' all-reduces: the bytes of each
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node) in SHARDS_OPS:
                amaxes = 4 * len(node.args[0])  # one fp32 amax per shard
                if op_name(node) == "graphpass.quantize_shards":
                    counts["all_reduce"] += 1
                    received["all_reduce"] += amaxes
                elif name == "forward":
                    once.append(amaxes)
                continue
            target = node.target
            if node.op != "call_function" or not _compat.is_op_overload(target):
                continue
            if target.namespace != "_c10d_functional" or target.__name__.startswith("wait_tensor"):
                continue
            op = target.__name__.split(".")[0]
            counts[op] += 1
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                received[op] += val.numel() * val.element_size()
        if counts or once:
            parts = ", ".join([f"{op} x{n} ({format_bytes(received[op])} out)"
                               for op, n in sorted(counts.items())] + ([
                f"all_reduce x{len(once)} ({format_bytes(sum(once))} out) in fp8_weight_cache's "
                "quantize_weight_shards, on the first micro-batch of each optimizer step"]
                if once else []))
            notes.append(Decision(What.COLLECTIVES, "distributed", f"{name}: {parts}"))
    return notes


SHARDS_OPS = frozenset({"graphpass.quantize_shards", "graphpass.quantize_weight_shards"})
"""SimpleFSDP's FP8 shards of a graph's weights, with their amax all-reduce inside
(``fp8/weight_cache.py``)."""


def weight_gathers(gm: fx.GraphModule, parameter_names: set[str]
                   ) -> list[tuple[fx.Node, fx.Node, torch.dtype | None, bool]]:
    """The all-gathers of parameters in ``gm`` (SimpleFSDP's weights): each gather, the shard's
    placeholder it reads (through views, casts and the FP8 quantize moved before it), the FP8
    dtype its bytes hold (None: it gathers the parameter's values), and whether it gathers the
    shard's block scales (blockwise: a second gather beside the bytes')."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or op_name(node) not in COLLECTIVE_GATHERS:
            continue
        x, fp8, scales = node.args[0], None, False
        while isinstance(x, fx.Node) and x.op == "call_function":
            name = op_name(x)
            if name == "getitem" and op_name(x.args[0]) in _QUANTIZES:
                scales = x.args[1] == 1
            elif name in _QUANTIZES:
                fp8 = x.meta["val"][0].dtype
            elif name == "getitem" and op_name(x.args[0]) in SHARDS_OPS:
                # the weight cache's shards (fp8/weight_cache.py): [data_0, scale_inv_0, ...]
                fp8 = x.meta["val"].dtype
                x = x.args[0].args[0][x.args[1] // 2]
                continue
            elif name not in VIEWS | CASTS | {"aten.clone"}:
                break
            x = x.args[0]
        if isinstance(x, fx.Node) and x.op == "placeholder" and x.name in parameter_names:
            found.append((node, x, fp8, scales))
    return found


_QUANTIZES = {"graphpass.quantize_amax", "graphpass.quantize"}


def weight_gather_notes(fw: fx.GraphModule, bw: fx.GraphModule, parameter_names: set[str],
                        names: dict[str, str]) -> list[Decision]:
    """One note per all-gather of a parameter (SimpleFSDP): the weight (the user's name, from
    ``names``, else its placeholder's), the gathered shape, the dtype it moves and the bytes
    this rank receives per step (blockwise: its bytes' gather and its tile scales' together)."""
    notes = []
    for side, gm in (("forward", fw), ("backward", bw)):
        gathers = weight_gathers(gm, parameter_names)
        scales = {shard: gather.meta["val"] for gather, shard, _, is_scale in gathers if is_scale}
        for gather, shard, fp8, is_scale in gathers:
            if is_scale:
                continue
            val = gather.meta["val"]
            shape = tuple(val.shape)
            moved = (f"{str(fp8).removeprefix('torch.')} (as uint8)" if fp8 is not None
                     else str(val.dtype).removeprefix("torch."))
            size = val.numel() * val.element_size()
            if fp8 is not None and shard in scales:
                tiles = scales[shard]
                moved += f" and {tuple(tiles.shape)} float32 tile scales"
                size += tiles.numel() * tiles.element_size()
            notes.append(Decision(What.WEIGHT_ALL_GATHER, "distributed", (
                f"{side}, {shape}, {moved}, {format_bytes(size)} per step"),
                normalize_path(names.get(shard.name, ""), of_module=False) or shard.name))
    return notes


SIMPLE_FSDP_FP8 = Decision(What.FP8_DISTRIBUTED, "fp8", (
    "FSDP in the graph (SimpleFSDP): a lowered weight whose all-gather moves FP8 is quantized "
    "shard by shard with the amax of the gathered weight (all-reduced, max, over the FSDP "
    "group; blockwise: each 128x128 tile by its own, the tile scales gathered beside the "
    "bytes), the bits of quantizing the gathered weight; one moving its parameter dtype is "
    "quantized after the all-gather (the fp8 all-gather notes say why); the gradients' "
    "reduce-scatters move the gradient dtype; activation amaxes are this rank's batch rows, not "
    "reduced across data-parallel ranks"))


FSDP_FP8 = Decision(What.FP8_DISTRIBUTED, "fp8", (
    "FSDP2: a weight graphpass.fsdp_fp8_weights wrapped is all-gathered in FP8, quantized shard "
    "by shard with the whole weight's amax (all-reduced, max; blockwise: each 128x128 tile by "
    "its own, the tile scales gathered beside the data): the bits of quantizing the gathered "
    "weight, which its FP8 GEMMs read; every other weight is all-gathered in the "
    "parameter dtype and, where lowered, quantized after the all-gather from the unsharded "
    "weight (the weight all-gather notes list each); activation amaxes are this rank's batch "
    "rows, not reduced across data-parallel ranks"))


def fsdp_weight_gather_notes(fw: fx.GraphModule, parameter_names: set[str],
                             names: dict[str, str]) -> list[Decision]:
    """Under FSDP2 (its all-gathers run before the graph, in its hooks): one note per weight the
    forward reads, with the dtype its all-gather moves and the bytes this rank receives per
    all-gather: FP8 for a weight ``fsdp_fp8_weights`` wrapped (its data input, 1 byte per
    element, plus, blockwise, its gathered fp32 block scales; a tensorwise scale is not
    gathered), else the parameter's dtype."""
    notes = []
    for p in fw.graph.find_nodes(op="placeholder"):
        val = p.meta.get("val")
        if not isinstance(val, torch.Tensor) or is_fsdp_fp8_scale(p):
            continue
        size = val.numel() * val.element_size()
        if p.meta.get(FSDP_FP8_DATA):
            moved, why = (f"{str(val.dtype).removeprefix('torch.')} (as uint8)",
                          "graphpass.fsdp_fp8_weights")
            scales = p.meta.get(FSDP_FP8_BLOCK_SCALES)  # their shape
            if scales:
                moved += f" and {scales} float32 tile scales"
                size += 4 * scales[0] * scales[1]
        elif p.name in parameter_names:
            moved, why = str(val.dtype).removeprefix("torch."), "parameter dtype"
        else:
            continue
        name = normalize_path(names.get(p.name, ""), of_module=False) or p.name
        notes.append(Decision(What.WEIGHT_ALL_GATHER, "distributed", (
            f"FSDP2 (before the graph), {tuple(val.shape)}, {moved} ({why}), "
            f"{format_bytes(size)} each all-gather"), name))
    return notes


def fp8_distributed_notes(fw: fx.GraphModule, bw: fx.GraphModule, *, fsdp: bool,
                          parameter_names: set[str] = frozenset()) -> list[Decision]:
    """FP8 in a distributed graph (docs/distributed.md): where the all-gathers quantize (before
    the collective with a group amax, or after it), and what graphpass does not do (FP8
    all-gather of FSDP2's weights, amaxes reduced over data-parallel ranks or weight shards).
    ``parameter_names``: the placeholders that are parameters (an all-gather of one is
    SimpleFSDP's, noted apart from the tensor-parallel ones)."""
    notes = [FSDP_FP8] if fsdp else []
    weights = {g for gm in (fw, bw) for g, *_ in weight_gathers(gm, parameter_names)}
    if weights:
        notes.append(SIMPLE_FSDP_FP8)
    moved = {node.meta["val"].dtype
             for gm in (fw, bw) for node in gm.graph.nodes
             if node.op == "call_function" and node not in weights
             and getattr(node.target, "__name__", "").startswith("all_gather_into_tensor")
             and isinstance(node.meta.get("val"), torch.Tensor)}
    high = sorted(str(d).removeprefix("torch.") for d in moved if d.is_floating_point)
    if torch.uint8 in moved:  # passes/fp8_all_gather.py: FP8 bytes, as uint8
        notes.append(Decision(What.FP8_DISTRIBUTED, "fp8", (
            "tensor parallelism: sequence-parallel inputs and gradients are quantized before "
            "their all-gathers, with the amax reduced (max) over the group as Transformer Engine "
            "does, and the all-gathers move FP8 bytes (uint8), so a gathered tensor has one "
            "scale, the same on every rank; a weight shard or a row-parallel input scales by "
            "this rank's shard")))
    if high:
        notes.append(Decision(What.FP8_DISTRIBUTED, "fp8", (
            f"tensor parallelism: all-gathers that move {', '.join(high)} are quantized after "
            "the collective (the fp8 all-gather notes say why), so a gathered input has one "
            "scale, the same on every rank; no amax is reduced across ranks there: a weight "
            "shard or a row-parallel input scales by this rank's shard")))
    return notes
