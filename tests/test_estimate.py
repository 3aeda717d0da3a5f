"""``graphpass.estimate`` against real steps: the peak torch's ``MemTracker`` measures over one
real training step (zero_grad, forward, loss, backward, optimizer step) on the CPU, and the
estimate of the same step under fake tensors, within 3%. FSDP2 on two gloo ranks:
tests/test_estimate_fsdp.py."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker

import graphpass
from graphpass.job.estimate import EstimateError, estimate
from graphpass.job.result import JobEstimate, Part, Phase

transformers = pytest.importorskip("transformers")

TOLERANCE = 0.03
VOCAB, SEQ = 256, 64


class Block(nn.Module):
    """A pre-norm transformer block and a language-model head, written here."""

    def __init__(self, dim: int = 128, heads: int = 4, vocab: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return self.head(x)


def _cross_entropy(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def _llama(dtype=torch.float32):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                   max_position_embeddings=SEQ)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _mixtral(dtype=torch.bfloat16):
    cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     max_position_embeddings=SEQ)
    return transformers.MixtralForCausalLM(cfg).to(dtype)


class _Measuring(MemTracker):
    """torch's MemTracker, letting compiled code run under it (torch otherwise runs the model
    eagerly while a dispatch mode is on)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def measured_peak(model, inputs, *, optimizer, loss_fn=None, options=None, micro_batches=1,
                  **kwargs) -> int:
    """The peak MemTracker measures over the second real step (the first makes the optimizer's
    state and compiles), the step ``estimate`` runs."""
    opt = optimizer([p for p in model.parameters() if p.requires_grad])
    runner = model
    if options is not None:
        torch._dynamo.reset()
        runner = torch.compile(model, backend=graphpass.backend(**options), dynamic=False)

    def step(tracker=None):
        opt.zero_grad(set_to_none=True)
        for k in range(micro_batches):
            if tracker is not None and k:
                tracker.reset_mod_stats()  # MemTracker refuses a second root forward otherwise
            out = runner(*inputs, **kwargs)
            loss = loss_fn(out, *inputs) if loss_fn else out.loss
            del out
            loss.backward()
            del loss
        opt.step()

    step()
    tracker = _Measuring()
    tracker.track_external(model, opt, *inputs, *kwargs.values())
    with tracker:
        step(tracker)
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    return snap["Total"]


def _check(model, inputs, *, optimizer, options=None, loss_fn=None, micro_batches=1,
           **kwargs) -> JobEstimate:
    config = graphpass.Config.from_options(**options) if options is not None else None
    torch._dynamo.reset()
    est = estimate(model, *inputs, optimizer=optimizer, loss_fn=loss_fn, config=config,
                   micro_batches=micro_batches, **kwargs)
    real = measured_peak(model, inputs, optimizer=optimizer, loss_fn=loss_fn, options=options,
                         micro_batches=micro_batches, **kwargs)
    assert abs(est.peak_bytes - real) <= TOLERANCE * real, (est.peak_bytes, real, str(est))
    assert sum(est.breakdown.values()) == est.peak_bytes
    return est


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=False)
ADAMW_FOREACH = functools.partial(torch.optim.AdamW, lr=1e-3, foreach=True)
SGD = functools.partial(torch.optim.SGD, lr=0.1)
SGD_MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
EAGER = dict(codegen="eager")
FP8 = dict(codegen="eager", fp8="tensorwise", kernels="reference")


def _ids(batch=2, seq=SEQ):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("optimizer,options,micro_batches", [
    (ADAMW, None, 1),
    # one_version: the compiled graphs counted under the tracker on every version by the SGD
    # case below; foreach AdamW's step by the Llama's, both on the first version
    pytest.param(ADAMW_FOREACH, EAGER, 1, marks=pytest.mark.one_version),
    (SGD, EAGER, 2),
    (SGD_MOMENTUM, None, 3),
])
def test_block_matches_real_step(optimizer, options, micro_batches):
    ids = _ids()
    est = _check(Block(), (ids,), optimizer=optimizer, options=options, loss_fn=_cross_entropy,
                 micro_batches=micro_batches)
    assert est.micro_batches == micro_batches
    assert {p.phase for p in est.phases} == set(Phase)
    if optimizer is not SGD:  # plain SGD keeps no state
        assert est.breakdown[Part.OPTIMIZER_STATE] > 0


# one_version: compiled graphs under the tracker on every version by the block's SGD case
@pytest.mark.one_version
def test_block_bf16_fp8_matches_real_step():
    ids = _ids()
    est = _check(Block().to(torch.bfloat16), (ids,), optimizer=ADAMW, options=FP8,
                 loss_fn=_cross_entropy)
    assert est.report is not None and est.report.graphs >= 1


# one_version: the block's cases cover the tracker and the compiled graphs on every version
@pytest.mark.one_version
@pytest.mark.parametrize("name,build,optimizer", [
    ("llama", _llama, ADAMW_FOREACH),
    ("mixtral-bf16", _mixtral, SGD_MOMENTUM),
])
def test_hf_model_matches_real_step(name, build, optimizer):
    ids = _ids()
    est = _check(build(), (), optimizer=optimizer, options=EAGER, input_ids=ids, labels=ids)
    assert est.breakdown[Part.LOGITS_AND_LOSS] >= 0


# --- what the estimate says of its input ---------------------------------------------------


class _ReadsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum().item() > 0 else y  # a branch on a value


def test_data_dependent_model_is_a_clear_error():
    with pytest.raises(EstimateError, match="cannot run on fake tensors.*reads a tensor's values"):
        estimate(_ReadsData(), torch.randn(4, 16), optimizer=SGD)


def test_optimizer_it_does_not_check_is_a_note():
    est = estimate(nn.Linear(16, 16), torch.randn(4, 16), optimizer=torch.optim.Adagrad)
    assert any("optimizer Adagrad is not one graphpass checks" in n for n in est.notes), est.notes
    assert est.breakdown[Part.OPTIMIZER_STATE] > 0


def test_default_loss_is_a_note():
    est = estimate(nn.Linear(16, 16), torch.randn(4, 16), optimizer=None)
    assert any(n.startswith("loss: output.float().mean()") for n in est.notes), est.notes
    assert any(n.startswith("no optimizer") for n in est.notes)
    assert est.phase_peak(Phase.OPTIMIZER_STEP) is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)),
     "not an optimizer already built"),
    (dict(optimizer=SGD, micro_batches=0), "micro_batches must be a positive int"),
    (dict(optimizer=lambda params: object()), "not a torch.optim.Optimizer"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(EstimateError, match=message):
        estimate(nn.Linear(16, 16), torch.randn(4, 16), **kwargs)


def test_output_without_loss_is_a_clear_error():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            return self.lin(x), x

    with pytest.raises(EstimateError, match="pass loss_fn="):
        estimate(Pair(), torch.randn(4, 16), optimizer=SGD)


def test_result_reads():
    """The result's text, dict and fits(): every part named, the peak where it is."""
    est = estimate(Block(), _ids(), optimizer=ADAMW, loss_fn=_cross_entropy)
    text = str(est)
    assert text.startswith("step peak (predicted): ") and "optimizer state" in text
    d = est.to_dict()
    assert d["peak_bytes"] == est.peak_bytes and d["phase"] == est.phase.value
    assert est.fits(est.peak_bytes) and not est.fits(est.peak_bytes - 1)
    assert est.fits(est.peak_bytes + 10, reserve_bytes=10)
    assert est.headroom(est.peak_bytes + 5) == 5
    assert max(p.bytes for p in est.phases) == est.peak_bytes


# one_version: two compiles; the step-peak model it reads is checked on every version
# (tests/test_peak.py), the tracker's compiled graphs by test_block_matches_real_step's SGD case
@pytest.mark.one_version
def test_inductor_transients_are_estimated():
    """Under codegen='inductor' each compiled graph's transients come from graphpass's model
    of Inductor's code (a note says so), and no more than the graphs run as-is allocate."""
    ids = _ids()
    torch._dynamo.reset()
    eager = estimate(Block(), ids, optimizer=SGD, loss_fn=_cross_entropy,
                     config=graphpass.Config(codegen="eager"))
    torch._dynamo.reset()
    inductor = estimate(Block(), ids, optimizer=SGD, loss_fn=_cross_entropy,
                        config=graphpass.Config(codegen="inductor"))
    assert any(n.startswith("estimated: the transients of 1 compiled graph run") for n in inductor.notes)
    assert any(n.startswith("counted: 1 compiled graph run") for n in eager.notes)
    assert inductor.peak_bytes <= eager.peak_bytes
    assert inductor.report is not None


# one_version: the budget's arithmetic is graphpass's own; the compiled graphs it re-plans are
# covered on every version by test_block_matches_real_step's SGD case
@pytest.mark.one_version
def test_job_memory_budget_plans_the_graphs_within_what_is_left():
    """memory_budget for the job: what lives outside the compiled graphs first, then each
    graph planned within the rest; a note says how the budget was shared, the parts at the
    peak are the budget's shares, and a budget no plan meets is the planner's ValueError."""
    ids = _ids(batch=4, seq=256)
    torch._dynamo.reset()
    free = estimate(Block(), ids, optimizer=SGD, loss_fn=_cross_entropy,
                    config=graphpass.Config(codegen="eager"))
    budget = int(free.peak_bytes * 0.95)
    torch._dynamo.reset()
    est = estimate(Block(), ids, optimizer=SGD, loss_fn=_cross_entropy,
                   config=graphpass.Config(codegen="eager", memory_budget=budget))
    assert est.peak_bytes <= budget < free.peak_bytes
    assert sum(est.budget.values()) == est.peak_bytes
    assert any(n.startswith("memory_budget ") and "fits the budget" in n for n in est.notes)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="cannot be met"):
        estimate(Block(), ids, optimizer=SGD, loss_fn=_cross_entropy,
                 config=graphpass.Config(codegen="eager", memory_budget=free.peak_bytes // 2))
