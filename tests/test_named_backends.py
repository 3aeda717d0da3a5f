"""Backends chosen by name (``torch.compile(backend="graphpass_fp8")``) and options from the
``GRAPHPASS_OPTIONS`` environment variable: the same validation as ``graphpass.backend(...)``,
the same partition, and the report saying where the options came from."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.registry import lookup_backend

import graphpass
from graphpass import Config
from graphpass.named import ENV, PRESETS, NamedBackend, env_options


class MLP(nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def _step(model, compiled, x):
    model.zero_grad()
    loss = compiled(x).pow(2).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_preset_name_is_registered():
    for name, options in PRESETS.items():
        named = lookup_backend(name)
        assert isinstance(named, NamedBackend) and named.name == name
        assert named.resolve().config == Config.from_options(**options)
    assert lookup_backend("graphpass_fp8").resolve().config.fp8 == "tensorwise"
    assert lookup_backend("graphpass_fp8").resolve().config.memory_policy == "auto"  # the planner


def test_fp8_by_name_is_the_backend_by_hand(monkeypatch):
    """``backend="graphpass_fp8"`` with kernels and codegen from the variable: FP8 tensorwise with
    the planner, bit-identical to ``graphpass.backend(...)`` with the same options; the report
    says where its options came from."""
    monkeypatch.setenv(ENV, "kernels=reference codegen=eager")
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(2, 16, 64)
    by_hand = graphpass.backend(fp8="tensorwise", kernels="reference", codegen="eager")
    ref = _step(model, torch.compile(model, backend=by_hand), x)
    torch._dynamo.reset()
    got = _step(model, torch.compile(model, backend="graphpass_fp8"), x)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)

    report = graphpass.last_report()
    assert report.meta["config"] == by_hand.config.as_dict()
    assert report.meta["options_from"] == \
        "backend name 'graphpass_fp8' + GRAPHPASS_OPTIONS='kernels=reference codegen=eager'"
    assert report.meta["fp8_coverage"] == by_hand.report().meta["fp8_coverage"]
    assert report.activation_bytes == by_hand.report().activation_bytes
    assert ("options: codegen='eager', fp8='tensorwise', kernels='reference' (from backend name "
            "'graphpass_fp8' + GRAPHPASS_OPTIONS='kernels=reference codegen=eager')") in report.table()
    # graphpass.backend(...) reports no such line: its options are in the user's code
    assert "options:" not in by_hand.report().table()


@pytest.mark.parametrize("text, expected", [
    ("", {}),
    ("fp8=tensorwise kernels=reference", {"fp8": "tensorwise", "kernels": "reference"}),
    ("fp8=tensorwise;recompute=core_attn,act", {"fp8": "tensorwise", "recompute": ("core_attn", "act")}),
    ("memory_planner=none planner_recompute_budget=0.05 offload=true",
     {"memory_planner": None, "planner_recompute_budget": 0.05,
      "offload": True}),
    ('{"fp8": "tensorwise", "fp8_exclude": ["output"], "planner_recompute_budget": null}',
     {"fp8": "tensorwise", "fp8_exclude": ("output",), "planner_recompute_budget": None}),
])
def test_variable_syntax(text, expected):
    assert env_options(text) == expected
    Config.from_options(**expected)


@pytest.mark.parametrize("text, message", [
    ("fp8=tensorwsie", r"invalid GRAPHPASS_OPTIONS='fp8=tensorwsie': fp8: 'tensorwsie' is not one "
                       r"of none, tensorwise, blockwise, mxfp8"),
    ("fp9=tensorwise", r"unknown option 'fp9'; valid options: codegen, report, fp8"),
    ("fp8", r"expected space-separated key=value items"),
    ("{fp8: 1}", r"not a JSON object"),
    ('["fp8"]', r"unknown option|expected space-separated"),
    ("fp8=rowwise kernels=te", r"kernels='te' with fp8='rowwise': Transformer Engine has no rowwise.*"
                               r"\(from GRAPHPASS_OPTIONS='fp8=rowwise kernels=te' on backend "
                               r"'graphpass_fp8'\)"),
    ('{"codgen": "eager"}', r"unknown graphpass option\(s\) 'codgen'; valid options are: codegen"),
])
def test_a_bad_variable_is_one_value_error_naming_the_fix(monkeypatch, text, message):
    monkeypatch.setenv(ENV, text)
    with pytest.raises(ValueError, match=message):
        NamedBackend("graphpass_fp8")


def test_a_bad_variable_fails_at_compile_in_process(monkeypatch):
    """A name torch has already loaded reads the variable again at each compile: torch wraps the
    ValueError in its BackendCompilerFailed, which repeats its text."""
    lookup_backend("graphpass_eager")
    monkeypatch.setenv(ENV, "fp8=delayed")
    with pytest.raises(Exception, match="invalid GRAPHPASS_OPTIONS='fp8=delayed'") as info:
        torch.compile(MLP(), backend="graphpass_eager")(torch.randn(2, 64))
    assert isinstance(info.value, ValueError) or isinstance(info.value.inner_exception, ValueError)


def test_a_bad_variable_fails_at_torch_compile_in_a_new_process():
    """The installed entry point: torch loads the name at ``torch.compile``, before any graph, and
    the user sees the ValueError itself (graphpass never imported by the script)."""
    script = textwrap.dedent("""
        import torch
        try:
            torch.compile(torch.nn.Linear(2, 2), backend="graphpass_fp8")
        except ValueError as e:
            print("ValueError:", e)
    """)
    env = {**os.environ, ENV: "kernels=cublas"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=120)
    assert "ValueError: invalid GRAPHPASS_OPTIONS='kernels=cublas': kernels: 'cublas' is not one of " \
           "auto, te, scaled_mm, reference" in out.stdout, out.stdout + out.stderr
