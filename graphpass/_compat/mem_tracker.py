"""torch's memory trackers (``torch.distributed._tools``) and fake tensors' data errors, for
``graphpass.estimate`` (``job/tracker.py``, ``job/estimate.py``).

``MemTracker``, ``FSDPMemTracker`` and ``get_untyped_storages`` are in the same modules on torch
2.11 to 2.15; 2.13 added the tracker's ``_fake_mode_on_entry`` (it skips the fake tensors of
DTensor's sharding propagation, which 2.11 counts).
"""

from __future__ import annotations

from typing import Any


def mem_tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker


def fsdp_mem_tracker_class() -> type:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    return FSDPMemTracker


def untyped_storages(t: Any) -> set[Any]:
    """The storages of tensor ``t`` (a wrapper subclass's inner tensors' too)."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    return get_untyped_storages(t)


def reads_data(error: BaseException) -> bool:
    """Whether ``error`` is a fake tensor's refusal to give a value or a data-dependent size
    (an ``.item()``, a branch on a tensor, ``nonzero``)."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException,
                                               DynamicOutputShapeException)
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(error, (DataDependentOutputException, DynamicOutputShapeException,
                              GuardOnDataDependentSymNode))


def fake_mode_for_meta() -> Any:
    """A ``FakeTensorMode`` that takes meta tensors as inputs (``to_empty`` of an FSDP2 model
    built on the meta device calls ``empty_like`` on its meta shards)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)
