"""Output-discarding recompute of the module classes the user names (Megatron's vocabulary).

A selected node is tagged ``MUST_RECOMPUTE``: torch's min-cut then never saves its output and
recomputes it in the backward from whatever it does save (the norm's input, the GEMM's output).
``full`` recomputes whole layers and saves only each chunk's output, as checkpointing does.
"""

from __future__ import annotations

import fnmatch
import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import Decision, Plan, What
from ..graph.nodes import is_backward, module_path
from ..graph.regions import Regions
from ..paths import layer_of
from .partitioner import TrialPartitioner
from .tags import overruled_by_user, tag, user_policy


def recompute(joint: fx.GraphModule, plan: Plan, config: Config,
              partitioner: TrialPartitioner) -> None:
    if not config.recompute:
        return
    regions = Regions(joint)
    selected: dict[fx.Node, str] = {}
    boundaries_overruled: list[fx.Node] = []
    for word in config.recompute:
        nodes = _full(regions, config, boundaries_overruled) if word == "full" else regions.select(word)
        plan.count("recompute", word, len(nodes))
        for node in nodes:
            matched = [p for p in config.recompute_include if fnmatch.fnmatchcase(module_path(node), p)]
            for pattern in matched:
                plan.count("recompute_include", pattern, 1)
            if matched:
                selected.setdefault(node, word)
    _whole_ops(selected)
    overruled: dict[str, list[fx.Node]] = {}
    for node, word in selected.items():
        if not tag(node, CheckpointPolicy.MUST_RECOMPUTE,
                   Decision(What.RECOMPUTED, f"recompute {word}", word, module_path(node), node.name)):
            overruled.setdefault(word, []).append(node)
    modules: dict[str, set[str]] = {}
    for node, word in selected.items():
        modules.setdefault(word, set()).add(module_path(node))
    for word in config.recompute:
        count = len(modules.get(word, ()))
        plan.decide(Decision(What.SELECTED, f"recompute {word}", f"{count} module(s)" + (
            "" if count else " — nothing in this graph matched")))
        if word in overruled:
            plan.decide(overruled_by_user(f"recompute {word}", overruled[word],
                                          CheckpointPolicy.MUST_RECOMPUTE))
    if boundaries_overruled:
        plan.decide(overruled_by_user("recompute full (layer-chunk boundaries)",
                                      boundaries_overruled, CheckpointPolicy.MUST_SAVE))


def _whole_ops(selected: dict[fx.Node, str]) -> None:
    """A selected output of a multi-output op another pass tagged must-save (a quantize of both
    usages: ``save_original="never"``, ``fp8_save_quantized_weight``) takes the op with it: torch's min-cut
    recomputes an op's outputs together or not at all and cannot save the tuple itself, so the
    two tags would leave it no partition. The selections take such quantizes whole already
    (``Regions._complete``); this keeps any selection in agreement with the op's tag."""
    for node, word in list(selected.items()):
        op = node.args[0] if node.target is operator.getitem else None
        if (isinstance(op, fx.Node) and op not in selected and user_policy(op) is None
                and op.meta.get("recompute") == CheckpointPolicy.MUST_SAVE):
            selected[op] = word


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
                if not tag(node, CheckpointPolicy.MUST_SAVE, Decision(
                        What.SAVED, "recompute full", "layer-chunk boundary (full recompute)",
                        module_path(node), node.name)):
                    overruled.append(node)
            else:
                selected.add(node)
    return selected
