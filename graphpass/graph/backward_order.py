"""The backward graph ordered for memory under Inductor: no kernel waits for a fused reduction.

Inductor fuses reductions of the same sizes that read a common buffer into one kernel (its
horizontal fusion; in a transformer layer, the norms' weight gradients, which all read the
layer's input). Its scheduler runs a fused kernel where its first reduction stood, after
everything its later reductions read (``Scheduler.topological_sort_schedule``), and the kernels
in between that the fused one does not need run after it. In a layer's backward the first of
those reductions (the last norm's weight gradient) comes first and the last (the first norm's)
comes after the attention backward and the q, k and v data gradients, so every weight-gradient
quantize and GEMM in between (the MLP's, o_proj's) runs after the attention backward, keeping its
inputs alive there: at a Llama-3-8B layer in FP8, the MLP's two 224 MiB input gradients at the
q_proj data gradient (``graph/inductor_kernels.py`` models that schedule).

:func:`order_for_memory` moves each such group's reductions to where the group can run anyway:
right after the last buffer any of them reads. A reduction before that point moves down there
with what reads it (the cast of a weight gradient to its dtype), one after it moves up with the
inline elementwise nodes it reads. The fused kernel then runs where it ran, and the kernels that
waited for it run in the graph's order, each beside its data gradient. Only nodes move; no op,
argument or value changes, so gradients are bit-identical; the reductions' inputs live as long
as the fused kernel kept them alive before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .nodes import module_path
from .inductor_kernels import FusedReductions, fused_reductions


@dataclass(frozen=True)
class Moved:
    """One fused reduction group moved beside the last buffer it reads."""

    reductions: tuple[str, ...]
    """The reductions' node names, in the graph's order."""
    modules: tuple[str, ...]
    """Their modules (``norm``, ``layers.0.post_attention_layernorm``), in the same order."""
    after: str
    """The node they now run right after."""
    released: tuple[str, ...]
    """The modules of the kernels that no longer wait for them, in the graph's order."""
    kernels: int
    """How many such kernels."""


def order_for_memory(gm: fx.GraphModule) -> list[Moved]:
    """Move each group of reductions Inductor fuses (``inductor_kernels.fused_reductions``)
    beside the last buffer its reductions read, where other kernels would wait for the group;
    what it moved.
    The graph stays topologically valid (``gm.graph.lint()``) and computes the same values."""
    moved: list[Moved] = []
    for _ in range(len(gm.graph.nodes)):  # one group at a time, the groups read afresh after each
        done = next((m for m in map(_move, fused_reductions(gm)) if m is not None), None)
        if done is None:
            break
        moved.append(done)
    if moved:
        gm.recompile()
    return moved


def _move(group: FusedReductions) -> Moved | None:
    """Move ``group`` beside the last buffer its reductions read, where a kernel between its
    first reduction and that buffer does not feed it (and so would wait for it)."""
    gm_nodes = group.members[0].graph.nodes
    position = {n: i for i, n in enumerate(gm_nodes)}
    members = sorted(group.members, key=position.__getitem__)
    first = members[0]
    anchor = max((b for b in group.reads if b.op == "call_function"), key=position.__getitem__,
                 default=first)
    if position[anchor] < position[first]:
        anchor = first
    move: set[fx.Node] = set()
    for member in members:
        if position[member] < position[anchor]:  # down, with what reads it before the anchor
            move |= _descendants(member, until=position[anchor], position=position)
        else:  # up, with the elementwise nodes it reads after the anchor
            move |= {a for a in _ancestors([member]) | {member} if position[a] > position[anchor]}
    needed = _ancestors(members)
    waiting = [n for n in gm_nodes if position[first] < position[n] < position[anchor]
               and n in group.kernels and n not in needed and n not in move]
    if not waiting:
        return None
    at = anchor
    for node in sorted(move, key=position.__getitem__):
        at.append(node)
        at = node
    first.graph.lint()
    return Moved(
        reductions=tuple(n.name for n in members),
        modules=tuple(module_path(n) or "(top level)" for n in members),
        after=anchor.name,
        released=tuple(dict.fromkeys(module_path(n) or "(top level)" for n in waiting)),
        kernels=len(waiting))


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    """Every node ``nodes`` read, transitively (not themselves, unless one reads another)."""
    seen: set[fx.Node] = set()
    todo = [i for n in nodes for i in n.all_input_nodes]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _descendants(node: fx.Node, *, until: int, position: dict[fx.Node, int]) -> set[fx.Node]:
    """``node`` and what reads it, transitively, up to position ``until``."""
    seen = {node}
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user not in seen and position[user] < until:
                seen.add(user)
                todo.append(user)
    return seen
