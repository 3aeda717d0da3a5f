"""One training step of torchtitan's own Llama 3 and DeepSeek-V3 models, compiled per
transformer block by torchtitan's own ``apply_compile`` with a graphpass backend name.

    GRAPHPASS_OPTIONS="kernels=reference codegen=eager" python examples/torchtitan_step.py

torchtitan (PyPI ``torchtitan``, installed with ``--no-deps``: see docs/trainers.md) builds the
models from its ``debugmodel`` configs, cut to ``--layers`` blocks (DeepSeek-V3's first block is
dense, the second MoE). Its ``compile.backend`` is a name, so the backend is ``graphpass_fp8``
(FP8 tensorwise with the planner; the variable adds options), in place of torchtitan's
``Float8LinearConverter`` (torchao), which is left out.

On a CPU, each block's attention kernel is torchtitan's own ``ScaledDotProductAttention``:
torchtitan 0.3.0 builds its language models with FlexAttention or varlen attention only, and
torch's FlexAttention has no backward on the CPU ("FlexAttention does not support backward on
CPU"). On a GPU the model's own attention stays (see docs/trainers.md for the backend name).

``--check`` also compiles a copy of each model per block by hand, with
``graphpass.backend(...)`` and the same options, and asserts bit-identical gradients and the
same saved bytes. Prints one line per model: loss, FP8 coverage, saved activation bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

BACKEND = "graphpass_fp8"


def build(name: str, layers: int) -> torch.nn.Module:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if name == "llama3":
        from torchtitan.models.llama3 import llama3_configs
        config = llama3_configs["debugmodel"](attn_backend="flex")
    else:
        from torchtitan.models.deepseek_v3 import deepseekv3_configs
        config = deepseekv3_configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    config.layers = config.layers[:layers]
    if not torch.cuda.is_available():
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config.build()


def titan_compile(model: torch.nn.Module, backend: str) -> None:
    """torchtitan's own per-block compile, as its trainer applies it (``compile.enable``)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.distributed.parallel_dims import ParallelDims

    apply_compile(model, compile_config=CompileConfig(enable=True, backend=backend),
                  parallel_dims=ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1,
                                             world_size=1))


def step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def run(name: str, *, layers: int, seq: int, batch: int, check: bool) -> dict:
    import graphpass
    from graphpass.named import NamedBackend
    from torch._dynamo.backends.registry import lookup_backend

    torch.manual_seed(0)
    model = build(name, layers)
    reference = copy.deepcopy(model) if check else None
    tokens = torch.randint(model.vocab_size if hasattr(model, "vocab_size") else 2048,
                           (batch, seq + 1))
    torch._dynamo.reset()
    titan_compile(model, BACKEND)
    named = lookup_backend(BACKEND)
    assert isinstance(named, NamedBackend)
    backend = named.resolve()
    before = len(backend.partitioner.reports)
    loss, grads = step(model, tokens)
    torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    reports = backend.partitioner.reports[before:]
    assert reports, "no graph was partitioned"
    report = type(reports[0]).merge(reports)
    coverage = report.meta["fp8_coverage"]
    out = {"model": name, "loss": loss, "fp8_share": coverage["fp8_share"],
           "activation_bytes": report.activation_bytes, "graphs": len(reports),
           "options_from": report.meta.get("options_from"),
           "not_lowered": sorted({n for n in report.notes if n.startswith("not lowered")})}
    if check:
        by_hand = graphpass.backend(**backend.options)
        for block in reference.layers.values():
            block.compile(backend=by_hand, fullgraph=True)
        _, expected = step(reference, tokens)
        torch.testing.assert_close(grads, expected, rtol=0, atol=0)
        assert by_hand.report().activation_bytes == report.activation_bytes
        out["checked"] = True
    fp8 = next(line for line in report.table().splitlines() if line.startswith("fp8:"))
    # blocks with the same structure share one compiled graph, counted once
    print(f"{name}: loss {loss:.4f}; saved {report.activation_bytes:,} B of activations in "
          f"{len(reports)} distinct block graph(s); {fp8}")
    for note in out["not_lowered"]:
        print(f"  {note}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["llama3", "deepseek_v3", "both"], default="both")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--check", action="store_true",
                        help="compare with the same blocks compiled by hand (bit-identical)")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    if not os.environ.get("GRAPHPASS_OPTIONS") and not torch.cuda.is_available():
        print("note: on a CPU, set GRAPHPASS_OPTIONS='kernels=reference codegen=eager'",
              file=sys.stderr)
    names = ["llama3", "deepseek_v3"] if args.model == "both" else [args.model]
    results = [run(n, layers=args.layers, seq=args.seq, batch=args.batch, check=args.check)
               for n in names]
    if args.json:
        print(json.dumps(results))  # the last line
    return 0


if __name__ == "__main__":
    sys.exit(main())
