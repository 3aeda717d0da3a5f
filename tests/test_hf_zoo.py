"""A zoo of tiny random-config Hugging Face models (no downloads) trained a few AdamW steps under
graphpass FP8: dense decoders, GPT-2's Conv1D, MoE (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS with
attention sinks), parallel residual blocks (GPT-NeoX, Falcon), encoders (BERT, RoBERTa, masked LM),
an encoder-decoder with cross-attention (T5) and a vision transformer (ViT).

Each model trains the same steps on one fixed batch twice from the same initial weights, with the
same backend (``codegen="eager"``) under FP8 and with ``fp8=None``, each compiling one Dynamo
trace of the model; the FP8 losses stay close to the baseline's and both go down. The FP8 coverage is checked against a hand count per architecture:
exactly these linears lowered, exactly these modules left in high precision for these reasons,
and every GEMM of the compiled graphs lowered or noted.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable

import pytest
import torch

import graphpass
from graphpass.decisions import What
from graphpass.testing import assert_fp8_lowered

transformers = pytest.importorskip("transformers")

from _one_trace import OneTrace  # noqa: E402
from test_fp8_coverage import assert_no_silent_gemm  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN, FFN = 128, 16, 2, 64, 128
STEPS, LR, SEED = 5, 1e-3, 0
IMAGE, PATCH, LABELS = 32, 8, 16

# the reasons of the not-lowered notes, by their beginning
EXCLUDED = "excluded by pattern '{}'"
HEAD = "the output head (from the graph: the logits of a log-softmax"
BMM = "aten.bmm of two activations (no weight operand, e.g. attention scores)"

# shared by the Llama-like decoders: 4 heads of 16, 2 key-value heads
DECODER = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ * 4)
DROPOUT_OFF = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@dataclasses.dataclass(frozen=True)
class Arch:
    build: Callable[[], torch.nn.Module]
    # "causal" (ids, labels = ids), "masked" (every third token labelled), "seq2seq" (the labels
    # the ids reversed), "image"
    inputs: str
    lowered: frozenset[str]  # the hand count: the module of every linear lowered to FP8
    not_lowered: dict[str, str]  # module: the beginning of its not-lowered reason
    fp8: str = "tensorwise"
    dtype: torch.dtype = torch.float32


def _layers(prefix: str, n: int, *linears: str) -> frozenset[str]:
    return frozenset(f"{prefix}.{i}.{m}" for i in range(n) for m in linears)


LLAMA = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
ATTENTION = LLAMA[:4]
BERT = ("attention.self.query", "attention.self.key", "attention.self.value",
        "attention.output.dense", "intermediate.dense", "output.dense")
T5_ATTENTION = tuple(f"layer.0.SelfAttention.{m}" for m in "qkvo")
NEOX = ("attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
LM_HEAD = {"lm_head": EXCLUDED.format("lm_head")}


def _moe(prefix, n, router="gate"):
    """An MoE decoder's high-precision modules: the head and the routers, excluded by name."""
    return {**LM_HEAD, **{f"{prefix}.{i}.mlp.{router}": EXCLUDED.format(f"*.{router}")
                          for i in range(n)}}


ZOO = {
    # dense decoder, 2 layers: q, k, v, o, gate, up, down = 7 per layer; lm_head by fp8_exclude
    "llama": Arch(lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
                      **DECODER, num_hidden_layers=2)),
                  "causal", _layers("model.layers", 2, *LLAMA), LM_HEAD),
    # Qwen3: Llama's seven linears (q/k RMSNorm adds none)
    "qwen3": Arch(lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                      **DECODER, num_hidden_layers=1, head_dim=16)),
                  "causal", _layers("model.layers", 1, *LLAMA), LM_HEAD),
    # Phi-3 (forward under transformers' deprecate_kwarg decorator): fused qkv and gate_up = 4
    "phi3": Arch(lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
                     **DECODER, num_hidden_layers=1, pad_token_id=0)),
                 "causal", _layers("model.layers", 1, "self_attn.qkv_proj", "self_attn.o_proj",
                                   "mlp.gate_up_proj", "mlp.down_proj"), LM_HEAD),
    # GPT-2: transformers' Conv1D (x @ W + b, W stored [in, out]): c_attn, attn.c_proj, c_fc,
    # mlp.c_proj = 4 per layer
    "gpt2": Arch(lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
                     n_embd=HIDDEN, n_layer=1, n_head=4, vocab_size=VOCAB, n_positions=SEQ * 4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
                 "causal", _layers("transformer.h", 1, "attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                   "mlp.c_proj"), LM_HEAD),
    # MoE: q, k, v, o and the experts module (its grouped GEMMs: one lowering) = 5 per layer;
    # the router (mlp.gate) by fp8_exclude. Mixtral in bf16: the experts run aten._grouped_mm
    # (float32 runs transformers' grouped_mm fallback op, which the other MoEs cover)
    "mixtral-bf16": Arch(lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
                             **DECODER, num_hidden_layers=1, num_local_experts=4,
                             num_experts_per_tok=2)),
                         "causal", _layers("model.layers", 1, *ATTENTION, "mlp.experts"),
                         _moe("model.layers", 1), dtype=torch.bfloat16),
    # Qwen3-MoE under the rowwise recipe: as Mixtral, 5 per layer
    "qwen3-moe-rowwise": Arch(lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                                  **DECODER, num_hidden_layers=1, head_dim=16,
                                  moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
                              "causal", _layers("model.layers", 1, *ATTENTION, "mlp.experts"),
                              _moe("model.layers", 1), fp8="rowwise"),
    # DeepSeek-V3: MLA's q_a, q_b, kv_a (with MQA), kv_b, o; the routed experts; the shared
    # expert's gate, up, down = 9 per layer. The router (mlp.gate) by fp8_exclude; MLA's eager
    # attention (q·k and p·v as matmuls) noted as two-activation bmm's
    "deepseek-v3": Arch(lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
                            **{**DECODER, "num_key_value_heads": 4}, num_hidden_layers=1,
                            moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                            n_shared_experts=1, first_k_dense_replace=0, n_group=1, topk_group=1,
                            q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                            qk_nope_head_dim=16, v_head_dim=16)),
                        "causal", _layers("model.layers", 1, "self_attn.q_a_proj",
                                          "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa",
                                          "self_attn.kv_b_proj", "self_attn.o_proj",
                                          "mlp.experts", "mlp.shared_experts.gate_proj",
                                          "mlp.shared_experts.up_proj",
                                          "mlp.shared_experts.down_proj"),
                        {**_moe("model.layers", 1), "model.layers.0.self_attn": BMM}),
    # GPT-OSS: attention with sinks (eager: bmm's noted), q, k, v, o and the experts = 5; its
    # router is mlp.router
    "gpt-oss": Arch(lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
                        **DECODER, num_hidden_layers=1, head_dim=16, num_local_experts=4,
                        num_experts_per_tok=2, layer_types=["full_attention"])),
                    "causal", _layers("model.layers", 1, *ATTENTION, "mlp.experts"),
                    {**_moe("model.layers", 1, router="router"), "model.layers.0.self_attn": BMM}),
    # parallel residual: attention and MLP read one layer input, 4 linears per layer
    "gpt-neox": Arch(lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
                         hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                         num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ * 4,
                         use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0)),
                     "causal", _layers("gpt_neox.layers", 1, *NEOX), LM_HEAD),
    # Falcon-7B's block: parallel attention and MLP, multi-query attention; query_key_value,
    # dense, dense_h_to_4h, dense_4h_to_h = 4 per layer. Eager attention, its two matmuls noted
    # as bmm's: under SDPA, torch 2.15 runs this attention as the CPU flash kernel, torch 2.11 and
    # 2.13 as the math path's bmm's (noted), and the notes would vary by version
    "falcon": Arch(lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
                       hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                       vocab_size=VOCAB, parallel_attn=True, new_decoder_architecture=False,
                       multi_query=True, bias=False, hidden_dropout=0.0, attention_dropout=0.0,
                       attn_implementation="eager")),
                   "causal", _layers("transformer.h", 1, "self_attention.query_key_value",
                                     "self_attention.dense", "mlp.dense_h_to_4h",
                                     "mlp.dense_4h_to_h"),
                   {**LM_HEAD, "transformer.h.0.self_attention": BMM}),
    # encoder-decoder (T5, eager attention without scaling, relative position bias): encoder
    # q, k, v, o, wi, wo = 6 per layer; decoder self-attention q, k, v, o, cross-attention q, k,
    # v, o (k and v of every decoder layer read the encoder's output), wi, wo = 10 per layer;
    # the head (tied to the embeddings) by fp8_exclude. Self-attention adds a position bias to
    # its scores: two matmuls, noted as bmm's; cross-attention, without one, runs SDPA. On
    # torch 2.11 a graph break inside the decoder stack's forward makes it a frame of its own,
    # whose paths begin at the model all the same ("decoder.block.0...", with a note)
    "t5": Arch(lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
                   d_model=HIDDEN, d_ff=FFN, d_kv=16, num_layers=1, num_decoder_layers=2,
                   num_heads=4, vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0,
                   pad_token_id=0)),
               "seq2seq", _layers("encoder.block", 1, *T5_ATTENTION, "layer.1.DenseReluDense.wi",
                                  "layer.1.DenseReluDense.wo")
               | _layers("decoder.block", 2, *T5_ATTENTION,
                         *(f"layer.1.EncDecAttention.{m}" for m in "qkvo"),
                         "layer.2.DenseReluDense.wi", "layer.2.DenseReluDense.wo"),
               {**LM_HEAD, "encoder.block.0.layer.0.SelfAttention": BMM,
                "decoder.block.0.layer.0.SelfAttention": BMM,
                "decoder.block.1.layer.0.SelfAttention": BMM}),
    # encoders, masked LM: query, key, value, attention output, intermediate, output = 6 per
    # layer, plus the head's hidden-to-hidden transform (not matched by 'lm_head': fnmatch
    # patterns match whole paths); the decoder (tied to the embeddings) is found as the output
    # head from the graph
    "bert": Arch(lambda: transformers.BertForMaskedLM(transformers.BertConfig(
                     hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                     num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ * 4,
                     **DROPOUT_OFF)),
                 "masked", _layers("bert.encoder.layer", 1, *BERT)
                 | {"cls.predictions.transform.dense"}, {"cls.predictions.decoder": HEAD}),
    "roberta": Arch(lambda: transformers.RobertaForMaskedLM(transformers.RobertaConfig(
                        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ * 4,
                        **DROPOUT_OFF)),
                    "masked", _layers("roberta.encoder.layer", 1, *BERT) | {"lm_head.dense"},
                    {"lm_head.decoder": HEAD}),
    # ViT image classification: q, k, v, o, fc1, fc2 = 6 per layer; the patch embedding is a
    # convolution (no GEMM op); the classifier is found as the output head from the graph
    "vit": Arch(lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
                    hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
                    num_attention_heads=4, image_size=IMAGE, patch_size=PATCH, num_labels=LABELS,
                    **DROPOUT_OFF)),
                "image", _layers("vit.layers", 1, "attention.q_proj", "attention.k_proj",
                                 "attention.v_proj", "attention.o_proj", "mlp.fc1", "mlp.fc2"),
                {"classifier": HEAD}),
}

# The hand counts, as numbers: one linear more or less lowered fails the test.
HAND_COUNT = {"llama": 7 * 2, "qwen3": 7, "phi3": 4, "gpt2": 4, "mixtral-bf16": 5,
              "qwen3-moe-rowwise": 5, "deepseek-v3": 9, "gpt-oss": 5, "gpt-neox": 4, "falcon": 4,
              "bert": 7, "roberta": 7, "vit": 6,
              "t5": 6 + 10 * 2}


def _batch(arch: Arch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if arch.inputs == "image":
        return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g).to(arch.dtype),
                "labels": torch.randint(0, LABELS, (BATCH,), generator=g)}
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)  # clear of the special tokens
    if arch.inputs == "causal":
        return {"input_ids": ids, "labels": ids}
    if arch.inputs == "seq2seq":  # the decoder reads the labels shifted right
        return {"input_ids": ids, "labels": ids.flip(1)}
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = ids[:, ::3]
    return {"input_ids": ids, "labels": labels}


def _train(arch: Arch):
    """STEPS AdamW steps on one batch, compiled by graphpass without FP8 and then with it, from
    the same initial weights: (baseline losses, FP8 losses, model, the FP8 run's merged report,
    the graphs its partitions returned). One Dynamo trace of the model serves both runs
    (``_one_trace``: the trace is most of a compile here); each configuration partitions and
    compiles it as a compile of its own would."""
    torch._dynamo.reset()
    torch.manual_seed(SEED)
    model = arch.build().to(arch.dtype)
    initial = copy.deepcopy(model.state_dict())
    batch = _batch(arch)
    # kernels="reference" (graphpass's FP8 emulation) only with fp8: graphpass refuses the option
    # without a recipe
    fp8 = graphpass.backend(codegen="eager", fp8=arch.fp8, kernels="reference")
    trace = OneTrace(baseline=graphpass.backend(codegen="eager"), fp8=fp8)
    step = torch.compile(lambda batch: model(**batch).loss, backend=trace)
    runs = {}
    for run in ("baseline", "fp8"):
        model.load_state_dict(initial)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = runs[run] = []
        with trace.use(run):
            for _ in range(STEPS):
                opt.zero_grad(set_to_none=True)
                loss = step(batch)
                loss.backward()
                opt.step()
                losses.append(loss.item())
    return runs["baseline"], runs["fp8"], model, fp8.report(), trace.graphs["fp8"]


# The largest relative gap of an FP8 loss from the baseline's at the same step (5 steps, lr 1e-3),
# measured over 4 seeds (0-3, torch 2.13) and seed 0 on torch 2.11 and 2.15 (ViT's and Mixtral's
# initial weights differ on 2.11): ViT 4.2e-3 (2.11; 3.0e-3 on 2.13), GPT-OSS 2.9e-3,
# DeepSeek-V3 2.2e-3, Mixtral (bf16) 1.3e-3, Llama 1.2e-3, every other model at most 1.0e-3,
# except T5: 9.7e-3 (seed 2; 8.1e-3 at seed 0 on every version), its attention logits unscaled
# (no 1/sqrt(d)), so FP8's error in q and k reaches the softmax whole. That is the recipe's, not
# graphpass's: an eager emulation of tensorwise current scaling written apart from graphpass
# (each F.linear's X and W cast to e4m3, dY to e5m2, scaled by their amaxes) gave the same first
# loss and gradients to float rounding.
# Bounds: about three times each worst. (At lr 3e-3, Adam's sign-like first steps turn FP8's noise
# in small gradients into full-size updates: the 2-layer Llama's gap reached 1.8e-2 at step 4.)
LOSS_GAP = {"default": 4e-3, "vit": 1.2e-2, "gpt-oss": 9e-3, "deepseek-v3": 7e-3, "t5": 3e-2}


@pytest.mark.parametrize("name", list(ZOO))
def test_trains_in_fp8_close_to_the_baseline_with_the_hand_counted_coverage(name):
    arch = ZOO[name]
    base, losses, model, report, graphs = _train(arch)
    gaps = [abs(f - b) / b for f, b in zip(losses, base)]
    print(f"{name}: baseline {base}\n{name}: fp8 {losses}\n{name}: largest gap {max(gaps):.2e}")

    # the losses: finite, going down, and the FP8 ones close to the baseline's
    for run in (base, losses):
        assert all(torch.isfinite(torch.tensor(run))), run
        assert all(b < a for a, b in zip(run, run[1:])), f"loss not decreasing: {run}"
    assert max(gaps) < LOSS_GAP.get(name, LOSS_GAP["default"]), (base, losses)

    # the coverage: exactly the hand-counted linears lowered (once each: no recompile), the rest
    # noted for the expected reason, and no GEMM left in high precision silently
    lowered = [d.module for d in report.decisions if d.what is What.LOWERED]
    not_lowered = {d.module: d.why for d in report.decisions if d.what is What.NOT_LOWERED}
    assert len(lowered) == len(set(lowered)), f"lowered more than once: {sorted(lowered)}"
    assert set(lowered) == arch.lowered, (sorted(set(lowered) - arch.lowered),
                                          sorted(arch.lowered - set(lowered)))
    assert len(lowered) == HAND_COUNT[name]
    assert set(not_lowered) == set(arch.not_lowered), not_lowered
    for module, why in not_lowered.items():
        assert why.startswith(arch.not_lowered[module]), (module, why)
    assert all(f"(reference/{arch.fp8}" in n for n in report.notes if n.startswith("lowered: ")), \
        report.notes
    assert_no_silent_gemm(graphs, report.notes)
    # every nn.Linear of the model has a decision, and is lowered or excluded as the head/router
    assert_fp8_lowered(report, model=model, allowed=("excluded by pattern *", "the output head *",
                                                     BMM + "*"))
