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

DTensor parameters (SimpleFSDP's shards, tensor-parallel weights): the compiled graph reads a
DTensor's local tensor, whose version counter no DTensor op moves (an in-place DTensor op bumps
the DTensor's own counter, and a ``foreach`` or fused optimizer step on DTensors neither).
:func:`track_dtensors` gives the local tensors their writes: the backend wraps each graph with
DTensor inputs under the cache so that a call first bumps a local tensor's counter where its
DTensor's moved since the last call (``load_state_dict``, ``p.mul_(...)``, a plain optimizer
step), and an optimizer step post hook (``torch.optim``'s, every optimizer) bumps those of the
stepped DTensor parameters. Both run on every rank alike.

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
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .. import _compat
from . import ops, recipes

_Key = tuple


@dataclasses.dataclass
class _Entry:
    storages: tuple  # torch's StorageWeakRef of each weight's storage
    versions: tuple[int, ...]
    outputs: list[Tensor]

    def expired(self) -> bool:
        return any(s.expired() for s in self.storages)


@dataclasses.dataclass
class Stats:
    """What the cache did since the last :func:`clear`."""

    quantized: int = 0
    """Weights quantized (the first call after a weight changed, or the first at all); a call of
    ``quantize_weight_shards`` counts each of its shards."""
    reused: int = 0
    """Weights whose cached copies a call returned, counted as ``quantized``."""

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


_SEEN: dict[int, tuple[weakref.ref, int]] = {}
"""Each DTensor input (by id, and a weak reference to tell a reused id) and its own version
when :func:`sync_versions` last saw it."""
_HOOKED: list[Any] = []


def sync_versions(tensors: Sequence[Any]) -> None:
    """Bump the local tensor's version counter of each DTensor of ``tensors`` whose own counter
    moved since the last call saw it: a write to the DTensor is a write to its local tensor,
    which the cache's key reads."""
    for t in tensors:
        if not _compat.is_dtensor(t):
            continue
        version = _version(t)
        seen = _SEEN.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] != version:
            torch.autograd.graph.increment_version(_compat.dtensor_local(t))
        if seen is None or seen[0]() is not t:
            for key in [k for k, (ref, _) in _SEEN.items() if ref() is None]:  # freed since
                del _SEEN[key]
        _SEEN[id(t)] = (weakref.ref(t), version)


def _after_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """An optimizer step wrote every parameter it holds, DTensors too: their local tensors'
    version counters say so (a ``foreach`` or fused step on DTensors moves no counter)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _compat.is_dtensor(p):
                torch.autograd.graph.increment_version(_compat.dtensor_local(p))


def track_dtensors(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` (a graph compiled with the cache, some of its inputs DTensors), calling
    :func:`sync_versions` on its inputs first; installs the optimizer step post hook, once."""
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOKED.append(register_optimizer_step_post_hook(_after_optimizer_step))
    def run(*args: Any) -> Any:
        # a boxed call passes one list of the inputs (the callee may empty it)
        sync_versions(args[0] if len(args) == 1 and isinstance(args[0], list) else args)
        return compiled(*args)

    if hasattr(compiled, "_boxed_call"):
        run._boxed_call = compiled._boxed_call  # type: ignore[attr-defined]
    return run


def _storage_ref(w: Tensor) -> object:
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(w.untyped_storage())


def _version(w: Tensor) -> int | None:
    """``w``'s version counter, or None where it has none (an inference-mode tensor)."""
    try:
        return w._version
    except RuntimeError:
        return None


def _cached(ws: list[Tensor], args: tuple, compute: Callable[[], list[Tensor]]) -> list[Tensor]:
    """``compute()``'s outputs, cached while every tensor of ``ws`` is the same tensor (storage,
    view, dtype) at the same version; ``args`` completes the key (recipe, role, ...)."""
    versions = tuple(_version(w) for w in ws)
    if None in versions:
        _STATS.quantized += len(ws)
        return compute()
    refs = tuple(_storage_ref(w) for w in ws)
    key = (*((r.cdata, w.storage_offset(), tuple(w.shape), tuple(w.stride()), w.dtype, w.device)
             for r, w in zip(refs, ws)), *args)
    entry = _CACHE.get(key)
    # The weak references keep the storages' addresses from being reused while the entry holds
    # them, so an unexpired entry at this key is of these storages.
    if entry is not None and not entry.expired() and entry.versions == versions:
        _STATS.reused += len(ws)
        return [t.detach() for t in entry.outputs]  # new tensors over the cached storage
    for k in [k for k, e in _CACHE.items() if e.expired()]:  # weights freed since
        del _CACHE[k]
    _CACHE.pop(key, None)  # the old copies go before the new ones are allocated
    outputs = compute()
    _CACHE[key] = _Entry(refs, versions, outputs)
    _STATS.quantized += len(ws)
    return [t.detach() for t in outputs]


def _quantize_weight(w: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    return _cached([w], (recipe, role, usage), lambda: ops._quantize_op(w, recipe, role, usage))


# CUDA graphs replay kernels without the Python that chose them: a replay would return the copies
# of the step it was captured in, stale after the optimizer step. Tagged cudagraph-unsafe, the op
# runs outside them: Inductor's graph partition (its default) captures the code around it, and
# without the partition Inductor leaves the graph out of CUDA graphs.
quantize_weight = torch.library.custom_op("graphpass::quantize_weight", _quantize_weight,
                                          mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
quantize_weight.register_fake(lambda w, recipe, role, usage: ops._quantize_fake(
    w, recipe, role, usage))

QUANTIZE_WEIGHT = torch.ops.graphpass.quantize_weight.default


def _shards(shards: list[Tensor], dtype: torch.dtype | None, recipe: str, role: str,
            group_name: str, reduce: bool = True) -> list[Tensor]:
    """SimpleFSDP's FP8 weight shards (``passes/fp8_weight_all_gather.py``): each shard cast to
    ``dtype`` (the mixed-precision policy's), the amaxes of all of them in one all-reduce (max)
    over ``group_name``, each shard quantized (rowwise, as 2-D rows) with its whole weight's amax:
    ``[data_0, scale_inv_0, data_1, ...]``, what the graph's all-gathers move. The graph's own
    form of the same arithmetic, op for op (``graphpass::amax``, the functional all-reduce,
    ``graphpass::quantize_amax``), so the bits are the same."""
    xs = [s if dtype is None else s.to(dtype) for s in shards]
    amaxes = torch.stack([recipes.tensor_amax(x) for x in xs])
    if reduce:  # not on fake tensors: their shapes need no collective
        amaxes = _compat.functional_collective("wait_tensor")(
            _compat.functional_collective("all_reduce")(amaxes, "max", group_name))
    out: list[Tensor] = []
    for i, x in enumerate(xs):
        out += ops._quantize_amax(x.reshape(-1, x.shape[-1]), amaxes[i], recipe, role)
    return out


def _quantize_weight_shards(shards: list[Tensor], dtype: torch.dtype | None, recipe: str,
                            role: str, group_name: str) -> list[Tensor]:
    """``_shards``, cached as one entry keyed on every shard's tensor and version: one
    all-reduce and one quantize of the group per optimizer step.

    The ranks must agree on every lookup: a miss runs the all-reduce, a hit does not, so a rank
    that missed where another hit would wait in an all-reduce its peers never join (they go on
    to the next all-gather). They agree because each rank decides from its own shards and the
    shards change together: an optimizer step writes every rank's shard in the same step (its
    version moves on every rank at once), as does ``load_state_dict`` (every rank loads) and a
    write through the DTensor parameter (an SPMD op, run on every rank); the first lookup after
    the process starts, or after :func:`clear`, misses on every rank. What breaks it: a write to
    one rank's local shard alone (``p.to_local().mul_(...)`` on rank 0), or :func:`clear` on one
    rank. After such a write, call :func:`clear` on every rank before the next step. No check
    detects it: seeing another rank's decision takes a collective on every micro-batch, which is
    what the cache removes."""
    return _cached(list(shards), ("shards", dtype, recipe, role, group_name),
                   lambda: _shards(shards, dtype, recipe, role, group_name))


def _shards_fake(shards, dtype, recipe, role, group_name):
    return _shards(shards, dtype, recipe, role, group_name, reduce=False)


def _quantize_shards(shards: list[Tensor], dtype: torch.dtype | None, recipe: str, role: str,
                     group_name: str) -> list[Tensor]:
    return _shards(shards, dtype, recipe, role, group_name)


quantize_shards = torch.library.custom_op("graphpass::quantize_shards", _quantize_shards,
                                          mutates_args=())
quantize_shards.register_fake(_shards_fake)
# as quantize_weight: a lookup outside CUDA graphs
quantize_weight_shards = torch.library.custom_op(
    "graphpass::quantize_weight_shards", _quantize_weight_shards, mutates_args=(),
    tags=(torch.Tag.cudagraph_unsafe,))
quantize_weight_shards.register_fake(_shards_fake)

QUANTIZE_SHARDS = torch.ops.graphpass.quantize_shards.default
"""SimpleFSDP's shards of a graph's weights quantized every call (``fp8_weight_cache="auto"``
before the memory budget chooses); ``QUANTIZE_WEIGHT_SHARDS`` is the cached one."""
QUANTIZE_WEIGHT_SHARDS = torch.ops.graphpass.quantize_weight_shards.default
