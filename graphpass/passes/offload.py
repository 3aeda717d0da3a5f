"""Offload eligibility of every forward tensor, wired into torch's activation offloading.

The policy is opt-out, as Transformer Engine's review settled on: activations are eligible by
default; parameters, quantized weights, FP8 scales and small tensors never are; users opt out by
module path or op. torch's offloader (``enable_activation_offloading``) additionally offloads only
base tensors (no views, no results of multi-output ops, contiguous), so those say so too.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.fx as fx

from .._compat import size_hint
from ..config import Config
from ..graph.nodes import VIEWS, is_backward, module_path, op_name
from ..report import format_bytes



def offload(joint: fx.GraphModule, config: Config, log: list[str]) -> None:
    static = {n for n in joint.graph.find_nodes(op="placeholder") if n.meta.get("graphpass_static")}
    # Every value the forward can compute may be saved: backward nodes too, where they read no
    # tangent, since the min-cut may run them in the forward and save their output (torch 2.14
    # saves a LayerNorm backward's normalized input where 2.13 saves the forward's equal one).
    reads_tangents: set[fx.Node] = set()
    for node in joint.graph.nodes:
        if (node.op == "placeholder" and "tangents" in node.name) or (
                is_backward(node) and any(i in reads_tangents for i in node.all_input_nodes)):
            reads_tangents.add(node)
            continue
        if node.op not in ("placeholder", "call_function"):
            continue
        reason = why_not_offloaded(node, config, is_parameter=node in static)
        node.meta["graphpass_offload"] = f"offload: no ({reason})" if reason else (
            "offload: yes" if config.offload else "offload: eligible")
        if config.offload and not reason:
            node.meta["should_offload"] = True


def why_not_offloaded(node: fx.Node, config: Config, *, is_parameter: bool) -> str | None:
    val = node.meta.get("val")
    fp8 = node.meta.get("graphpass_fp8", {})
    if is_parameter:
        return "parameter"
    if not isinstance(val, torch.Tensor):
        return "not a tensor"
    if fp8.get("role") == "weight":
        return "quantized weight"
    if node.meta.get("graphpass_kind") == "fp8_scale":
        return "FP8 scale"
    nbytes = size_hint(val.numel(), where=f"offload's size of {node.name}") * val.element_size()
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
