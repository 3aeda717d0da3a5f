"""FSDP2's weight all-gathers in FP8, through FSDP2's all-gather extension.

``graphpass.fsdp_fp8_weights(model, config)``, called before ``fully_shard``, puts each weight
graphpass will lower in a :class:`FP8GatherShard`: a wrapper of the high-precision tensor that
behaves as it everywhere (the optimizer, ``state_dict``, FSDP's sharding) and defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``, which FSDP2 calls around its all-gather:

    pre:   x    = the shard in the parameter dtype (MixedPrecisionPolicy.param_dtype)
           amax = the whole weight's amax (max over the shards: one all-reduce for all weights,
                  precompute_fsdp_fp8_scales, or this weight's own)
           data = quantize_amax(x, amax)          graphpass's tensorwise quantize, E4M3
           the all-gather moves data's bytes (uint8), half a bf16 all-gather's
    post:  FP8GatheredWeight(data, scale_inv)     what the module's forward reads

The max of the shards' amaxes is the whole weight's amax, and tensorwise quantization is
elementwise under one scale, so the gathered bytes and scale are the bits quantizing the gathered
weight gives. The compiled block receives them as two graph inputs (AOTAutograd flattens the
wrapper subclass); the weight's value in the traced graph is ``graphpass::fsdp_fp8_weight(data,
scale_inv)``, and ``passes/fsdp_fp8_weights.py`` gives the FP8 GEMMs the gathered data and scale
in place of the quantizes of that value (the columnwise copy is the data transposed). The graph
never reads the dequantized value: a weight that anything else reads is a clear error at compile
time, and an uncompiled forward that reads it raises.

Scales: the amaxes are read after the optimizer step. ``precompute_fsdp_fp8_scales(model)``
reduces all of them in one all-reduce (max) per data-parallel group, as torchao's precompute
does; a weight whose shard changed since (its version counter moved: the call was forgotten)
reduces its own amax in its pre-all-gather, correct but one all-reduce per weight, with a
warning once. Never a stale scale.

Blockwise (128x128 weight tiles): a tile lies within one shard exactly where every shard
boundary falls on a multiple of 128 rows. FSDP2 pads each shard to ceil(rows / world) rows and
wants every all-gather input in that padded size, so the FP8 gather takes even shards
(``rows % world == 0``) of a multiple of 128 rows each. There no reduction is needed:

    pre:   data, scale_inv = quantize(x, blockwise, "weight")   the shard's own 128x128 tiles
           the all-gather moves data (uint8) and scale_inv (fp32, 1/16384 of the elements),
           both along dim 0: the whole weight's data and its (rows/128, ceil(cols/128)) scales
    post:  FP8GatheredWeight(data, scale_inv)

Each tile's amax, scale and cast read that tile alone, and the shard's tiles are the whole
weight's tiles of its rows, so the gathered data and scales are the bits quantizing the gathered
weight gives (``tests/test_fsdp_fp8_gather.py``). dgrad's columnwise copy is the quantize of
``w.t()`` in 128x128 tiles: the same tiles transposed, the same amaxes, the same elementwise
cast, so it is the gathered data transposed with the gathered scales transposed, bit for bit; no
second gather. Any other shard layout (a boundary inside a tile, uneven shards) is all-gathered
in the parameter dtype and quantized after, with a warning naming the weight, its shard rows
and the block; so is a 1-rank mesh, where FSDP2 gathers nothing and passes the extension its
first all-gather input only (the scales would be lost; there are no bytes to save).

Not FP8-gathered, with a warning: rowwise and mxfp8 (docs/distributed.md says why per recipe).
The forward's rowwise copy has its scales within a row (rowwise) or a 1x32 block along it
(mxfp8), inside any dim-0 shard, but dgrad's columnwise copy is the quantize of ``w.t()``,
scaled along dim 0: per column of the whole weight (rowwise: across the shards, so a reduction
of per-column amaxes), or per 32 rows (mxfp8: inside 32-row-aligned shards, but not a transpose
of the rowwise copy). Either way one FSDP2 all-gather serves both GEMMs, so it would move both
FP8 copies: 2 bytes per element plus scales, no fewer than the bf16 gather's 2.

Under tensor parallelism (a 2-D dp x tp mesh), call it after ``parallelize_module`` and before
``fully_shard`` on the dp mesh: it wraps each TP DTensor weight's local tensor (its TP shard),
which FSDP2 then shards over dp, as torchao's float8 weights sit inside TP's DTensors (before
``parallelize_module`` gives the same layout: TP shards the wrapper). The compiled TP graph
quantizes a weight's TP shard with that shard's own amax (none is reduced over tp), so "the
whole weight" above is the TP shard: its amax is reduced over the dp group only (FSDP2's shard
mesh), and the FP8 bytes are the bits of quantizing the gathered TP shard, for column- and
row-parallel weights alike. FSDP2 hands the unsharded parameter back as a DTensor over the
gathered ``FP8GatheredWeight``. A DTensor on a mesh of more than one dimension, or with a
Partial or strided placement, keeps its bf16 gather (a warning says so).

One module because the two wrapper subclasses, FSDP2's hooks on them, the amax reductions and
the wrapping of a model read and write one state per weight (``_State``): which recipe, which
shard layout, which scale, and why a weight gathers in high precision.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
import weakref
from typing import Any

import torch
from torch import Tensor
from .. import _compat
from . import ops, recipes

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


class FSDPFP8Warning(UserWarning):
    """What graphpass's FSDP2 FP8 all-gather does not do for an input (it gathers bf16 there)."""


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, FSDPFP8Warning, stacklevel=3)


@dataclasses.dataclass
class _State:
    """One wrapped weight: its name, recipe, and the amax of its last reduction."""

    name: str
    recipe: str
    amax: Tensor | None = None
    version: int | None = None  # the sharded parameter's version counter at the reduction
    reduced_alone: bool = False
    param: Any = None  # a weakref to the sharded parameter (its version counter)
    amax_dtype: torch.dtype | None = None  # the dtype ``amax`` was taken in
    fallback: str | None = None  # why it gathers in high precision (set at its first gather)
    size: torch.Size | None = None  # the gathered weight's shape (TP-local under TP)
    param_dtype: torch.dtype | None = None  # the dtype FSDP2 gathers (its MixedPrecisionPolicy)

    @property
    def blocks(self) -> bool:
        """Block-scaled (blockwise's 128x128 weight tiles): the shard's scales are gathered."""
        return not recipes.get_recipe(self.recipe).per_tensor


# ---------------------------------------------------------------------------------------------
# The graph's view of a gathered FP8 weight.

@torch.library.custom_op("graphpass::fsdp_fp8_weight", mutates_args=())
def fsdp_fp8_weight(data: Tensor, scale_inv: Tensor, dtype: torch.dtype, recipe: str) -> Tensor:
    """The value of a weight FSDP2 gathered in FP8 under ``recipe`` (a ``Recipe.key``), as the
    traced graph names it. The partition replaces every read of it by the gathered data and
    scale; it is never computed."""
    raise RuntimeError(
        "graphpass: a weight all-gathered in FP8 by FSDP2 (graphpass.fsdp_fp8_weights) was read "
        f"outside a graph compiled by graphpass with fp8={recipes.get_recipe(recipe).name!r}: "
        "only graphpass's FP8 GEMMs read the gathered FP8 bytes; compile the module with "
        "torch.compile(backend=graphpass.backend(...)) and the config fsdp_fp8_weights was "
        "given, or build the model without fsdp_fp8_weights")


@fsdp_fp8_weight.register_fake
def _(data: Tensor, scale_inv: Tensor, dtype: torch.dtype, recipe: str) -> Tensor:
    return data.new_empty(data.shape, dtype=dtype)


FSDP_FP8_WEIGHT = torch.ops.graphpass.fsdp_fp8_weight.default


class FP8GatheredWeight(Tensor):
    """A weight after FSDP2's FP8 all-gather: the E4M3 data of the whole weight and its scales
    (``scale_inv``, fp32: shape () tensorwise, (ceil(rows/128), ceil(cols/128)) blockwise), with
    the parameter dtype and shape outside, and the recipe key it was quantized under.
    Traceable: AOTAutograd passes ``data`` and ``scale_inv`` as graph inputs."""

    @staticmethod
    def __new__(cls, data: Tensor, scale_inv: Tensor, dtype: torch.dtype, recipe: str,
                requires_grad: bool = False) -> "FP8GatheredWeight":
        return Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                             storage_offset=data.storage_offset(), dtype=dtype,
                                             device=data.device, requires_grad=requires_grad)

    def __init__(self, data: Tensor, scale_inv: Tensor, dtype: torch.dtype, recipe: str,
                 requires_grad: bool = False) -> None:
        self._data = data
        self._scale_inv = scale_inv
        self._recipe = recipe

    def __repr__(self) -> str:
        return (f"FP8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"data={self._data.dtype}, recipe={self._recipe!r})")

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale_inv"], (self.dtype, self._recipe)

    def _stable_hash_for_caching(self) -> str:
        """What AOTAutograd's cache keys this input on (beside its inner tensors' metadata)."""
        return f"graphpass.FP8GatheredWeight:{self.dtype}:{self._data.dtype}:{self._recipe}"

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], meta: Any, outer_size: Any,
                             outer_stride: Any) -> "FP8GatheredWeight":
        dtype, recipe = meta
        return FP8GatheredWeight(inner["_data"], inner["_scale_inv"], dtype, recipe)

    __torch_function__ = _compat.DISABLED_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _ALIASES:  # FSDP's own handling of the unsharded parameter: the same bytes
            (w, *rest) = args
            return FP8GatheredWeight(func(w._data, *rest, **kwargs), w._scale_inv, w.dtype,
                                     w._recipe)
        # Anything else reads the weight's value: in a graph graphpass partitions, its FP8
        # GEMMs read the data and scale instead (passes/fsdp_fp8_weights.py).
        def value(t: Any) -> Any:
            if isinstance(t, FP8GatheredWeight):
                return FSDP_FP8_WEIGHT(t._data, t._scale_inv, t.dtype, t._recipe)
            return t
        return func(*_compat.tree_map(value, args), **_compat.tree_map(value, kwargs))


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.as_strided.default,
            torch.ops.aten.alias.default}


# ---------------------------------------------------------------------------------------------
# The sharded weight.

class FP8GatherShard(Tensor):
    """A weight (and, after ``fully_shard``, its shard) that FSDP2 all-gathers in FP8: the
    high-precision tensor ``_tensor`` wrapped, every op on it run on ``_tensor`` (the ops FSDP2
    uses to shard and copy it give a wrapped result, so the shard stays one of these)."""

    @staticmethod
    def __new__(cls, tensor: Tensor, state: _State) -> "FP8GatherShard":
        return Tensor._make_wrapper_subclass(cls, tensor.shape, strides=tensor.stride(),
                                             storage_offset=tensor.storage_offset(),
                                             dtype=tensor.dtype, device=tensor.device,
                                             requires_grad=tensor.requires_grad)

    def __init__(self, tensor: Tensor, state: _State) -> None:
        self._tensor = tensor
        self._state = state

    def __repr__(self) -> str:
        return f"FP8GatherShard({self._tensor!r}, name={self._state.name!r})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], state: _State, outer_size: Any,
                             outer_stride: Any) -> "FP8GatherShard":
        return FP8GatherShard(inner["_tensor"], state)

    __torch_function__ = _compat.DISABLED_TORCH_FUNCTION

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        state = next(a._state for a in _flat(args, kwargs) if isinstance(a, FP8GatherShard))
        out = func(*_compat.tree_map(_unwrap, args), **_compat.tree_map(_unwrap, kwargs))
        if func.overloadpacket not in _PRESERVE:
            return out
        return _compat.tree_map(lambda t: FP8GatherShard(t, state) if isinstance(t, Tensor)
                                and t.dtype in _HIGH_PRECISION else t, out)

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: Any,
                            module: torch.nn.Module,
                            mp_policy: Any) -> tuple[tuple[Tensor, ...], Any]:
        state = self._state
        state.size = torch.Size(outer_size)
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        state.param_dtype = dtype
        shard = self._tensor.to(dtype)
        if state.fallback is None and dtype not in _HIGH_PRECISION:
            state.fallback = (f"MixedPrecisionPolicy(param_dtype={dtype}): graphpass quantizes "
                              "a float32, bfloat16 or float16 weight")
        if state.fallback is None and state.blocks:
            if tuple(shard.shape[1:]) != tuple(outer_size[1:]):
                state.fallback = (f"FSDP2 shards it along a dim other than 0 ({tuple(shard.shape)}"
                                  f" of {tuple(outer_size)}, a shard_placement_fn): the tile "
                                  "scales are gathered along dim 0")
            else:
                state.fallback = block_shards(state.recipe, tuple(outer_size), mesh.size())
        if state.fallback is not None:
            _warn_once(f"graphpass fsdp_fp8_weights: {state.name} is all-gathered in {dtype}, "
                       f"not FP8: {state.fallback}")
            return (_padded(shard, outer_size, mesh),), None
        fp8 = recipes.fp8_dtype(state.recipe, "weight")
        if state.blocks:  # the shard's own tiles: no reduction (module docstring)
            data, scale_inv = ops.QUANTIZE(shard, state.recipe, "weight", "rowwise")
            return (data.view(torch.uint8), scale_inv), (None, fp8, dtype, state.recipe)
        amax = _amax_now(self, mesh, dtype, module)
        data, scale_inv = ops.QUANTIZE_AMAX(shard, amax, state.recipe, "weight")
        data = data.view(torch.uint8).view(shard.shape)
        return (_padded(data, outer_size, mesh),), (scale_inv, fp8, dtype, state.recipe)

    def fsdp_post_all_gather(self, outputs: tuple[Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Tensor | None = None) -> Any:
        gathered = outputs[0]
        size = self._state.size
        # FSDP2 hands the gathered bytes viewed as (-1, *shard.shape[1:]); they are the weight's
        # elements in order (a dim-0 shard's padding at the end; a shard_placement_fn's other
        # dim copied back into place by FSDP2), so the weight is their first numel elements
        whole = gathered.reshape(-1)[:size.numel()].view(size)
        if metadata is None:  # gathered in high precision
            if out is not None:
                return None
            return whole, (gathered,)
        scale_inv, fp8, dtype, recipe = metadata
        data = whole.view(fp8)
        if scale_inv is None:  # blockwise: the gathered scales (views of FSDP2's buffers)
            scale_inv = outputs[1]
        if out is not None:
            # FSDP2's unsharded parameter: under tensor parallelism a DTensor over the weight
            target = _compat.dtensor_local(out) if _compat.is_dtensor(out) else out
            target._scale_inv = scale_inv
            return None
        return FP8GatheredWeight(data, scale_inv, dtype, recipe), tuple(outputs)


def block_shards(recipe: str, shape: tuple[int, ...], world: int) -> str | None:
    """Why a block-scaled weight of ``shape``, sharded along dim 0 over ``world`` ranks, cannot
    be quantized shard by shard (a scale block would cross a shard boundary, or FSDP2 pads the
    shards); None where every block lies within one shard."""
    rows = shape[0]
    block = recipes.block_shape(recipe, "weight")[0]
    per = -(-rows // world)
    if world == 1:  # torch's FSDP2 copies a 1-rank group's first all-gather input only
        return ("one rank: FSDP2 gathers nothing on a 1-rank mesh and keeps only the first "
                "all-gather input, which would drop the tile scales")
    if rows % world:
        return (f"uneven shards ({rows} rows over {world} ranks, each padded to {per} rows): a "
                f"{recipes.get_recipe(recipe).name} weight's {block}x{block} scale blocks are "
                "quantized shard by shard on even shards only")
    if per % block:
        return (f"its shards are {per} rows ({rows} rows over {world} ranks), not a multiple of "
                f"the {block}x{block} scale block: a block would cross a shard boundary, so its "
                "scale needs rows of two shards")
    return None


_PRESERVE = {torch.ops.aten.split, torch.ops.aten.split_with_sizes, torch.ops.aten.chunk,
             torch.ops.aten.view, torch.ops.aten.as_strided, torch.ops.aten.slice,
             torch.ops.aten.narrow, torch.ops.aten.clone, torch.ops.aten.detach,
             torch.ops.aten.alias, torch.ops.aten.copy_, torch.ops.aten.empty_like,
             torch.ops.aten.new_zeros, torch.ops.aten.new_empty, torch.ops.aten._to_copy,
             torch.ops.aten.contiguous, torch.ops.aten.zeros_like, torch.ops.aten.t,
             torch.ops.aten.transpose, torch.ops.aten.reshape, torch.ops.aten._unsafe_view,
             torch.ops.aten.cat, torch.ops.aten.expand}


def _flat(args: Any, kwargs: Any) -> list[Any]:
    return _compat.tree_leaves((args, kwargs))


def _unwrap(t: Any) -> Any:
    return t._tensor if isinstance(t, FP8GatherShard) else t


def _padded(t: Tensor, outer_size: torch.Size, mesh: Any) -> Tensor:
    """``t`` padded with zero rows to FSDP's padded shard size (dim 0, ceil(rows / world));
    a shard of another dim (a ``shard_placement_fn``'s: FSDP2 shards those evenly) as it is."""
    world = mesh.size()
    rows = -(-outer_size[0] // world)
    if t.shape[0] == rows or tuple(t.shape[1:]) != tuple(outer_size[1:]):
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad]) if t.shape[0] else pad


def _version(shard: FP8GatherShard, module: torch.nn.Module | None) -> int:
    """The version counter of the parameter whose local shard ``shard`` is (the sharded
    DTensor's: an optimizer step, ``load_state_dict`` or an in-place edit moves it; the
    shard's own does not, as the DTensor writes it below autograd)."""
    state = shard._state
    param = state.param() if state.param is not None else None
    if param is None and module is not None:
        param = next((p for p in module.parameters()
                      if p is shard or getattr(p, "_local_tensor", None) is shard), None)
        if param is not None:
            state.param = weakref.ref(param)
    if param is None:
        raise RuntimeError(f"graphpass fsdp_fp8_weights: {state.name}'s sharded parameter was "
                           "not found: is the model sharded with fully_shard?")
    return param._version


def _amax_now(shard: FP8GatherShard, mesh: Any, dtype: torch.dtype,
              module: torch.nn.Module | None) -> Tensor:
    state = shard._state
    version = _version(shard, module)
    if state.amax is not None and state.version == version and state.amax_dtype == dtype:
        return state.amax
    if state.version is not None:
        _warn_once("graphpass fsdp_fp8_weights: a weight changed since its amax was reduced "
                   "(graphpass.precompute_fsdp_fp8_scales(model) not called after "
                   "optimizer.step()?): each such weight's amax is all-reduced on its own before "
                   "its all-gather, correct but one all-reduce per weight")
    amax = _local_amax(shard._tensor, dtype).reshape(1)
    torch.distributed.all_reduce(amax, torch.distributed.ReduceOp.MAX, group=mesh.get_group())
    state.amax, state.version, state.reduced_alone = amax[0], version, True
    state.amax_dtype = dtype
    return state.amax


def _local_amax(t: Tensor, dtype: torch.dtype) -> Tensor:
    """This rank's amax of ``t`` in the gathered dtype (an empty shard: 0)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return ops.AMAX(t.to(dtype))


def precompute_fsdp_fp8_scales(model: torch.nn.Module) -> int:
    """After ``optimizer.step()``: the amax of every weight ``fsdp_fp8_weights`` wrapped,
    reduced (max) over its data-parallel group (FSDP2's shard mesh, the dp dimension of a 2-D
    mesh under tensor parallelism) in one all-reduce per group, kept for the next
    all-gathers. Returns how many weights. A weight that changes after this call reduces its
    own amax again before its all-gather (with a warning), so a late or forgotten call costs
    all-reduces, never a stale scale. Call it after ``fully_shard`` too, so that the first
    all-gathers find their amaxes reduced (the amax is taken in FSDP2's ``param_dtype``).
    Blockwise weights have no amax to reduce (each tile's scale is its shard's): not counted."""
    groups: dict[Any, list[tuple[FP8GatherShard, torch.dtype]]] = {}
    p_version: dict[int, int] = {}
    dtype_of: dict[int, torch.dtype] = {}
    dtypes = _compat.fsdp_param_dtypes(model)
    sharded = _compat.fsdp_shard_params(model)
    for p in model.parameters():
        local = _compat.dtensor_local(p) if _compat.is_dtensor(p) else p
        if (not isinstance(local, FP8GatherShard) or local._state.fallback is not None
                or local._state.blocks):  # block scales need no amax
            continue
        if id(p) not in sharded:
            raise ValueError("graphpass.precompute_fsdp_fp8_scales: the model's FP8-gathered "
                             "weights are not sharded yet: call it after fully_shard (and "
                             "after each optimizer.step())")
        mesh = sharded[id(p)][0]  # the data-parallel mesh FSDP2 gathers over (not TP's)
        dtype = local._state.param_dtype
        if dtype is None and id(p) in dtypes:  # not gathered yet: FSDP2's MixedPrecisionPolicy
            dtype = dtypes[id(p)] or local.dtype
        if dtype is None:  # unknown: the first all-gather reduces this weight's amax itself
            continue
        if local._state.param is None:
            local._state.param = weakref.ref(p)
        p_version[id(local)] = p._version
        dtype_of[id(local)] = dtype
        groups.setdefault(mesh.get_group(), []).append((local, dtype))
    for group, shards in groups.items():
        amaxes = torch.stack([_local_amax(s._tensor, d) for s, d in shards])
        torch.distributed.all_reduce(amaxes, torch.distributed.ReduceOp.MAX, group=group)
        for (shard, _), amax in zip(shards, amaxes):
            state = shard._state
            state.amax, state.version, state.reduced_alone = amax, p_version[id(shard)], False
            state.amax_dtype = dtype_of[id(shard)]
    return sum(len(s) for s in groups.values())


@dataclasses.dataclass(frozen=True)
class Wrapped:
    """What ``fsdp_fp8_weights`` did: the weights it wrapped, and each weight it left in the
    parameter dtype with the reason."""

    fp8: tuple[str, ...]
    kept: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"FP8 all-gather: {len(self.fp8)} weights"]
        lines += [f"  {name}: {why}" for name, why in self.kept]
        return "\n".join(lines)


def fsdp_fp8_weights(model: torch.nn.Module, config: Any) -> Wrapped:
    """Before ``fully_shard`` (and, under tensor parallelism, after ``parallelize_module``):
    wrap the weight of each ``nn.Linear`` that graphpass will lower under ``config`` so that
    FSDP2 all-gathers it in FP8 (module docstring); a TP DTensor weight's local tensor is
    wrapped. A model ``fully_shard`` was applied to is a ValueError. Left in the parameter
    dtype, each with its reason (returned, and warned): linears ``fp8_exclude`` names (the
    output head by default), weights that are not 2-D floating-point tensors, DTensor layouts
    other than Shard or Replicate on a 1-D mesh, every weight when the recipe is neither
    tensorwise nor blockwise, when ``fp8_weight_all_gather`` is off, or when this torch's FSDP2
    has no all-gather extension. A blockwise weight whose shards are not whole 128-row blocks
    is wrapped and says so (a warning) at its first all-gather, which moves the parameter
    dtype."""
    from ..config import given

    config = given(config)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    every = None
    if config.recipe is None:
        every = "FP8 is off (fp8=None)"
    elif not config.fp8_weight_all_gather:
        every = "fp8_weight_all_gather=False"
    elif not (config.recipe.per_tensor or config.recipe.scaling is recipes.Scaling.BLOCKWISE):
        every = f"fp8={config.fp8!r}: {columnwise_across_shards(config.recipe)}"
    elif not _compat.fsdp_all_gather_extension():
        every = f"torch {torch.__version__}'s FSDP2 has no all-gather extension"
    if any(_compat.is_fsdp_module(m) for m in model.modules()):
        raise ValueError("graphpass.fsdp_fp8_weights: the model is sharded with fully_shard "
                         "already: call it before fully_shard (after parallelize_module under "
                         "tensor parallelism: docs/distributed.md#fsdp2-and-tensor-parallelism)")
    kept: list[tuple[str, str]] = []
    fp8: list[str] = []
    for name, module in linears:
        w = module.weight
        tp, why_tp = _tp_layout(w) if _compat.is_dtensor(w) else (None, None)
        local = _compat.dtensor_local(w) if _compat.is_dtensor(w) else w
        why = every or _why_not(name, w, config) or why_tp
        if why is not None:
            kept.append((f"{name}.weight", why))
            continue
        if isinstance(local, FP8GatherShard):
            fp8.append(f"{name}.weight")
            continue
        state = _State(f"{name}.weight", config.fp8_recipe)
        wrapped = FP8GatherShard(local.detach(), state)
        if tp is not None:  # the DTensor's local tensor, as FSDP2 shards it (the TP shard)
            wrapped = _compat.dtensor_from_local(wrapped, w)
        module.weight = torch.nn.Parameter(wrapped, requires_grad=w.requires_grad)
        fp8.append(f"{name}.weight")
    result = Wrapped(tuple(fp8), tuple(kept))
    if every is not None and linears:
        _warn_once(f"graphpass fsdp_fp8_weights: no weight is all-gathered in FP8: {every}")
    for name, why in kept if every is None else ():
        _warn_once(f"graphpass fsdp_fp8_weights: {name} is all-gathered in its dtype: {why}")
    return result


def _tp_layout(w: Tensor) -> tuple[str | None, str | None]:
    """A tensor-parallel (DTensor) weight: its layout as a note says it, or why FSDP2 does not
    all-gather it in FP8. Under tensorwise scaling the compiled graph quantizes each rank's TP
    shard with that shard's own amax (the TP note: "a weight shard scales by this rank's
    shard"), and FSDP2 shards and all-gathers that local tensor over the data-parallel mesh, so
    the amax is reduced over the data-parallel group only: the FP8 bytes are the bits of
    quantizing the gathered TP shard, whichever dim TP cuts. Left in the parameter dtype: a
    DTensor on a mesh of more than one dimension, or with a placement other than Shard and
    Replicate (Partial, strided: the local tensor is not the TP shard FSDP2 gathers)."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = w.device_mesh, tuple(w.placements)
    if mesh.ndim != 1 or not all(type(p) in (Shard, Replicate) for p in placements):
        return None, (f"a DTensor on a {mesh.ndim}-D mesh with placements {placements}: the "
                      "FP8 all-gather takes a tensor-parallel weight sharded (Shard) or "
                      "replicated on a 1-D mesh "
                      "(docs/distributed.md#fsdp2-and-tensor-parallelism)")
    return f"{placements[0]} over a tensor-parallel mesh of {mesh.size()}", None


def columnwise_across_shards(recipe: recipes.Recipe) -> str:
    """Why a rowwise or mxfp8 weight is not all-gathered in FP8 (module docstring)."""
    if recipe.per_row:
        where = ("one scale per column of the whole weight, along dim 0 across FSDP's row "
                 "shards")
    else:
        where = ("1x32 blocks down each column, 32 rows of dim 0, not the rowwise copy's blocks "
                 "transposed")
    return (f"dgrad's columnwise copy of a weight has {where}; one all-gather serves both "
            "GEMMs, so an FP8 gather would move both FP8 copies, 2 bytes per element and the "
            "scales, no fewer than the bf16 gather: the FP8 all-gather is for tensorwise and "
            "blockwise scaling (docs/distributed.md)")


def _why_not(name: str, w: Tensor, config: Any) -> str | None:
    for pattern in config.fp8_exclude:
        parts = name.split(".")
        if any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts))):
            return f"excluded by fp8_exclude pattern {pattern!r}"
    if w.dim() != 2 or w.dtype not in _HIGH_PRECISION:
        return f"a {w.dim()}-D {w.dtype} weight: graphpass lowers 2-D float weights"
    return None
