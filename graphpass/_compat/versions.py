"""Version shims: where torch 2.11, 2.13 and 2.15 differ, one function or constant per difference,
each saying which versions do what (size hints, FLOP formulas, random ops, Inductor's rounding
and realization rules, the CUDA build).

Version checks (``TORCH_VERSION``) and feature probes (``hasattr``) live here, so that a
difference upstream is handled in one place and read by name everywhere else.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

TORCH_VERSION_STR = torch.__version__.split("+")[0]
TORCH_VERSION = tuple(int(p) for p in TORCH_VERSION_STR.split(".")[:2])

# The size assumed for an unbacked symbol (a data-dependent size: nonzero, .item()).
UNBACKED_SIZE_HINT = 4096
# What size_hint assumed while recording: {symbol: [where, ...]} (see ``assumed_sizes``).
_assumed: contextvars.ContextVar[dict[str, list[str]] | None] = contextvars.ContextVar(
    "graphpass_assumed_sizes", default=None)


def size_hint(expr: Any, fallback: int = UNBACKED_SIZE_HINT, *, where: str = "") -> int:
    """A concrete int for a possibly symbolic size (2.12 renamed the hint helpers).

    A backed symbol has a hint (the example input's size); an unbacked one has none and counts as
    ``fallback``: inside ``assumed_sizes()`` that assumption is recorded with ``where`` it was made.
    """
    if isinstance(expr, int):
        return expr
    from torch.fx.experimental import symbolic_shapes as ss

    unbacked = ss.free_unbacked_symbols(expr)
    assumed = _assumed.get()
    if unbacked and assumed is not None:
        for sym in sorted(unbacked, key=str):
            places = assumed.setdefault(str(sym), [])
            if where not in places:
                places.append(where)
    if hasattr(ss, "optimization_hint"):  # torch >= 2.12
        return int(ss.optimization_hint(expr, fallback=fallback))
    return int(ss.size_hint(expr, fallback=fallback))  # torch 2.11


@contextlib.contextmanager
def assumed_sizes() -> Iterator[dict[str, list[str]]]:
    """Record the unbacked symbols ``size_hint`` gave its fallback for: ``{"u0": [where, ...]}``."""
    token = _assumed.set({})
    try:
        yield _assumed.get()
    finally:
        _assumed.reset(token)


def _sdpa_flops_know_gqa() -> bool:
    from torch.utils.flop_counter import sdpa_flop_count

    try:
        sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:  # torch 2.11: key/value heads must equal the query's
        return False
    return True


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """torch's FLOP formula for an op (``torch.utils.flop_counter``), or None.

    torch 2.11's attention formulas reject grouped-query attention (key/value with fewer heads
    than the query, what ``enable_gqa`` and the CPU flash kernel take); later versions count it as
    the kernel runs it, with key/value broadcast to the query's heads. On 2.11 the formula gets
    those broadcast shapes.
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(packet)
    if formula is None or packet not in _SDPA_QUERY_ARG or _sdpa_flops_know_gqa():
        return formula
    q_at = _SDPA_QUERY_ARG[packet]

    def broadcast_heads(*args: Any, **kwargs: Any) -> int:
        args = list(args)
        heads = args[q_at].shape[1]
        for i in (q_at + 1, q_at + 2):  # key, value
            shape = args[i].shape
            args[i] = torch.Size((shape[0], heads, *shape[2:]))
        return formula(*args, **kwargs)

    return broadcast_heads


_aten = torch.ops.aten
# Where the query is in the SDPA ops' arguments (key and value follow it).
_SDPA_QUERY_ARG = {
    **{op: 0 for op in (_aten._scaled_dot_product_flash_attention,
                        _aten._scaled_dot_product_efficient_attention,
                        _aten._scaled_dot_product_cudnn_attention)},
    **{op: 1 for op in (_aten._scaled_dot_product_flash_attention_backward,
                        _aten._scaled_dot_product_efficient_attention_backward,
                        _aten._scaled_dot_product_cudnn_attention_backward)},
}


def inductor_rounds_fused_casts(*, device_types: Iterable[str]) -> bool:
    """Whether Inductor's generated code for all of ``device_types`` rounds fused bf16/fp16
    intermediates as eager does under ``emulate_precision_casts``, which fused FP8 quantizes need
    for the recipe's bits: Triton (CUDA) in every supported torch, the C++ backend (CPU) from 2.13
    (2.11's ``codegen/cpp.py`` ignores the setting; 2.12 is not tested)."""
    return "cpu" not in set(device_types) or TORCH_VERSION >= (2, 13)


def assumed_sizes_why(assumed: dict[str, list[str]]) -> list[str]:
    """For the report, after ``assumed_sizes()``: each symbol, the size assumed, where (the first
    three places)."""
    def places(p: list[str]) -> str:
        return ", ".join(p[:3]) + (f" and {len(p) - 3} more" if len(p) > 3 else "")

    return [f"unbacked {sym} assumed {UNBACKED_SIZE_HINT} in {places(p)}" for sym, p in assumed.items()]


def is_rng_op(node: fx.Node) -> bool:
    """Whether recomputing ``node`` would draw new random numbers: an op tagged
    ``nondeterministic_seeded`` (dropout, rand, Inductor's seeds, attention), except attention
    whose ``dropout_p`` is statically 0, which draws none and recomputes bit-identically.

    torch 2.14 decides so itself (``partitioners.is_rng_op``, pytorch/pytorch#187985) and saves
    no RNG state for a recomputed dropout-free attention; 2.11 and 2.13 treat every tagged op as
    random. graphpass uses torch 2.14's rule on every version (``partitioner.min_cut_partition``,
    ``partitioner_patch.random_ops_only``).
    """
    from torch._functorch import partitioners

    if hasattr(partitioners, "is_rng_op"):  # torch >= 2.14
        return partitioners.is_rng_op(node)
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    at = names.index("dropout_p")
    default = target._schema.arguments[at].default_value
    dropout_p = (node.args[at] if len(node.args) > at
                 else node.kwargs.get("dropout_p", default))
    if dropout_p is None:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(dropout_p == 0.0)


# The ops that make Inductor realize an elementwise value read more than once, on a CPU
# (``StorageBox.should_realize_on_reuse``'s ``heavy_ops``): 2.13 and 2.15 list these seven, 2.11
# only exp and sigmoid (2.12 not checked).
INDUCTOR_REALIZE_HEAVY_OPS = frozenset(
    ("aten.exp", "aten.sigmoid") if TORCH_VERSION < (2, 13) else
    ("aten.exp", "aten.log", "aten.log10", "aten.log1p", "aten.log2", "aten.sigmoid", "aten.tanh"))


def cuda_version() -> tuple[int, int] | None:
    """The CUDA version this torch was built with, (major, minor), or None for a CPU build."""
    if not torch.version.cuda:
        return None
    return tuple(int(p) for p in torch.version.cuda.split(".")[:2])  # type: ignore[return-value]
