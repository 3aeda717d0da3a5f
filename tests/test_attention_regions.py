"""Attention written by hand is ``core_attn`` by its arithmetic (graph/regions.py): a scores GEMM
of two activations, scaling, masking, extra logits, the row maximum subtracted, a softmax,
dropout, and a values GEMM that contracts the softmax's dimension. Each variant is written as
the library writes it (transformers' eager attention functions, copied op for op); each test
checks the exact ops selected and the exact tensors saved, and that the scores and the softmax
are recomputed, not saved. Nothing else is attention: a GEMM, ReLU, GEMM; a softmax over the
queries or over the heads; a softmax whose GEMMs contract another dimension; scores against a
weight."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy

import graphpass
from graphpass import _compat, pipeline
from graphpass.graph.nodes import op_name
from graphpass.graph.regions import Regions
from graphpass.selections import EmptySelectionWarning

DIM, HEADS, KV_HEADS, SEQ, BATCH = 64, 4, 2, 16, 2
HEAD = DIM // HEADS


def _causal_additive(dtype):
    """The 4-D additive mask transformers' masking utilities pass to eager attention."""
    return torch.full((SEQ, SEQ), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]


def _repeat_kv(hidden_states, n_rep):
    """transformers' ``repeat_kv`` (models/llama/modeling_llama.py)."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class _Projections(nn.Module):
    """q/k/v/o projections with grouped K/V heads, as transformers' Llama attention has them."""

    def __init__(self, dropout=0.0, built_mask=False):
        super().__init__()
        self.built_mask = built_mask  # built in the forward (from positions), or a buffer
        self.register_buffer("mask", _causal_additive(torch.float32), persistent=False)
        self.q_proj = nn.Linear(DIM, HEADS * HEAD)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD)
        self.o_proj = nn.Linear(HEADS * HEAD, DIM)
        self.num_key_value_groups = HEADS // KV_HEADS
        self.scaling = HEAD ** -0.5
        self.attention_dropout = dropout

    def forward(self, x):
        shape = (*x.shape[:-1], -1, HEAD)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = self.attend(q, k, v, _causal_additive(x.dtype) if self.built_mask else self.mask.to(x.dtype))
        return x + self.o_proj(out.reshape(*x.shape[:-1], -1).contiguous())

    def masked_scores(self, query, key, value, attention_mask):
        """The lines transformers' ``eager_attention_forward`` of Llama and GPT-OSS share: KV
        heads repeated, scaled scores, the additive mask."""
        key_states = _repeat_kv(key, self.num_key_value_groups)
        value_states = _repeat_kv(value, self.num_key_value_groups)
        attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * self.scaling
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        return attn_weights, value_states


class LlamaEager(_Projections):
    """transformers' ``eager_attention_forward`` of Llama: softmax in fp32, then cast back."""

    def attend(self, query, key, value, attention_mask):
        attn_weights, value_states = self.masked_scores(query, key, value, attention_mask)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
        attn_weights = nn.functional.dropout(attn_weights, p=self.attention_dropout, training=self.training)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous()


class GptOssEager(_Projections):
    """transformers' ``eager_attention_forward`` of GPT-OSS: a learned sink logit per head
    concatenated to the scores, the row maximum subtracted, the sink dropped after the softmax."""

    def __init__(self, dropout=0.0, built_mask=False):
        super().__init__(dropout, built_mask)
        self.sinks = nn.Parameter(torch.randn(HEADS))

    def attend(self, query, key, value, attention_mask):
        attn_weights, value_states = self.masked_scores(query, key, value, attention_mask)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[-2], -1)
        combined_logits = torch.cat([attn_weights, sinks], dim=-1)
        combined_logits = combined_logits - combined_logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined_logits, dim=-1, dtype=combined_logits.dtype)
        scores = probs[..., :-1]  # we drop the sink here
        attn_weights = nn.functional.dropout(
            scores, p=self.attention_dropout, training=self.training).to(value_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        return attn_output.transpose(1, 2).contiguous()


class Gpt2Attn(nn.Module):
    """GPT-2's ``_attn`` (transformers 4.x; ImageGPT's today): fused q/k/v split, scores divided
    by a 0-d tensor, the causal mask a bool buffer applied with ``where``, softmax, ``type``."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        causal = torch.tril(torch.ones((SEQ, SEQ), dtype=torch.bool)).view(1, 1, SEQ, SEQ)
        self.register_buffer("bias", causal, persistent=False)
        self.attn_dropout = nn.Dropout(dropout)

    def _attn(self, query, key, value):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype,
                                                 device=attn_weights.device)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        mask_value = torch.finfo(attn_weights.dtype).min
        mask_value = torch.full([], mask_value, dtype=attn_weights.dtype, device=attn_weights.device)
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        return torch.matmul(attn_weights, value)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, HEAD).permute(0, 2, 1, 3) for t in self.c_attn(x).split(DIM, dim=2))
        out = self._attn(q, k, v).permute(0, 2, 1, 3).contiguous().view(b, s, DIM)
        return x + self.c_proj(out)


def _alibi_slopes(heads):
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    return torch.tensor([start ** (i + 1) for i in range(heads)])


class BloomAlibi(nn.Module):
    """Bloom's attention: ALiBi's per-head linear bias as the ``baddbmm`` input of the scores,
    an additive mask, softmax in fp32 cast back, ``bmm`` with the values."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)
        self.attention_dropout = nn.Dropout(dropout)
        self.inv_norm_factor = 1.0 / math.sqrt(HEAD)
        self.register_buffer("mask", _causal_additive(torch.float32), persistent=False)

    def forward(self, x):
        b, s, _ = x.shape
        fused = self.query_key_value(x).view(b, s, HEADS, 3, HEAD)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))
        q = q.reshape(b * HEADS, -1, HEAD)
        k = k.reshape(b * HEADS, -1, HEAD).transpose(-1, -2)
        v = v.reshape(b * HEADS, -1, HEAD)
        positions = torch.arange(s, dtype=torch.float32)
        alibi = (_alibi_slopes(HEADS)[:, None] * positions).repeat(b, 1).view(b * HEADS, 1, s).to(x.dtype)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=self.inv_norm_factor)
        attn_weights = scores.view(b, HEADS, s, -1) + self.mask.to(x.dtype)
        probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        probs = self.attention_dropout(probs)
        context = torch.bmm(probs.view(b * HEADS, s, -1), v)
        context = context.view(b, HEADS, s, HEAD).permute(0, 2, 1, 3).reshape(b, s, DIM)
        return x + self.dense(context)


# --- harness ----------------------------------------------------------------------------------

def _x(dtype=torch.float32):
    torch.manual_seed(1)
    return torch.randn(BATCH, SEQ, DIM, dtype=dtype)


def _plan(model, dtype=torch.float32, **cfg):
    """(report, the joint graph's recomputed forward ops as a Counter of (op, shape), the ops
    ``Regions.attention`` holds, likewise, the EmptySelectionWarnings' messages)."""
    got = {}
    original = pipeline.PASSES

    def recorded(graph_pass):
        def run(joint, plan, config, partitioner):
            if graph_pass.__name__ == "recompute":
                got["attention"] = _ops(Regions(joint).attention)
            graph_pass(joint, plan, config, partitioner)
            if graph_pass.__name__ == "recompute":
                got["recomputed"] = _ops(n for n in joint.graph.nodes
                                         if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE)
        run.__name__ = graph_pass.__name__
        return run

    pipeline.PASSES = tuple(recorded(p) for p in original)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", EmptySelectionWarning)
            report = graphpass.plan(model.to(dtype), _x(dtype).requires_grad_(),
                                    config=graphpass.Config(**cfg))
    finally:
        pipeline.PASSES = original
    empty = [str(w.message) for w in caught if issubclass(w.category, EmptySelectionWarning)]
    return report, got.get("recomputed", collections.Counter()), got["attention"], empty


def _ops(nodes):
    from graphpass.graph.nodes import tensor_val
    return collections.Counter((op_name(n), tuple(tensor_val(n).shape) if tensor_val(n) is not None else ())
                               for n in nodes)


def _saved(report):
    """The saved activations as a Counter of (op, shape, dtype)."""
    return collections.Counter((r.op, r.shape, r.dtype) for r in report.rows if r.kind != "parameter")


# --- what core_attn selects -------------------------------------------------------------------

S4, S3, ROW = (BATCH, HEADS, SEQ, SEQ), (BATCH * HEADS, SEQ, SEQ), (BATCH, HEADS, SEQ, 1)
REPEATED = (BATCH, KV_HEADS, HEADS // KV_HEADS, SEQ, HEAD)  # repeat_kv's copy of K or V
# Softmax decomposed as the joint graph holds it: the row max, exp, sum, div.
SOFTMAX = {("aten.amax", ROW): 1, ("aten.sub", S4): 1, ("aten.exp", S4): 1, ("aten.sum", ROW): 1,
           ("aten.div", S4): 1}
# repeat_kv for K and V (its copy, its view to the query heads), K transposed, the expand and
# copy of Q the batched matmul makes, the views to and from the bmm's 3-D operands and result
REPEAT_KV = {("aten.clone", REPEATED): 2, ("aten.view", S4): 3, ("aten.permute", S4): 1,
             ("aten.expand", S4): 3, ("aten.clone", S4): 1, ("aten.view", S3): 4}
def _inputs(dtype):
    """The saved inputs of the q/k/v projections and of the output projection."""
    return {("aten.view", (BATCH * SEQ, DIM), dtype): 2}


def _qkv(dtype):
    """Q, and K and V with their KV heads only: the projections' outputs."""
    return {("aten.addmm", (BATCH * SEQ, HEADS * HEAD), dtype): 1,
            ("aten.addmm", (BATCH * SEQ, KV_HEADS * HEAD), dtype): 2}


CASES = {
    # (module, dtype, the ops core_attn selects, the activations saved with it as (op, shape,
    # dtype))
    "llama": (LlamaEager, torch.bfloat16, {
        ("aten.bmm", S3): 2, ("aten.mul", S4): 1, ("aten.add", S4): 1, **SOFTMAX, **REPEAT_KV,
        ("prims.convert_element_type", S4): 2,  # to fp32 for the softmax, and back
    }, {**_qkv("bfloat16"), **_inputs("bfloat16")}),
    "gpt_oss": (GptOssEager, torch.float32, {
        ("aten.bmm", S3): 2, ("aten.mul", S4): 1, ("aten.add", S4): 1, **REPEAT_KV,
        # the sink logit concatenated, the row maximum (with its indices) subtracted, the softmax
        # over one more column, the sink's column dropped; the copy the slice's matmul makes
        ("aten.cat", (*S4[:3], SEQ + 1)): 1, ("aten.max", ()): 1, ("getitem", ROW): 2,
        ("aten.amax", ROW): 1, ("aten.sub", (*S4[:3], SEQ + 1)): 2, ("aten.exp", (*S4[:3], SEQ + 1)): 1,
        ("aten.sum", ROW): 1, ("aten.div", (*S4[:3], SEQ + 1)): 1, ("aten.slice", S4): 1,
        # the sliced probabilities copied for the bmm (torch 2.15's matmul reads them as they are)
        ("aten.clone", S4): 2 if _compat.TORCH_VERSION < (2, 15) else 1,
    }, {**_qkv("float32"), **_inputs("float32")}),
    "gpt2": (Gpt2Attn, torch.float32, {
        # scores divided, the causal mask applied with where, the softmax; the bmm operands'
        # copies of Q, K and V are slices of the fused projection's output: saved, not recomputed
        ("aten.bmm", S3): 2, ("aten.view", S4): 1, ("aten.div", S4): 2, ("aten.where", S4): 1,
        ("aten.amax", ROW): 1, ("aten.sub", S4): 1, ("aten.exp", S4): 1, ("aten.sum", ROW): 1,
        ("aten.expand", S4): 1, ("aten.view", S3): 1, ("aten.full", ()): 2,  # the 0-d scale and mask value
    }, {("aten.view", S3, "float32"): 3, **_inputs("float32")}),
    "bloom": (BloomAlibi, torch.bfloat16, {
        # ALiBi as baddbmm's input, the mask added, the softmax in fp32 and cast back
        ("aten.baddbmm", S3): 1, ("aten.bmm", S3): 1, ("aten.view", S4): 1, ("aten.add", S4): 1,
        **SOFTMAX, ("prims.convert_element_type", S4): 2, ("aten.view", S3): 1,
    }, {
        # Q, K (transposed) and V copied out of the fused projection, the ALiBi bias
        ("aten.view", S3, "bfloat16"): 2, ("aten.permute", S3, "bfloat16"): 1,
        ("prims.convert_element_type", (BATCH * HEADS, 1, SEQ), "bfloat16"): 1,
        **_inputs("bfloat16"),
    }),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_written_by_hand_is_core_attn(case):
    """Each variant: ``core_attn`` recomputes exactly its attention, from the scores GEMM to the
    values GEMM; what stays saved is Q, K, V (or the copies the GEMMs read, where those are
    smaller than what they copy), the mask and the projections' inputs: never the scores, the
    softmax or its statistics, which the plan without a selection saves."""
    module, dtype, selected, saved = CASES[case]
    torch.manual_seed(0)
    model = module().eval()  # no dropout op (p=0 leaves a copy on some torch versions)
    base, _, _, _ = _plan(model, dtype)
    report, recomputed, attention, empty = _plan(model, dtype, recompute=("core_attn",))
    assert empty == []
    assert attention == collections.Counter(selected), sorted(attention.items())
    assert recomputed == attention
    assert _saved(report) == collections.Counter(saved), sorted(_saved(report).items())
    assert report.activation_bytes < base.activation_bytes
    assert any(r.shape[-2:] in ((SEQ, SEQ), (SEQ, SEQ + 1), (SEQ, 1))
               for r in base.rows if r.kind != "parameter")  # scores, softmax or statistics
    assert "recomputed: core_attn in backward: (top level)" in report.notes


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_with_core_attn(case):
    """A training step compiled with ``core_attn`` gives the gradients of the step without a
    selection, bit for bit, and those of eager within rounding."""
    module, dtype, _, _ = CASES[case]
    torch.manual_seed(0)
    model = module().to(dtype)

    def grads(cfg):
        model.zero_grad()
        x = _x(dtype).requires_grad_()
        run = model
        if cfg is not None:
            torch._dynamo.reset()
            run = torch.compile(model, backend=graphpass.backend(codegen="eager", **cfg))
        run(x).float().pow(2).mean().backward()
        return [x.grad, *(p.grad.clone() for p in model.parameters())]

    eager, plain, selected = grads(None), grads({}), grads(dict(recompute=("core_attn",)))
    assert all(torch.equal(a, b) for a, b in zip(selected, plain))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(selected, eager):
        torch.testing.assert_close(a, b, **tol)


def test_attention_dropout_is_recomputed_with_it():
    """GPT-2's attention dropout (``attn_pdrop``, 0.1 by default). Planned (Inductor's seeded
    random): the mask drawn from the graph's seeds is part of the selection and recomputed
    from them, so only the seeds (8 bytes) are saved beside Q, K and V. Run with eager code
    generation (torch's RNG, one ``native_dropout``): the dropout is recomputed under its saved
    RNG state, and the gradients are those of no selection, bit for bit."""
    torch.manual_seed(0)
    model = Gpt2Attn(dropout=0.1)
    report, recomputed, attention, empty = _plan(model, recompute=("core_attn",))
    assert empty == [] and recomputed == attention
    # torch 2.11's Inductor rewrites this attention into SDPA's math decomposition (its
    # fuse_attention pass), selected too but with other ops
    if _compat.TORCH_VERSION >= (2, 13):
        dropout = {("prims.inductor_lookup_seed", ()): 1, ("prims.inductor_random", S4): 1,
                   ("aten.gt", S4): 1, ("aten.mul", S4): 2}
        assert attention == collections.Counter(CASES["gpt2"][2]) + collections.Counter(dropout)
        assert _saved(report) == collections.Counter({
            ("aten.view", S3, "float32"): 3, ("aten.view", (BATCH * SEQ, DIM), "float32"): 2,
            ("prims.inductor_seeds", (1,), "int64"): 1})
    assert ("prims.inductor_random", S4) in attention and ("aten.bmm", S3) in attention
    assert not [k for k in _saved(report) if k[2] == "bool"]  # no dropout mask

    def step(cfg):
        torch._dynamo.reset()
        model.zero_grad()
        x = _x().requires_grad_()
        torch.manual_seed(5)
        torch.compile(model, backend=graphpass.backend(codegen="eager", **cfg))(x).pow(2).mean().backward()
        return [x.grad, *(p.grad.clone() for p in model.parameters())]

    plain = step({})
    assert all(torch.equal(a, b) for a, b in zip(step(dict(recompute=("core_attn",))), plain))
    notes = graphpass.last_report().notes
    assert "recomputed: aten::native_dropout under its saved RNG state in backward: (top level)" in notes
    assert {r.op for r in graphpass.last_report().rows if r.is_activation} == {
        "aten.view", "higher_order.run_and_save_rng_state"}


def test_a_mask_built_in_the_forward_is_recomputed_with_it():
    """The causal mask built from positions inside the attention (``full(...).triu(1)``), read
    by nothing else, is recomputed with it: nothing of sequence x sequence is saved."""
    torch.manual_seed(0)
    report, _, attention, empty = _plan(LlamaEager(built_mask=True).eval(), recompute=("core_attn",))
    assert empty == []
    mask = attention - collections.Counter(CASES["llama"][2])
    assert {op for op, _ in mask} >= {"prims.iota", "aten.ge", "aten.where"}
    assert all(shape[-2:] != (SEQ, SEQ) for _, shape, _ in _saved(report))


def test_fp8_keeps_attention_gemms_high_precision_and_selected():
    """Under FP8 the projections are FP8 GEMMs and the attention's two bmm stay high precision
    with their note; ``core_attn`` selects the same attention as without FP8."""
    torch.manual_seed(0)
    report, recomputed, attention, empty = _plan(GptOssEager().eval(), fp8="tensorwise",
                                                 recompute=("core_attn",))
    assert empty == [] and recomputed == attention
    assert attention == collections.Counter(CASES["gpt_oss"][2])
    reason = ("aten.bmm of two activations (no weight operand, e.g. attention scores); graphpass "
              "lowers GEMMs against a weight")
    assert f"not lowered: <root>: {reason}" in report.notes
    assert set(report.meta["fp8_coverage"]["high_precision_flops"]) == {reason}


# --- what is not attention --------------------------------------------------------------------

class _ThreeActivations(nn.Module):
    """Three activations a, b, c (B x S x D) from linears, and ``body(a, b, c)``."""

    def __init__(self, body):
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(DIM, DIM) for _ in range(3))
        self.w = nn.Parameter(torch.randn(DIM, SEQ) * DIM ** -0.5)
        self.body = body

    def forward(self, x):
        return x + self.body(self, self.a(x), self.b(x), self.c(x))


def _heads(t):
    return t.view(BATCH, SEQ, HEADS, HEAD).transpose(1, 2)


def _merge(t):
    return t.transpose(1, 2).reshape(BATCH, SEQ, DIM)


NOT_ATTENTION = {
    # no softmax
    "gemm_relu_gemm": lambda m, a, b, c: torch.relu(a @ b.transpose(-1, -2)) @ c,
    "linear_relu_linear": lambda m, a, b, c: m.c(torch.relu(m.b(a))),
    # a softmax, but over the queries: the values GEMM contracts the keys
    "softmax_over_queries": lambda m, a, b, c: F.softmax(a @ b.transpose(-1, -2), dim=-2) @ c,
    # over the heads: the scores' batch dimension
    "softmax_over_heads": lambda m, a, b, c: _merge(
        F.softmax(_heads(a) @ _heads(b).transpose(-1, -2), dim=1) @ _heads(c)),
    # over the keys, but the probabilities are contracted over the queries
    "contracted_over_queries": lambda m, a, b, c: F.softmax(
        a @ b.transpose(-1, -2), dim=-1).transpose(-1, -2) @ c,
    # scores against a weight (a learned query), not of two activations
    "scores_against_a_weight": lambda m, a, b, c: F.softmax(a @ m.w, dim=-1) @ c,
    # a softmax between two linears
    "softmax_between_linears": lambda m, a, b, c: m.c(F.softmax(m.b(a), dim=-1)),
}


@pytest.mark.parametrize("case", sorted(NOT_ATTENTION))
def test_what_is_not_attention_is_not_selected(case):
    """Two GEMMs with a ReLU or a softmax between them that do not compute attention: nothing is
    attention, and ``core_attn`` warns that it selected nothing."""
    if case == "softmax_over_heads" and _compat.TORCH_VERSION < (2, 13):
        pytest.skip("torch 2.11's Inductor rewrites this graph into an SDPA op (its "
                    "fuse_attention pass), attention by name")
    report, recomputed, attention, empty = _plan(_ThreeActivations(NOT_ATTENTION[case]),
                                                 recompute=("core_attn",))
    assert attention == collections.Counter() and recomputed == collections.Counter()
    assert len(empty) == 1 and "recompute='core_attn' selected nothing" in empty[0], empty


def test_gpt_oss_from_transformers():
    """A tiny random GPT-OSS from transformers with its eager attention (sinks): ``core_attn``
    selects the attention of its one layer, sinks, row maximum and slice included (and the
    causal mask the model builds, which only that layer reads), with no EmptySelectionWarning;
    the saved tensors of the attention module are Q, K and V (K and V with their KV heads),
    none of sequence x sequence; under FP8 its bmm GEMMs stay high precision with their note."""
    transformers = pytest.importorskip("transformers")
    seq = 24  # not the head dimension, so shapes tell Q/K/V from scores
    cfg = transformers.GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD, vocab_size=256, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["full_attention"], attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    ids = torch.randint(0, 256, (BATCH, seq))
    found = {}
    original = pipeline.PASSES
    at = [p.__name__ for p in original].index("recompute")
    pipeline.PASSES = (*original[:at], lambda joint, *_: found.update(
        attention=Regions(joint).attention), *original[at:])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", EmptySelectionWarning)
            report = graphpass.plan(model, ids, labels=ids, config=graphpass.Config(
                fp8="tensorwise", recompute=("core_attn",)))
    finally:
        pipeline.PASSES = original
    assert not [w for w in caught if issubclass(w.category, EmptySelectionWarning)]
    from graphpass.graph.nodes import module_path
    attention = found["attention"]
    assert {module_path(n) for n in attention} == {"model.layers.0.self_attn", "model"}
    # the causal mask the model builds from positions, which only this layer reads
    assert {op_name(n) for n in attention if module_path(n) == "model"} <= {
        "prims.iota", "aten.add", "aten.unsqueeze", "aten.le", "aten.expand", "aten.where",
        "aten.full", "aten.scalar_tensor"}
    ops = _ops(attention)
    assert ops[("aten.bmm", (BATCH * HEADS, seq, seq))] == 1  # the scores
    assert ops[("aten.bmm", (BATCH * HEADS, seq, HEAD))] == 1  # the values
    assert ops[("aten.cat", (BATCH, HEADS, seq, seq + 1))] == 1  # the sinks
    assert ops[("aten.max", ())] == 1 and ops[("aten.slice", (BATCH, HEADS, seq, seq))] == 1
    saved = collections.Counter(r.shape for r in report.rows
                                if r.is_activation and r.module == "model.layers.0.self_attn")
    assert saved == collections.Counter({(BATCH * HEADS, seq, HEAD): 1,  # Q
                                         (BATCH, KV_HEADS, seq, HEAD): 2}), saved  # K, V
    reason = ("aten.bmm of two activations (no weight operand, e.g. attention scores); graphpass "
              "lowers GEMMs against a weight")
    assert f"not lowered: model.layers.0.self_attn: {reason}" in report.notes
