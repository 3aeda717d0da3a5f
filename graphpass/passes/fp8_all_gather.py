"""All-gather sequence-parallel inputs in FP8, as Transformer Engine does under tensor parallelism.

Under sequence parallelism a column-parallel linear's input (and, in the backward, a row-parallel
linear's output gradient) is all-gathered along the sequence and then quantized tensorwise, whole.
This pass moves the quantize before the collective wherever the gathered tensor is read by
tensorwise quantizes only:

    amax   = graphpass::amax(x_local)                      this rank's shard
    amax   = all_reduce(amax, "max", group)                the group's amax (TE's amax reduction)
    data   = graphpass::quantize_amax(x_local, amax)       this rank's shard, the group's scale
    data   = all_gather(data as uint8, group)              1 byte per element instead of 2
    ...the layout ops that followed the bf16 all-gather, on the FP8 bytes...

Tensorwise quantization is elementwise under one scale, and the max of the ranks' amaxes is the
amax of the gathered tensor exactly, so the gathered FP8 bytes and the scale are bit-identical to
quantizing the gathered tensor (``tests/test_distributed_gloo.py`` checks outputs and gradients
with the pass on and off). A columnwise copy is the rowwise one transposed (same scale). The
bytes go as uint8: gloo has no float8 type.

Not rewritten, with a note: a gathered tensor that anything but a tensorwise quantize reads (its
high-precision value is needed), and layout ops between the all-gather and the quantizes that do
not keep every gathered element exactly once.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import _compat
from ..config import Config
from ..decisions import Decision, Plan, Quantized, What, record
from ..fp8 import recipes
from ..fp8.ops import AMAX, QUANTIZE, QUANTIZE_AMAX
from ..graph.joint import (Side, copy_checkpoint_tags, in_user_checkpoint, partition_side,
                           set_partition_side)
from ..graph.collectives import gathered_parameter
from ..graph.nodes import module_path, op_name, replace_tuple_node
from ..graph.ops import COLLECTIVE_GATHERS, COLLECTIVE_WAITS, GATHER_LAYOUT
from .partitioner import TrialPartitioner

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def fp8_all_gather(joint: fx.GraphModule, plan: Plan, config: Config,
                   partitioner: TrialPartitioner) -> None:
    if config.fp8 is None:
        return
    # a parameter's gather (SimpleFSDP's weights) is passes/fp8_weight_all_gather.py's, which
    # ran before this pass and noted each it left
    gathers = [n for n in joint.graph.nodes if op_name(n) in COLLECTIVE_GATHERS
               and gathered_parameter(n, plan.parameters) is None]
    for gather in gathers:
        found = match_gather(gather)
        if isinstance(found, str):
            if found:
                plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", found, module_path(gather)),
                            once=True)
            continue
        wait, path, quantizes = found
        role = quantizes[0].args[2]
        where = module_path(quantizes[0]) or module_path(gather)
        if not config.fp8_sequence_all_gather:
            plan.decide(Decision(What.NOT_FP8_ALL_GATHER, "fp8", (
                f"{role}: off (fp8_sequence_all_gather=False): the all-gather moves "
                f"{_dtype(gather)}, quantized after it"), where), once=True)
            continue
        pinned = any(partition_side(q) is Side.MUST_BE_IN_BACKWARD for q in quantizes)
        quantize_before_gather(joint.graph, gather, wait, path, quantizes)
        side = "backward" if role == "grad" else "forward"
        # save_original pins the columnwise quantize in the backward to re-quantize a saved
        # original; with no high-precision gathered tensor left, the backward transposes the
        # gathered FP8 copy (same bits, fewer bytes than the bf16 gathered original)
        extra = ("; save_original: the backward transposes the gathered FP8 copy (no "
                 "high-precision original is gathered)") if pinned else ""
        plan.decide(Decision(What.FP8_ALL_GATHER, "fp8", (
            f"{role}, {side}: quantized before the all-gather with the group's amax "
            f"(all-reduce max), the all-gather moves FP8 bytes{extra}"), where), once=True)
    joint.graph.lint()
    joint.recompile()


def _dtype(node: fx.Node) -> str:
    return str(node.meta["val"].dtype).removeprefix("torch.")


def _live_users(node: fx.Node) -> list[fx.Node]:
    """Users that are used, or are not layout ops (the lowering leaves dead views behind)."""
    return [u for u in node.users if u.users or op_name(u) not in GATHER_LAYOUT | {"getitem"}]


def match_gather(gather: fx.Node,
                 blocks: bool = False) -> tuple[fx.Node, list[fx.Node], list[fx.Node]] | str:
    """(the wait, the layout nodes after it in graph order, the quantizes reading them), or why
    not ("" when no quantize reads the gathered tensor: nothing to say). ``blocks``: blockwise
    quantizes match too (a weight's 128x128 tiles: ``passes/fp8_weight_all_gather.py`` checks
    the shards)."""
    x = gather.args[0]
    if not isinstance(x, fx.Node) or x.meta["val"].dtype not in _HIGH_PRECISION:
        return ""
    users = _live_users(gather)
    if len(users) != 1 or op_name(users[0]) not in COLLECTIVE_WAITS:
        return ""
    wait = users[0]
    numel = wait.meta["val"].numel()
    path: list[fx.Node] = []
    quantizes: list[fx.Node] = []
    others: list[str] = []
    todo, seen = [wait], {wait}
    while todo:
        node = todo.pop()
        for user in _live_users(node):
            if user in seen:
                continue
            seen.add(user)
            name = op_name(user)
            if name == "graphpass.quantize" and user.args[0] is node and len(user.args) == 4:
                quantizes.append(user)  # not a grouped one (offsets): it is quantized per group
            elif name in GATHER_LAYOUT | {"getitem"}:
                path.append(user)
                todo.append(user)
            else:
                others.append("the graph's output" if user.op == "output" else name)
    if not quantizes:
        return ""
    if others:
        return (f"the gathered {_dtype(wait)} is also read by {', '.join(sorted(set(others)))}: "
                "quantized after the all-gather")
    recipes_ = {recipes.get_recipe(q.args[1]) for q in quantizes}
    block_ok = blocks and len(recipes_) == 1 and (
        next(iter(recipes_)).scaling is recipes.Scaling.BLOCKWISE)
    if len(recipes_) != 1 or not (next(iter(recipes_)).per_tensor or block_ok):
        shown = sorted({r.quantization_key for r in recipes_})
        return (f"{', '.join(shown)} scales: the FP8 all-gather is for tensorwise scaling "
                "only (docs/distributed.md): quantized after the all-gather")
    if len({q.args[2] for q in quantizes}) != 1:
        return "quantized in two roles: quantized after the all-gather"
    why = _every_element_once(path, quantizes, numel)
    if why:
        return why
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    return wait, sorted(path, key=order.__getitem__), quantizes


def _every_element_once(path: list[fx.Node], quantizes: list[fx.Node], numel: int) -> str:
    """Whether each quantize reads every gathered element exactly once (so its amax is the
    gathered tensor's): views keep the elements, and a split's pieces must go, each once and
    all of them, into one cat."""
    for node in path:
        if op_name(node) in ("aten.split", "aten.split_with_sizes"):
            pieces = [u for u in node.users if u.users]
            indices = sorted(u.args[1] for u in pieces)
            cats = {c for u in pieces for c in u.users}
            if (indices != list(range(len(node.meta["val"]))) or len(cats) != 1
                    or any(len(u.users) != 1 for u in pieces)):
                return "the gathered pieces are not all concatenated once: quantized after it"
            (cat,) = cats
            if op_name(cat) != "aten.cat" or sorted(cat.args[0], key=str) != sorted(pieces, key=str):
                return "the gathered pieces are not all concatenated once: quantized after it"
    for q in quantizes:
        if q.args[0].meta["val"].numel() != numel:
            return "a quantize reads part of the gathered tensor: quantized after it"
    return ""


def quantize_before_gather(graph: fx.Graph, gather: fx.Node, wait: fx.Node, path: list[fx.Node],
                           quantizes: list[fx.Node], amax: fx.Node | None = None,
                           shard: tuple[fx.Node, fx.Node] | None = None,
                           blocks: bool = False) -> None:
    """Rewrite ``gather`` (matched by :func:`match_gather`): quantize its input with the group's
    amax, all-gather the FP8 bytes. ``amax``: the group's amax of the input, reduced already
    (one all-reduce for several gathers); None reduces this input's own amax here. ``shard``:
    the input's FP8 rows and their scale_inv, quantized already (SimpleFSDP's weight cache,
    ``fp8/weight_cache.py``): neither amax nor quantize here. ``blocks``: a blockwise weight
    whose dim-0 shards are whole 128-row tiles, with only views of the gathered whole in
    ``path``: each shard quantized alone (no amax), its tile scales gathered beside its bytes,
    a columnwise copy both transposed."""
    x, group_size, group_name = gather.args[:3]
    _, recipe, role, _ = quantizes[0].args
    fp8 = recipes.fp8_dtype(recipe, role)
    side = partition_side(gather) or Side.FORWARD
    local = x.meta["val"]

    def new(target: Callable[..., Any], args: tuple, like: fx.Node, val: Any = None,
            kwargs: dict[str, Any] | None = None, module: fx.Node | None = None) -> fx.Node:
        node = graph.call_function(target, args, kwargs or {})
        if val is None:
            vals = fx.node.map_aggregate(
                args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
            if target is operator.getitem:
                val = vals[0][vals[1]]
            else:
                with _fake_mode(vals):
                    val = target(*vals, **fx.node.map_aggregate(
                        kwargs or {}, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a))
        node.meta["val"] = val
        for key in ("nn_module_stack", "fwd_nn_module_stack", "seq_nr", "stack_trace"):
            if key in (module or like).meta:
                node.meta[key] = (module or like).meta[key]
        set_partition_side(node, partition_side(like) or side)
        if in_user_checkpoint(like):
            copy_checkpoint_tags(like, node)
        return node

    quantized = Quantized(role, False, x, recipe)
    with graph.inserting_before(gather):
        if shard is not None:
            data, scale_inv = shard
        elif blocks:
            reduced = None
        elif amax is None:
            local_amax = new(AMAX, (x,), gather)
            reduced = new(_compat.functional_collective("all_reduce"),
                          (local_amax, "max", group_name), gather,
                          val=local_amax.meta["val"].new_empty(()))
            reduced = new(_compat.functional_collective("wait_tensor"), (reduced,), gather,
                          val=reduced.meta["val"])
        else:
            reduced = amax
        if shard is None:
            rows = new(torch.ops.aten.reshape.default, (x, [-1, local.shape[-1]]), gather)
            # the quantize and its outputs belong to the linear, as the quantizes they replace
            if blocks:
                q = new(QUANTIZE, (rows, recipe, role, "rowwise"), gather, module=quantizes[0])
            else:
                q = new(QUANTIZE_AMAX, (rows, reduced, recipe, role), gather,
                        module=quantizes[0])
            data = new(operator.getitem, (q, 0), gather, module=quantizes[0])
            scale_inv = new(operator.getitem, (q, 1), gather, module=quantizes[0])
            record(q, quantized=quantized)
        record(data, quantized=quantized)
        record(scale_inv, quantized=quantized, fp8_scale=True)
        if blocks:  # the shards' tile scales, gathered along dim 0 as the bytes are
            local_scale = scale_inv.meta["val"]
            scale_inv = new(gather.target, (scale_inv, group_size, group_name), gather,
                            val=local_scale.new_empty((local_scale.shape[0] * group_size,
                                                       *local_scale.shape[1:])))
            scale_inv = new(wait.target, (scale_inv,), wait, val=scale_inv.meta["val"])
            record(scale_inv, quantized=quantized, fp8_scale=True)
        as_bytes = new(torch.ops.aten.view.dtype, (data, torch.uint8), gather)
        as_bytes = new(torch.ops.aten.view.default, (as_bytes, list(local.shape)), gather)
        gathered_val = wait.meta["val"].new_empty(wait.meta["val"].shape, dtype=torch.uint8)
        moved = new(gather.target, (as_bytes, group_size, group_name), gather, val=gathered_val)
        moved = new(wait.target, (moved,), wait, val=gathered_val)
        # FP8 again, before the layout ops: what the backward may save is an FP8 tensor
        copies = {wait: new(torch.ops.aten.view.dtype, (moved, fp8), wait)}
    for old in path:  # the same layout ops, on the FP8 bytes
        args = fx.node.map_arg(old.args, lambda a: copies.get(a, a))
        kwargs = fx.node.map_arg(old.kwargs, lambda a: copies.get(a, a))
        with graph.inserting_before(old):
            copies[old] = new(old.target, args, old, kwargs=kwargs)
            record(copies[old], quantized=quantized)
    for old_q in quantizes:
        usage = old_q.args[3]
        rowwise = copies[old_q.args[0]]
        outputs: dict[int, fx.Node] = {}
        with graph.inserting_before(old_q):
            if usage in ("rowwise", "both"):
                outputs[0], outputs[1] = rowwise, scale_inv
            if usage in ("columnwise", "both"):
                # permute, not t: the graphs Inductor lowers have t decomposed already
                t = new(torch.ops.aten.permute.default, (rowwise, [1, 0]), old_q)
                col = new(torch.ops.aten.clone.default, (t,), old_q,
                          kwargs={"memory_format": torch.contiguous_format})
                if "recompute" in old_q.meta:  # save_original="never": the FP8 copy is saved
                    col.meta["recompute"] = old_q.meta["recompute"]
                record(t, quantized=Quantized(role, True, x, recipe))
                record(col, quantized=Quantized(role, True, x, recipe))
                col_scale = scale_inv
                if blocks:  # the tiles of the transpose are the tiles transposed
                    ts = new(torch.ops.aten.permute.default, (scale_inv, [1, 0]), old_q)
                    col_scale = new(torch.ops.aten.clone.default, (ts,), old_q,
                                    kwargs={"memory_format": torch.contiguous_format})
                    record(col_scale, quantized=Quantized(role, True, x, recipe),
                           fp8_scale=True)
                first = 2 if usage == "both" else 0
                outputs[first], outputs[first + 1] = col, col_scale
        replace_tuple_node(graph, old_q, outputs)
    for old in reversed([wait, *path]):
        for user in list(old.users):  # dead views the lowering left
            if not user.users and user not in path:
                graph.erase_node(user)
        graph.erase_node(old)
    graph.erase_node(gather)


def _fake_mode(vals: list[Any]) -> Any:
    flat = [v for val in vals for v in (val if isinstance(val, (list, tuple)) else [val])]
    mode = next((v.fake_mode for v in flat if hasattr(v, "fake_mode")), None)
    return mode or contextlib.nullcontext()
