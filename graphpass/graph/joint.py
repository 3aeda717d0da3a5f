"""The vocabulary of AOTAutograd's joint graph and of the forward and backward graphs torch's
partitioner makes from it: which side of the partition a node is on (``Side``), the forward's
inputs (primals) and the backward's (tangents), the user's checkpoint regions, and the markers
and nodes of torch's activation offloading.

These are the names torch's partitioner reads and writes in node metadata (``partitioner_tag``,
``recompute``, ``ac_graph_id``, ``should_offload``) and in node names (``tangents_N``,
``cpu_offload_<name>``); every other module asks here, never by the strings.
"""

from __future__ import annotations

import enum
from typing import Any

import torch
import torch.fx as fx


# -- the side of the partition ----------------------------------------------------------------

class Side(enum.Enum):
    """The side of the partition AOTAutograd's joint graph puts a node on
    (``meta["partitioner_tag"]``, read by torch's partitioner); the value is torch's tag."""

    FORWARD = "is_forward"
    BACKWARD = "is_backward"
    MUST_BE_IN_BACKWARD = "must_be_in_backward"
    """Pinned in the backward: computed there, never saved from the forward."""
    MUST_BE_IN_FORWARD = "must_be_in_forward"


_SIDE_KEY = "partitioner_tag"
_SIDES = {side.value: side for side in Side}  # read on every walk of a graph: a dict, not Side()
# The metadata that places a node: its side, and its checkpoint region with its policy. A copy of
# a node on another side leaves them out.
PLACEMENT_KEYS = ("recompute", _SIDE_KEY, "ac_graph_id")


def partition_side(node: fx.Node) -> Side | None:
    """The side of the partition the joint graph puts ``node`` on; None if untagged (or tagged
    with a value torch's partitioner does not know). The partitioner copies the tag with the
    node, so a forward node it recomputes in the backward keeps ``Side.FORWARD``."""
    return _SIDES.get(node.meta.get(_SIDE_KEY))


def set_partition_side(node: fx.Node, side: Side) -> None:
    """Put ``node`` on ``side``."""
    if not isinstance(side, Side):
        raise TypeError(f"set_partition_side takes a Side, not {side!r}")
    node.meta[_SIDE_KEY] = side.value


# -- the joint graph's inputs -----------------------------------------------------------------

def is_tangent(node: fx.Node) -> bool:
    """A backward input of an AOTAutograd joint graph (a gradient), which it names
    ``tangents_N``."""
    return node.op == "placeholder" and "tangents" in node.name


def primals(joint: fx.GraphModule) -> list[fx.Node]:
    """The forward inputs of an AOTAutograd joint graph: its placeholders but the tangents."""
    return [n for n in joint.graph.find_nodes(op="placeholder") if not is_tangent(n)]


# The meta keys of the primals of a weight FSDP2 all-gathered in FP8: its scale, its data.
FSDP_FP8_SCALE = "graphpass_fsdp_fp8_scale"
FSDP_FP8_DATA = "graphpass_fsdp_fp8_data"
# ...and on a data primal whose scales are gathered beside it (blockwise's 128x128 tiles):
# the scales' shape
FSDP_FP8_BLOCK_SCALES = "graphpass_fsdp_fp8_block_scales"


def is_fsdp_fp8_scale(node: fx.Node) -> bool:
    """The scale of a weight FSDP2 all-gathered in FP8 (``fp8/fsdp.py``): the second input of
    ``graphpass::fsdp_fp8_weight``, or marked so by ``passes/fsdp_fp8_weights.py``."""
    return bool(node.meta.get(FSDP_FP8_SCALE)) or any(
        str(u.target) == "graphpass.fsdp_fp8_weight.default" and u.args[1] is node
        for u in node.users)


def gradients(joint: fx.GraphModule) -> dict[fx.Node, Any]:
    """Each primal's gradient output. The joint graph returns one gradient per input, last; a
    weight FSDP2 all-gathers in FP8 is two primals (its FP8 data and its scale, a tensor
    subclass flattened) with one plain gradient, the weight's: the data's."""
    inputs = [p for p in primals(joint) if not is_fsdp_fp8_scale(p)]
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    return dict(zip(inputs, outputs[len(outputs) - len(inputs):]))


def _input_descriptors(primals: list[fx.Node]) -> list[Any] | None:
    """Each primal's input descriptor walked down to the input it came from (through a tensor
    subclass's attributes: from torch 2.13 a DTensor input becomes two primals, its
    ``_local_tensor`` and its ``device_mesh``, each a ``SubclassGetAttrAOTInput`` over the
    ``PlainAOTInput(idx)`` of the DTensor). None where nothing was flattened (no subclass
    descriptors: torch 2.11, or no subclass input): the primals are the inputs then."""
    descs = [n.meta.get("desc") for n in primals]
    if not all(descs) or not any(getattr(d, "base", None) is not None for d in descs):
        return None
    walked = []
    for desc in descs:
        while getattr(desc, "base", None) is not None:
            desc = desc.base
        walked.append(desc)
    return walked


def primal_input_indices(primals: list[fx.Node]) -> list[int | None]:
    """For each primal, the index of the AOTAutograd input (dynamo's graph input) it comes
    from: a DTensor's local shard and mesh both map to the DTensor's input."""
    descs = _input_descriptors(primals)
    if descs is None:
        return list(range(len(primals)))
    return [getattr(desc, "idx", None) for desc in descs]


def static_primal_positions(primals: list[fx.Node], static: list[int]) -> list[int]:
    """Positions among the joint graph's primals of the inputs torch calls static (parameters,
    buffers). ``static`` counts AOTAutograd's inputs before tensor subclasses are flattened
    (``_input_descriptors``), so from torch 2.13 the positions of a graph with DTensor inputs
    shift."""
    descs = _input_descriptors(primals)
    if descs is None:
        return [i for i in static if i < len(primals)]  # nothing flattened: positions as given
    wanted = set(static)
    positions = []
    for pos, desc in enumerate(descs):
        idx = getattr(desc, "idx", None)
        if idx is not None and idx in wanted:
            positions.append(pos)
        elif idx is None and type(desc).__name__ in ("ParamAOTInput", "BufferAOTInput"):
            positions.append(pos)
    return positions


# -- the user's checkpoint regions ------------------------------------------------------------

def in_user_checkpoint(node: fx.Node) -> bool:
    """Inside the user's own checkpoint region (``torch.utils.checkpoint``, a selective-checkpoint
    policy): torch marks its nodes with ``meta["ac_graph_id"]`` beside their ``recompute`` tag."""
    return "ac_graph_id" in node.meta


def copy_checkpoint_tags(source: fx.Node, to: fx.Node) -> None:
    """Put ``to`` in ``source``'s checkpoint region, with its policy, if it is in one."""
    for key in ("recompute", "ac_graph_id"):
        if key in source.meta:
            to.meta[key] = source.meta[key]


# -- torch's activation offloading ------------------------------------------------------------

def mark_for_offload(node: fx.Node) -> None:
    """Ask torch's activation offloading (``enable_activation_offloading``) to offload the node's
    output if it is saved."""
    node.meta["should_offload"] = True


def offloaded_source(node: fx.Node) -> fx.Node | None:
    """The tensor a node of torch's activation offloading moves to the host, or None for any
    other node. The node is ``cpu_offload_<name>``: a ``prims.device_put`` to the host (torch
    2.11, and every version without the separate stream), or on 2.13's separate stream the
    ``ao.wait_tensor`` of an ``ao.offload``."""
    if not node.name.startswith("cpu_offload_") or node.op != "call_function":
        return None
    if node.target is torch.ops.prims.device_put.default:
        return node.args[0]
    issue = offload_issue(node)
    return issue.args[0] if issue is not node else None


def offload_issue(node: fx.Node) -> fx.Node:
    """Where the copy of an offloaded tensor (``offloaded_source(node)`` is not None) starts:
    ``node`` itself (a ``device_put``), or the ``ao.offload`` its ``ao.wait_tensor`` waits for."""
    if _target_name(node) == "ao.wait_tensor.default" and isinstance(node.args[0], fx.Node) \
            and _target_name(node.args[0]) == "ao.offload.default":
        return node.args[0]
    return node


def reload_of(offloaded: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """For a backward input that torch's offloading reloads (a ``cpu_offload_<name>``
    placeholder): the node that starts the copy back (a ``device_put``, or 2.13's
    ``ao.reload``) and the node whose value the backward reads (the ``device_put`` itself, or
    the ``ao.wait_tensor`` of the ``ao.reload``); None for any other node."""
    for user in offloaded.users:
        if user.target is torch.ops.prims.device_put.default:
            return user, user
        if _target_name(user) == "ao.reload.default":
            wait = next((u for u in user.users if _target_name(u) == "ao.wait_tensor.default"), user)
            return user, wait
    return None


def is_offload_machinery(node: fx.Node) -> bool:
    """A node of torch's activation offloading that computes nothing on the device: a copy, a
    wait, or a stream/event op of its separate-stream mode."""
    name = _target_name(node)
    return (node.target is torch.ops.prims.device_put.default
            or name.startswith(("streams.", "ao.offload", "ao.reload", "ao.wait_tensor")))


def _target_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else ""
