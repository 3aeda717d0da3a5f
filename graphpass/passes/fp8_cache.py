"""The FP8 activation cache (``fp8_cache``, opt-in and lossy): saved activations stored in FP8.

After the exact passes, torch's min-cut of a copy of the joint graph says what their plan saves
(``TrialPartitioner.saves``). Each saved floating activation the level selects gets visible
nodes: ``cache_quantize`` in the forward (FP8 data of the same shape plus fp32 scales) and
``cache_dequantize`` pinned in the backward, which every backward reader of the activation then
reads instead. torch's min-cut sees the 1-byte data and saves it in place of the original.

Which value reads what:

* the forward always computes with the exact value (no forward node is rewritten);
* the backward reads the dequantized value: its own nodes directly, and where the exact plan
  recomputes a forward node in the backward (``silu(gate)`` of SwiGLU) or reads a view of a
  cached value, that node becomes an explicit backward node reading the dequantized inputs, so
  recompute and backward agree and the original need not be saved. Everything else the exact
  plan saves (a norm's ``rstd``, attention's log-sum-exp) stays exact. A random op (dropout) is not copied (a copy would draw new
  numbers): its inputs stay exact for torch's replay, and a cached input it reads is a note.

So gradients differ from the exact plan's only through the cached values. Anything the level
selects but the cache cannot take (too small, not floating, a parameter) is a report note.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

from .. import _compat
from ..config import Config
from ..decisions import Cached, Decision, Plan, What, facts, record
from ..fp8 import recipes
from ..fp8.cache import CACHE_DEQUANTIZE, CACHE_DEQUANTIZE_COPY, CACHE_QUANTIZE, DTYPES
from ..graph.joint import (PLACEMENT_KEYS, Side, copy_checkpoint_tags, partition_side,
                           set_partition_side)
from ..graph.nodes import (is_backward, is_random, module_path, op_name, producer, tensor_bytes,
                           tensor_val)
from ..graph.ops import CASTS, VIEWS
from ..graph.regions import Regions, is_attention
from .partitioner import TrialPartitioner

BY = "fp8_cache"


def fp8_cache(joint: fx.GraphModule, plan: Plan, config: Config,
              partitioner: TrialPartitioner) -> None:
    if config.fp8_activation_cache is None:
        return
    saved, recomputed = partitioner.saves(joint)
    selected = _select(joint, saved, config.fp8_activation_cache, plan.parameters)
    plan.count("fp8_activation_cache", config.fp8_activation_cache, len(selected))
    graph = joint.graph
    copies = _lowered_copies(joint)
    small, cached = [], {}
    for node in selected:
        why = _not_cacheable(node, plan)
        if why:
            plan.decide(Decision(What.NOT_CACHED, BY, f"{node.name} in {module_path(node) or '<root>'}"
                                 f": {why}", module_path(node), node.name))
        elif _nbytes(node) < config.fp8_activation_cache_min_bytes:
            small.append(node)
        elif node in copies:
            cached[node] = _reuse(graph, node, *copies[node])
        else:
            cached[node] = _insert(graph, node, config.fp8_activation_cache_format)
    if small:
        plan.decide(Decision(What.NOT_CACHED, BY, (
            f"{len(small)} saved tensor(s) below fp8_cache_min_bytes="
            f"{config.fp8_activation_cache_min_bytes:,} ({sum(map(_nbytes, small)):,} B in all)")))
    if cached:
        _read_in_backward(graph, cached, recomputed, plan)
    graph.lint()
    joint.recompile()
    if cached:
        undone, saved = _undo_saved_exact(joint, partitioner, cached)
        if undone:  # partition the graph as it is now
            saved, _ = partitioner.saves(joint)
        _still_exact(joint, plan, config, saved, undone)


def _undo_saved_exact(joint: fx.GraphModule, partitioner: TrialPartitioner,
                      cached: dict[fx.Node, fx.Node]) -> tuple[set[fx.Node], list[fx.Node]]:
    """The cached tensors torch's min-cut of the rewritten graph still saves exact (a backward
    recompute reads the original): their quantize would run in the backward on the exact saved
    value, a lossy read that saves no byte. Undo the cache for them (their backward readers read
    the original again); returns them and what the min-cut saved. A reused FP8 lowering copy is
    left as it is."""
    saved, _ = partitioner.saves(joint)
    undone = set()
    for node in dict.fromkeys(map(_base, saved)):
        q = cached.get(node)
        if q is None or q.target is not CACHE_DEQUANTIZE:  # not cached, or a reused copy
            continue
        q.replace_all_uses_with(node)
        data = q.args[0]
        quantize = data.args[0]
        for dead in (q, *list(quantize.users), quantize):
            if not dead.users:
                joint.graph.erase_node(dead)
        undone.add(node)
    if undone:
        joint.graph.lint()
        joint.recompile()
    return undone, saved


def _still_exact(joint: fx.GraphModule, plan: Plan, config: Config, saved: list[fx.Node],
                 undone: set[fx.Node]) -> None:
    """Never silent: torch's min-cut of the rewritten graph may still save, exact, a tensor the
    level selects (on the tiny GPT under ``all``, the final LayerNorm's output and statistic:
    the backward reads them again after the rewrite; ``undone``: cached tensors whose cache was
    undone for that). Each one is a note; the cache does not chase it (a second rewrite could
    move the cut again)."""
    if config.fp8_activation_cache == "all":  # backward nodes that read no gradient, run in the forward
        for node in saved:
            if (is_backward(node) and tensor_val(node) is not None and not _not_cacheable(node, plan)
                    and _nbytes(node) >= config.fp8_activation_cache_min_bytes):
                plan.decide(Decision(What.NOT_CACHED, BY, (
                    f"{node.name} in {module_path(node) or '<root>'}: a backward node (it reads no "
                    "gradient) that torch's min-cut runs in the forward; the cache takes forward "
                    "tensors only"), module_path(node), node.name))
    for node in _select(joint, saved, config.fp8_activation_cache, plan.parameters):
        if (facts(node).cached is not None or _not_cacheable(node, plan)
                or _nbytes(node) < config.fp8_activation_cache_min_bytes):  # noted above
            continue
        why = ("torch's min-cut of the cached graph saves it exact" + (
            " (a backward recompute reads it), so the backward reads it exact too" if node in undone
            else ""))
        plan.decide(Decision(What.NOT_CACHED, BY, f"{node.name} in {module_path(node) or '<root>'}: {why}",
                             module_path(node), node.name))


def _select(joint: fx.GraphModule, saved: list[fx.Node], level: str,
            plan_parameters: set[fx.Node]) -> list[fx.Node]:
    """The saved activations the level selects, in graph order, each once (a view's base for a
    saved view: the cache stores the tensor the view reads, and the backward views the
    dequantized value)."""
    regions = Regions(joint)
    acts = regions.activation_inputs_region()
    out: dict[fx.Node, None] = {}
    for node in saved:
        base = _base(node)
        if is_backward(base) or tensor_val(base) is None or base in plan_parameters:
            continue
        readers = _readers(base)
        if level == "all":
            take = True
        elif level == "act_input":
            take = any(r in acts for r in readers)
        elif level == "attn":
            take = producer(base) in regions.attention or any(r in regions.attention for r in readers)
        else:  # layer_input
            take = base not in regions.norms and _reaches_norm(base, regions.norms)
        if take:
            out[base] = None
    order = {n: i for i, n in enumerate(joint.graph.nodes)}
    return sorted(out, key=order.__getitem__)


def _base(node: fx.Node) -> fx.Node:
    """The tensor a saved view reads (through views, not casts)."""
    while node.op == "call_function" and op_name(node) in VIEWS and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
    """The forward nodes reading ``node``, through views and casts."""
    out, todo, seen = [], [node], {node}
    while todo:
        for user in todo.pop().users:
            if user in seen or user.op != "call_function" or is_backward(user):
                continue
            seen.add(user)
            if op_name(user) in VIEWS | CASTS:
                todo.append(user)
            else:
                out.append(user)
    return out


def _reaches_norm(node: fx.Node, norms: set[fx.Node]) -> bool:
    """Whether a norm reads ``node`` in the forward, directly or through residual adds: under
    FP8 lowering the exact plan saves the residual stream's summands (a projection's output)
    rather than their sum, and the backward re-adds them for the norm."""
    todo, seen = [node], {node}
    while todo:
        for reader in _readers(todo.pop()):
            if reader in norms:
                return True
            if op_name(reader) == "aten.add" and reader not in seen:
                seen.add(reader)
                todo.append(reader)
    return False


def _not_cacheable(node: fx.Node, plan: Plan) -> str:
    val = tensor_val(node)
    if val.dtype not in DTYPES:
        return f"{str(val.dtype).removeprefix('torch.')} is no floating dtype the cache stores"
    if val.numel() == 0:
        return "empty"
    if facts(node).quantized is not None or facts(node).fp8_scale:
        return "an FP8 copy already"
    if node.target is operator.getitem and node.args[1] != 0 and is_attention(producer(node)):
        return ("attention's softmax statistics (log-sum-exp) stay exact: an error e in them "
                "scales the backward's attention probabilities by exp(e)")
    return ""


def _nbytes(node: fx.Node) -> int:
    return tensor_bytes(tensor_val(node), where=f"the FP8 cache of {node.name}")


def _insert(graph: fx.Graph, node: fx.Node, fmt: str) -> fx.Node:
    """``cache_quantize`` after ``node`` (forward) and ``cache_dequantize`` (pinned in the
    backward); returns the dequantized value."""
    val = tensor_val(node)
    dtype = str(val.dtype).removeprefix("torch.")
    cached = Cached(source=node, dtype=dtype, fmt=fmt)
    with graph.inserting_after(node):
        q = _call(graph, CACHE_QUANTIZE, (node, fmt), like=node)
    with graph.inserting_after(q):
        data = _call(graph, operator.getitem, (q, 0), like=node)
    with graph.inserting_after(data):
        scale = _call(graph, operator.getitem, (q, 1), like=node)
    # the original's layout, or a contiguous one for a strided view (q, k, v of a packed qkv)
    stride = (list(val.stride()) if _compat.is_non_overlapping_and_dense(val)
              else list(torch.empty(val.shape, device="meta").stride()))
    with graph.inserting_after(scale):
        dq = _call(graph, CACHE_DEQUANTIZE, (data, scale, fmt, val.dtype, stride), like=node)
    record(data, cached=cached)
    record(scale, cached=cached, fp8_scale=True)
    set_partition_side(dq, Side.MUST_BE_IN_BACKWARD)
    return dq


# Shape-only ops between a saved activation and the 2-D input of a linear's quantize, each with
# the op that undoes it.
_INVERTIBLE = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.permute", "aten.transpose",
               "aten.t", "aten.clone", "aten.contiguous"}


def _lowered_copies(joint: fx.GraphModule) -> dict[fx.Node, tuple[fx.Node, fx.Node, list[fx.Node]]]:
    """Activations whose columnwise FP8 copy (a linear's input, for wgrad) the FP8 lowering
    makes in the forward or leaves to the min-cut: the copy's data and scale, and the shape-only
    ops from the activation to the quantized 2-D input."""
    out = {}
    for q in joint.graph.nodes:
        if op_name(q) != "graphpass.quantize" or is_backward(q) or len(q.args) != 4:
            continue  # a grouped quantize (token-group offsets) has per-group scales: not reused
        x, recipe, role, usage = q.args
        if (role != "input" or usage == "rowwise" or tensor_val(x) is None or tensor_val(x).dim() != 2
                or partition_side(q) is Side.MUST_BE_IN_BACKWARD):  # save_original="always"
            continue
        first = 2 if usage == "both" else 0
        items = {u.args[1]: u for u in q.users if u.target is operator.getitem}
        if first not in items or first + 1 not in items:
            continue
        path, node = [], x
        while node.op == "call_function" and op_name(node) in _INVERTIBLE:
            if not all(isinstance(d, int) for d in tensor_val(node.args[0]).shape):
                break
            path.append(node)
            node = node.args[0]
        else:
            out.setdefault(node, (items[first], items[first + 1], path))
            continue
    return out


def _reuse(graph: fx.Graph, node: fx.Node, data: fx.Node, scale: fx.Node,
           path: list[fx.Node]) -> fx.Node:
    """The lowering's columnwise FP8 copy of ``node`` (through ``path``) as its cached value:
    dequantized in the backward and the shape-only ops undone."""
    val = tensor_val(node)
    recipe = facts(data).quantized.recipe
    shown = recipes.get_recipe(recipe).quantization_key
    cached = Cached(source=node, dtype=str(val.dtype).removeprefix("torch."),
                    fmt=f"the fp8 lowering's columnwise {shown} copy")
    record(data, cached=cached)
    record(scale, cached=cached)
    with graph.inserting_after(scale):
        value = _call(graph, CACHE_DEQUANTIZE_COPY, (data, scale, recipe, val.dtype), like=node)
    last = value
    for op in path:  # from the quantized input back to ``node``
        shape = list(tensor_val(op.args[0]).shape)
        name = op_name(op)
        if name in ("aten.view", "aten.reshape", "aten._unsafe_view"):
            step = (torch.ops.aten.reshape.default, (value, shape))
        elif name == "aten.permute":
            dims = list(op.args[1])
            step = (torch.ops.aten.permute.default, (value, sorted(range(len(dims)), key=dims.__getitem__)))
        elif name == "aten.transpose":
            step = (torch.ops.aten.transpose.int, (value, *op.args[1:3]))
        elif name == "aten.t":
            step = (torch.ops.aten.t.default, (value,))
        else:  # clone, contiguous: the same values
            continue
        with graph.inserting_after(last):
            value = last = _call(graph, step[0], step[1], like=node)
    _pin_chain(value, data)
    return value


def _pin_chain(value: fx.Node, data: fx.Node) -> None:
    """Pin the dequantize and the ops undoing the shape in the backward."""
    todo = [value]
    while todo:
        node = todo.pop()
        if node is data or node.op != "call_function" or node.target is operator.getitem:
            continue
        set_partition_side(node, Side.MUST_BE_IN_BACKWARD)
        todo += node.all_input_nodes


def _call(graph: fx.Graph, target, args: tuple, *, like: fx.Node) -> fx.Node:
    """A new node with fake-tensor metadata and ``like``'s module."""
    node = graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    if target is operator.getitem:
        node.meta["val"] = vals[0][vals[1]]
    else:
        fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
        with fake_mode or contextlib.nullcontext():
            node.meta["val"] = target(*vals)
    set_partition_side(node, Side.FORWARD)
    for key in ("nn_module_stack", "seq_nr", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    copy_checkpoint_tags(like, node)
    return node


def _read_in_backward(graph: fx.Graph, cached: dict[fx.Node, fx.Node], recomputed: set[fx.Node],
                      plan: Plan) -> None:
    """Point every backward reader of a cached value at its dequantized value, copying the exact
    plan's recomputes into the backward where they read one."""
    value: dict[fx.Node, fx.Node] = dict(cached)
    exact_reads: dict[fx.Node, str] = {}

    def in_backward(node: fx.Node, before: fx.Node) -> fx.Node:
        """What the backward reads for the forward node ``node``."""
        if node in value:
            return value[node]
        # the exact plan's recomputes, and views (free) of a cached value
        if node.op != "call_function" or (node not in recomputed and op_name(node) not in VIEWS):
            return node
        args = fx.map_arg((node.args, node.kwargs), lambda a: in_backward(a, before))
        if args == (node.args, node.kwargs):
            return node
        if is_random(node):  # a copy would draw other numbers: torch replays it, exactly
            for a in node.all_input_nodes:
                if in_backward(a, before) is not a:
                    exact_reads.setdefault(a, op_name(node))
            return node
        with graph.inserting_before(before):
            copy = graph.call_function(node.target, *args)
        copy.meta = {k: v for k, v in node.meta.items() if k not in PLACEMENT_KEYS}
        set_partition_side(copy, Side.MUST_BE_IN_BACKWARD)
        value[node] = copy
        return copy

    for user in list(graph.nodes):
        if not is_backward(user):
            continue
        new = fx.map_arg((user.args, user.kwargs),
                         lambda a: a if is_backward(a) else in_backward(a, user))
        if new != (user.args, user.kwargs):
            user.args, user.kwargs = new
    for node, op in exact_reads.items():
        plan.decide(Decision(What.NOT_CACHED, BY, (
            f"{node.name} in {module_path(node) or '<root>'}: the backward's recompute of {op} "
            "(a random op, replayed exactly) reads it exact"), module_path(node), node.name))
