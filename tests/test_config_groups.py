"""``Config`` holds its options in groups (``FP8``, ``Recompute``, ``Offload``,
``ActivationCache``, ``MemoryPlan``), each a frozen dataclass that validates itself; the flat
keywords build the same groups. An option without effect under the others is a report note."""

from __future__ import annotations

import pickle

import pytest
import torch

import graphpass
from graphpass import FP8, ActivationCache, Config, MemoryPlan, Offload, Recompute
from graphpass.backend import Partitioner
from graphpass.cli_flags import config_flags
from graphpass.config import DEFAULTS, SHORTHAND


@pytest.mark.parametrize("flat, grouped", [
    ({"fp8": "rowwise", "kernels": "scaled_mm"},
     {"fp8": FP8("rowwise", kernels="scaled_mm")}),
    ({"fp8": "tensorwise", "fp8_format": "e4m3", "fp8_exclude": ["output"],
      "fp8_save_quantized_weight": True},
     {"fp8": FP8("tensorwise", format="e4m3", exclude=("output",), weight_once=True)}),
    ({"recompute": ["full"], "recompute_method": "block", "recompute_num_layers": 2},
     {"recompute": Recompute(("full",), method="block", num_layers=2)}),
    ({"offload": True, "offload_min_bytes": 0, "offload_exclude": ("aten.mm",)},
     {"offload": Offload(True, min_bytes=0, exclude=("aten.mm",))}),
    ({"fp8_activation_cache": "attn", "fp8_activation_cache_format": "e4m3_tensor"},
     {"fp8_activation_cache": ActivationCache("attn", format="e4m3_tensor")}),
    ({"memory_planner": "auto", "memory_budget": 0.5, "planner_recompute_budget": None},
     {"memory_planner": MemoryPlan("auto", recompute_budget=None, budget=0.5)}),
    # a group and keywords that change it
    ({"fp8": "rowwise", "fp8_pow2_scales": True, "kernels": "scaled_mm"},
     {"fp8": FP8("rowwise", kernels="scaled_mm"), "fp8_pow2_scales": True}),
])
def test_flat_and_grouped_forms_build_equal_configs(flat, grouped):
    a, b = Config(**flat), Config(**grouped)
    assert a == b and hash(a) == hash(b)
    assert a.as_dict() == b.as_dict() and a.changed() == b.changed()
    assert Partitioner(a).uuid() == Partitioner(b).uuid()  # the compile caches' key
    assert a.fp8_recipe == b.fp8_recipe and a.memory_policy == b.memory_policy
    assert Config.from_options(**a.changed()) == a
    assert eval(repr(a), {"Config": Config}) == a
    assert pickle.loads(pickle.dumps(a)) == a


def test_backend_takes_a_group_too():
    backend = graphpass.backend(fp8=FP8("tensorwise", weight_once=True), recompute=("layernorm",))
    assert backend.config == Config(fp8="tensorwise", fp8_save_quantized_weight=True,
                                    recompute=("layernorm",))
    assert backend.config.changed() == {"fp8": "tensorwise", "fp8_save_quantized_weight": True,
                                        "recompute": ("layernorm",)}


def test_groups_read_back_by_keyword_and_by_group():
    config = Config(fp8="rowwise", kernels="scaled_mm", recompute=("layernorm",), offload=True)
    assert config.float8 == FP8("rowwise", kernels="scaled_mm")
    assert (config.fp8, config.kernels, config.fp8_exclude) == ("rowwise", "scaled_mm",
                                                                 FP8().exclude)
    assert config.recomputation.modules == config.recompute == ("layernorm",)
    assert config.offloading.enabled and config.offload_on_stream
    assert config.activation_cache == ActivationCache() and config.memory_plan == MemoryPlan()
    assert config.memory_policy == "auto" and Config().memory_policy == "default"
    assert set(config.as_dict()) == set(SHORTHAND) == set(DEFAULTS)
    assert Config().changed() == {} and repr(Config()) == "Config()"


def test_replace_keeps_the_rest_of_a_group():
    config = Config(fp8="tensorwise", fp8_format="e4m3", recompute=("mlp",))
    assert config.replace(kernels="reference").float8 == FP8("tensorwise", format="e4m3",
                                                             kernels="reference")
    assert config.replace(fp8=FP8("rowwise")).float8 == FP8("rowwise")
    assert config.replace(recompute_include=("layers.0.*",)).recompute == ("mlp",)
    with pytest.raises(ValueError, match="unknown graphpass option\\(s\\) 'fp9'; valid options "
                                         "are: codegen, report, fp8, "):
        config.replace(fp9="tensorwise")


def test_unknown_keyword_of_config_is_a_value_error_naming_the_valid_ones():
    """``Config(...)`` itself, not only ``from_options`` and ``backend()``: a ValueError (not
    Python's TypeError) that lists every valid keyword."""
    with pytest.raises(ValueError) as e:
        Config(fp8_recipe="tensorwise")
    assert str(e.value).startswith("unknown graphpass option(s) 'fp8_recipe'; valid options are: ")
    assert all(name in str(e.value) for name in SHORTHAND)


@pytest.mark.parametrize("make, message", [
    (lambda: FP8("delayed"), "fp8='delayed': DelayedScaling keeps amax history"),
    (lambda: FP8("tensorwsie"), "invalid graphpass option fp8='tensorwsie'; valid values are: "
                                "None, 'tensorwise', 'blockwise', 'mxfp8', 'rowwise'"),
    (lambda: FP8("rowwise", kernels="te"), "kernels='te' with fp8='rowwise': Transformer Engine "
                                           "has no rowwise"),
    (lambda: FP8("mxfp8", kernels="te"), "kernels='te' with fp8='mxfp8': that provider runs "
                                         "fp8='tensorwise' only"),
    (lambda: FP8(weight_cache="yes"), "fp8_weight_cache='yes'; valid values are: False, True, "
                                      "'auto'"),
    (lambda: FP8(weight_cache=1), "fp8_weight_cache=1; valid values are: False, True, 'auto'"),
    (lambda: FP8(exclude="output"), "fp8_exclude='output'; expected a tuple of strings: write "
                                    "fp8_exclude=('output',)"),
    (lambda: FP8(min_gemm_flops=-1), "fp8_min_gemm_flops=-1; expected a count of 0 or more"),
    (lambda: Recompute(("attention",)), "recompute='attention'; valid values are"),
    (lambda: Recompute(num_layers=0), "recompute_num_layers=0; expected a positive layer count"),
    (lambda: Offload(stream="yes"), "offload_stream='yes'; expected a bool"),
    (lambda: Offload(min_bytes=True), "offload_min_bytes=True; expected an int"),
    (lambda: ActivationCache(format="e4m3"),
     "fp8_activation_cache_format='e4m3'; valid values are"),
    (lambda: MemoryPlan(budget=1.5), "memory_budget=1.5; expected bytes"),
    (lambda: MemoryPlan(recompute_budget=-1), "recompute_budget=-1; expected a fraction"),
    (lambda: Config(fp8=Recompute()), "fp8=Recompute(modules=(), "),
    (lambda: Config(codegen="aot"), "invalid graphpass option codegen='aot'; valid values are: "
                                    "'inductor', 'eager'"),
])
def test_each_group_validates_itself(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert message in str(e.value)


def test_contradictions_stay_errors_in_either_form():
    for make in (lambda: Config(fp8="rowwise", kernels="te"),
                 lambda: Config(fp8=FP8("rowwise"), kernels="te"),
                 lambda: Config(fp8="rowwise").replace(kernels="te")):
        with pytest.raises(ValueError, match="Transformer Engine has no rowwise"):
            make()


def test_unused_options_run_as_their_defaults():
    config = Config(kernels="reference", fp8_weight_cache=True, offload_stream=False,
                    offload_exclude=("aten.mm",), recompute_method="block")
    assert [u.option for u in config.unused()] == [
        "fp8_weight_cache", "kernels", "recompute_method", "offload_stream", "offload_exclude"]
    # read back in effect: the defaults; as written in as_dict and changed
    assert (config.kernels, config.fp8_weight_cache, config.offload_stream,
            config.offload_exclude, config.recompute_method) == ("auto", False, None, (), "uniform")
    assert config.changed()["kernels"] == "reference" and config.float8.kernels == "reference"
    assert config.recipe is None and not config.offload_on_stream
    # the group keeps them too, and says which have no effect
    assert [str(u) for u in FP8(kernels="reference").unused()] == [
        "kernels='reference' has no effect without fp8='tensorwise' (or another recipe)"]
    assert FP8(kernels="reference").in_effect() == FP8()
    assert FP8("tensorwise", pow2_scales=True).scaling == FP8("tensorwise").scaling


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


NOTE = "unused: kernels='reference' has no effect without fp8='tensorwise' (or another recipe)"


def test_an_option_without_effect_is_a_report_note_not_an_error():
    """A bf16/FP8 sweep keeps kernels='reference' at its bf16 point: the plan is bf16's, bytes
    for bytes, with a note."""
    x = torch.randn(16, 32)
    swept = graphpass.plan(_mlp(), x, config=Config(kernels="reference"))
    assert NOTE in graphpass.last_report().notes
    plain = graphpass.plan(_mlp(), x, config=Config())
    assert NOTE in swept.notes and NOTE not in plain.notes
    assert swept.activation_bytes == plain.activation_bytes
    assert [(r.name, r.bytes) for r in swept.rows] == [(r.name, r.bytes) for r in plain.rows]


class _Broken(torch.nn.Module):
    """Two graphs: a graph break between the linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(y).relu()


def test_the_note_reaches_a_backends_report_once():
    backend = graphpass.backend(kernels="reference", codegen="eager")
    torch._dynamo.reset()
    model = torch.compile(_Broken(), backend=backend)
    model(torch.randn(16, 32, requires_grad=True)).sum().backward()
    report = backend.report()
    assert report.graphs == 2 and report.notes.count(NOTE) == 1
    assert [d.why for d in report.decisions if d.what is graphpass.What.UNUSED] == [NOTE[8:]]
    assert NOTE in graphpass.last_report().notes


def test_cli_flags_cover_every_keyword_with_its_groups_help():
    flags = {f.name: f for f in config_flags()}
    assert list(flags) == list(SHORTHAND)
    assert flags["kernels"].convert("te") == "te"
    assert flags["offload_min_bytes"].help.startswith("Saved tensors smaller than this are never "
                                                      "offloaded. ")
    assert flags["offload_min_bytes"].help.endswith("(default: 1048576)")
    assert flags["fp8_exclude"].help.endswith("(default: output,lm_head,*.gate,*.router)")
