"""Inductor (``torch._inductor``): the partitioner hook (``custom_partitioner_fn``) and partition
step, its compile, config, decompositions and joint-graph passes, the post-grad pattern matcher,
its op tables and lowerings. Inductor's C++ code generation guards are ``inductor_cpp``'s."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.fx as fx


def custom_partitioner_base() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_partition_fn() -> Callable[..., Any]:
    """Inductor's partition step: its joint-graph passes, then ``custom_partitioner_fn``.

    Outside ``compile_fx`` nobody installs Inductor's virtualized fake mode, which its random-op
    joint pass (dropout) reads; install the joint graph's own.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    def partition_fn(gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return compile_fx.partition_fn(gm, joint_inputs, **kwargs)

    return partition_fn


def remove_noop_ops(graph: fx.Graph) -> bool:
    """Inductor's joint-graph removal of no-op ``alias``/``clone``/same-shape views (never one that
    would make a graph output alias an input); True if it removed any. Same call in 2.11-2.15."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops as remove

    before = len(graph.nodes)
    remove(graph)
    return len(graph.nodes) != before


def compile_fx(gm: fx.GraphModule, example_inputs: Any, *, config_patches: dict[str, Any]) -> Any:
    """Inductor's compile, with ``config_patches`` for this compile only."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile

    return inductor_compile(gm, example_inputs, config_patches=config_patches)


def inductor_config() -> Any:
    from torch._inductor import config

    return config


def inductor_decompositions() -> Callable[[], Any]:
    """Inductor's ``select_decomp_table``: AOTAutograd calls it for the table when it needs it."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def control_dependencies() -> tuple[Callable[..., Any], type] | None:
    """Inductor's ordering constraint on a post-grad graph: ``(preserve_node_ordering,
    OrderedSet)`` (``torch._inductor.fx_passes.control_dependencies``: each dependent node wrapped
    in the ``control_deps`` HOP, whose lowering adds scheduler dependencies that its memory
    reorder keeps; torch 2.11, 2.13 and 2.15), None where this torch has none."""
    try:
        from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
        from torch.utils._ordered_set import OrderedSet
    except ImportError:
        return None
    return preserve_node_ordering, OrderedSet


def inductor_pattern_matcher() -> Any:
    """Inductor's pattern matcher module (``PatternMatcherPass``, ``register_graph_pattern``...);
    slow to import, so on first use."""
    from torch._inductor import pattern_matcher

    return pattern_matcher


@functools.lru_cache(maxsize=1)
def inductor_lowering_tables() -> tuple[Any, frozenset[Any], frozenset[Any]]:
    """Inductor's op tables (``torch._inductor.lowering``): the ops it lowers to its own IR, the
    ops it runs as extern fallback kernels, and the ops whose inputs it materializes (GEMMs,
    convolutions, attention). Slow to import, so on first use."""
    from torch._inductor import lowering

    return (lowering.lowerings, frozenset(lowering.fallbacks),
            frozenset(lowering.needs_realized_inputs))


def register_persistent_outputs(op: Any) -> None:
    """Lower ``op`` (an OpOverload) as Inductor's extern fallback kernel whose outputs Inductor
    never reuses: no later buffer is allocated in their memory and no kernel updates them in
    place once the graph stops reading them (``GraphLowering.never_reuse_buffers``, read by the
    wrapper's ``can_reuse``). For an op whose outputs outlive the graph (the weight cache's
    copies). Idempotent."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V
    from torch.utils import _pytree

    if getattr(lowering.lowerings.get(op), "graphpass_persistent", False):
        return
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args: Any, **kwargs: Any) -> Any:
        outputs = fallback(*args, **kwargs)
        for out in _pytree.tree_leaves(outputs):
            if hasattr(out, "get_name"):
                V.graph.never_reuse_buffers.add(out.get_name())
        return outputs

    lowering.register_lowering(op, type_promotion_kind=None)(lower)
    lowering.lowerings[op].graphpass_persistent = True
