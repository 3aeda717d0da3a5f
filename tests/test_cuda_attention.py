"""Attention whose value head dim differs from its query/key head dim (DeepSeek-V3's MLA), planned
on fake CPU tensors, saves what CUDA's memory-efficient kernel saves (its output and logsumexp),
not the (batch, heads, seq, seq) probabilities of SDPA's math path; a real compile still runs
the CPU's own SDPA (graphpass/graph/cuda_attention.py)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpass
from graphpass.decisions import What

BATCH, HEADS, SEQ, HIDDEN, QK, V = 1, 2, 64, 32, 24, 16


class TwoAttentions(nn.Module):
    """An MLA-like attention (q/k head dim 24, v head dim 16, one head count) and a grouped one
    (4 query heads over 2 key/value heads) with the same head dims."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HEADS * QK, bias=False)
        self.kv = nn.Linear(HIDDEN, HEADS * (QK + V), bias=False)
        self.gq = nn.Linear(HIDDEN, 2 * HEADS * QK, bias=False)
        self.o = nn.Linear(3 * HEADS * V, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HEADS, QK).transpose(1, 2)
        k, v = self.kv(x).view(b, n, HEADS, QK + V).transpose(1, 2).split([QK, V], dim=-1)
        mla = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        gq = self.gq(x).view(b, n, 2 * HEADS, QK).transpose(1, 2)
        grouped = F.scaled_dot_product_attention(gq, k, v, is_causal=True, enable_gqa=True)
        out = torch.cat((mla, grouped), dim=1)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


def test_mla_attention_plans_as_cudas_efficient_kernel():
    with torch.device("meta"):
        model = TwoAttentions().to(torch.bfloat16)
    x = torch.zeros(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, device="meta")
    report = graphpass.plan(model, x, config=graphpass.Config(codegen="eager"))

    efficient = [r for r in report.rows if r.op == "aten._scaled_dot_product_efficient_attention"]
    # bf16 output (batch, heads, seq, v), fp32 logsumexp (batch, heads, seq rounded up to 32),
    # and the int64 philox seed and offset
    assert sorted((r.shape, r.dtype, r.bytes) for r in efficient) == sorted([
        ((BATCH, HEADS, SEQ, V), "bfloat16", BATCH * HEADS * SEQ * V * 2),
        ((BATCH, HEADS, SEQ), "float32", BATCH * HEADS * SEQ * 4),
        ((), "int64", 8), ((), "int64", 8)])
    # the grouped attention stays on the math path: its seq x seq probabilities, and a note
    square = [r for r in report.rows if r.shape[-2:] == (SEQ, SEQ)]
    assert [(r.shape, r.dtype) for r in square] == [((BATCH, 2 * HEADS, SEQ, SEQ), "float32")]

    attention = [d for d in report.decisions
                 if d.what in (What.CUDA_ATTENTION, What.MATH_ATTENTION)]
    assert [d.what for d in attention] == [What.CUDA_ATTENTION, What.MATH_ATTENTION]
    assert all(d.module == "" for d in attention)
    assert "query/key head dim 24, value head dim 16" in attention[0].why
    assert "(2 for 4 query heads)" in attention[1].why
    assert [n for n in report.notes if n.startswith("attention ")] == [
        str(d) for d in attention]


def test_real_compile_keeps_torchs_sdpa():
    torch.manual_seed(0)
    model = TwoAttentions()
    x = torch.randn(BATCH, SEQ, HIDDEN)
    expected = model(x)
    expected.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    backend = graphpass.backend(codegen="eager")
    out = torch.compile(model, backend=backend)(x)
    out.sum().backward()
    torch.testing.assert_close(out, expected)
    for p, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, grad)
    report = backend.report()
    assert not any(d.what in (What.CUDA_ATTENTION, What.MATH_ATTENTION) for d in report.decisions)
    assert not any("efficient_attention" in r.op for r in report.rows)


def test_estimate_notes_the_attention_traced_as_on_cuda():
    with torch.device("meta"):
        model = TwoAttentions().to(torch.bfloat16)
    x = torch.zeros(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, device="meta")
    est = graphpass.estimate(model, x, optimizer=None, config=graphpass.Config(codegen="eager"))
    assert [n.split(":")[0] for n in est.notes if n.startswith("attention ")] == [
        "attention as on CUDA", "attention by the math path"]
    efficient = [r for r in est.report.rows
                 if r.op == "aten._scaled_dot_product_efficient_attention"]
    assert sum(r.bytes for r in efficient) == BATCH * HEADS * SEQ * (V * 2 + 4) + 16
