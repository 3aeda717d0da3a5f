"""A GPU backward's FP8 GEMMs in the graph's order, each operand's FP8 copy made just before its
GEMM: ``order_backward`` on CUDA.

Inductor's scheduler fuses the quantizes of a backward's FP8 GEMM operands that read the same
buffers into one kernel, wherever their GEMMs run: on a Llama-3-8B layer (seq 8192, FP8
tensorwise) the SwiGLU backward's kernel writes five 112 MiB FP8 copies at once (both copies of
the gate's and the up projection's input gradients, the SwiGLU output's transposed copy) while
its three 224 MiB inputs are live, and the weight-gradient GEMMs that read them run after the
attention backward. Its memory reorder (``reorder_for_peak_memory``) does not undo that, and did
not keep the nodes ``graph/backward_order.py`` moves (an H200 measured the same peak with and
without them).

:func:`order_gemm_operands` says the order in a way Inductor keeps: each FP8 GEMM operand that the
backward makes (the ``prims.inductor_force_stride_order`` that realizes an inlined quantize's
copy, ``fp8/inductor.py``, or one ``realize_op_operands`` gives an op's operand) depends on the
GEMM before it in the graph's order, through torch's
``control_deps`` (``torch._inductor.fx_passes.control_dependencies``: the scheduler and its
memory reorder honour it). A quantize's copy is then written after the GEMM before its own, so
no copy waits for a GEMM far ahead, and copies for different GEMMs are not fused into one
kernel. With the gradients' quantizes reading a stored gradient (``fp8/inductor.py``,
``stored_gradients``), each gradient's bf16 inputs die at the kernel that makes it, where
Inductor writes the gradients into their dying buffers, as it does for bf16.

The step-peak model reads the partitioned graphs, before the inlining: there the copies are the
quantize ops' outputs, and ``planned_order`` gives it the same order (``operand_quantizes``),
which ``graph/inductor_reorder.py`` keeps in its model of Inductor's reorder.

Only the order of kernels changes: every op, argument and value is the same, so the gradients are
the same bits with and without it (a stored bf16 gradient holds what the fused kernel rounds to
bf16 in registers: ``emulate_precision_casts``). What it costs is bandwidth: the copies of two
GEMMs' operands that read the same inputs read them once each, and a stored gradient is written
and read once more (Inductor's byte estimate of the Llama layer's kernels: 9.72 GB against 11.68,
``benchmarks/cuda_peak.py --kernel-bytes``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
import torch.fx as fx

from .. import _compat
from ..graph.nodes import producer, viewed
from . import ops

_GEMMS = (torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_grouped_mm.default)
_OPERANDS = 2  # mat1/mat_a and mat2/mat_b: the data operands of both torch GEMMs


def _force_stride_order() -> object:
    """``prims.inductor_force_stride_order``, which Inductor registers when it is imported (it
    is, wherever a post-grad graph exists)."""
    op = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return getattr(op, "default", None)


def is_gemm(node: fx.Node) -> bool:
    """Whether ``node`` runs an FP8 GEMM: torch's (an inlined ``graphpass::fp8_gemm``) or the
    op itself (TE's, the reference provider's, one whose code does not trace)."""
    return node.op == "call_function" and (node.target in _GEMMS or node.target is ops.FP8_GEMM)


def _data_operands(gemm: fx.Node) -> tuple:
    """``gemm``'s FP8 data operands: torch's GEMMs' first two arguments, the op's ``a`` and
    ``b``."""
    if gemm.target is ops.FP8_GEMM:
        return gemm.args[0], gemm.args[2]
    return gemm.args[:_OPERANDS]


def operand_copies(gemm: fx.Node) -> list[fx.Node]:
    """The nodes that realize ``gemm``'s FP8 data operands in the graph (through views): the
    ``inductor_force_stride_order`` of an inlined GEMM's operand, or of an op's
    (``realize_op_operands``)."""
    force_stride_order = _force_stride_order()
    out = []
    for arg in map(viewed, _data_operands(gemm)):
        if isinstance(arg, fx.Node) and arg.target is force_stride_order and arg not in out:
            out.append(arg)
    return out


def operand_quantizes(gemm: fx.Node) -> list[fx.Node]:
    """The ``graphpass::quantize`` nodes whose outputs are the FP8 data operands of ``gemm`` (a
    ``graphpass::fp8_gemm`` of a partitioned graph, before the inlining): where the backward
    makes the copies that ``operand_copies`` realizes after it."""
    if gemm.target is not ops.FP8_GEMM:
        return []
    out = []
    for arg in map(viewed, _data_operands(gemm)):
        op = producer(arg) if isinstance(arg, fx.Node) else None
        if op is not None and op.target is ops.QUANTIZE and op not in out:
            out.append(op)
    return out


def is_backward(graph: fx.Graph) -> bool:
    """Whether ``graph`` is a backward: AOTAutograd names its output gradients ``tangents_*``."""
    return any(p.name.startswith("tangents") for p in graph.find_nodes(op="placeholder"))


def operand_order(graph: fx.Graph, copies: Callable[[fx.Node], list[fx.Node]]
                  ) -> dict[fx.Node, fx.Node]:
    """Each FP8 GEMM operand copy of ``graph`` (``copies(gemm)``) that no earlier FP8 GEMM reads,
    with the FP8 GEMM before its own in the graph's order."""
    gemms = [n for n in graph.nodes if is_gemm(n)]
    after: dict[fx.Node, fx.Node] = {}
    done: set[fx.Node] = set()
    for before, gemm in zip(gemms, gemms[1:]):
        done.update(copies(before))
        for copy in copies(gemm):
            if copy not in done:
                after[copy] = before
                done.add(copy)
    return after


def realize_op_operands(graph: fx.Graph) -> int:
    """Give each computed FP8 data operand of a ``graphpass::fp8_gemm`` op of ``graph`` (TE's,
    cuBLASLt's blockwise GEMM, one whose code does not trace) an ``inductor_force_stride_order``
    of its own strides, where the op reads the copy an inlined quantize computes: the point
    where Inductor realizes it, which ``order_gemm_operands`` can then order. The op takes its
    inputs in a fixed stride order already (a custom op's), so the strides and values are the
    same. How many it added."""
    force_stride_order = _force_stride_order()
    added = 0
    for gemm in graph.find_nodes(op="call_function", target=ops.FP8_GEMM):
        for index in (0, 2):
            arg = gemm.args[index]
            val = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if not isinstance(val, torch.Tensor) or arg.op == "placeholder" \
                    or arg.target is force_stride_order:
                continue
            with graph.inserting_before(gemm):
                held = graph.call_function(force_stride_order, (arg, list(val.stride())))
            held.meta = {**arg.meta, "val": _like(val)}
            gemm.update_arg(index, held)
            added += 1
    return added


def _like(val: torch.Tensor) -> torch.Tensor:
    """A fake tensor of ``val``'s size, strides, dtype and device, a storage of its own (no two
    nodes share one, which Inductor's alias analysis would read as the same buffer)."""
    mode = getattr(val, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


def order_gemm_operands(graph: fx.Graph) -> dict[str, str]:
    """In a backward ``graph`` (``is_backward``), make each FP8 GEMM operand copy
    (``operand_copies``) depend on the FP8 GEMM before its own in the graph's order (a copy an
    earlier GEMM reads too stays where it is): ``{copy: the GEMM it now follows}``, by node
    name. Nothing in a forward, nor where ``graph`` has fewer than two FP8 GEMMs."""
    deps_cls = _compat.control_dependencies()
    if deps_cls is None or not is_backward(graph):
        return {}
    preserve_node_ordering, ordered_set = deps_cls
    realize_op_operands(graph)
    after = operand_order(graph, operand_copies)
    if after:
        preserve_node_ordering(graph, {copy: ordered_set([gemm]) for copy, gemm in after.items()})
    return {copy.name: gemm.name for copy, gemm in after.items()}


_ORDERED: contextvars.ContextVar[bool] = contextvars.ContextVar("graphpass_gemm_order",
                                                               default=False)


@contextlib.contextmanager
def ordered_gemms(on: bool = True) -> Iterator[None]:
    """Within it (``on``), the step-peak model runs a GPU backward's quantizes as
    ``order_gemm_operands`` orders them (``planned_order``): the graphs are compiled with
    ``order_backward``."""
    token = _ORDERED.set(on)
    try:
        yield
    finally:
        _ORDERED.reset(token)


def planned_order(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """For the step-peak model of a partitioned graph compiled for a GPU: within
    ``ordered_gemms``, each quantize of a backward that makes an FP8 GEMM's operand no earlier
    GEMM reads (``operand_quantizes``), with the FP8 GEMM it runs after; else nothing."""
    if not _ORDERED.get() or not is_backward(graph):
        return {}
    return operand_order(graph, operand_quantizes)
