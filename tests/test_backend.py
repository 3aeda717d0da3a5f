"""The torch.compile backend: options, registration, numerics, inference, breaks, dynamic shapes."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass import Config


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _grads(model, x, compiled):
    model.zero_grad()
    x = x.detach().requires_grad_()
    loss = compiled(x).float().pow(2).mean()
    loss.backward()
    return loss.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown graphpass option\(s\) 'codgen'.*valid options are: codegen"):
        graphpass.backend(codgen="eager")


def test_invalid_value_names_the_valid_values():
    with pytest.raises(ValueError, match=r"codegen='tvm'.*'inductor', 'eager'"):
        graphpass.backend(codegen="tvm")
    with pytest.raises(ValueError, match="report=1.*expected a bool"):
        Config(report=1)


def test_config_is_frozen_and_replace_validates():
    cfg = Config()
    with pytest.raises(Exception):
        cfg.codegen = "eager"
    assert cfg.replace(codegen="eager").codegen == "eager"
    with pytest.raises(ValueError):
        cfg.replace(codegen="nope")


def test_registered_name_uses_the_default_options():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("graphpass").resolve().config == Config()
    model = Block()
    x = torch.randn(4, 32)
    ref = _grads(model, x, model)
    got = _grads(model, x, torch.compile(model, backend="graphpass"))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert graphpass.last_report().meta["config"] == Config().as_dict()


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_gradients_match_eager(codegen):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(2, 8, 32)
    ref = _grads(model, x, model)
    got = _grads(model, x, torch.compile(model, backend=graphpass.backend(codegen=codegen)))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_inference_compiles_without_partition(codegen):
    model = Block()
    x = torch.randn(4, 32)
    before = graphpass.last_report()
    with torch.no_grad():
        out = torch.compile(model, backend=graphpass.backend(codegen=codegen))(x)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert graphpass.last_report() is before  # nothing is saved for backward, nothing reported


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_graph_breaks(codegen):
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Block(), Block()

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    torch.manual_seed(0)
    model = Broken()
    x = torch.randn(4, 32)
    ref = _grads(model, x, model)
    backend = graphpass.backend(codegen=codegen)
    got = _grads(model, x, torch.compile(model, backend=backend))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    # the backend keeps one report per graph it partitioned and merges them; last_report() is
    # the latest graph's
    assert len(backend.partitioner.reports) == 2 and backend.report().graphs == 2
    assert graphpass.last_report() is backend.partitioner.reports[-1]
    # plan() merges one report per graph
    report = graphpass.plan(model, x.requires_grad_())
    assert report.graphs == 2
    assert {r.module.split(".")[0] for r in report.rows if r.kind == "activation"} >= {"a", "b"}
    assert backend.report().activation_bytes == report.activation_bytes


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_dynamic_shapes(codegen):
    torch.manual_seed(0)
    model = Block()
    compiled = torch.compile(model, backend=graphpass.backend(codegen=codegen))
    for batch in (3, 5, 9):
        x = torch.randn(batch, 32)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(_grads(model, x, compiled), _grads(model, x, model), rtol=1e-4, atol=1e-5)
    report = graphpass.last_report()
    assert any(r.kind == "symint" for r in report.rows)  # the batch size crosses to the backward


_CACHE_SCRIPT = textwrap.dedent(
    """
    import importlib, sys, torch, graphpass
    b = importlib.import_module("graphpass.backend")  # the module, not the function of that name
    calls = []
    real = b.run
    b.run = lambda *a, **k: calls.append(1) or real(*a, **k)
    for mode in sys.argv[1:]:  # a compile per mode, each a fresh dynamo
        torch._dynamo.reset()
        calls.clear()
        torch.manual_seed(0)
        # two bias-free linears: a joint graph to partition whose Inductor code is GEMMs only
        # (extern calls), so neither process compiles a C++ kernel (a GELU and the biases' sums
        # were four, 4-8 s of g++ each on torch 2.13); the caches' keys are what this checks
        model = torch.nn.Sequential(torch.nn.Linear(16, 64, bias=False),
                                    torch.nn.Linear(64, 16, bias=False))
        cfg = dict(report=mode == "report")
        out = torch.compile(model, backend=graphpass.backend(**cfg))(torch.randn(4, 16))
        out.sum().backward()
        print(len(calls))
    """
)


def test_compile_caches_never_serve_another_configs_partition(tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
           "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}

    def partitions(*modes):
        """How many partitions each compile ran, the modes compiled in order in one process."""
        out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT, *modes], env=env,
                             capture_output=True, text=True, check=True)
        return [int(n) for n in out.stdout.split()[-len(modes):]]

    assert partitions("report") == [1]  # cold cache
    # A new process: the same config and graphpass are served from the cache; another config
    # must partition again.
    assert partitions("report", "no-report") == [0, 1]


def test_dropout_under_eager_codegen_and_plan():
    """Inductor's random-op joint pass needs its virtualized fake mode outside compile_fx too."""
    import dataclasses

    from graphpass.models import gpt

    model, (x,) = gpt.build("tiny")
    model = type(model)(dataclasses.replace(model.config, dropout=0.1))
    x = x.detach().requires_grad_()
    torch.compile(model, backend=graphpass.backend(codegen="eager"))(x).sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert graphpass.plan(model, x).activation_bytes == graphpass.last_report().activation_bytes
