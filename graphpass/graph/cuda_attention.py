"""Attention on the fake CPU tensors of ``graphpass.plan`` and ``graphpass.estimate``, traced as
the kernel a CUDA device runs where the CPU would run SDPA's math path.

Contract: :func:`rewrite` takes dynamo's graph of a frame whose tensors are fake (never a graph
that runs on real tensors) and replaces each ``scaled_dot_product_attention`` whose value head
dim differs from the query/key head dim (DeepSeek-V3's multi-head latent attention: 192 for
query and key, 128 for the value) by a call of ``aten._scaled_dot_product_efficient_attention``,
the memory-efficient kernel CUDA's SDPA picks there (its flash kernel takes one head dim).
The CPU's fused flash kernel takes one head dim too, so on the fake CPU tensors torch would
decompose that SDPA into its math path, which saves the (batch, heads, seq, seq) fp32
probabilities for the backward: a tensor no GPU run saves. The efficient kernel's meta kernels
give what the GPU saves, its output and its logsumexp, and its backward is the efficient
backward. Each replaced call is a :class:`Decision` (``What.CUDA_ATTENTION``); a call left to
the math path because the efficient kernel does not take its grouped key/value heads is one too
(``What.MATH_ATTENTION``), so the seq x seq matrix in the report is never silent.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..decisions import Decision, What
from .nodes import module_path

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                                  "scale": None, "enable_gqa": False}


def efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """SDPA as CUDA's memory-efficient kernel (for fake tensors only: the CPU has no such
    kernel). A boolean mask becomes the additive bias SDPA makes of it on CUDA."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    compute_log_sumexp = any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, compute_log_sumexp, dropout_p, is_causal,
        scale=scale)[0]


def rewrite(gm: fx.GraphModule) -> list[Decision]:
    """Replace in ``gm`` (dynamo's graph of fake tensors) each SDPA whose value head dim differs
    from its query's by :func:`efficient_attention`; the decisions, one per call."""
    decisions: list[Decision] = []
    for node in list(gm.graph.find_nodes(op="call_function", target=F.scaled_dot_product_attention)):
        bound = dict(_SDPA_DEFAULTS)
        bound.update(zip(_SDPA_ARGS, node.args))
        bound.update(node.kwargs)
        shapes = [_shape(bound[name]) for name in ("query", "key", "value")]
        if any(s is None or len(s) < 2 for s in shapes):
            continue
        q, k, v = shapes
        if q[-1] == v[-1]:  # one head dim: the CPU's flash kernel, which saves what CUDA's does
            continue
        where = module_path(node)
        dims = f"query/key head dim {q[-1]}, value head dim {v[-1]}"
        if bound["enable_gqa"] and not (q[-3] == k[-3] == v[-3]):
            decisions.append(Decision(What.MATH_ATTENTION, "fake tensors", (
                f"{dims} with grouped key/value heads ({k[-3]} for {q[-3]} query heads): "
                "graphpass traces the memory-efficient kernel only where query, key and value have "
                "one head count, so SDPA's math path runs on the fake CPU tensors and saves the "
                "(batch, heads, seq, seq) fp32 probabilities, which a GPU run may not"), where))
            continue
        del bound["enable_gqa"]
        node.target = efficient_attention
        node.args = ()
        node.kwargs = bound
        decisions.append(Decision(What.CUDA_ATTENTION, "fake tensors", (
            f"{dims}: traced as CUDA's memory-efficient kernel "
            "(aten._scaled_dot_product_efficient_attention), which saves its output and "
            "logsumexp; the CPU's flash kernel takes one head dim, and SDPA's math path would "
            "save the (batch, heads, seq, seq) fp32 probabilities, which no GPU run saves"), where))
    if decisions:
        gm.recompile()
    return decisions


def _shape(value: Any) -> tuple[int, ...] | None:
    example = value.meta.get("example_value") if isinstance(value, fx.Node) else None
    return tuple(example.shape) if isinstance(example, torch.Tensor) else None
