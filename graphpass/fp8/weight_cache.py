"""Weights quantized once per optimizer step (``Config.fp8_weight_cache``).

With gradient accumulation, every micro-batch's forward quantizes every lowered weight again,
though a weight changes only at the optimizer step: for 16 DeepSeek-V3-shaped experts that is
704 M parameters read and two FP8 copies written per micro-batch. ``graphpass::quantize_weight``
is ``graphpass::quantize`` of a parameter with a cache in front of it: it returns the FP8 copies
of its last call while the parameter is the same tensor (the same storage, view and dtype) at
the same version, and otherwise quantizes and replaces them. The version is torch's version
counter, which every in-place write bumps: an optimizer step (``foreach`` and fused ones too),
``load_state_dict`` (``param.copy_``), ``p.mul_(...)`` under ``no_grad``. Nothing to pass per
micro-batch (Transformer Engine asks for ``is_first_microbatch``).

What the version counter does not see, and so the cache cannot: writes through ``p.data`` (a
tensor sharing the storage with a version counter of its own; autograd's saved-tensor check
misses them as well) and writes by a kernel outside torch into the storage. After such a write,
call :func:`clear` (``graphpass.clear_weight_cache()``).

Exactness: a cached copy is the output of the same quantize, so every micro-batch's GEMMs read
the bits re-quantizing would give (``tests/test_weight_cache.py``). The cache holds the copies
between steps: 1 byte per element and copy, plus the scales, per cached weight.

Inductor: the op runs as an extern kernel whose outputs are the cached tensors themselves, so
Inductor must never write into their memory once the graph no longer reads them (its buffer
reuse and in-place updates): ``_compat.register_persistent_outputs`` marks them. The
backward reads the copies it needs through the op again (the pass tags it must-recompute: a
lookup, nothing saved), so no cached tensor is ever a saved tensor AOTAutograd could donate to
the backward's buffer reuse.

CUDA graphs (Inductor's ``triton.cudagraphs``, ``mode="reduce-overhead"``): the op is tagged
``cudagraph_unsafe``, so it runs on every step outside the captured graphs, which replay the
rest; a captured lookup would replay the copies of the step it was captured in.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from . import ops

_Key = tuple


@dataclasses.dataclass
class _Entry:
    storage: object  # torch's StorageWeakRef of the weight's storage
    version: int
    outputs: list[Tensor]


@dataclasses.dataclass
class Stats:
    """What the cache did since the last :func:`clear`."""

    quantized: int = 0
    """Calls that quantized (the first after a weight changed, or the first at all)."""
    reused: int = 0
    """Calls that returned the cached copies."""

    def __str__(self) -> str:
        return f"{self.quantized} quantized, {self.reused} reused"


_CACHE: dict[_Key, _Entry] = {}
_STATS = Stats()


def stats() -> Stats:
    """A copy of the counts since the last :func:`clear`."""
    return dataclasses.replace(_STATS)


def held_bytes() -> int:
    """Bytes the cached copies hold now (data and scales), on every device."""
    return sum(t.untyped_storage().nbytes() for e in _CACHE.values() for t in e.outputs)


def clear() -> None:
    """Drop every cached copy and reset the counts: the next call of each weight quantizes."""
    _CACHE.clear()
    _STATS.quantized = _STATS.reused = 0


def _storage_ref(w: Tensor) -> object:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(w.untyped_storage())


def _version(w: Tensor) -> int | None:
    """``w``'s version counter, or None where it has none (an inference-mode tensor)."""
    try:
        return w._version
    except RuntimeError:
        return None


def _cached(w: Tensor, recipe: str, role: str, usage: str,
            compute: Callable[[Tensor, str, str, str], list[Tensor]]) -> list[Tensor]:
    version = _version(w)
    if version is None:
        _STATS.quantized += 1
        return compute(w, recipe, role, usage)
    ref = _storage_ref(w)
    key = (ref.cdata, w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device,
           recipe, role, usage)
    entry = _CACHE.get(key)
    # The weak reference keeps the storage's address from being reused while the entry holds
    # it, so an unexpired reference at this key is this storage.
    if entry is not None and not entry.storage.expired() and entry.version == version:
        _STATS.reused += 1
        return [t.detach() for t in entry.outputs]  # new tensors over the cached storage
    for k in [k for k, e in _CACHE.items() if e.storage.expired()]:  # weights freed since
        del _CACHE[k]
    _CACHE.pop(key, None)  # the old copies go before the new ones are allocated
    outputs = compute(w, recipe, role, usage)
    _CACHE[key] = _Entry(ref, version, outputs)
    _STATS.quantized += 1
    return [t.detach() for t in outputs]


def _quantize_weight(w: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    return _cached(w, recipe, role, usage, ops._quantize_op)


# CUDA graphs replay kernels without the Python that chose them: a replay would return the copies
# of the step it was captured in, stale after the optimizer step. Tagged cudagraph-unsafe, the op
# runs outside them: Inductor's graph partition (its default) captures the code around it, and
# without the partition Inductor leaves the graph out of CUDA graphs.
quantize_weight = torch.library.custom_op("graphpass::quantize_weight", _quantize_weight,
                                          mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
quantize_weight.register_fake(lambda w, recipe, role, usage: ops._quantize_fake(
    w, recipe, role, usage))

QUANTIZE_WEIGHT = torch.ops.graphpass.quantize_weight.default
