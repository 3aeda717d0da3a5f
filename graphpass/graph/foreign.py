"""Other libraries' layers in a compiled model: their ops in a graph, or their modules outside it.

Transformer Engine's modules (``te.Linear``, ``te.LayerNormLinear``, ...) bring their own FP8
recipe, kernels and saved tensors. Under torch.compile a TE module runs either inside the graph,
as TE's custom ops with their own autograd (TE 2.20 registers ``te.Linear``'s forward and
backward as ``transformer_engine_compile::`` ops where torch has opaque constant types: torch
2.15 has them, 2.11 to 2.14 not), or outside it: TE keeps the module's forward from Dynamo
(``no_torch_dynamo``), which breaks the graph there and runs the module eagerly between the
compiled graphs. graphpass lowers neither (its lowering takes torch's linear and matmul ops),
sees nothing inside such an op, and plans the memory of its own graphs only. The report says so,
per module:

* ``left to <library>: <module>: ...``: the library's ops in this graph, not lowered; what they
  return for their backward is saved as any tensor is (the report's rows list it);
* ``outside the graph: <module>: ...``: a module of a known library (Transformer Engine) that the
  compiled frame holds and none of this graph's ops came from.

Any other library's custom ops get the first note too, under their namespace. A model compiled in
several graphs (graph breaks) says ``outside the graph`` of a module only where no graph holds its
ops (``Report.merge``).
"""

from __future__ import annotations

import contextvars
from typing import Iterable

import torch
import torch.fx as fx

from .. import _compat
from ..decisions import Decision, What
from ..paths import nested
from .nodes import module_stack

# Namespaces of torch's own ops (those torch 2.15 registers, and graphpass's): every other op
# overload is a library's.
TORCH_NAMESPACES = frozenset({
    "aten", "prims", "graphpass", "higher_order", "inductor", "inductor_prims", "profiler",
    "rngprims", "debugprims", "debug_mode_ops", "_c10d_functional", "c10d_functional",
    "_c10d_functional_autograd", "c10d", "_dtensor", "fsdp", "symm_mem", "quantized_decomposed",
    "quantized", "_quantized", "quantization", "mkl", "mkldnn", "mkldnn_prepacked", "onednn",
    "sparse", "streams", "mempool", "export", "onnx", "flex_gemm", "flex_lib", "_native",
    "_native_aot", "_test", "_inductor_test"})
# Libraries whose modules the report names where their ops are missing from a graph: module
# prefix of the class, and the library's name.
LIBRARIES = {"transformer_engine": "Transformer Engine"}

# Set by the backend around a compile: the library modules of the frame's models (their paths, as
# graphpass names modules, and their classes), found by ``library_modules``.
frame_library_modules: contextvars.ContextVar[dict[str, type]] = contextvars.ContextVar(
    "graphpass_frame_library_modules", default={})


def library(name: str) -> str | None:
    """The library a namespace or a class's module belongs to, by name, or None."""
    for prefix, label in LIBRARIES.items():
        if name == prefix or name.startswith((prefix + ".", prefix + "_")):
            return label
    return None


def library_modules(models: Iterable[torch.nn.Module]) -> dict[str, type]:
    """The outermost modules of a known library in ``models`` (a ``te.TransformerLayer``, not
    also the ``te.LayerNormMLP`` inside it), by path."""
    found: dict[str, type] = {}
    for model in models:
        for path, module in model.named_modules():
            if library(type(module).__module__) is None:
                continue
            if not any(path.startswith(outer + ".") for outer in found if outer):
                found[path] = type(module)
    return found


def namespace(node: fx.Node) -> str | None:
    """The namespace of a library's op (``transformer_engine_compile``), or None for torch's."""
    target = node.target
    if node.op != "call_function" or not _compat.is_op_overload(target):
        return None
    return None if target.namespace in TORCH_NAMESPACES else target.namespace


def foreign_notes(graphs: Iterable[fx.GraphModule]) -> list[Decision]:
    """The ``left to`` notes of the libraries' ops in ``graphs`` (a partition's forward and
    backward), per library and module, then the ``outside the graph`` notes of the frame's
    library modules none of those ops came from."""
    ops: dict[tuple[str, str], dict[str, None]] = {}  # (library, module): ops, in order
    for gm in graphs:
        for node in gm.graph.nodes:
            ns = namespace(node)
            if ns is None:
                continue
            stack = module_stack(node)
            # the outermost module of the op's library on its stack, else its innermost module
            owner = next((p for p, cls in stack if library(cls.__module__) is not None),
                         stack[-1][0] if stack else "")
            key = (library(ns) or ns, owner)
            ops.setdefault(key, {})[node.target.name()] = None
    notes = [Decision(What.LIBRARY_OPS, lib, f"{', '.join(names)}: its own quantizes, GEMMs "
                      "and saved tensors; graphpass neither lowers nor looks into them", module)
             for (lib, module), names in ops.items()]
    traced = [module for _, module in ops]
    for path, cls in frame_library_modules.get().items():
        if any(nested(module, path) for module in traced):
            continue
        label = library(cls.__module__)
        notes.append(Decision(
            What.OUTSIDE_GRAPH, label,
            f"a {label} module ({cls.__name__}) none of this graph's ops came from: where "
            f"{label} keeps its forward from Dynamo (a graph break), it runs eagerly between the "
            f"compiled graphs with {label}'s own FP8 and saved tensors, outside graphpass's plan "
            "and report", path))
    return notes

