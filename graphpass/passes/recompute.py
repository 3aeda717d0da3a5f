"""Output-discarding recompute of the module classes the user names (Megatron's vocabulary).

A selected node is tagged ``MUST_RECOMPUTE``: torch's min-cut then never saves its output and
recomputes it in the backward from whatever it does save (the norm's input, the GEMM's output).
``full`` recomputes whole layers and saves only each chunk's output, as checkpointing does.
"""

from __future__ import annotations

import fnmatch

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..graph.nodes import is_backward, is_random, layer_of, module_path
from ..graph.regions import Regions


def recompute(joint: fx.GraphModule, config: Config, log: list[str]) -> None:
    if not config.recompute:
        return
    regions = Regions(joint)
    selected: dict[fx.Node, str] = {}
    boundaries_overruled: list[fx.Node] = []
    for word in config.recompute:
        nodes = _full(regions, config, boundaries_overruled) if word == "full" else regions.select(word)
        for node in nodes:
            if any(fnmatch.fnmatchcase(module_path(node), p) for p in config.recompute_include):
                selected.setdefault(node, word)
    overruled: dict[str, list[fx.Node]] = {}
    for node, word in selected.items():
        if not tag(node, CheckpointPolicy.MUST_RECOMPUTE, f"recomputed: {word}"):
            overruled.setdefault(word, []).append(node)
    modules: dict[str, set[str]] = {}
    for node, word in selected.items():
        modules.setdefault(word, set()).add(module_path(node))
    for word in config.recompute:
        count = len(modules.get(word, ()))
        log.append(f"recompute {word}: {count} module(s)" + ("" if count else
                   " — nothing in this graph matched"))
        if word in overruled:
            log.append(conflict_note(f"recompute {word}", overruled[word],
                                     CheckpointPolicy.MUST_RECOMPUTE))
    if boundaries_overruled:
        log.append(conflict_note("recompute full (layer-chunk boundaries)", boundaries_overruled,
                                 CheckpointPolicy.MUST_SAVE))


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
    return node.meta.get("recompute") if "ac_graph_id" in node.meta else None


def tag(node: fx.Node, policy: CheckpointPolicy, reason: str = "") -> bool:
    """Tag ``node`` for torch's min-cut, unless the user's checkpoint policy says otherwise: the
    user's tags win. False where they did (callers note the conflict)."""
    user = user_policy(node)
    if user is not None:
        return user == policy
    node.meta["recompute"] = policy
    if reason:
        node.meta["graphpass_recompute"] = reason
    return True


def conflict_note(source: str, nodes: list[fx.Node], wanted: CheckpointPolicy) -> str:
    """The report note for nodes where the user's checkpoint policy overrode graphpass's."""
    users = sorted({user_policy(n).name for n in nodes})
    modules = sorted({module_path(n) or "(top level)" for n in nodes})
    return (f"{source}: kept your checkpoint policy ({', '.join(users)}) over {wanted.name} on "
            f"{len(nodes)} node(s) in {', '.join(modules)}")


def _full(regions: Regions, config: Config, overruled: list[fx.Node]) -> set[fx.Node]:
    """Whole layers, chunked as Megatron's recompute_method; chunk outputs are saved."""
    layers = regions.layers()
    n = config.recompute_num_layers
    if config.recompute_method == "block":
        chunks = [layers[:n]]
    else:
        chunks = [layers[i:i + n] for i in range(0, len(layers), n)]
    selected = set()
    for chunk in chunks:
        members = {node for node in regions.nodes if layer_of(module_path(node)) in chunk}
        for node in members:
            read_outside = [u for u in node.users if u not in members and not is_backward(u)]
            if read_outside:  # the next layer or the model output reads it: the checkpoint boundary
                if not tag(node, CheckpointPolicy.MUST_SAVE,
                           "saved: layer-chunk boundary (full recompute)"):
                    overruled.append(node)
            else:
                selected.add(node)
    return selected
