"""Quantize before dispatch: re-gather the routed experts' input in the backward.

A routed MoE layer dispatches its tokens to the experts with a gather of the layer input X
(``index_select``/``index`` by the router's sort or capacity slots), repeating each token
``top_k`` times (DeepSeek-V3: 8, plus capacity slack). The experts' wgrad needs the columnwise
FP8 copy of the *dispatched* tokens, ``top_k`` times the tokens of X; X itself is often saved
anyway (the router's wgrad reads it in high precision). DeepSeek-V3 keeps one FP8 copy of the
layer input for the experts instead of one of the dispatched tokens.

Which copy is bit-exact, per recipe (the wgrad operand is columnwise: its scales run along the
tokens, and the experts' quantize scales each group or expert on its own, fp8/ops.py):

* tensorwise: one scale per expert's tokens; X's FP8 copy has one scale for all of X, so gathering
  it gives other bits;
* blockwise 1x128 / mxfp8 1x32 columnwise: a block is 128 (32) consecutive tokens of one expert;
  in X's copy a block is 128 (32) consecutive tokens of X, other tokens, so other amaxes;
* rowwise columnwise: one scale per column of each expert's tokens; X's copy has one per column
  of all of X.

Only rowwise 1x128 / 1x32 copies (blocks along K, one token row each) commute with a gather of
rows; that is the forward GEMM's operand, which the backward does not read. So no FP8 copy of X
gives the wgrad operand's bits: the exact form is to keep X in its own dtype and re-run the
gather and the columnwise quantize in the backward (both deterministic: the same bits). This pass
finds each columnwise expert-input quantize whose input is such a gather, counts the bytes the
exact plan saves for it (the FP8 copy, or the dispatched tokens) against what re-gathering needs
(X and the indices, nothing where the plan saves them anyway), tags the gather and the quantize
``MUST_RECOMPUTE`` for torch's min-cut where that saves bytes, and keeps the tags only if torch's
min-cut of the tagged graph saves fewer bytes in all. Every candidate gets a note.
"""

from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _compat
from ..config import Config
from ..decisions import FACTS, Decision, Plan, What
from ..graph.joint import Side, partition_side
from ..graph.nodes import is_backward, module_path, op_name, tensor_val
from .partitioner import TrialPartitioner
from .tags import tag, user_policy

BY = "dispatch"
_VIEWS = ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.alias")


def regather(joint: fx.GraphModule, plan: Plan, config: Config,
             partitioner: TrialPartitioner) -> None:
    if config.fp8 is None:
        return
    candidates = [(q, g) for q in _expert_input_quantizes(joint) if (g := _gather(q.args[0]))]
    if not candidates:
        return
    saved, _ = partitioner.saves(joint)
    before = _bytes(saved, plan)
    saved_storages = {_storage(n) for n in saved} - {None}
    undo: dict[fx.Node, tuple[object, object]] = {}
    applied: list[tuple[fx.Node, str]] = []
    for quantize, gather in candidates:
        module = module_path(quantize)
        source, index = gather.args[0], _index(gather)
        if quantize.args[3] != "columnwise":
            # save_original="never" (or a module pattern) merged both usages into one forward op
            # that must be saved: the FP8 copy is what the user asked for
            plan.decide(_not(module, f"{_dispatch(gather)}: save_original='never' saves the "
                                     "dispatched tokens' FP8 copy (quantized in the forward, as "
                                     "Transformer Engine does)"), once=True)
            continue
        kept = _kept(quantize, gather)
        gain = _bytes([n for n in saved if n in kept], plan)
        if not gain:
            plan.decide(_not(module, f"{_dispatch(gather)}: the plan already saves no copy of "
                                     "the dispatched tokens (it re-gathers them)"), once=True)
            continue
        cost = sum(_bytes([n], plan) for n in (source, index)
                   if isinstance(n, fx.Node) and _storage(n) not in saved_storages)
        if cost >= gain:
            plan.decide(_not(module, f"{_dispatch(gather)}: keeping {source.name} and the indices "
                                     f"({cost:,} B) saves no bytes over the dispatched copy "
                                     f"({gain:,} B)"), once=True)
            continue
        conflict = [n for n in kept if user_policy(n) not in (None, CheckpointPolicy.MUST_RECOMPUTE)]
        if conflict:
            tags = ", ".join(f"{n.name} ({user_policy(n).name})" for n in conflict)
            plan.decide(_not(module, f"{_dispatch(gather)}: your checkpoint policy decides "
                                     f"{tags}"), once=True)
            continue
        why = f"dispatch ({_dispatch(gather)}, re-gathered)"
        for node in kept:
            if partition_side(node) is Side.MUST_BE_IN_BACKWARD:
                continue  # save_original="always" put the quantize in the backward already
            undo.setdefault(node, (node.meta.get("recompute"), node.meta.get(FACTS)))
            tag(node, CheckpointPolicy.MUST_RECOMPUTE,
                Decision(What.RECOMPUTED, BY, why, module_path(node), node.name))
        applied.append((quantize, (
            f"{_dispatch(gather)}: re-gathers {source.name} "
            f"{tuple(tensor_val(source).shape)} {str(tensor_val(source).dtype)[6:]} from "
            f"{module_path(source) or '<root>'} in the backward for the wgrad's FP8 copy instead "
            "of saving "
            f"{gain:,} B of the dispatched tokens ({cost:,} B more kept)")))
    if not applied:
        return
    after = _bytes(partitioner.saves(joint).saved, plan)
    if after >= before:
        for node, (policy, known) in undo.items():
            _restore(node, policy, known)
        for quantize, _ in applied:
            plan.decide(_not(module_path(quantize), (
                f"{_dispatch(quantize.args[0])}: torch's min-cut of the re-gathering plan saves "
                f"{after:,} B, not fewer than {before:,} B")), once=True)
        return
    for quantize, why in applied:
        plan.decide(Decision(What.REGATHERED, BY, f"{why}; {before - after:,} B fewer saved in all",
                             module_path(quantize), quantize.name), once=True)


def _expert_input_quantizes(joint: fx.GraphModule) -> list[fx.Node]:
    """Forward quantizes of a grouped GEMM's input for wgrad: a 3-D (bmm experts) or offsets
    (token groups) columnwise quantize, or a ``both`` one (``save_original="never"``)."""
    found = []
    for node in joint.graph.nodes:
        if op_name(node) != "graphpass.quantize" or is_backward(node):
            continue
        x, _, role, usage = node.args[:4]
        grouped = len(node.args) > 4 or (tensor_val(x) is not None and tensor_val(x).dim() == 3)
        if role == "input" and usage in ("columnwise", "both") and grouped:
            found.append(node)
    return found


def _gather(x: fx.Node) -> fx.Node | None:
    """The dispatch ``x`` is (through views): a gather of rows, ``index_select(X, 0, i)`` or
    ``X[i]``, of a forward tensor X; else None."""
    while op_name(x) in _VIEWS:
        x = x.args[0]
    name = op_name(x)
    if name == "aten.index_select" and x.args[1] == 0:
        return x
    if name == "aten.index" and len(x.args[1]) == 1 and isinstance(x.args[1][0], fx.Node):
        return x
    return None


def _index(gather: fx.Node) -> fx.Node:
    return gather.args[2] if op_name(gather) == "aten.index_select" else gather.args[1][0]


def _dispatch(node: fx.Node) -> str:
    gather = node if op_name(node) in ("aten.index_select", "aten.index") else _gather(node)
    return f"{op_name(gather)} of {gather.args[0].name}" if gather is not None else node.name


def _kept(quantize: fx.Node, gather: fx.Node) -> list[fx.Node]:
    """The nodes re-run in the backward: the gather, the views to the quantize, the quantize and
    its outputs."""
    chain, x = [], quantize.args[0]
    while x is not gather:
        chain.append(x)
        x = x.args[0]
    outputs = [u for u in quantize.users if u.target is operator.getitem]
    return [gather, *reversed(chain), quantize, *outputs]


def _storage(node: fx.Node) -> int | None:
    val = tensor_val(node)
    return _compat.storage_id(val) if val is not None else None


def _bytes(nodes: list[fx.Node], plan: Plan) -> int:
    """Bytes of ``nodes``' values, once per storage, parameters apart (as the report counts)."""
    params = {_storage(p) for p in plan.parameters}
    seen, total = set(), 0
    for node in nodes:
        val, sid = tensor_val(node), _storage(node)
        if val is None or sid is None or sid in params or sid in seen:
            continue
        seen.add(sid)
        total += _compat.size_hint(val.untyped_storage().nbytes(),
                                   where=f"the bytes of {node.name}")
    return total


def _restore(node: fx.Node, policy: object, known: object) -> None:
    if policy is None:
        node.meta.pop("recompute", None)
    else:
        node.meta["recompute"] = policy
    if known is None:
        node.meta.pop(FACTS, None)
    else:
        node.meta[FACTS] = known


def _not(module: str, why: str) -> Decision:
    return Decision(What.NOT_REGATHERED, BY, why, module)

