"""benchmarks/memory.py's per-tensor byte comparison of fp8_cache=all with torch's activation
quantization pass behind graphpass's exact plan (issue 12's byte target): every saved byte of
both plans is in exactly one row, and the counted reason adds up to the difference."""

import re

import torch

import graphpass
from benchmarks import memory
from examples import llama


def _plans():
    model, inputs = llama.build("tiny", layers=1)
    ours = graphpass.plan(model, *inputs, config=graphpass.Config(fp8="tensorwise", fp8_cache="all"))
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
