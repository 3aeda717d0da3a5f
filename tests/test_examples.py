"""Checks for the reference models in examples/: tiny eager/compile parity, real sizes on meta."""

from __future__ import annotations

import dataclasses
import importlib
import math
import time
from types import ModuleType
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from graphpass.models import MODELS


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"graphpass.models.{name}")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("name", MODELS)
def test_tiny_compiled_matches_eager(name: str) -> None:
    mod = _module(name)
    eager_model, (eager_x,) = mod.build("tiny")
    compiled_model, (compiled_x,) = mod.build("tiny")  # same seed: identical copy

    eager_out = eager_model(eager_x)
    assert eager_out.shape == eager_x.shape == (2, 32, mod.SIZES["tiny"].hidden)
    eager_loss = _loss(eager_out)
    eager_loss.backward()

    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    compiled_loss = _loss(compiled(compiled_x))
    compiled_loss.backward()

    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(compiled_loss, eager_loss, **tol)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad, **tol)
    compiled_grads = dict(compiled_model.named_parameters())
    for param_name, param in eager_model.named_parameters():
        assert param.grad is not None, param_name
        torch.testing.assert_close(
            compiled_grads[param_name].grad, param.grad, **tol, msg=param_name
        )


# Parameters of one real-size layer (norm weights included), derived by hand:
#   llama:    q,o 2*4096^2 + k,v 2*4096*(8*128) + mlp 3*4096*14336 + norms 2*4096
#   gpt:      qkv h*3h+3h, proj h*h+h, fc1 h*4h+4h, fc2 4h*h+h, 2 LayerNorms 4h
#             = 12h^2 + 13h with h = 12288
#   deepseek: attention 187,107,328 =
#               q_a 7168*1536 + q_a_norm 1536 + q_b 1536*128*(128+64)
#               + kv_a 7168*(512+64) + kv_a_norm 512 + kv_b 512*128*(128+128) + o 128*128*7168
#             moe 11,320,164,352 =
#               gate 7168*256 + experts 256*3*7168*2048 + shared 3*7168*2048
#             + norms 2*7168
REAL = {
    "llama": ((1, 8192, 4096), 218_112_000),
    "gpt": ((1, 2048, 12288), 1_812_099_072),
    "deepseek": ((1, 4096, 7168), 11_507_286_016),
}


@pytest.mark.parametrize("name", MODELS)
def test_real_size_builds_on_meta(name: str) -> None:
    mod = _module(name)
    start = time.perf_counter()
    model, (x,) = mod.build("real")
    assert time.perf_counter() - start < 5.0

    shape, layer_params = REAL[name]
    assert x.shape == shape and x.dtype == torch.bfloat16 and x.is_meta and x.requires_grad
    assert len(model.layers) == 1
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert sum(p.numel() for p in model.layers[0].parameters()) == layer_params
    assert model(x).shape == shape


def test_real_config_values() -> None:
    from graphpass.models import deepseek, gpt, llama

    ll = llama.SIZES["real"]
    assert (ll.hidden, ll.heads, ll.kv_heads, ll.head_dim, ll.ffn) == (4096, 32, 8, 128, 14336)
    assert (ll.rope_theta, ll.norm_eps) == (500000.0, 1e-5)
    gp = gpt.SIZES["real"]
    assert (gp.hidden, gp.heads, gp.head_dim, gp.ffn) == (12288, 96, 128, 49152)
    ds = deepseek.SIZES["real"]
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.v_head_dim) == (1536, 512, 192, 128)
    assert (ds.n_routed_experts, ds.num_experts_per_tok, ds.n_shared_experts) == (256, 8, 1)
    assert (ds.moe_intermediate_size, ds.norm_eps) == (2048, 1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_real_size_traces_on_meta(name: str) -> None:
    model, (x,) = _module(name).build("real")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _loss(compiled(x)).backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_module_paths() -> None:
    from graphpass.models import deepseek

    names = {n: set(dict(_module(n).build("tiny")[0].named_parameters())) for n in MODELS}
    assert {
        "layers.0.input_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.1.mlp.down_proj.weight",
        "norm.weight",
    } <= names["llama"]
    assert {
        "layers.0.ln_1.bias",
        "layers.0.attn.qkv.weight",
        "layers.1.mlp.fc2.bias",
    } <= names["gpt"]
    assert {
        "layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "layers.0.mlp.gate.weight",
        "layers.0.mlp.experts.gate_proj",
        "layers.0.mlp.shared_experts.up_proj.weight",
    } <= names["deepseek"]
    assert deepseek.build("tiny")[0].layers[0].mlp.experts.down_proj.shape == (4, 128, 256)


def test_build_options() -> None:
    from graphpass.models import llama

    model, (x,) = llama.build("tiny", layers=3, batch=1, seq=16, dtype=torch.float64)
    assert len(model.layers) == 3 and x.shape == (1, 16, 256) and x.dtype == torch.float64
    assert model(x).dtype == torch.float64
    a, _ = llama.build("tiny", seed=1)
    b, _ = llama.build("tiny", seed=1)
    c, _ = llama.build("tiny", seed=2)
    assert torch.equal(a.layers[0].self_attn.q_proj.weight, b.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(a.layers[0].self_attn.q_proj.weight, c.layers[0].self_attn.q_proj.weight)
    with pytest.raises(ValueError, match="tiny"):
        llama.build("huge")


def test_gpt_zero_dropout_leaves_no_dropout_in_graph() -> None:
    from graphpass.models import gpt

    def ops(dropout: float) -> set[str]:
        config = dataclasses.replace(gpt.SIZES["tiny"], layers=1, dropout=dropout)
        graphs: list[torch.fx.GraphModule] = []

        def backend(gm: torch.fx.GraphModule, _: list[torch.Tensor]) -> Callable[..., Any]:
            graphs.append(gm)
            return gm.forward

        x = torch.randn(2, 32, config.hidden)
        torch.compile(gpt.Model(config).train(), backend=backend, fullgraph=True)(x)
        return {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}

    assert not any("dropout" in op for op in ops(0.0))
    assert any("dropout" in op for op in ops(0.1))


@pytest.mark.parametrize("capacity_factor", [1.0, 2.0])  # with / without dropped tokens
def test_deepseek_moe_matches_per_token_reference(capacity_factor: float) -> None:
    from graphpass.models import deepseek

    config = dataclasses.replace(deepseek.SIZES["tiny"], capacity_factor=capacity_factor)
    torch.manual_seed(0)
    moe = deepseek.MoE(config)
    tokens = torch.randn(64, config.hidden)
    experts = moe.experts
    assignments = 64 * config.num_experts_per_tok
    capacity = math.ceil(assignments / config.n_routed_experts * capacity_factor)

    with torch.no_grad():
        scores = moe.gate(tokens).sigmoid()
        weights, chosen = scores.topk(config.num_experts_per_tok, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True) * config.routed_scaling_factor
        expected = moe.shared_experts(tokens)
        load = [0] * config.n_routed_experts
        for choice in range(config.num_experts_per_tok):  # first choices claim capacity first
            for t in range(64):
                e = int(chosen[t, choice])
                load[e] += 1
                if load[e] <= capacity:
                    h = tokens[t]
                    y = F.silu(h @ experts.gate_proj[e]) * (h @ experts.up_proj[e])
                    y = y @ experts.down_proj[e]
                    expected[t] += weights[t, choice] * y
        actual = moe(tokens.view(2, 32, -1)).view(64, -1)

    assert (max(load) > capacity) == (capacity_factor == 1.0)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)


def test_llama_tiny_lm_trains() -> None:
    from graphpass.models import llama

    model, (ids,) = llama.build("tiny_lm")
    assert ids.dtype == torch.long and model.output is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
