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
    for word in config.recompute:
        nodes = _full(regions, config) if word == "full" else regions.select(word)
        for node in nodes:
            if any(fnmatch.fnmatchcase(module_path(node), p) for p in config.recompute_include):
                selected.setdefault(node, word)
    for node, word in selected.items():
        tag(node, CheckpointPolicy.MUST_RECOMPUTE, f"recomputed: {word}")
    modules: dict[str, set[str]] = {}
    for node, word in selected.items():
        modules.setdefault(word, set()).add(module_path(node))
    for word in config.recompute:
        count = len(modules.get(word, ()))
        log.append(f"recompute {word}: {count} module(s)" + ("" if count else
                   " — nothing in this graph matched"))


def random_recomputes(joint: fx.GraphModule) -> list[fx.Node]:
    """Selected nodes whose op torch treats as random (``nondeterministic_seeded``: dropout, and
    attention even without it). torch recomputes them under an RNG state it saves for each, on
    CPU a 5 KB generator state, which can outweigh the outputs they discard."""
    return [n for n in joint.graph.nodes
            if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE and is_random(n)]


def tag(node: fx.Node, policy: CheckpointPolicy, reason: str = "") -> None:
    node.meta["recompute"] = policy
    if reason:
        node.meta["graphpass_recompute"] = reason


def _full(regions: Regions, config: Config) -> set[fx.Node]:
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
                tag(node, CheckpointPolicy.MUST_SAVE, "saved: layer-chunk boundary (full recompute)")
            else:
                selected.add(node)
    return selected
