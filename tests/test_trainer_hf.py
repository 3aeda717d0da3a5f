"""graphpass under the Hugging Face ``Trainer``: the recipe of docs/trainers.md, run on a tiny
random Llama and a tiny Mixtral (fp32, FP8 tensorwise with the reference kernels on the CPU, the
eager code generation: the partition is what is tested, not Inductor's kernels).

accelerate refuses any backend name outside its own list, so the model is compiled in place
before the Trainer sees it, and the Trainer's own ``torch_compile`` stays off.
"""

import copy
import math

import pytest
import torch

import graphpass

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ, BATCH, STEPS = 128, 32, 2, 3
OPTIONS = dict(fp8="tensorwise", kernels="reference", codegen="eager")


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=SEQ))


class Tokens(torch.utils.data.IterableDataset):
    """Fixed random token rows, in order (the Trainer shuffles no iterable dataset), so a step's
    batch is known."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        for row in self.rows:
            yield {"input_ids": row, "labels": row}


class FirstGradients(transformers.TrainerCallback):
    """The gradients of the first step, as the optimizer is about to read them."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters()
                          if p.grad is not None}


def train(model, rows, output_dir, backend, **arguments):
    """The recipe: compile the model in place with a graphpass backend, then train it with the
    Trainer as usual (``torch_compile`` left off: the model is compiled already)."""
    model.compile(backend=backend)
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        disable_tqdm=True, **arguments)
    gradients = FirstGradients(model)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(rows),
                                   callbacks=[gradients])
    trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log], gradients.grads


def _by_hand(model, rows):
    """The first step with the same model compiled by hand, called as the Trainer calls it: labels
    in their own tensor, no KV cache, and the count of label tokens (after the causal shift) that
    the loss is normalised by, as a float tensor. (The Trainer's gradient clipping is off.)"""
    backend = graphpass.backend(**OPTIONS)
    compiled = torch.compile(model, backend=backend)
    ids = torch.stack(rows[:BATCH])
    tokens = torch.tensor(float(ids[:, 1:].numel()))
    loss = compiled(input_ids=ids, labels=ids.clone(), use_cache=False, num_items_in_batch=tokens).loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, backend


@pytest.mark.parametrize("build", [_llama, _mixtral], ids=["llama", "mixtral"])
def test_trainer_trains_with_graphpass_fp8(build, tmp_path):
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    rows = [torch.randint(VOCAB, (SEQ,)) for _ in range(BATCH * STEPS)]
    backend = graphpass.backend(**OPTIONS)

    losses, grads = train(model, rows, tmp_path, backend, max_grad_norm=0.0)

    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), losses
    report = backend.report()
    assert report is not None and report.activation_bytes > 0
    assert report.meta["fp8_coverage"]["fp8_share"] > 0.5, report.table()
    expected, by_hand = _by_hand(reference, rows)
    assert grads.keys() == expected.keys()
    torch.testing.assert_close(grads, expected, rtol=0, atol=0)
    # the first step's graph saves what the same graph compiled by hand saves
    first = backend.partitioner.reports[0]
    assert (first.activation_bytes, first.bytes_by("kind")) == \
        (by_hand.report().activation_bytes, by_hand.report().bytes_by("kind"))
    print(f"{build.__name__[1:]}: losses {losses}; saved {report.activation_bytes:,} B; " + next(
        line for line in report.table().splitlines() if line.startswith("fp8:")))


def test_accelerate_refuses_a_backend_name(tmp_path):
    """Why the recipe compiles the model itself: the Trainer hands ``torch_compile_backend`` to
    accelerate, which accepts only the names in its own list (its ``DynamoBackend`` enum)."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), torch_compile_backend="graphpass_fp8",
                                          use_cpu=True, report_to="none")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64))
    with pytest.raises(ValueError, match="'GRAPHPASS_FP8' is not a valid DynamoBackend"):
        transformers.Trainer(model=model, args=args)
