"""Fuzzed options and inputs: every invalid option or contradiction is one ValueError that names the
fix, never a traceback from torch internals; every valid one plans a model.

Judged on the options alone: unknown names, values outside a field's choices or type, and
contradictions (``kernels="te"`` with ``fp8="rowwise"``). An option that does nothing without
another (``offload_stream`` without ``offload``, ``save_original_modules`` without ``fp8``,
``recompute_method`` without ``"full"``...) is a report note, not an error: a sweep over ``fp8``
(None included) keeps its other options at every point. Judged on the graph: a recompute word that
selects nothing there is a report note too, because one model compiles to several graphs (graph
breaks, the head) and a word may rightly match in only some of them.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import graphpass
from graphpass.config import CHOICES, RECOMPUTE_MODULES, Config

JUNK = st.sampled_from([object(), "x", "", -1, 1.5, float("nan"), [1], {"a": 1}, b"tensorwise",
                        True, None, ("*", 3)])
FIELDS = {
    **{name: st.sampled_from(valid) for name, valid in CHOICES.items()},
    "report": st.booleans(),
    "fuse_quantize": st.booleans(),
    "order_backward": st.booleans(),
    "fp8_pow2_scales": st.one_of(st.none(), st.booleans()),
    "fp8_exclude": st.lists(st.sampled_from(["output", "*.gate", "layers.0.*"]), max_size=2),
    "fp8_min_gemm_flops": st.integers(-5, 10**9),
    "fp8_save_original_input_modules": st.lists(st.sampled_from(["*.o_proj", "mlp.*"]), max_size=2),
    "recompute": st.lists(st.sampled_from([*RECOMPUTE_MODULES, "attention"]), max_size=3),
    "recompute_num_layers": st.integers(-1, 4),
    "recompute_include": st.lists(st.sampled_from(["*", "layers.0.*"]), min_size=1, max_size=2),
    "planner_recompute_budget": st.one_of(st.none(), st.floats(-1, 2), st.just(float("nan"))),
    "memory_budget": st.one_of(st.none(), st.integers(-5, 1 << 40), st.floats(-1, 2)),
    "offload": st.booleans(),
    "offload_stream": st.one_of(st.none(), st.booleans()),
    "offload_min_bytes": st.integers(-5, 1 << 22),
    "offload_exclude": st.lists(st.sampled_from(["aten.mm", "layers.0.*"]), max_size=2),
    "fp8_activation_cache_min_bytes": st.integers(-5, 1 << 20),
}
OPTIONS = st.dictionaries(
    st.sampled_from([*FIELDS, "fp8_recipe", "recompute_modules"]),
    st.just(None), max_size=6,
).flatmap(lambda keys: st.fixed_dictionaries(
    {k: st.one_of(FIELDS.get(k, JUNK), JUNK) for k in keys}))
# The message names the option and how to fix it (valid values, the expected form, what to set).
FIX = re.compile(r"(unknown|invalid) graphpass option.*(valid|expected|set|use|write)", re.S)


def _judge(options: dict) -> graphpass.backend | None:
    """The backend for ``options``, or None after checking the ValueError is a good one."""
    try:
        backend = graphpass.backend(**options)
    except ValueError as e:
        assert FIX.search(str(e)), str(e)
        assert "\n" not in str(e)
        return None
    return backend


@settings(max_examples=400, deadline=None)
@given(OPTIONS)
def test_any_options_are_a_backend_or_one_clear_value_error(options):
    backend = _judge(options)
    if backend is None:
        return
    # the repr names exactly the options the user set
    args = ", ".join(f"{k}={v!r}" for k, v in options.items())
    assert repr(backend) == f"graphpass.backend({args})"
    assert Config.from_options(**options) == backend.config


@pytest.mark.parametrize("options, note", [
    ({"offload_stream": True}, "offload_stream=True has no effect without offload=True"),
    ({"offload_stream": False}, "offload_stream=False has no effect without offload=True"),
    ({"offload_min_bytes": 0}, "offload_min_bytes=0 has no effect without offload=True"),
    ({"fp8_save_original_input_modules": ("*.o_proj",)},
     "fp8_save_original_input_modules=('*.o_proj',) has no effect without fp8='tensorwise' (or "
     "another recipe)"),
    ({"kernels": "te"}, "kernels='te' has no effect without fp8='tensorwise' (or another recipe)"),
    ({"recompute_method": "block"}, "recompute_method='block' has no effect without "
                                    "recompute=('full',)"),
    ({"recompute": ("mlp",), "recompute_num_layers": 2},
     "recompute_num_layers=2 has no effect without recompute=('full',)"),
    ({"recompute_include": ("layers.0.*",)}, "recompute_include=('layers.0.*',) has no effect "
                                             "without a recompute selection such as "
                                             "recompute=('core_attn',)"),
    ({"fp8_activation_cache_min_bytes": 0}, "fp8_activation_cache_min_bytes=0 has no effect "
                                            "without fp8_activation_cache='act_input' (or another "
                                            "level)"),
    ({"order_backward": True, "codegen": "eager"},
     "order_backward=True has no effect without codegen='inductor' (graphs run as they are under "
     "codegen='eager')"),
])
def test_option_without_effect_is_a_note(options, note):
    backend = graphpass.backend(**options)
    assert [str(u) for u in backend.config.unused()] == [note]
    # it runs as without the option: a group's option reads back as its default
    name = note.split("=")[0]
    value = options[name]
    if name != "order_backward":  # Config's own field, read as written (min_cut asks codegen)
        assert getattr(backend.config, name) == Config().as_dict()[name]
    assert backend.config.changed()[name] == value  # as written
    assert repr(backend) == "graphpass.backend(" + ", ".join(
        f"{k}={v!r}" for k, v in options.items()) + ")"


@pytest.mark.parametrize("options, message", [
    ({"kernels": "te", "fp8": "rowwise"}, "kernels='te' with fp8='rowwise': Transformer Engine has "
                                          "no rowwise"),
    ({"kernels": "scaled_mm", "fp8": "mxfp8"}, "kernels='scaled_mm' with fp8='mxfp8': that "
                                               "provider runs fp8='tensorwise' or 'rowwise' or "
                                               "'blockwise' only"),
    ({"recompute": ("attention",)}, "invalid graphpass option recompute='attention'; valid values"),
    ({"recompute": "mlp"}, "expected a tuple of strings: write recompute=('mlp',)"),
    ({"recompute_num_layers": True, "recompute": ("full",)}, "expected an int"),
    ({"planner_recompute_budget": float("inf")}, "planner_recompute_budget=inf; expected a fraction"),
    ({"offload": True, "offload_min_bytes": -1}, "offload_min_bytes=-1; expected a count of 0"),
    ({"fp8_recipe": "tensorwise"}, "unknown graphpass option(s) 'fp8_recipe'; valid options are"),
    ({"fp8_activation_cache": "activations"},
     "invalid graphpass option fp8_activation_cache='activations'; valid values"),
])
def test_invalid_combination_names_the_fix(options, message):
    with pytest.raises(ValueError) as e:
        graphpass.backend(**options)
    assert message in str(e.value)


def test_sweep_options_are_exempt_from_the_unused_notes():
    # sweeps over fp8 (None included) set these at every point: the CLI's shared flags, and
    # test_memory_passes' UNOPTIMISED baseline
    assert Config(fp8_save_original_input="never", memory_planner="default").unused() == ()
    assert Config(fp8_exclude=("output", "*.gate")).unused() == ()


def test_backend_repr_shows_only_the_options_set():
    assert repr(graphpass.backend(fp8="tensorwise")) == "graphpass.backend(fp8='tensorwise')"
    assert repr(graphpass.backend()) == "graphpass.backend()"
    # a Backend made from a Config (no options) shows the fields that differ from the defaults
    from graphpass.backend import Backend
    assert repr(Backend(Config(fp8="mxfp8", offload=True))) == (
        "graphpass.backend(fp8='mxfp8', offload=True)")


def test_torch_errors_name_the_backend_by_its_options(monkeypatch):
    from graphpass.fp8 import providers

    monkeypatch.setattr(providers, "te_status", lambda: providers.TEStatus(None))
    backend = graphpass.backend(fp8="tensorwise", kernels="te", codegen="eager")
    compiled = torch.compile(torch.nn.Linear(32, 32), backend=backend)
    with pytest.raises(Exception) as e:
        compiled(torch.randn(16, 32)).sum().backward()
    assert str(e.value).startswith(
        "backend=\"graphpass.backend(fp8='tensorwise', kernels='te', codegen='eager')\" raised:\n"
        "ValueError: graphpass fp8 lowering of <root>: kernels='te' needs Transformer Engine "
        "(Transformer Engine not installed): pip install 'graphpass[te]' on a CUDA machine, or "
        "use kernels='auto', 'scaled_mm' or 'reference'")


@pytest.mark.parametrize("call, message", [
    (lambda m, x: graphpass.plan(m, x, config="tensorwise"),
     "config='tensorwise' is not a graphpass.Config; write config=graphpass.Config("),
    (lambda m, x: graphpass.plan(m, x, config={"fp8": "tensorwise"}), "is not a graphpass.Config"),
    (lambda m, x: graphpass.plan(lambda t: m(t), x), "graphpass.plan takes an nn.Module, not function"),
])
def test_bad_plan_arguments_are_value_errors(call, message):
    model = torch.nn.Linear(16, 16)
    with pytest.raises(ValueError, match=re.escape(message)):
        call(model, torch.randn(4, 16))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPTIONS)
def test_every_valid_config_plans_a_model(options):
    backend = _judge(options)
    if backend is None:
        return
    try:
        report = graphpass.plan(_mlp(), torch.randn(16, 32), config=backend.config)
    except ValueError as e:  # a budget below the smallest reachable peak: one clear error
        if backend.config.memory_budget is None or "cannot be met" not in str(e):
            raise
        assert "the smallest predicted step peak graphpass reaches is " in str(e)
        return
    if not backend.config.report:  # report=False records nothing: plan says so in a note
        assert report.graphs == 0 and report.notes
        return
    assert report.graphs == 1
    for word in backend.config.recompute:
        assert any(n.startswith(f"recompute {word}: ") for n in report.notes)


def test_recompute_word_selecting_nothing_is_a_note_not_an_error():
    report = graphpass.plan(_mlp(), torch.randn(16, 32), config=Config(recompute=("moe",)))
    assert "recompute moe: 0 module(s) — nothing in this graph matched" in report.notes
