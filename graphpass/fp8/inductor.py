"""Inductor code generation for ``graphpass::quantize``: the recipe inlined after the partition.

The partition needs each quantize as one op: its 1-byte outputs are values the min-cut can save,
recompute or offload. Once the forward and backward graphs are fixed, an opaque op only costs:
Inductor runs it as an extern call on materialized inputs (an amax pass, a scale, a cast, each
its own kernel). Inlining the recipe's arithmetic into the partitioned graphs (a post-grad pass,
before Inductor's own pattern passes) lets Inductor fuse the amax reduction, the scale and the
saturating cast, and the transpose of a columnwise copy, with the ops around them, as it does
for torchao's float8.

The tensorwise, rowwise and blockwise recipes are inlined: they are the ones the TE,
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` and cuBLASLt blockwise GEMMs take. A rowwise
scale is local to its row (one reduction along it). A blockwise scale is local to its 1x128
block or 128x128 tile (``_fused_blockwise``). Quantizes over token groups (offsets: an expert
GEMM's operands) are device ops without a host sync (each token's group, or its block within
the group, from the offsets; rowwise's per-(group, column) amaxes reduced over row chunks, the
tensorwise groups' and the blockwise blocks' amaxes one scatter-max), so they are inlined too.
Two rowwise quantizes run graphpass's Triton kernels on CUDA instead of Inductor's fusion: the
expert weights' (``triton_weight_quantize``) and the token groups' (``triton_group_quantize``).
They are inlined too, as the op's own code traced with each kernel launch a
``torch.library.wrap_triton`` one (``_traced_launches``): Inductor compiles the kernels as user
kernels and its code launches them, with no call of the op on the host each step. Every mxfp8
quantize stays one op (``fusion_notes`` says so in the report).

Numerics. Fusing is a speed decision, held to a bound, not to the opaque op's bits: each
dequantized FP8 value of a fused quantize is within one FP8 ulp of the opaque op's (the bound the
tests assert, ``tests/test_fp8_lowering.py``). Where Inductor can cheaply read the value eager
reads, the bits are the op's as well: in a fused kernel it keeps bf16 intermediates in fp32
unless ``emulate_precision_casts`` is set, so the backend sets it (a rounding in registers, no
extra memory traffic) together with exact fp32 division (``eager_numerics.division_rounding``:
the scale ``fmax / amax``). On the CPU that makes fused and opaque bit-identical
(``test_inlined_quantize_is_bit_identical_to_the_op``); on an H100 (torch 2.11) gradient
quantizes fused with their producers in the backward gave other bits than the op, which the
bound covers. Every quantize is inlined on every device, gradients included: an opaque gradient
quantize ran five or six eager kernels with fp32 temporaries of the whole gradient (the FP8 step
was 0.63x bf16's). ``fuse_quantize=False`` keeps each one opaque, for debugging.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import warnings
from typing import Any, Iterator

import torch
import torch.fx as fx

from .. import _compat
from ..decisions import Decision, OpaqueOpWarning, What
from ..graph.nodes import viewed
from . import ops, recipes, replacements, triton_quantize
from .gemm_order import order_gemm_operands, ordered_gemms

_log = logging.getLogger(__name__)
INLINED = (recipes.Scaling.TENSORWISE, recipes.Scaling.ROWWISE, recipes.Scaling.BLOCKWISE)
INLINED_RECIPES = tuple(s.value for s in INLINED)  # their names, as the notes say them


def inlinable(recipe: recipes.Recipe | str) -> bool:
    """Whether a quantize is inlined: every tensorwise, rowwise and blockwise one (either scale
    setting), on every device and in every role, over token groups too (each written without a
    loop over the groups or a host sync)."""
    return recipes.as_recipe(recipe).scaling in INLINED


def fusion_notes(*, device_types: set[str],
                 recipe: recipes.Recipe | str | None = None) -> list[Decision]:
    """The report's decisions for the quantizes ``fuse_quantize`` leaves as one op on these
    devices, under ``recipe``."""
    if not _compat.inductor_rounds_fused_casts(device_types=device_types):
        return [Decision(What.FUSE_QUANTIZE_OFF, "fuse_quantize", (
            f"torch {_compat.TORCH_VERSION_STR}'s Inductor CPU code does not round fused bf16 "
            "values as eager does, so fused quantizes would not give the recipe's FP8 bits; each "
            "quantize runs as one op (torch >= 2.13 fuses them)"))]
    if recipe is not None and not inlinable(recipe):
        return [Decision(What.FUSE_QUANTIZE_OFF, "fuse_quantize", (
            f"{recipes.as_recipe(recipe).name} quantizes run as one op each (graphpass inlines "
            f"{', '.join(INLINED_RECIPES[:-1])} and {INLINED_RECIPES[-1]} ones)"))]
    return []


@functools.lru_cache(maxsize=1)
def _patterns() -> Any:
    """The pattern pass, built on first use (importing Inductor's pattern matcher is slow)."""
    pm = _compat.inductor_pattern_matcher()
    patterns = pm.PatternMatcherPass(pass_name="graphpass_inline_quantize")

    # A quantize is inlined as the recipe's torch code, or, where graphpass's Triton kernels run
    # it, as the op's own code traced with the kernels' launches as Inductor's
    # (triton_quantize.inductor_launches): the compiled graph then launches them itself, with no
    # call of the op (its dispatch, checks and Triton's launcher on the host each step)
    @pm.register_graph_pattern(
        pm.CallFunction(ops.QUANTIZE, pm.KeywordArg("x"), pm.KeywordArg("recipe"),
                        pm.KeywordArg("role"), pm.KeywordArg("usage")),
        extra_check=lambda match: _inlined_whole(match.output_node())
        or triton_weight_quantize(match.output_node()),
        pass_dict=patterns,
    )
    def _inline(match: Any, x: fx.Node, recipe: str, role: str, usage: str) -> None:
        if triton_weight_quantize(match.output_node()):
            _replace_or_keep(match, lambda x: ops._quantize(x, recipe, role, usage), [x],
                             _traced_launches)
            return
        match.replace_by_example(
            lambda x: fused_quantize(_input(x, role), recipe, role, usage), [x],
            trace_fn=replacements.tracer(("fused", recipe, role, usage)))

    @pm.register_graph_pattern(
        pm.CallFunction(ops.QUANTIZE, pm.KeywordArg("x"), pm.KeywordArg("recipe"),
                        pm.KeywordArg("role"), pm.KeywordArg("usage"), pm.KeywordArg("offs")),
        # over token groups: per-row, per-(group, column), per-group or per-block scales, each
        # token's from the offsets on the device, no host sync; graphpass's Triton kernels run
        # the rowwise ones on CUDA
        extra_check=lambda match: inlinable(match.kwargs["recipe"])
        or triton_group_quantize(match.output_node()),
        pass_dict=patterns,
    )
    def _inline_groups(match: Any, x: fx.Node, recipe: str, role: str, usage: str,
                       offs: fx.Node) -> None:
        if triton_group_quantize(match.output_node()):
            _replace_or_keep(match, lambda x, offs: ops._quantize(x, recipe, role, usage, offs),
                             [x, offs], _traced_launches)
            return
        match.replace_by_example(
            lambda x, offs: ops.groups_torch(_stored(x), recipe, role, usage, offs), [x, offs],
            trace_fn=replacements.tracer(("groups", recipe, role, usage)))

    # The FP8 GEMMs torch's kernels run on CUDA (kernels="scaled_mm"): the op's own code traced,
    # torch._scaled_mm / torch._scaled_grouped_mm then Inductor's extern calls. One whose code
    # does not trace (a GEMM per token group reads the offsets on the host) stays the op.
    for arity in (len(_GEMM_ARGS) - 1, len(_GEMM_ARGS)):
        pm.register_graph_pattern(
            pm.CallFunction(ops.FP8_GEMM, *[pm.KeywordArg(k) for k in _GEMM_ARGS[:arity]]),
            extra_check=lambda match: _inlinable_gemm(match.output_node()),
            pass_dict=patterns,
        )(_inline_gemm)

    return patterns


_GEMM_ARGS = ("a", "a_scale_inv", "b", "b_scale_inv", "recipe", "roles", "out_dtype", "bias",
              "kernel", "offs")
_GEMM_OPERANDS = ("a", "a_scale_inv", "b", "b_scale_inv")


def _inlinable_gemm(node: fx.Node) -> bool:
    """Whether ``node`` (a ``graphpass::fp8_gemm``) runs torch's FP8 GEMMs on CUDA."""
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return (len(node.args) > 8 and node.args[8] == "scaled_mm"
            and isinstance(val, torch.Tensor) and val.device.type == "cuda")


def _inline_gemm(match: Any, **kwargs: Any) -> None:
    """Replaces the matched ``fp8_gemm`` by its code, each operand held to its stride order in
    the traced graph (``prims.inductor_force_stride_order``: the op's fixed stride order, which
    a TN-only FP8 GEMM needs), or leaves the op where that code does not trace."""
    names = [k for k in _GEMM_ARGS if k in kwargs]
    tensors = [k for k in names if isinstance(kwargs[k], fx.Node)]

    def gemm(*values: torch.Tensor) -> torch.Tensor:
        args = {**kwargs, **dict(zip(tensors, values))}
        for k in _GEMM_OPERANDS:
            args[k] = torch.ops.prims.inductor_force_stride_order(args[k], args[k].stride())
        return ops._fp8_gemm(*(args[k] for k in names))

    _replace_or_keep(match, gemm, [kwargs[k] for k in tensors],
                     lambda fn, values: _compat.inductor_pattern_matcher().fwd_only(fn, values))


def _replace_or_keep(match: Any, fn: Any, args: list, trace_fn: Any) -> None:
    """``match.replace_by_example(fn, args, trace_fn)``, or the op left where ``trace_fn``
    cannot trace ``fn`` (nothing is replaced before the trace succeeds), with an
    ``OpaqueOpWarning`` naming the node and why."""
    try:
        match.replace_by_example(fn, args, trace_fn=trace_fn)
    except Exception as e:  # noqa: BLE001  (the op runs as it did, and the warning says so)
        node = match.output_node()
        why = (str(e).strip().splitlines() or [""])[0][:200]
        warnings.warn(OpaqueOpWarning(
            f"graphpass: {node.name} ({node.target}) stays graphpass's op in Inductor's code, "
            f"its dispatch and checks on the host every step: its code did not trace "
            f"({type(e).__name__}{': ' + why if why else ''})"), stacklevel=2)
        _log.debug("%s stays the op: %s", node, e)


def _traced_launches(fn: Any, args: Any) -> fx.GraphModule:
    """``fn`` (a quantize on graphpass's Triton kernels) traced with each launch a
    ``torch.library.wrap_triton`` one, functionalized: each kernel one functional launch whose
    results are the buffers it writes (Inductor's reinplacing then writes them in place, and
    its code launches the kernel itself). Which buffers a kernel writes, torch finds from the
    kernel's Triton IR; where it cannot (no GPU target to compile for), it takes every argument
    as written, the quantize's input included, which Inductor's scheduler then failed on
    (``KeyError``, torch 2.11): such a trace is refused, and the op stays."""
    fwd_only = _compat.inductor_pattern_matcher().fwd_only
    with triton_quantize.inductor_launches():
        gm = fwd_only(torch.func.functionalize(fn, remove="mutations"), args)
    written = _inputs_written(gm)
    if written:
        raise ValueError(f"a Triton launch would write the quantize's input {written}")
    return gm


def _inputs_written(gm: fx.GraphModule) -> list[str]:
    """The placeholders of ``gm`` that a functional Triton launch in it writes (through views)."""
    functional = torch.ops.higher_order.triton_kernel_wrapper_functional
    out = []
    for node in gm.graph.nodes:
        if node.target is not functional:
            continue
        for name in node.kwargs.get("tensors_to_clone", ()):
            base = viewed(node.kwargs["kwargs"][name])
            if isinstance(base, fx.Node) and base.op == "placeholder":
                out.append(base.name)
    return out


_OPAQUE: contextvars.ContextVar[bool] = contextvars.ContextVar("graphpass_opaque_quantizes",
                                                              default=False)


@contextlib.contextmanager
def opaque_quantizes(opaque: bool = True) -> Iterator[None]:
    """Within it (``opaque``), ``computes_input_in_loops`` is False for every quantize: the
    graphs are compiled with ``fuse_quantize=False``, each quantize one op."""
    token = _OPAQUE.set(opaque)
    try:
        yield
    finally:
        _OPAQUE.reset(token)


_STORED_GRADIENTS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "graphpass_stored_gradients", default=False)


@contextlib.contextmanager
def stored_gradients(stored: bool = True) -> Iterator[None]:
    """Within it (``stored``), an inlined quantize of a gradient (role ``grad``) reads it from a
    buffer of its own on every device (``_input``), and ``computes_input_in_loops`` says so:
    the graphs are compiled with ``order_backward`` (``fp8/gemm_order.py``), where a gradient
    that its quantizes' kernels recompute would keep the producer's inputs alive until the last
    of them."""
    token = _STORED_GRADIENTS.set(stored)
    try:
        yield
    finally:
        _STORED_GRADIENTS.reset(token)


@contextlib.contextmanager
def quantize_code(config: Any) -> Iterator[None]:
    """How the quantizes of graphs compiled under ``config`` (a ``graphpass.Config``) read their
    inputs and when they run, for the step-peak model: ``opaque_quantizes`` under
    ``fuse_quantize=False``, ``stored_gradients`` and ``gemm_order.ordered_gemms`` under
    ``order_backward``."""
    with opaque_quantizes(not config.fuse_quantize), stored_gradients(config.order_backward), \
            ordered_gemms(config.order_backward):
        yield


def _inlined_whole(node: fx.Node) -> bool:
    """Whether the pattern pass inlines ``node`` (a ``graphpass::quantize``) with
    ``fused_quantize``: an inlinable recipe, not over token groups (offsets: one scale per token
    group, ``_inline_groups``), not the expert weights' Triton kernels."""
    return (node.target is ops.QUANTIZE and len(node.args) == 4 and inlinable(node.args[1])
            and not triton_weight_quantize(node))


def computes_input_in_loops(node: fx.Node) -> bool:
    """Whether Inductor's code runs ``node`` (a ``graphpass::quantize``) as loops that compute
    its input's elementwise producer in place, so that the input is never a buffer: an inlined
    quantize whose input is not stored (``_input``, on a GPU). On the CPU its input is stored;
    an op left whole (grouped, Triton, mxfp8, or every quantize under ``opaque_quantizes``:
    ``fuse_quantize=False``) reads its input from memory."""
    if _OPAQUE.get() or not _inlined_whole(node):
        return False
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(val, torch.Tensor) and not _stores_input(val, node.args[2])


def triton_weight_quantize(node: fx.Node) -> bool:
    """Whether ``node`` (a ``graphpass::quantize``) is a rowwise quantize of 3-D expert weights
    that graphpass's Triton kernels run (``ops.uses_triton_weight_kernel``): not inlined as the
    recipe's torch code, but as the kernels' launches (``_traced_launches``). The kernels read
    the weights for both copies' amaxes once, where Inductor's code reads them once per copy,
    and give the op's bits, so a weight's copies are the same whether the weight cache
    (``fp8_weight_cache``) holds them or each step quantizes them."""
    x = node.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    return (isinstance(val, torch.Tensor) and recipes.get_recipe(node.args[1]).per_row
            and ops.uses_triton_weight_kernel(val))


def triton_group_quantize(node: fx.Node) -> bool:
    """Whether ``node`` (a ``graphpass::quantize`` over token groups) is one that graphpass's
    Triton kernels run (``ops.uses_triton_group_kernel``: rowwise, on CUDA): not inlined as the
    recipe's torch code, but as the kernels' launches (``_traced_launches``). The kernels read
    the tokens twice for both copies and write the columnwise one straight into the 16-aligned
    layout; Inductor's code of the recipe reads them about four times, its transposed stores
    strided."""
    x, offs = node.args[0], node.args[4]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    offs_val = offs.meta.get("val") if isinstance(offs, fx.Node) else None
    return (isinstance(val, torch.Tensor) and isinstance(offs_val, torch.Tensor)
            and ops.uses_triton_group_kernel(val, node.args[1], offs_val))


def fused_quantize(x: torch.Tensor, recipe: str, role: str, usage: str) -> list[torch.Tensor]:
    """``graphpass::quantize``'s outputs, written for fusion: the same bits as the op's recipe
    (``ops._quantize``), with no fp32 value that two loops read. The recipe reads one fp32 copy
    of ``x`` twice (the amax, then the cast), and Inductor may realize a value that two loops
    read: a whole fp32 temporary (measured on the CPU: fp32 buffers of the SwiGLU output and of
    a columnwise input's transpose in the tiny Llama's step). Here the amax reduces ``x`` in its
    own dtype (abs and max are exact, so the fp32 of that max is the fp32 amax), and each copy
    casts ``x`` to fp32 on its own, inside its cast loop; a tensorwise ``both`` quantize shares
    one amax and one scale (the columnwise copy is the rowwise one transposed, bit for bit),
    rowwise (2-D, or a stack of expert matrices) has one amax per row of each copy. The scales
    are a buffer of their own (``_stored``)."""
    rec = recipes.get_recipe(recipe)
    if rec.scaling is recipes.Scaling.BLOCKWISE:
        return _fused_blockwise(x, recipe, role, usage)
    if rec.per_row and x.dim() in (2, 3):
        out = []
        for columnwise in ops._COLUMNWISE[usage]:
            # the recipe's arithmetic (recipes.rowwise_quantize) with its scales stored; x is
            # stored, so its fp32 upcast is a load and a convert in each loop that reads it
            x32 = (x.transpose(-2, -1) if columnwise else x).to(torch.float32)
            scale = _stored(recipes.row_scale(x32, recipe, role))
            out += [recipes.scaled_cast(x32, scale, recipe, role).contiguous(),
                    recipes.reciprocal(scale)]
        return out
    if x.dim() != 2 or recipes.block_shape(recipe, role) is not None:
        return ops._quantize(x, recipe, role, usage)  # the recipe as the op runs it
    amax = recipes._abs_amax(x, (0, 1)).to(torch.float32) if recipes._maybe_nonempty(x) else (
        x.new_zeros((), dtype=torch.float32))
    scale = _stored(recipes.tensorwise_scale(amax, recipe, role))
    scale_inv = recipes.reciprocal(scale)
    out: list[torch.Tensor] = []
    for columnwise in ops._COLUMNWISE[usage]:
        data = recipes.scaled_cast((x.t() if columnwise else x).to(torch.float32), scale, recipe,
                                   role).contiguous()
        out += [data, scale_inv.clone() if out else scale_inv]
    return out


def _fused_blockwise(x: torch.Tensor, recipe: str, role: str, usage: str) -> list[torch.Tensor]:
    """A blockwise quantize written for fusion, bit-identical to ``recipes.quantize``: ``x``
    (2-D, or a stack of matrices quantized one by one) is viewed as its blocks (zero-padded to
    whole ones, as the recipe pads a partial block), each block's amax reduced over ``|x|``
    upcast (exact), and each copy cast from ``x`` upcast inside its cast loop. Every block is
    local, so an amax is one reduction over its block, no global one. A 128x128 weight's
    columnwise copy has the rowwise copy's tiles transposed (the same amaxes, the same scales
    transposed, the same bits transposed): one amax serves both. A 1x128 columnwise copy has
    blocks down ``x``'s columns: its own amax, reduced over x's rows in place, with no transposed
    copy of ``x`` written first."""
    bm, bk = recipes.block_shape(recipe, role)
    rec = recipes.get_recipe(recipe)
    dtype = recipes.fp8_dtype(rec, role)
    *lead, m, k = x.shape

    def tiles(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """(..., R, C) zero-padded to whole tiles: (..., R/rows, rows, C/cols, cols), or
        (..., R, C/cols, cols) for one-row blocks (no dimension of size 1, which would give
        Inductor's view of the cast data back to (R, C) a copy of its own)."""
        r, c = t.shape[-2:]
        rb, cb = -(-r // rows), -(-c // cols)
        padded = torch.nn.functional.pad(t, (0, cb * cols - c, 0, rb * rows - r))
        if rows == 1:
            return padded.reshape(*lead, r, cb, cols)
        return padded.reshape(*lead, rb, rows, cb, cols)

    def scale_of(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
        # The amax of each tile of |t| upcast (exact: abs, the upcast and max are): no value
        # the cast loop also reads, and an fp32 accumulator (Inductor's C++ code declares one
        # bf16 variable per output of a bf16 reduction, twice where two quantizes' identical
        # amaxes share a kernel: a compile error).
        a = t.abs().to(torch.float32)
        amax = torch.where(torch.isnan(a), 0.0, a).amax(dim=dims)
        return _stored(recipes.blockwise_scale(amax, rec, role, x.dtype))

    def cast(src: torch.Tensor, scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        """(..., R, C) ``src`` cast by its (..., R/rows, C/cols) block scales, each broadcast
        over its block (an index ``k // 128`` in the cast loop, no copy): the cast reads
        ``src`` and the scales only, so a GEMM's copy of it recomputes from them."""
        r, c = src.shape[-2:]
        rb, cb = scale.shape[-2:]
        each = scale[..., :, None, :, None].expand(*lead, rb, rows, cb, cols)
        each = each.reshape(*lead, rb * rows, cb * cols)[..., :r, :c]
        return recipes._saturating_cast(src.to(torch.float32) * each, dtype).contiguous()

    out: list[torch.Tensor] = []
    if bm > 1:  # 128x128 tiles: both copies from one amax
        scale = scale_of(tiles(x, bm, bk), (-3, -1))  # (..., M/128, K/128)
        for columnwise in ops._COLUMNWISE[usage]:
            if columnwise:
                s = scale.transpose(-2, -1)
                out += [cast(x.transpose(-2, -1), s, bk, bm), recipes.reciprocal(s).contiguous()]
            else:
                out += [cast(x, scale, bm, bk), recipes.reciprocal(scale)]
        return out
    for columnwise in ops._COLUMNWISE[usage]:
        src = x.transpose(-2, -1) if columnwise else x
        scale = scale_of(tiles(src, 1, bk), (-1,))  # (..., R, C/128)
        out += [cast(src, scale, 1, bk), recipes.reciprocal(scale)]
    return out


def _input(x: torch.Tensor, role: str) -> torch.Tensor:
    """A quantize's input as its inlined loops read it: stored (``_stored``) for Inductor's C++
    code; as its producer's values on CUDA, where Inductor's Triton code computes an elementwise
    producer (a recomputed SwiGLU output, a SwiGLU gradient, a norm's output) inside the amax
    and each cast loop and realizes no fp32 temporary in its place. There no bf16 copy of the
    input is written or held: on the Llama-3-8B layer (seq 8192, torch 2.11,
    ``benchmarks/cuda_peak.py``) the backward then holds no (8192, 14336) bf16 SwiGLU output or
    gradient beside their FP8 copies, and Inductor's byte count of the step's kernels falls
    (tensorwise 11.2 -> 9.4 GB, rowwise 11.6 -> 9.9, blockwise 12.2 -> 10.9) with the step
    peak (tensorwise 1,249 -> 1,201 MiB above weights, inputs and gradients; rowwise 1,441 ->
    1,169; blockwise 1,250 -> 1,204). The bits are the stored input's: ``emulate_precision_casts``
    rounds the producer's bf16 values in registers as eager rounds them in memory. Within
    ``stored_gradients`` a gradient is stored on every device (``order_backward``)."""
    return _stored(x) if _stores_input(x, role) else x


def _stores_input(x: torch.Tensor, role: str) -> bool:
    """Whether an inlined quantize of ``x`` in ``role`` stores it first: for Inductor's C++
    code, and a gradient within ``stored_gradients``."""
    return x.device.type == "cpu" or (role == "grad" and _STORED_GRADIENTS.get())


def _stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a buffer of its own: an ``as_strided`` view of itself, which Inductor lowers by
    realizing ``t`` (it needs a storage to view; a contiguous ``t`` only, the layout Inductor
    gives a value it realizes). For a quantize's input and its scales:

    * the input: the amax and each cast read it in loops of their own (a columnwise copy in
      another order), and Inductor computes an unrealized elementwise producer (a SwiGLU
      gradient, a norm's output) inside every loop that reads it, or realizes what two loops
      share: ``|x|`` upcast, a whole fp32 temporary (measured on the CPU's code of the tiny Llama
      step). Stored, the input is the bf16 tensor the opaque op read, each loop reads it once;
    * the scales (1/128 of the data or less): computed from the amaxes in about 20 elementwise
      ops, which every cast loop would otherwise recompute per element, past Inductor's limit
      for inlining (100 ops), where it cuts the loop in two at a whole fp32 temporary of the
      scaled values."""
    return t.as_strided(t.shape, t.stride()) if t.is_contiguous() else t


def inline_quantizes(graph: fx.Graph) -> int:
    """Replace every inlinable ``graphpass::quantize`` in ``graph`` by its recipe's ops (each
    kind of quantize traced once: ``replacements``)."""
    with replacements.per_graph():
        return _patterns().apply(graph)


def post_grad_pass(source_hash: str, user_pass: Any, *, order_backward: bool = False) -> Any:
    """An Inductor ``post_grad_custom_pre_pass`` that inlines quantizes after ``user_pass`` (the
    one already configured, if any: a pass or a list of them, kept and run first); with
    ``order_backward``, each gradient's quantizes read it stored (``stored_gradients``) and the
    FP8 GEMMs' operand copies follow the graph's order (``gemm_order.order_gemm_operands``)."""
    _compat.guard_cpp_loop_split()  # blockwise quantizes index their scales as k // 128
    user_passes = [] if user_pass is None else (
        list(user_pass) if isinstance(user_pass, (list, tuple)) else [user_pass])

    class InlineQuantize(_compat.custom_graph_pass_base()):  # type: ignore[misc]
        def __call__(self, graph: fx.Graph) -> None:
            for p in user_passes:
                p(graph)
            with stored_gradients(order_backward):
                inline_quantizes(graph)
            if order_backward:
                order_gemm_operands(graph)

        def uuid(self) -> str:
            parts = [source_hash, f"order_backward={order_backward}"] + [
                str(p.uuid()) if hasattr(p, "uuid") else repr(p) for p in user_passes]
            return hashlib.sha256("|".join(parts).encode()).hexdigest()

    return InlineQuantize()
