"""The user's own checkpointing wins over graphpass's tags, and says so where they conflict.

torch marks the nodes of a ``torch.utils.checkpoint`` region in the joint graph with
``meta["ac_graph_id"]`` and ``meta["recompute"]`` (``PREFER_RECOMPUTE`` for full checkpointing;
a selective-checkpoint policy's answer per op). graphpass's passes never overwrite those tags;
where a recompute word or the planner wanted otherwise, the report says so. Gradients are then
bit-identical to the same model under Inductor's default partitioner.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _session import once
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import graphpass


def _step(make, backend):
    """The gradients of one step under ``backend`` (None: Inductor with torch's own partitioner;
    a name: that torch backend) and graphpass's reports."""
    torch._dynamo.reset()
    model, inputs = make()
    compiled = torch.compile(model, backend=backend) if backend else torch.compile(model)
    out = compiled(**inputs) if isinstance(inputs, dict) else compiled(*inputs)
    (out.loss if hasattr(out, "loss") else out.sum()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return grads, backend.partitioner.reports if hasattr(backend, "partitioner") else []


def _assert_same_arithmetic(got, expected):
    """The same saved set as torch's own partition (asserted by each test), so the same
    arithmetic; Inductor's C++ code of two compiles may still group reductions differently on
    some CPUs (2.3e-10 to 3e-8 apart on the tiny HF Llama, torch 2.13, an AMD EPYC without
    AVX-512), so the gradients are held to fp32 rounding, not to bits."""
    assert got.keys() == expected.keys()
    different = [name for name in got
                 if not torch.allclose(got[name], expected[name], rtol=1e-5, atol=1e-7)]
    assert not different


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids}


# The HF Llama's tests are about the partition (the saved set, the notes): eager code generation
# (backend.eager_compile partitions the joint graph Inductor's would, without compiling its C++
# kernels: three Inductor compiles of this model were a minute of CPU), against torch's own
# partitioner on the same joint graph, Inductor's decompositions and min-cut, run eagerly
# (aot_eager_decomp_partition). Inductor's code for a checkpointed graph under graphpass:
# test_selective_checkpoint_policy_wins_with_notes.
@pytest.fixture(scope="module")
def hf_llama_reference_grads(tmp_path_factory):
    """The checkpointed HF Llama's gradients under torch's own partitioner (min-cut, Inductor's
    decompositions, run eagerly): one compile per session (whichever xdist worker first needs
    it), shared by the tests comparing to it."""
    out = once(tmp_path_factory, "hf-llama-reference-grads",
               lambda out: torch.save(_step(_hf_llama, "aot_eager_decomp_partition")[0],
                                      out / "grads.pt"), timeout=600)
    return torch.load(out / "grads.pt")


def test_hugging_face_gradient_checkpointing_is_respected(hf_llama_reference_grads):
    expected = hf_llama_reference_grads
    got, reports = _step(_hf_llama, graphpass.backend(codegen="eager"))
    _assert_same_arithmetic(got, expected)
    body = reports[0]  # the decoder; the loss head is a second graph after a graph break
    # Each checkpointed layer saves only its input: the embedding (layer 0's input), layer 0's
    # output (layer 1's input), each 2x16x64 fp32 = 8,192 B; besides them only the token ids
    # (2x16 int64, 256 B), the causal mask (2x1x16x16 fp32, 2,048 B), the final norm's rsqrt
    # (2x16x1 fp32, 128 B); no RNG state, since the attention has no dropout (attention_dropout=0).
    inside = {r.name: (r.module, r.bytes) for r in body.rows
              if r.is_activation and r.module.startswith("layers.") and r.kind == "activation"}
    assert sorted(inside.values()) == [("layers.0", 8192), ("layers.0.self_attn", 2048)]
    assert body.bytes_by("kind")["activation"] == 8192 * 2 + 256 + 2048 + 128
    assert "rng_state" not in body.bytes_by("kind")
    assert any(n.startswith("recomputed: your checkpoint in backward: layers.0, ") for n in body.notes)


def test_checkpoint_region_covers_the_fp8_lowering():
    # The quantizes and FP8 GEMMs replacing a checkpointed layer's GEMMs join its region: no FP8
    # copy or GEMM output is saved inside a layer, only the layer inputs as above.
    # Eager code generation: the partition, which this test is about, is the same as under
    # Inductor (backend.eager_compile), without compiling its kernels.
    _, reports = _step(_hf_llama, graphpass.backend(codegen="eager", fp8="tensorwise",
                                                    fp8_exclude=("lm_head",)))
    body = reports[0]
    assert any(n.startswith("lowered: layers.0.self_attn.q_proj") for n in body.notes)
    inside = sorted((r.module, r.kind, r.bytes) for r in body.rows
                    if r.is_activation and r.module.startswith("layers."))
    assert inside == [("layers.0", "activation", 8192), ("layers.0.self_attn", "activation", 2048)]
    assert any(n.startswith("planner: kept your checkpoint policy (PREFER_RECOMPUTE) over "
                            "MUST_SAVE on ") for n in body.notes)


def _sac_policy(ctx, op, *args, **kwargs):
    # keep the activation, recompute everything else, GEMMs included
    return (CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.gelu.default
            else CheckpointPolicy.PREFER_RECOMPUTE)


class _SACMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(64, 128)
        self.act = torch.nn.GELU()
        self.down = torch.nn.Linear(128, 64)

    def _block(self, x):
        return self.down(self.act(self.up(x)))

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
        return checkpoint(self._block, x, use_reentrant=False, context_fn=context)


def _sac_mlp():
    torch.manual_seed(0)
    return _SACMLP(), (torch.randn(16, 64, requires_grad=True),)


def test_selective_checkpoint_policy_wins_with_notes():
    expected, _ = _step(_sac_mlp, None)
    # "act" wants GELU recomputed, the user's policy saves it; the planner wants the GEMMs saved,
    # the user's policy recomputes them
    got, reports = _step(_sac_mlp, graphpass.backend(recompute=("act",), memory="auto"))
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in got)
    report = reports[0]
    assert "recompute act: kept your checkpoint policy (MUST_SAVE) over MUST_RECOMPUTE on 5 node(s) in act" in report.notes
    assert "planner: kept your checkpoint policy (PREFER_RECOMPUTE) over MUST_SAVE on 2 node(s) in down, up" in report.notes
    # saved, by hand: x (16x64 fp32) and, of Inductor's decomposed GELU (all MUST_SAVE by the
    # policy), its output and the erf term its backward reads (16x128 fp32 each); no GEMM output
    saved = sorted((r.module, r.shape, r.bytes) for r in report.rows if r.is_activation)
    assert saved == [("act", (16, 128), 8192), ("act", (16, 128), 8192),
                     ("input:x", (16, 64), 4096)]


def test_full_recompute_inside_user_checkpoint_keeps_the_users_tags(hf_llama_reference_grads):
    expected = hf_llama_reference_grads
    got, reports = _step(_hf_llama, graphpass.backend(codegen="eager", recompute=("full",)))
    _assert_same_arithmetic(got, expected)
    notes = reports[0].notes
    assert any(n.startswith("recompute full: kept your checkpoint policy (PREFER_RECOMPUTE) over "
                            "MUST_RECOMPUTE on ") for n in notes)
    assert any(n.startswith("recompute full (layer-chunk boundaries): kept your checkpoint policy "
                            "(PREFER_RECOMPUTE) over MUST_SAVE on ") for n in notes)
