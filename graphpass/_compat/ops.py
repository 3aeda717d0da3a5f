"""Operators and tensors below torch's public API: op classes (``torch._ops``), op names,
storages (``torch._C``, Inductor's storage ids), memory layout (``torch._prims_common``) and
pytrees (``torch.utils._pytree``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves  # the leaves of a node's meta["val"]


def op_name(target: Any) -> str | None:
    """``aten.mm``, ``graphpass.quantize``, ``higher_order.run_with_rng_state`` for a node's
    target, or None for a plain Python callable."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return None


def is_op_overload(target: Any) -> bool:
    """An operator overload (``torch.ops.aten.mm.default``), which FLOP formulas and tags know."""
    return isinstance(target, torch._ops.OpOverload)


def is_higher_order(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def is_non_overlapping_and_dense(val: torch.Tensor) -> bool:
    """Whether a tensor's elements fill its storage span once each (no expanded view)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    return bool(dense(val))


def storage_id(val: torch.Tensor) -> int | None:
    """An id shared by all tensors (fake, meta or real) that alias one storage."""
    if not torch._C._has_storage(val):
        return None
    from torch._inductor.fx_utils import get_storage

    return get_storage(val)


def has_storage(val: torch.Tensor) -> bool:
    """Whether a tensor (fake, meta or real) has a storage (a sparse or nested one may not)."""
    return torch._C._has_storage(val)


def tensor_metadata(val: torch.Tensor) -> Any:
    """The ``tensor_meta`` FX's shape propagation and ``make_fx`` put on a node of ``val``."""
    from torch.fx.passes.shape_prop import _extract_tensor_metadata

    return _extract_tensor_metadata(val)


def tree_map(fn: Any, tree: Any) -> Any:
    """torch's pytree map (``torch.utils._pytree.tree_map``)."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


# A tensor subclass's ``__torch_function__`` that lets torch functions reach its
# ``__torch_dispatch__`` (the wrapper subclasses' idiom).
DISABLED_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
