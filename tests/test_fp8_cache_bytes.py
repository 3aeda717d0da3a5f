"""benchmarks/memory.py's per-tensor byte comparison of fp8_cache=all with torch's activation
quantization pass behind graphpass's exact plan (issue 12's byte target): every saved byte of
both plans is in exactly one row, and the counted reason adds up to the difference."""

import re

import torch

import graphpass
from benchmarks import memory
from graphpass.models import llama


def _plans(fmt="e4m3_1x128_pow2"):
    model, inputs = llama.build("tiny", layers=1)
    ours = graphpass.plan(model, *inputs, config=graphpass.Config(
        fp8="tensorwise", fp8_cache="all", fp8_cache_format=fmt))
    model, inputs = llama.build("tiny", layers=1)
    with torch._inductor.config.patch(
            post_grad_fusion_options={"activation_quantization_aten_pass": memory.TORCH_AQ}):
        theirs = graphpass.plan(model, *inputs, config=graphpass.Config(fp8="tensorwise"))
    return ours, theirs


def test_byte_comparison_counts_every_saved_byte_once():
    ours, theirs = _plans()
    rows = memory.byte_comparison(ours, theirs)
    assert sum(a["exact"] + a["data"] + a["scale"] for _, a, _ in rows) == ours.activation_bytes
    assert sum(b["exact"] + b["data"] + b["scale"] for _, _, b in rows) == theirs.activation_bytes
    # torch's pass did cast (its rows are recognised, not counted as exact)
    assert sum(b["data"] for _, _, b in rows) > 0 and sum(b["scale"] for _, _, b in rows) > 0
    # the log-sum-exp: graphpass keeps it exact, torch's pass casts it; its row is matched by name
    lse = [(a, b) for _, a, b in rows if a["exact"] and b["data"]]
    assert lse and all(a["data"] == 0 for a, _ in lse)
    reason = memory.byte_reason(rows)
    counted = sum(int(n.replace(",", "")) for n in re.findall(r"([+-][\d,]+) B", reason))
    assert counted == ours.activation_bytes - theirs.activation_bytes, reason

    # the FAIL line's bound over every choice of cached tensors, by hand: the scales (-2,172 B)
    # plus, per tensor kept exact, the cheaper of exact and cached in 1x128 (numel + numel/128
    # against torch's data and scales): k and v 8,192 + 64 - 8,704 = -448 each (cheaper than
    # +24,064 exact), the log-sum-exp 256 + 2 - 288 = -30 (cheaper than +736)
    assert memory.least_difference_1x128(rows) == -2172 - 448 - 448 - 30


def test_per_tensor_format_stores_one_fp32_scale_per_cached_tensor():
    """``all`` in ``e4m3_tensor`` (the benchmark's info line against torch's pass): every cached
    tensor's scales are one fp32, so the scales part of the difference is 4 B per cached tensor
    minus torch's per-row scales, and the counted parts still add up."""
    ours, theirs = _plans("e4m3_tensor")
    rows = memory.byte_comparison(ours, theirs)
    cached = [a for _, a, _ in rows if a["data"]]
    assert len(cached) == 7 and all(a["scale"] == 4 for a in cached)  # by hand: table in docs
    kept, scales, data = memory.byte_parts(rows)
    assert scales == 4 * 7 - sum(b["scale"] for _, a, b in rows if not a["exact"]) and data == 0
    assert {name for name, _ in kept} == {"permute_5", "add_4", "getitem_5"}  # k, v < 64 KiB; LSE
    assert sum(d for _, d in kept) + scales + data == ours.activation_bytes - theirs.activation_bytes
