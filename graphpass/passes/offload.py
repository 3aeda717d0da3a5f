"""Offload eligibility of every forward tensor, wired into torch's activation offloading.

The policy is opt-out, as Transformer Engine's review settled on: activations are eligible by
default; parameters, quantized weights, FP8 scales and small tensors never are; users opt out by
module path or op. torch's offloader (``enable_activation_offloading``) additionally offloads only
base tensors (no views, no results of multi-output ops, contiguous), so those say so too.

With ``offload_hidden_only`` the eligible tensors the min-cut saves are offloaded only where their
copies hide under compute (``graph/offload_copies.py``: the copy out under the forward after the
tensor's last use, the copy back under the backward before its first, one copy at a time each
way, on an H100's roofline), taken largest first, then longest-lived; the rest stay on the device
and say how long their copies take against the compute they would have had.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.fx as fx

from ..config import Config
from ..decisions import Decision, Plan, What, facts, record
from ..graph.joint import is_tangent, mark_for_offload
from ..graph.nodes import is_backward, module_path, op_name, tensor_bytes
from ..graph.offload_copies import format_seconds
from ..graph.roofline import H100
from ..graph.ops import VIEWS
from ..report import format_bytes
from .partitioner import TrialPartitioner


def offload(joint: fx.GraphModule, plan: Plan, config: Config,
            partitioner: TrialPartitioner) -> None:
    # Every value the forward can compute may be saved: backward nodes too, where they read no
    # tangent, since the min-cut may run them in the forward and save their output (torch 2.14
    # saves a LayerNorm backward's normalized input where 2.13 saves the forward's equal one).
    reads_tangents: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if is_tangent(node) or (
                is_backward(node) and any(i in reads_tangents for i in node.all_input_nodes)):
            reads_tangents.add(node)
            continue
        if node.op not in ("placeholder", "call_function"):
            continue
        reason = why_not_offloaded(node, config, is_parameter=node in plan.parameters)
        what = (What.NOT_OFFLOADED if reason else What.OFFLOAD if config.offload
                else What.OFFLOAD_ELIGIBLE)
        record(node, offload=Decision(what, "offload", reason or "", node=node.name))
        if config.offload and not reason:
            mark_for_offload(node)


def offload_hidden(joint: fx.GraphModule, plan: Plan, config: Config,
                   partitioner: TrialPartitioner) -> None:
    """With ``offload_hidden_only``: keep the offload marks of the saved tensors whose copies
    hide, largest and longest-lived first (runs after the passes that decide what is saved)."""
    if not (config.offload and config.offload_hidden_only):
        return
    windows = partitioner.predict_peak(joint).windows  # every eligible tensor marked
    by_name = {n.name: n for n in joint.graph.nodes}
    saved = [by_name[name] for name in windows.out if name in by_name
             and by_name[name].meta.get("should_offload")]
    saved.sort(key=lambda n: (-_bytes(n), -(windows.out[n.name] + windows.back[n.name]), n.name))
    chosen: list[tuple[str, int]] = []
    stream = config.offload_stream is not False
    for node in saved:
        nbytes = _bytes(node)
        if stream and windows.late([*chosen, (node.name, nbytes)]) <= 0:
            chosen.append((node.name, nbytes))
            continue
        node.meta.pop("should_offload")
        copy = H100.copy(nbytes)
        busy = (": it would hide alone, but the link is busy with larger copies"
                if stream and windows.late([(node.name, nbytes)]) <= 0 else "")
        why = (f"copy not hidden: {format_seconds(copy)} each way, "
               + (f"under {format_seconds(windows.out[node.name])} of forward compute after its "
                  f"last use and {format_seconds(windows.back[node.name])} of backward compute "
                  f"before its first{busy}"
                  if stream else "offload_stream=False copies on the default stream"))
        record(node, offload=Decision(What.NOT_OFFLOADED, "offload", why, node=node.name))


def _bytes(node: fx.Node) -> int:
    return tensor_bytes(node.meta["val"], where=f"offload's size of {node.name}")


def why_not_offloaded(node: fx.Node, config: Config, *, is_parameter: bool) -> str | None:
    val = node.meta.get("val")
    known = facts(node)
    if is_parameter:
        return "parameter"
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if known.quantized is not None and known.quantized.role == "weight":
        return "quantized weight"
    if known.fp8_scale:
        return "FP8 scale"
    nbytes = tensor_bytes(val, where=f"offload's size of {node.name}")
    if nbytes < config.offload_min_bytes:
        return f"{format_bytes(nbytes)} < offload_min_bytes"
    path, op = module_path(node), op_name(node)
    for pattern in config.offload_exclude:
        if fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(op, pattern):
            return f"opted out by {pattern!r}"
    if node.op == "placeholder":
        return "graph input: torch offloads only intermediates"
    if op in VIEWS:
        return "view: torch offloads base tensors only"
    if op == "getitem":
        return "result of a multi-output op: torch's offloader skips getitem"
    if not val.is_contiguous():
        return "non-contiguous"
    return None
