"""``graphpass.estimate`` of a Llama-3-8B-shaped training step (transformers' LlamaForCausalLM,
32 layers, vocabulary 128,256, bf16) at sequence 8192, one rank of FSDP2 over 8 ranks on torch's
fake process group, AdamW: the per-device peak, its breakdown and the time the estimate takes.

    PYTHONPATH=. python benchmarks/estimate_8b.py [--codegen inductor|eager] [--fp8 tensorwise]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

import graphpass
from graphpass.distributed import fake_process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--codegen", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--fp8", default=None)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=args.seq, rope_theta=500000.0, use_cache=False)
    start = time.monotonic()
    with fake_process_group(args.world):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (args.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        ids = torch.zeros(1, args.seq, dtype=torch.long, device="meta")
        options = dict(codegen=args.codegen)
        if args.fp8:
            options.update(fp8=args.fp8)
        est = graphpass.estimate(
            model, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4, foreach=True),
            config=graphpass.Config.from_options(**options), input_ids=ids, labels=ids)
    took = time.monotonic() - start
    print(est)
    print(f"peak_bytes: {est.peak_bytes}")
    print(f"estimate took {took:.1f} s (torch {torch.__version__})")


if __name__ == "__main__":
    main()
