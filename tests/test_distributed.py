"""Distributed training under graphpass (issue 14): per-rank planning of a tensor- and
sequence-parallel layer at real size, on fake tensors with torch's fake process group."""

from collections import Counter

import pytest
import torch

import graphpass
from examples import llama
from graphpass.distributed import fake_process_group

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="needs torch.distributed")

MiB = 2**20


def test_llama3_70b_layer_at_tp8_plans_one_rank_by_hand_count():
    """One rank of a Llama-3-70B layer, TP=8 with sequence parallelism, sequence 8192, FP8
    tensorwise under graphpass's auto policy: every saved byte accounted for by hand."""
    b, s, h, tp, heads, kv, d, ffn = 1, 8192, 8192, 8, 64, 8, 128, 28672
    with fake_process_group(tp, rank=3):
        block, inputs = llama.build_tp("70b", tp=tp)
        report = graphpass.plan(block, *inputs, config=graphpass.Config(fp8="tensorwise"))
    assert inputs[0].shape == (b, s // tp, h)  # this rank's sequence shard

    bf16, fp8, f32 = 2, 1, 4
    hand = {
        # Sequence-parallel boundaries: the block's input (the first norm's input) and the
        # attention branch's output after o_proj's reduce-scatter (the second norm's input),
        # each this rank's s/tp rows of the residual stream.
        ("", (b, s // tp, h), "bfloat16"): b * s // tp * h * bf16,
        ("self_attn.o_proj", (b, s // tp, h), "bfloat16"): b * s // tp * h * bf16,
        # The all-gathered, normed input of q/k/v (one quantize shared) and of gate/up, in FP8.
        ("self_attn.q_proj", (b * s, h), "float8_e4m3fn"): b * s * h * fp8,
        ("mlp.gate_proj", (b * s, h), "float8_e4m3fn"): b * s * h * fp8,
        # Attention on this rank's heads: q after RoPE, k after RoPE, v, the output, the
        # logsumexp.
        ("self_attn", (b, heads // tp, s, d), "bfloat16"): 2 * b * heads // tp * s * d * bf16,
        ("self_attn", (b, kv // tp, s, d), "bfloat16"): 2 * b * kv // tp * s * d * bf16,
        ("self_attn", (b, heads // tp, s), "float32"): b * heads // tp * s * f32,
        # SwiGLU: gate and up outputs on this rank's ffn/tp columns.
        ("mlp.gate_proj", (b * s, ffn // tp), "bfloat16"): b * s * ffn // tp * bf16,
        ("mlp.up_proj", (b * s, ffn // tp), "bfloat16"): b * s * ffn // tp * bf16,
    }
    # No FP8 weight shard is saved: the planner re-quantizes every weight shard in the backward
    # (weights are resident anyway). This needs graphpass to know the graph's parameters: from
    # torch 2.13 a DTensor parameter flattens into two graph inputs, and torch's static-input
    # indices count unflattened inputs; graphpass maps them through the input descriptors.
    params = [r for r in report.rows if r.kind == "parameter"]
    assert sorted(tuple(r.shape) for r in params) == sorted(
        [(h,), (h,), (heads * d // tp, h), (kv * d // tp, h), (kv * d // tp, h),
         (h, heads * d // tp), (ffn // tp, h), (ffn // tp, h), (h, ffn // tp)])
    got: Counter = Counter()
    scales = 0
    for row in report.rows:
        if row.kind == "fp8_scale":
            scales += row.bytes
            continue
        if row.op == "input" and tuple(row.shape) != (b, s // tp, h):
            continue  # parameters, and the RoPE tables the caller holds anyway
        if row.bytes:
            got[(row.module if row.op != "input" else "", tuple(row.shape), row.dtype)] += row.bytes
    assert dict(got) == hand
    assert scales == 2 * f32  # one per FP8 copy saved: the 2 gathered inputs
    assert sum(hand.values()) == 308 * MiB + 256 * 1024  # 180.25 MiB bf16/f32 + 128 MiB FP8
    # The whole report: those, plus the RoPE tables (2 x s x d bf16), graph inputs it saves.
    assert report.activation_bytes == sum(hand.values()) + scales + 2 * s * d * bf16

    # The report names the collectives: per linear pair an all-gather of the sequence
    # (s x h bf16 out) and a reduce-scatter back onto it (s/tp x h out), mirrored in backward.
    gathered, scattered = 2 * b * s * h * bf16, 2 * b * s // tp * h * bf16
    assert (f"collectives in the forward: all_gather_into_tensor x2 ({gathered // MiB}.00 MiB "
            f"out), reduce_scatter_tensor x2 ({scattered // MiB}.00 MiB out)") in report.notes
    assert any(n.startswith("collectives in the backward: all_gather_into_tensor x2")
               for n in report.notes)
    # What graphpass does not do under TP, as a note (docs/distributed.md): no FP8 all-gather,
    # no amax reduced across ranks. (tests/test_distributed_gloo.py asserts it on real ranks.)
    assert any(n.startswith("fp8 under tensor parallelism: quantizes run after the all-gathers, "
                            "which move bfloat16") for n in report.notes)
    for linear in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"lowered: self_attn.{linear} (reference/tensorwise)" in report.notes
    for linear in ("gate_proj", "up_proj", "down_proj"):
        assert f"lowered: mlp.{linear} (reference/tensorwise)" in report.notes


def test_fake_process_group_refuses_a_second_default_group():
    with fake_process_group(2):
        with pytest.raises(RuntimeError, match="already exists"):
            with fake_process_group(2):
                pass
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("tp, message", [(3, r"must divide the sequence \(32\)"),
                                         (16, r"must divide heads \(4\)")])
def test_tp_degree_must_divide_sequence_and_heads(tp, message):
    with fake_process_group(tp):
        with pytest.raises(ValueError, match=message):
            llama.build_tp("tiny", tp=tp)


def test_cli_plans_one_rank_with_tp(capsys):
    """`graphpass report --tp N` plans one rank on the fake process group, its bf16 comparison
    too (the same rank, not the unsharded layer), and leaves no process group behind."""
    from graphpass.cli import main

    assert main(["report", "--model", "llama", "--tp", "2", "--fp8", "tensorwise",
                 "--kernels", "reference"]) == 0
    out = capsys.readouterr().out
    assert "collectives in the forward: all_gather_into_tensor x2" in out
    assert "llama tiny (one rank of TP=2): without FP8" in out
    assert not torch.distributed.is_initialized()


def test_cli_tp_refuses_layers_and_examples_without_a_plan(capsys):
    from graphpass.cli import main

    assert main(["report", "--model", "llama", "--tp", "2", "--layers", "2"]) != 0
    assert "drop --layers" in capsys.readouterr().err
    assert main(["report", "--model", "gpt", "--tp", "2"]) != 0
    assert "no tensor-parallel plan" in capsys.readouterr().err
