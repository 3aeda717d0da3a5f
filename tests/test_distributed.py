"""Distributed training under graphpass (issue 14): per-rank planning of a tensor- and
sequence-parallel layer at real size, on fake tensors with torch's fake process group."""

from collections import Counter

import pytest
import torch

import graphpass
from graphpass.models import llama
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

    # The report names the collectives: per linear pair an all-gather of the sequence in FP8
    # (s x h x 1 B out: quantized before the collective, passes/fp8_all_gather.py) after an
    # all-reduce of the amax (one fp32), and a reduce-scatter back onto the sequence (s/tp x h
    # bf16 out), mirrored in the backward (the output gradients of o_proj and down_proj).
    gathered, scattered = 2 * b * s * h * fp8, 2 * b * s // tp * h * bf16
    for side in ("forward", "backward"):
        assert (f"collectives in the {side}: all_gather_into_tensor x2 ({gathered // MiB}.00 MiB "
                f"out), all_reduce x2 ({2 * f32} B out), reduce_scatter_tensor x2 "
                f"({scattered // MiB}.00 MiB out)") in report.notes
    # How FP8 is scaled under TP, as a note (docs/distributed.md); tests/test_distributed_gloo.py
    # asserts it on real ranks.
    assert any(n.startswith("fp8 under tensor parallelism: sequence-parallel inputs and gradients "
                            "are quantized before their all-gathers") for n in report.notes)
    for linear in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"lowered: self_attn.{linear} (reference/tensorwise)" in report.notes
    for linear in ("gate_proj", "up_proj", "down_proj"):
        assert f"lowered: mlp.{linear} (reference/tensorwise)" in report.notes


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_fp8_all_gather_halves_the_gathered_bytes_and_saves_the_same(fp8_format):
    """One rank of the tiny Llama block at TP=2 (bf16, sequence 32, hidden 256), FP8 tensorwise
    (both formats: the backward gathers E5M2 or E4M3 gradients), with the FP8 all-gather
    (default) and without (fp8_sequence_all_gather=False): the all-gathers move 1 byte per element
    instead of 2, each after a 4-byte amax all-reduce; the saved bytes are the same (the
    gathered FP8 copies are saved either way). The bits are compared on real ranks in
    tests/test_distributed_gloo.py."""
    b, s, h, tp = 2, 32, 256, 2
    reports = {}
    for on in (True, False):
        with fake_process_group(tp):
            block, inputs = llama.build_tp("tiny", tp=tp, dtype=torch.bfloat16)
            reports[on] = graphpass.plan(block, *inputs, config=graphpass.Config(
                fp8="tensorwise", fp8_format=fp8_format, kernels="reference",
                fp8_sequence_all_gather=on))
    gathered = 2 * b * s * h  # two all-gathers of the whole sequence per side
    scattered = f"reduce_scatter_tensor x2 ({2 * b * s // tp * h * 2 // 1024}.00 KiB out)"
    for side in ("forward", "backward"):
        assert (f"collectives in the {side}: all_gather_into_tensor x2 ({gathered // 1024}.00 KiB "
                f"out), all_reduce x2 (8 B out), {scattered}") in reports[True].notes
        assert (f"collectives in the {side}: all_gather_into_tensor x2 ({2 * gathered // 1024}.00 "
                f"KiB out), {scattered}") in reports[False].notes
    assert reports[True].activation_bytes == reports[False].activation_bytes
    # the saved FP8 copies of the two gathered inputs: s x h bytes each, as before
    fp8 = [r for r in reports[True].rows if r.kind == "fp8_data"]
    assert sorted((r.module, r.bytes) for r in fp8) == [
        ("mlp.gate_proj", b * s * h), ("self_attn.q_proj", b * s * h)]
    assert sum(n.startswith("fp8 all-gather: not for") for n in reports[False].notes) == 4
    assert sum(n.startswith("fp8 all-gather: ") for n in reports[True].notes) == 4


def test_fp8_all_gather_needs_the_gathered_tensor_read_only_by_quantizes():
    """k_proj kept in bf16 reads the gathered attention input: that all-gather stays bf16 (its
    bf16 value is needed), said in a note; the MLP's input is still gathered in FP8."""
    with fake_process_group(2):
        block, inputs = llama.build_tp("tiny", tp=2, dtype=torch.bfloat16)
        report = graphpass.plan(block, *inputs, config=graphpass.Config(
            fp8="tensorwise", kernels="reference", fp8_exclude=("self_attn.k_proj",)))
    assert ("fp8 all-gather: not for self_attn: the gathered bfloat16 is also read by aten.mm: "
            "quantized after the all-gather") in report.notes
    assert any(n.startswith("fp8 all-gather: mlp.gate_proj: input, forward") for n in report.notes)
    assert any(n.startswith("fp8 under tensor parallelism: all-gathers that move bfloat16")
               for n in report.notes)


def test_fp8_all_gather_is_tensorwise_only_and_says_so():
    """mxfp8 (per-block scales): the all-gathers stay bf16, each with a note saying why."""
    with fake_process_group(2):
        block, inputs = llama.build_tp("tiny", tp=2, dtype=torch.bfloat16)
        report = graphpass.plan(block, *inputs, config=graphpass.Config(
            fp8="mxfp8", kernels="reference"))
    notes = [n for n in report.notes if n.startswith("fp8 all-gather")]
    # the forward's gathers belong to the module whose input they gather, the backward's to the
    # row-parallel linear whose output gradient they gather
    assert notes == [f"fp8 all-gather: not for {m}: mxfp8 scales: the FP8 all-gather is for "
                     "tensorwise scaling only (docs/distributed.md): quantized after the all-gather"
                     for m in ("self_attn", "mlp", "mlp.down_proj", "self_attn.o_proj")], notes
    assert any("collectives in the forward: all_gather_into_tensor x2 (64.00 KiB out)" in n
               for n in report.notes)


@pytest.mark.parametrize("special", [None, "nan", "inf", "zero_shard"])
def test_shards_quantized_with_the_group_amax_are_the_whole_tensor_quantized(special):
    """What the FP8 all-gather rests on: each shard quantized with the max of the shards'
    amaxes, concatenated, has the bits (and scale) of the whole tensor quantized at once."""
    from graphpass.fp8 import recipes

    x = torch.randn(64, 48, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 30
    if special == "nan":
        x[3, 5] = float("nan")
    elif special == "inf":
        x[40, 1] = float("inf")
    elif special == "zero_shard":
        x[:16] = 0
    shards = x.chunk(4)
    amax = torch.stack([recipes.tensor_amax(t) for t in shards]).amax()
    for role in ("input", "grad"):
        parts = [recipes.quantize(t, "tensorwise", role, amax=amax) for t in shards]
        data, scale_inv = recipes.quantize(x, "tensorwise", role)
        assert torch.equal(torch.cat([p[0] for p in parts]).view(torch.uint8), data.view(torch.uint8))
        assert all(torch.equal(p[1], scale_inv) for p in parts)
    with pytest.raises(ValueError, match="tensorwise only"):
        recipes.quantize(x, "blockwise", "input", amax=amax)


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
