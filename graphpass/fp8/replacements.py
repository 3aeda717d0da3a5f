"""The quantize inlining pass's replacement graphs, traced once per kind of quantize in a graph.

Inductor's ``Match.replace_by_example`` traces the replacement function with ``make_fx`` and
Inductor's decompositions for every match: for the inlined recipe, 20 or so ops through the
proxy, the Python dispatcher and the fake tensors, 30 ms a quantize on the CPU, most of the
pattern pass (2.9 s of the tiny Llama's FP8 step, 72 quantizes). A graph's quantizes repeat per
layer: the same recipe, role, usage and input shape, strides and dtype trace to the same ops.
``tracer`` (its cache one per graph the pass rewrites: ``per_graph``) traces the first of each
kind, keeps a copy of its graph, and gives the next ones that copy with each node's value and
tensor metadata computed again on the match's own fake inputs (one fake op per node, no
tracing), as the trace would have set them: no two inserted nodes share a fake tensor, and the
ops, their arguments and every other metadata field are the trace's. Inputs with symbolic sizes
are traced every time.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
import torch.fx as fx

from .. import _compat

_current: contextvars.ContextVar[dict[Hashable, fx.GraphModule] | None] = contextvars.ContextVar(
    "graphpass_replacements", default=None)


@contextlib.contextmanager
def per_graph() -> Iterator[None]:
    """Share traced replacements among the matches of one pattern pass over one graph."""
    token = _current.set({})
    try:
        yield
    finally:
        _current.reset(token)


def _value_key(value: Any) -> Hashable | None:
    """What of a fake input the trace depends on; None where a size is symbolic (read without
    ``int()``, which would specialize it and guard on it)."""
    if not isinstance(value, torch.Tensor):
        return None
    shape, stride, offset = tuple(value.shape), tuple(value.stride()), value.storage_offset()
    if not all(type(s) is int for s in (*shape, *stride, offset)):
        return None
    return (shape, stride, offset, value.dtype, value.device, value.requires_grad)


def tracer(kind: Hashable) -> Callable[[Callable[..., Any], Sequence[Any]], fx.GraphModule] | None:
    """A ``trace_fn`` for ``Match.replace_by_example`` of a replacement identified by ``kind``
    (the recipe, role and usage), shared within the current ``per_graph``; None outside one
    (Inductor's own tracing)."""
    cache = _current.get()
    try:
        hash(kind)
    except TypeError:
        return None
    if cache is None:
        return None

    def trace(fn: Callable[..., Any], args: Sequence[Any]) -> fx.GraphModule:
        fwd_only = _compat.inductor_pattern_matcher().fwd_only
        keys = [_value_key(a) for a in args]
        if any(k is None for k in keys):
            return fwd_only(fn, args)
        key = (kind, tuple(keys))
        template = cache.get(key)
        if template is None:
            traced = fwd_only(fn, args)
            if all(n.op in _REPLAYED for n in traced.graph.nodes):
                cache[key] = _copy(traced)  # replace_by_example then writes the match's metadata
            return traced
        return _refreshed(_copy(template), args)

    return trace


_REPLAYED = ("placeholder", "call_function", "output")


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm``'s graph, each node's metadata dict copied (``Graph.graph_copy``)."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, graph)


def _refreshed(gm: fx.GraphModule, args: Sequence[Any]) -> fx.GraphModule:
    """``gm`` with every node's ``val`` and ``tensor_meta`` computed from ``args`` (fake
    tensors), as ``make_fx``'s ``set_meta`` sets them."""
    from torch.fx.experimental.proxy_tensor import extract_val

    env: dict[fx.Node, Any] = {}
    placeholders = iter(args)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = next(placeholders)
        elif node.op == "call_function":
            call_args, call_kwargs = fx.map_arg((node.args, node.kwargs), lambda n: env[n])
            value = node.target(*call_args, **call_kwargs)
        else:  # the output (a template has no other op: _REPLAYED)
            continue
        env[node] = value
        if "val" in node.meta:
            node.meta["val"] = extract_val(value, include_real=node.op == "placeholder")
        if "tensor_meta" in node.meta and isinstance(value, torch.Tensor):
            node.meta["tensor_meta"] = _compat.tensor_metadata(value)
    gm.recompile()
    return gm
