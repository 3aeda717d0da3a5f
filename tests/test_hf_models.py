"""Tiny random-config Hugging Face models (no downloads) compiled with FP8: every GEMM lowered
or noted, FP8 coverage, and loss and gradients close to eager."""

import dataclasses

import pytest
import torch

import graphpass

transformers = pytest.importorskip("transformers")

from _one_trace import OneTrace  # noqa: E402
from test_fp8_coverage import assert_no_silent_gemm  # noqa: E402

VOCAB, SEQ = 256, 64


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    # no dropout: the comparison with eager needs the same numbers, and CPU attention with
    # dropout takes SDPA's math path (bmm), which is not a GEMM against a weight
    cfg = transformers.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=VOCAB,
                                  n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _mixtral(experts="grouped_mm"):
    cfg = transformers.MixtralConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=SEQ, experts_implementation=experts)
    return transformers.MixtralForCausalLM(cfg)


# float32 Mixtral's experts run transformers' grouped_mm fallback custom op (torch's grouped_mm
# has no float32 CPU path under compile there); bfloat16 runs aten._grouped_mm.
MODELS = {"llama": _llama, "gpt2": _gpt2, "mixtral": _mixtral,
          "mixtral-bf16": lambda: _mixtral().to(torch.bfloat16)}


def _compile_step(model, ids, **options):
    """One compiled FP8 training step: (loss, gradients, merged report, compiled graphs)."""
    backend = graphpass.backend(codegen="eager", kernels="reference", **options)
    trace = OneTrace(step=backend)
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=trace)
    with trace.use("step"):
        return (*_step(model, ids, compiled), backend.report(), trace.graphs["step"])


def _step(model, ids, compiled):
    model.zero_grad()
    loss = compiled(ids)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _eager_step(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _not_lowered(report):
    return sorted({n.split(": ")[1] for n in report.notes if n.startswith("not lowered: ")})


@dataclasses.dataclass
class Steps:
    model: torch.nn.Module
    ids: torch.Tensor
    # by exclude list ("none": fp8_exclude=(), "default"): (loss, gradients, report, graphs)
    runs: dict[str, tuple]


@pytest.fixture(scope="module")
def steps(request):
    """One FP8 training step of a model (seed 0) without excludes and with the default ones, both
    compiled from one Dynamo trace of the model (``_one_trace``: the trace is most of a compile
    here), each partitioned as a compile of its own would; the tests of one model share it
    (pytest orders them together)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MODELS[request.param]()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    backends = {"none": graphpass.backend(codegen="eager", kernels="reference", fp8="tensorwise",
                                          fp8_exclude=()),
                "default": graphpass.backend(codegen="eager", kernels="reference", fp8="tensorwise")}
    trace = OneTrace(**backends)
    compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=trace)
    runs = {}
    for name, backend in backends.items():
        with trace.use(name):
            runs[name] = (*_step(model, ids, compiled), backend.report(), trace.graphs[name])
    torch._dynamo.reset()
    return Steps(model, ids, runs)


@pytest.mark.parametrize("steps", ["llama", "gpt2", "mixtral", "mixtral-bf16"], indirect=True)
def test_coverage_without_excludes(steps):
    _, _, report, graphs = steps.runs["none"]
    assert_no_silent_gemm(graphs, report.notes)
    cov = report.meta["fp8_coverage"]
    assert cov["fp8_share"] >= 0.97, "\n".join(report.notes)


@pytest.mark.parametrize("steps", ["llama", "gpt2", "mixtral", "mixtral-bf16"], indirect=True)
def test_default_excludes_leave_only_lm_head_and_routers(steps, request):
    name = request.node.callspec.params["steps"]
    _, _, report, graphs = steps.runs["default"]
    assert_no_silent_gemm(graphs, report.notes)
    expected = {"lm_head"}
    if name.startswith("mixtral"):
        expected |= {f"model.layers.{i}.mlp.gate" for i in range(2)}
    assert {m.removeprefix("G.model.") for m in _not_lowered(report)} == expected, report.notes
    for note in report.notes:
        if note.startswith("not lowered: "):
            assert "excluded by pattern" in note, note
    if name.startswith("mixtral"):  # the experts: torch._grouped_mm (bf16), the fallback (fp32)
        assert [n.replace(": G.", ": ") for n in report.notes
                if n.startswith("lowered: ") and "experts" in n] == [
            f"lowered: model.layers.{i}.mlp.experts (reference/tensorwise)" for i in range(2)]


@pytest.mark.parametrize("steps", ["llama", "gpt2", "mixtral"], indirect=True)
def test_loss_and_gradients_close_to_eager(steps, request):
    name = request.node.callspec.params["steps"]
    ref_loss, ref_grads = _eager_step(steps.model, steps.ids)
    loss, grads, _, _ = steps.runs["none"]
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < LOSS_BOUND
    rel = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items() if g.norm() > 0}
    assert set(grads) == set(ref_grads)
    assert max(rel.values()) < GRAD_BOUND.get(name, GRAD_BOUND["default"]), sorted(rel.items(), key=lambda kv: -kv[1])[:3]


# Measured (tensorwise, 2 layers, seed 0): loss within 5e-4 relative, every parameter's gradient
# within 0.17 (Frobenius, relative; q/k projections worst: E5M2 gradients, compounded over two
# layers and through attention). Bounds: 10x and 1.5x those.
# Mixtral with its experts in FP8 too: loss within 5.5e-4, worst gradient the layer-1 router's at
# 0.267 (the experts' FP8 noise and the attention's, compounded: 0.149 with only the experts in
# FP8, 0.161 with all but the experts; the experts' own weights 0.18). Bound: 1.5x.
LOSS_BOUND = 0.005
GRAD_BOUND = {"default": 0.25, "mixtral": 0.4}


def _gpt_neox():
    # use_parallel_residual: attention and MLP read the layer input (each through its own norm)
    # and add into one residual, so both output projections (attention.dense,
    # mlp.dense_4h_to_h) read one output gradient
    cfg = transformers.GPTNeoXConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=VOCAB,
                                     max_position_embeddings=SEQ, use_parallel_residual=True,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    return transformers.GPTNeoXForCausalLM(cfg)


def test_gpt_neox_parallel_block_trains_in_fp8():
    """GPT-NeoX's parallel block (as GPT-J's, Falcon's, Cohere's): one FP8 step lowers its four
    linears, with loss and gradients as close to eager as the other models'."""
    torch.manual_seed(0)
    model = _gpt_neox()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    ref_loss, ref_grads = _eager_step(model, ids)
    loss, grads, report, _ = _compile_step(model, ids, fp8="tensorwise")
    layer = "gpt_neox.layers.0."
    assert sorted(n.split(": ")[1].split(" ")[0].removeprefix("G.") for n in report.notes
                  if n.startswith("lowered: ")) == [
        layer + m for m in ("attention.dense", "attention.query_key_value", "mlp.dense_4h_to_h",
                            "mlp.dense_h_to_4h")]
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < LOSS_BOUND
    rel = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref_grads.items() if g.norm() > 0}
    assert max(rel.values()) < GRAD_BOUND["default"], sorted(rel.items(), key=lambda kv: -kv[1])[:3]


def test_plan_takes_a_batch_as_keywords():
    """``graphpass.plan(model, **batch)``, as the model is called in training: the keyword inputs
    are faked and passed on, and the report names them by their keywords."""
    torch.manual_seed(0)
    model = _gpt_neox()
    ids = torch.randint(0, VOCAB, (2, SEQ))
    batch = {"input_ids": ids, "labels": ids}
    report = graphpass.plan(model, **batch, config=graphpass.Config(fp8="tensorwise"))
    # transformers' forward is wrapped in decorators taking **kwargs: the keywords are its inputs
    assert "input:input_ids" in {r.module for r in report.rows}
    assert not [r.module for r in report.rows if "kwargs" in r.module]
    assert [n for n in report.notes if n.startswith("lowered: ")]
