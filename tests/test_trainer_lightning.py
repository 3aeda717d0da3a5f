"""graphpass under Lightning: the recipe of docs/trainers.md. A LightningModule compiles its
model in ``configure_model`` (Lightning's hook for it) with a graphpass backend; the Trainer
then trains as usual. A tiny fp32 MLP-block model, FP8 tensorwise with the reference kernels on
the CPU, the eager code generation (the partition is what is tested)."""

import copy
import math

import pytest
import torch
import torch.nn as nn

import graphpass

pl = pytest.importorskip("pytorch_lightning")

STEPS, DIM = 3, 64
OPTIONS = dict(fp8="tensorwise", kernels="reference", codegen="eager")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.output = nn.Linear(DIM, 16)  # kept in high precision (fp8_exclude's default)

    def forward(self, x):
        return self.output(x + self.down(torch.nn.functional.silu(self.up(self.norm(x)))))


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class Module(pl.LightningModule):
    """The recipe: compile in ``configure_model`` with a graphpass backend."""

    def __init__(self, net, backend):
        super().__init__()
        self.net, self.backend = net, backend
        self.losses, self.first_grads = [], None

    def configure_model(self):
        self.net.compile(backend=self.backend)

    def training_step(self, batch, _index):
        x, y = batch
        loss = loss_fn(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, _optimizer):
        if self.first_grads is None:
            self.first_grads = {n: p.grad.clone() for n, p in self.net.named_parameters()}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_lightning_trains_with_graphpass_fp8():
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    x, y = torch.randn(STEPS * 8, 32, DIM), torch.randint(16, (STEPS * 8, 32))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    backend = graphpass.backend(**OPTIONS)
    module = Module(net, backend)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)

    assert len(module.losses) == STEPS and all(map(math.isfinite, module.losses)), module.losses
    report = backend.report()
    assert report is not None and report.meta["fp8_coverage"]["fp8_share"] > 0.5, report
    # the first step's gradients: bit-identical to the same net compiled by hand
    by_hand = graphpass.backend(**OPTIONS)
    compiled = torch.compile(reference, backend=by_hand)
    loss_fn(compiled(x[:8].clone()), y[:8]).backward()  # a batch of its own, as the loader gives
    torch.testing.assert_close(module.first_grads, {n: p.grad for n, p in reference.named_parameters()},
                               rtol=0, atol=0)
    first = backend.partitioner.reports[0]
    assert first.activation_bytes == by_hand.report().activation_bytes
    print(f"lightning: losses {module.losses}; saved {first.activation_bytes:,} B; "
          + next(line for line in report.table().splitlines() if line.startswith("fp8:")))
