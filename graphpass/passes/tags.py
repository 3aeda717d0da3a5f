"""Tagging nodes for torch's min-cut (``meta["recompute"]``) without overriding the user.

The user's own checkpoint regions (``torch.utils.checkpoint``, selective-checkpoint policies)
tag their nodes themselves; every pass and the random-op weighing tag through :func:`tag`, which
keeps the user's policy and says where it did.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..decisions import Decision, What, record
from ..graph.joint import in_user_checkpoint
from ..graph.nodes import is_random, module_path


def random_recomputes(joint: fx.GraphModule) -> list[fx.Node]:
    """Selected nodes whose op draws random numbers (dropout, attention with dropout; not
    dropout-free attention, ``_compat.is_rng_op``). torch recomputes them under an RNG state it
    saves for each, on CPU a 5 KB generator state, which can outweigh the outputs they discard."""
    return [n for n in joint.graph.nodes
            if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE and is_random(n)
            and user_policy(n) is None]  # the user's own policy is theirs to weigh


def user_policy(node: fx.Node) -> CheckpointPolicy | None:
    """The policy of the user's own checkpoint region a node is in (``torch.utils.checkpoint``
    tags its nodes ``PREFER_RECOMPUTE``, a selective-checkpoint policy with what it returned;
    torch marks both with ``ac_graph_id``), or None outside any."""
    return node.meta.get("recompute") if in_user_checkpoint(node) else None


def tag(node: fx.Node, policy: CheckpointPolicy, decision: Decision | None = None) -> bool:
    """Tag ``node`` for torch's min-cut, unless the user's checkpoint policy says otherwise: the
    user's tags win. False where they did (callers note the conflict)."""
    user = user_policy(node)
    if user is not None:
        return user == policy
    node.meta["recompute"] = policy
    if decision is not None:
        record(node, recompute=decision)
    return True


def overruled_by_user(by: str, nodes: list[fx.Node], wanted: CheckpointPolicy) -> Decision:
    """The decision for nodes where the user's checkpoint policy overrode graphpass's."""
    users = sorted({user_policy(n).name for n in nodes})
    modules = ", ".join(sorted({module_path(n) or "(top level)" for n in nodes}))
    return Decision(What.OVERRULED, by, f"({', '.join(users)}) over {wanted.name} on "
                    f"{len(nodes)} node(s) in {modules}", modules)
