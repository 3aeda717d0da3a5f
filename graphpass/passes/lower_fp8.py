"""Lower each linear's forward, dgrad and wgrad GEMMs to quantize + FP8 GEMM nodes.

Transformer Engine's layouts (fprop TN, dgrad NN, wgrad NT) become, with every operand stored
K-major as Hopper's TN-only FP8 GEMMs need:

    fprop  Y  = X  @ W.T   a = X rowwise         b = W rowwise
    dgrad  dX = dY @ W     a = dY rowwise        b = W columnwise (W.T, blocks along N)
    wgrad  dW = dY.T @ X   a = dY columnwise     b = X columnwise (X.T, blocks along M)

A weight stored [in, out] (GPT-2's Conv1D, ``Y = X @ W``) swaps W's two copies (fprop reads the
columnwise one) and computes dW = X.T @ dY (a = X columnwise, b = dY columnwise), which has W's
own (K, N) shape.

Quantizes of forward tensors (X, W, both usages) are forward nodes, as in TE, so by default the
partitioner saves the 1-byte columnwise copies for the backward; the save-original pass may move
them into the backward instead. Each forward tensor is quantized once per usage, however many
linears read it (q, k and v share one quantized norm output), and so is each gradient that several
linears read (a parallel block's two output projections, adding into one residual); a shared
quantize sits before the first of its GEMMs in the graph's order (``_move_before``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from ..graph.joint import Side, copy_checkpoint_tags, set_partition_side
from ..config import Config
from ..decisions import Decision, Plan, Quantized, What, facts, record
from ..fp8 import cost, ops, providers, recipes
from ..fp8.ops import FP8_GEMM, QUANTIZE
from ..graph import gemms
from ..graph.flops import node_flops
from ..graph.heads import HEAD_PATTERNS, output_heads
from ..graph.linears import Linear, find_grouped, find_grouped_offsets, find_linears
from ..graph.nodes import is_backward, module_path, op_name
from .partitioner import TrialPartitioner
from .save_original import merge_usages

_HIGH_PRECISION = (torch.float32, torch.bfloat16, torch.float16)
_VIEWS = ("aten.view", "aten.reshape", "aten._unsafe_view")


def lower_fp8(joint: fx.GraphModule, plan: Plan, config: Config,
              partitioner: TrialPartitioner) -> None:
    recipe = config.recipe
    if recipe is None:
        return
    quantized: dict[tuple[Any, ...], tuple[fx.Node, fx.Node]] = {}
    replaced: dict[fx.Node, fx.Node] = {}  # each GEMM lowered so far: its FP8 GEMM
    plain = find_linears(joint)
    linears = plain + find_grouped(joint) + find_grouped_offsets(joint)
    for pattern in config.fp8_exclude:
        plan.count("fp8_exclude", pattern, sum(fnmatch.fnmatchcase(lin.module, pattern) for lin in linears))
    heads = output_heads(plain)
    asked = [p for p in config.fp8_exclude if p in HEAD_PATTERNS]
    kept_heads = {f: (f"the output head ({how}); fp8_exclude's {' and '.join(map(repr, asked))} "
                      "keep it in high precision") for f, how in heads.items() if asked}
    slower = _slower_in_fp8(linears, config, plan, kept_heads)
    any_flops = config.replace(fp8_min_gemm_flops=0)  # fp8/fsdp.py's weights: see below
    for lin in linears:
        head = heads.get(lin.fprop)
        reason = (why_not_lowered(lin, config) or kept_heads.get(lin.fprop)
                  or slower.get(lin.fprop))
        if (reason and op_name(lin.w) == "graphpass.fsdp_fp8_weight" and lin.fprop not in
                kept_heads and why_not_lowered(lin, any_flops) is None):
            plan.decide(Decision(What.COST_NOT_JUDGED, "fp8", (  # no bf16 weight to run
                f"the weight arrives all-gathered in FP8 (graphpass.fsdp_fp8_weights), so the "
                f"linear is lowered; in bf16 otherwise: {reason}"), lin.module), once=True)
            reason = None
        if reason:
            plan.decide(Decision(What.NOT_LOWERED, "fp8", reason, lin.module), once=True)
            for node in (lin.fprop, lin.dgrad, lin.wgrad):
                if node is not None:
                    record(node, not_lowered=reason)
            continue
        device = lin.x.meta["val"].device
        try:
            provider, why = providers.resolve(config.kernels, recipe, device)
        except ValueError as e:
            raise ValueError(f"graphpass fp8 lowering of {lin.module or '<root>'}: {e}") from None
        if why:
            plan.decide(Decision(What.KERNELS, "fp8", why), once=True)
        _rewrite(joint, lin, recipe.key, provider.name, quantized, replaced)
        missing = [g for g, n in (("dgrad", lin.dgrad), ("wgrad", lin.wgrad)) if n is None]
        extra = f"; {', '.join(missing)} not in this graph" if missing else ""
        if head:  # lowered though the graph shows the output head: fp8_exclude names no head
            extra += (f"; the output head ({head}), lowered: fp8_exclude has neither "
                      f"{HEAD_PATTERNS[0]!r} nor {HEAD_PATTERNS[1]!r}")
        plan.decide(Decision(What.LOWERED, "fp8", f"{provider.name}/{recipe.label}{extra}",
                             lin.module), once=True)
        if provider.name == "scaled_mm" and (lin.offs is not None or lin.w.meta["val"].dim() == 3):
            plan.decide(Decision(What.GROUPED_GEMMS, "fp8", _grouped_kernels(recipe),
                                 lin.module), once=True)
        w = lin.w.meta["val"]
        if recipe.per_row and w.dim() == 3 and device.type == "cuda":
            plan.decide(Decision(What.WEIGHT_QUANTIZE, "fp8", _weight_kernel(w), lin.module),
                        once=True)
        if recipe.per_row and lin.offs is not None and device.type == "cuda":
            plan.decide(Decision(What.TOKEN_QUANTIZE, "fp8", _token_kernel(
                lin.x.meta["val"], recipe, lin.offs.meta["val"]), lin.module), once=True)
    _merge_grouped_gradient_quantizes(joint.graph)
    # No silent high-precision GEMM: every GEMM left is named, once per module and reason.
    for gemm in gemms.gemms(joint):
        if gemm.reason is not None:
            plan.decide(Decision(What.NOT_LOWERED, "fp8", gemm.reason, gemm.module), once=True)
    _lint(joint)
    joint.recompile()


def _merge_grouped_gradient_quantizes(graph: fx.Graph) -> None:
    """A token-grouped gradient's two copies (rowwise for dgrad, columnwise for wgrad) from one
    ``usage="both"`` quantize: the grouped kernels then read the gradient for both copies'
    amaxes once and again for both casts, where two quantizes read it four times. Same bits
    (the copies do not depend on each other); both copies are made at the first GEMM's
    quantize, which in a linear's backward is right before the other."""
    pairs: dict[tuple[Any, ...], dict[str, fx.Node]] = {}
    for node in graph.nodes:
        if node.target is QUANTIZE and len(node.args) > 4 and node.args[2] == "grad" \
                and is_backward(node):
            x, recipe, role, usage, offs = node.args[:5]
            pairs.setdefault((x, recipe, role, offs), {})[usage] = node
    for by_usage in pairs.values():
        if set(by_usage) == {"rowwise", "columnwise"}:
            merge_usages(graph, by_usage["rowwise"], by_usage["columnwise"])


def _lint(joint: fx.GraphModule) -> None:
    """torch's lint of the rewritten graph, failing with one line that names the module whose
    node is wrong (torch's own error, with its dump of the whole graph, is the cause)."""
    try:
        joint.graph.lint()
    except Exception as e:
        node, arg = _out_of_order(joint.graph)
        where = (module_path(node) or module_path(arg)) if node is not None else ""
        what = (f"node {node.name} reads {arg.name} before it is defined" if node is not None
                else str(e).splitlines()[0] if str(e) else type(e).__name__)
        workaround = f"; adding {where!r} to fp8_exclude keeps it in high precision" if where else ""
        raise RuntimeError(f"graphpass fp8 lowering of {where or '<root>'} produced an invalid "
                           f"graph: {what} (a graphpass bug{workaround})") from e


def _out_of_order(graph: fx.Graph) -> tuple[fx.Node | None, fx.Node | None]:
    """The first node of ``graph`` that reads a node defined after it, and that node."""
    seen: set[fx.Node] = set()
    for node in graph.nodes:
        for arg in node.all_input_nodes:
            if arg not in seen:
                return node, arg
        seen.add(node)
    return None, None


def _precedes(a: fx.Node, b: fx.Node) -> bool:
    """Whether node ``a`` comes before node ``b`` of the same graph: two walks forward, one from
    each, so the cost is the distance between them, not the graph's length."""
    walks = [a, b]
    while walks[0] is not None or walks[1] is not None:
        for i, (found, answer) in enumerate(((b, True), (a, False))):
            if walks[i] is None:
                continue
            walks[i] = walks[i].next
            if walks[i] is found:
                return answer
            if walks[i].op == "root":  # the end of the graph
                walks[i] = None
    raise ValueError(f"{a.name} and {b.name} are not two nodes of one graph")


def _move_before(reused: tuple[fx.Node, fx.Node], x: fx.Node, before: fx.Node) -> None:
    """A quantize is shared by every GEMM that reads the same tensor in the same role and usage
    (q, k and v read one norm output; two output projections whose outputs meet in one residual
    read one gradient). It was inserted before its first GEMM in the lowering's order, which need
    not be the graph's: where it comes after ``before`` (the GEMM that reuses it), it moves with
    its two getitems to just before ``before``; where its input comes after ``before`` too (a
    view of the tensor made for another linear), it reads ``x``, this GEMM's view of the same
    tensor, instead. A quantize already before ``before`` stays where it is."""
    data, scale = reused
    q = data.args[0]
    if _precedes(q, before):
        return
    old = q.args[0]
    if not _precedes(old, before):
        q.update_arg(0, x)
        for node in (q, data, scale):
            record(node, quantized=dataclasses.replace(facts(node).quantized, source=x))
        if not old.users and op_name(old) in _VIEWS:
            old.graph.erase_node(old)
    for node in (q, data, scale):
        before.prepend(node)


def _slower_in_fp8(linears: list[Linear], config: Config, plan: Plan,
                   kept: dict[fx.Node, str] | None = None) -> dict[fx.Node, str]:
    """The linears, MoE experts included, that the roofline of ``config.fp8_cost_model``
    estimates faster in bf16, by forward node, with the reason (output heads ``kept`` in high
    precision are not estimated). A linear's input quantize is shared by the lowered linears
    that read the same tensor (q, k and v; an expert's gate and up projections), and costs
    nothing more where one of them is lowered anyway. The estimate reads no memory option:
    ``fp8_weight_cache`` is a memory decision, which never changes numerics, so it never
    changes which linears are lowered; where the cache would make FP8 the faster (weights
    quantized once per optimizer step), the note says so."""
    if config.fp8_cost_model == "off":
        return {}
    eligible = [lin for lin in linears
                if why_not_lowered(lin, config) is None and lin.fprop not in (kept or {})]
    sharers: dict[Any, int] = {}
    for lin in eligible:
        sharers[_canonical(lin.x)] = sharers.get(_canonical(lin.x), 0) + 1
    shapes = {lin.fprop: mnkg for lin in eligible if (mnkg := _gemm_shape(lin)) is not None}
    for lin in eligible:  # a dynamic size: lowered as asked, and said
        if lin.fprop not in shapes and (dynamic := _dynamic_sizes(lin)):
            plan.decide(Decision(What.COST_NOT_JUDGED, "fp8", (
                f"{dynamic}: the roofline has no size to judge it by; lowered"), lin.module),
                once=True)

    def estimate(lin: Linear, **kw: Any) -> cost.Estimate:
        m, n, k, groups = shapes[lin.fprop]
        return cost.linear_estimate(m, n, k, groups=groups, **kw)

    first = {lin.fprop: estimate(lin, input_sharers=sharers[_canonical(lin.x)])
             for lin in eligible if lin.fprop in shapes}
    lowered_inputs = {_canonical(lin.x) for lin in eligible
                      if lin.fprop not in first or not first[lin.fprop].faster_in_bf16}
    slower = {}
    for lin in eligible:
        if lin.fprop not in first or not first[lin.fprop].faster_in_bf16:
            continue
        quantized = _canonical(lin.x) in lowered_inputs
        bf16 = estimate(lin, input_quantized=quantized)
        if not bf16.faster_in_bf16:
            continue
        m, n, k, groups = shapes[lin.fprop]
        average = " (M: the token groups' average)" if lin.offs is not None else ""
        shape = f"M={m if isinstance(m, int) else round(m, 1)} N={n} K={k}" + (
            f" per expert{average}, {groups} experts" if groups > 1 else "")
        lowers = "fp8_cost_model='off' lowers it"
        cached = estimate(lin, input_quantized=quantized, weight_cached=True)
        if not cached.faster_in_bf16:
            lowers += ("; with gradient accumulation and fp8_weight_cache=True (the weight "
                       "quantized once per optimizer step) FP8 is the faster: "
                       f"{cached.fp8_time()}")
        slower[lin.fprop] = f"faster in bf16 ({bf16.describe()}, {shape}; {lowers})"
    return slower


def _gemm_sizes(lin: Linear) -> tuple[Any, Any, Any, Any]:
    """A linear's GEMM sizes, any of them a symbol under dynamic shapes: (M, the rows over all
    groups; N; K; groups, 1 for a plain linear)."""
    x, w = lin.x.meta["val"], lin.w.meta["val"]
    k = x.shape[-1]
    rows = x.numel() // k if not isinstance(k, int) or k else 0
    n = w.shape[-1] if lin.stored_kn else w.shape[-2]
    return rows, n, k, w.shape[0] if w.dim() == 3 else 1


def _dynamic_sizes(lin: Linear) -> str:
    """The sizes of a linear's GEMMs that are symbolic, in words (``M=s0 is dynamic``), or ""."""
    rows, n, k, _ = _gemm_sizes(lin)
    dynamic = [f"{d}={v}" for d, v in (("M", rows), ("K", k), ("N", n)) if not isinstance(v, int)]
    return f"{' and '.join(dynamic)} {'is' if len(dynamic) == 1 else 'are'} dynamic" \
        if dynamic else ""


def _gemm_shape(lin: Linear) -> tuple[float, int, int, int] | None:
    """A linear's GEMM shape for the cost model: (M tokens per group, N, K, groups); a plain
    linear is one group of all its rows, a ``bmm`` expert's M its capacity, token groups'
    (offsets) M the tokens over the experts (their average). None where a size is dynamic."""
    rows, n, k, groups = _gemm_sizes(lin)
    if not all(isinstance(d, int) for d in (rows, n, k, groups)) or not k or not groups:
        return None
    return (rows // groups if rows % groups == 0 else rows / groups), n, k, groups


def _grouped_kernels(recipe: recipes.Recipe) -> str:
    """How the scaled_mm provider runs an expert linear's three GEMMs (fp8/providers.py): by
    the recipe's scaling (blockwise: torch's blockwise GEMM, whatever its scales), then by its
    gradients' format (the grouped kernel takes E4M3 operands only)."""
    if recipe.scaling is recipes.Scaling.BLOCKWISE:
        return ("forward, dgrad and wgrad one blockwise torch scaled_mm per expert: torch has no "
                "grouped blockwise FP8 GEMM")
    # which GEMMs accumulate fast: torchao's MoE training runs all three fast (its grouped GEMMs
    # took 14% less time than graphpass's under "te" on an H200, docs/numbers.md)
    acc = recipe.accumulation
    accumulation = (f"; accumulation: forward {acc['fprop']}, dgrad {acc['dgrad']}, wgrad "
                    f"{acc['wgrad']} (fp8_accumulate={recipe.accumulate!r}; 'fast' for all three "
                    "as torchao's MoE training)")
    if recipe.dtype("grad") == recipes.E4M3:
        return ("forward, dgrad and wgrad each one torch._scaled_grouped_mm (CUDA sm90+, its "
                "emulation on the CPU; one torch._scaled_mm per expert on older GPUs)"
                + accumulation)
    return ("forward one torch._scaled_grouped_mm (CUDA sm90+, its emulation on the CPU); dgrad "
            "and wgrad one torch._scaled_mm per expert: their gradient operand is E5M2 "
            "(tensorwise's HYBRID format), which the grouped kernel refuses (E4M3 only); "
            "fp8_format='e4m3' or fp8='rowwise' runs all three as one grouped kernel each"
            + accumulation)


def _weight_kernel(w: torch.Tensor) -> str:
    """What quantizes a rowwise 3-D expert weight on CUDA: graphpass's Triton kernels, or why
    Inductor's fused code of the recipe does instead (the same bits, each copy one more read of
    the weight)."""
    why = ops.why_not_triton_weight_kernel(w)
    if why is None:
        return ("graphpass's Triton kernels (fp8/triton_quantize.py: both copies' amaxes from "
                "one read of the weight)")
    return (f"Inductor's fused code, not graphpass's Triton kernels: {why} (the same bits, one "
            "more read of the weight per copy)")


def _token_kernel(x: torch.Tensor, recipe: recipes.Recipe, offs: torch.Tensor) -> str:
    """What quantizes a rowwise expert GEMM's token-grouped operands on CUDA: graphpass's Triton
    kernels, or why Inductor's fused code of the recipe does instead (the same bits)."""
    why = ops.why_not_triton_group_kernel(x, recipe, offs)
    if why is None:
        return ("graphpass's Triton kernels (fp8/triton_grouped.py: both copies from two reads of "
                "the tokens, the wgrad copy written straight into the 16-aligned token layout)")
    return f"Inductor's fused code, not graphpass's Triton kernels: {why} (the same bits)"


def why_not_lowered(lin: Linear, config: Config) -> str | None:
    """Why a linear stays in high precision, in the user's words, or None to lower it."""
    for pattern in config.fp8_exclude:
        if fnmatch.fnmatchcase(lin.module, pattern):
            return f"excluded by pattern {pattern!r}"
    x, w = lin.x.meta["val"], lin.w.meta["val"]
    if x.dtype not in _HIGH_PRECISION or w.dtype not in _HIGH_PRECISION:
        return f"dtype {x.dtype}/{w.dtype} is not float32, bfloat16 or float16"
    # x is (M, K) or, for grouped experts, (groups, M, K); W is (N, K), or (K, N) when stored
    # [in, out], with the same leading groups.
    *_, m, k = x.shape
    n = w.shape[-1] if lin.stored_kn else w.shape[-2]
    recipe = config.recipe
    multiple = recipe.multiple
    # wgrad contracts over M (tokens). Block recipes scale the wgrad's operands in blocks along M,
    # so M needs their alignment; token groups (offsets) are quantized per group, padded where a
    # block would span two (fp8/ops.py). Tensorwise has no block along M, and every provider
    # zero-pads a contraction to 16 (exact): M may be any size, even dynamic (the tokens a
    # per-expert loop routes to one expert: nonzero's unbacked size). Rowwise likewise: a scale
    # spans a whole row along M, never a block of it.
    tensorwise = recipe.per_row or recipe.block("input") is None
    for dim, size in (("K", k), ("N", n), ("M", m)):
        if dim == "M" and tensorwise:
            continue
        if not isinstance(size, int):
            return f"{dim}={size} is dynamic; FP8 GEMMs need static multiples of {multiple}"
        if size % multiple and not (dim == "M" and lin.offs is not None):
            return f"{dim}={size} not a multiple of {multiple}"
    # torch's formula: 2*M*N*K, per group for experts; over token groups 2*T*N*K
    flops = 2 * m * n * k if lin.offs is not None else node_flops(lin.fprop)
    if flops < config.fp8_min_gemm_flops:
        return f"GEMM of {flops:,} FLOPs is below fp8_min_gemm_flops={config.fp8_min_gemm_flops:,}"
    return None


def _rewrite(joint: fx.GraphModule, lin: Linear, recipe: str, kernel: str,
             quantized: dict[tuple[Any, ...], tuple[fx.Node, fx.Node]],
             replaced: dict[fx.Node, fx.Node] | None = None) -> None:
    graph = joint.graph
    replaced = {} if replaced is None else replaced
    # The linears were found before any was lowered: one that reads another's output (a 2-D
    # chain, no view between them) reads its FP8 GEMM now.
    for field in ("x", "w", "bias", "offs"):
        node = getattr(lin, field)
        while node in replaced:
            node = replaced[node]
        setattr(lin, field, node)

    def quantize(x: fx.Node, role: str, columnwise: bool, before: fx.Node, backward: bool,
                 offs: fx.Node | None = None):
        key = (_canonical(x), role, columnwise, offs)
        if key in quantized:
            _move_before(quantized[key], x, before)
        else:
            usage = "columnwise" if columnwise else "rowwise"
            args = (x, recipe, role, usage) if offs is None else (x, recipe, role, usage, offs)
            with graph.inserting_before(before):
                q = _call(graph, QUANTIZE, args, before, backward)
                data = _call(graph, operator.getitem, (q, 0), before, backward)
                scale = _call(graph, operator.getitem, (q, 1), before, backward)
            for node in (q, data, scale):
                record(node, quantized=Quantized(role, columnwise, x, recipe))
            record(scale, fp8_scale=True)
            quantized[key] = (data, scale)
        return quantized[key]

    def gemm(old: fx.Node, a, b, roles: str, bias: fx.Node | None, backward: bool,
             offs: fx.Node | None = None, before: fx.Node | None = None) -> None:
        args = (*a, *b, recipe, roles, old.meta["val"].dtype, bias, kernel)
        before = before or old
        with graph.inserting_before(before):
            new = _call(graph, FP8_GEMM, args if offs is None else (*args, offs), before,
                        backward)
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        replaced[old] = new

    if lin.offs is not None:
        _rewrite_token_groups(lin, quantize, gemm)
        return
    fprop = lin.fprop
    # The GEMMs want W as (N, K) for fprop and (K, N) for dgrad, both K-major. A weight stored
    # [in, out] (K, N) is the transpose of nn.Linear's: its rowwise copy is what dgrad reads and
    # its columnwise copy (the quantization of W.T) what fprop reads. Either way W is quantized
    # from the parameter itself, never from a transposed copy of it.
    kn = lin.stored_kn
    qx = quantize(lin.x, "input", False, fprop, backward=False)
    qw = quantize(lin.w, "weight", kn, fprop, backward=False)
    if lin.wgrad is not None:
        qxt = quantize(lin.x, "input", True, fprop, backward=False)
    if lin.dgrad is not None:
        qwt = quantize(lin.w, "weight", not kn, fprop, backward=False)
    gemm(fprop, qx, qw, "input,weight", lin.bias, backward=False)
    if lin.dgrad is not None:
        qg = quantize(lin.dgrad.args[0], "grad", False, lin.dgrad, backward=True)
        gemm(lin.dgrad, qg, qwt, "grad,weight", None, backward=True)
    if lin.wgrad is not None and not kn:
        grad = lin.wgrad.args[0].args[0]  # wgrad reads permute(dY)
        qgt = quantize(grad, "grad", True, lin.wgrad, backward=True)
        gemm(lin.wgrad, qgt, qxt, "grad,input", None, backward=True)
    elif lin.wgrad is not None:  # dW = X.T @ dY, (K, N) like the stored weight
        qgt = quantize(lin.wgrad.args[1], "grad", True, lin.wgrad, backward=True)
        gemm(lin.wgrad, qxt, qgt, "input,grad", None, backward=True)


def _rewrite_token_groups(lin: Linear, quantize: Callable[..., Any], gemm: Callable[..., Any]) -> None:
    """``_rewrite`` for experts over token groups (``Linear.offs``): the tokens' quantizes and the
    GEMMs take the offsets; the weights are quantized per expert, as for ``bmm`` experts."""
    offs, kn, fprop = lin.offs, lin.stored_kn, lin.fprop
    qx = quantize(lin.x, "input", False, fprop, False, offs)
    qw = quantize(lin.w, "weight", kn, fprop, False)
    if lin.wgrad is not None:
        qxt = quantize(lin.x, "input", True, fprop, False, offs)
    if lin.dgrad is not None:
        qwt = quantize(lin.w, "weight", not kn, fprop, False)
    gemm(fprop, qx, qw, "input,weight", None, False, offs)
    bw = lin.fused_backward
    if bw is not None:  # transformers' fallback backward: (x, W (E, K, N), offs, dY) -> (dX, dW)
        grad = bw.args[3]
        if lin.dgrad is not None:
            qg = quantize(grad, "grad", False, bw, True, offs)
            gemm(lin.dgrad, qg, qwt, "grad,weight", None, True, offs, before=bw)
        qgt = quantize(grad, "grad", True, bw, True, offs)
        gemm(lin.wgrad, qxt, qgt, "input,grad", None, True, offs, before=bw)
        if not bw.users:
            bw.graph.erase_node(bw)
        return
    if lin.dgrad is not None:
        qg = quantize(lin.dgrad.args[0], "grad", False, lin.dgrad, True, offs)
        gemm(lin.dgrad, qg, qwt, "grad,weight", None, True, offs)
    if lin.wgrad is not None:
        # (E, N, K): dW = dY.T @ x, (E, K, N): dW = x.T @ dY; both read dY columnwise. A
        # gradient transposed after its GEMM (``wgrad_flipped``) is the other one's.
        kn = kn != lin.wgrad_flipped
        grad = lin.wgrad.args[1] if kn else lin.wgrad.args[0].args[0]
        qgt = quantize(grad, "grad", True, lin.wgrad, True, offs)
        if kn:
            gemm(lin.wgrad, qxt, qgt, "input,grad", None, True, offs)
        else:
            gemm(lin.wgrad, qgt, qxt, "grad,input", None, True, offs)


def _canonical(x: fx.Node) -> Any:
    """Views of one tensor to one shape are one tensor (each linear may view its 3-D input), and
    an alias is its base (the canonicalize pass removes aliases; one kept as a graph output)."""
    if op_name(x) == "aten.alias":
        return _canonical(x.args[0])
    if op_name(x) in _VIEWS:
        return (_canonical(x.args[0]), tuple(x.args[1]))
    return x


def _call(graph: fx.Graph, target: Callable[..., Any], args: tuple, like: fx.Node,
          backward: bool) -> fx.Node:
    """A new node with fake-tensor metadata, on the forward or backward side of ``like``."""
    node = graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if target is operator.getitem:
        node.meta["val"] = vals[0][vals[1]]
    else:
        with fake_mode or contextlib.nullcontext():
            node.meta["val"] = target(*vals)
    set_partition_side(node, Side.BACKWARD if backward else Side.FORWARD)
    for key in ("nn_module_stack", "fwd_nn_module_stack", "seq_nr", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    # Inside a user's checkpoint region (torch.utils.checkpoint, SAC), the quantizes and FP8 GEMM
    # that replace a GEMM keep the region's policy: the user's checkpoint still covers them.
    if not backward:
        copy_checkpoint_tags(like, node)
    return node

