"""Renamed options: each old keyword (``graphpass.config.DEPRECATED``) still works wherever a
keyword is taken (``Config``, ``replace``, ``from_options``, ``GRAPHPASS_OPTIONS``, the CLI's
flags and policies), warns once per process with a FutureWarning naming its new name, and gives
the same config as the new name."""
import argparse
import warnings

import pytest

import graphpass
from graphpass import config as config_module
from graphpass.cli_flags import add_config_flags, config_flags, parse_policy
from graphpass.config import DEPRECATED, SHORTHAND, Config
from graphpass.named import env_options

# A value other than the default for each renamed keyword, valid with fp8="tensorwise".
VALUES = {
    "fp8_sequence_all_gather": False,
    "fp8_save_quantized_weight": True,
    "fp8_activation_cache": "attn",
    "fp8_activation_cache_format": "e4m3_tensor",
    "fp8_activation_cache_min_bytes": 0,
    "memory_planner": "default",
    "planner_recompute_budget": 0.05,
    "fp8_save_original_input": "never",
    "fp8_save_original_input_modules": ("layers.0.*",),
}
TEXT = {"fp8_sequence_all_gather": "false", "fp8_save_quantized_weight": "true",
        "fp8_activation_cache": "attn", "fp8_activation_cache_format": "e4m3_tensor",
        "fp8_activation_cache_min_bytes": "0", "memory_planner": "default",
        "planner_recompute_budget": "0.05", "fp8_save_original_input": "never",
        "fp8_save_original_input_modules": "layers.0.*"}


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Each test sees the first use of every old name in this process."""
    monkeypatch.setattr(config_module, "_warned", set())


def test_every_old_name_maps_to_a_keyword():
    assert set(VALUES) == set(DEPRECATED.values())
    assert set(DEPRECATED.values()) <= set(SHORTHAND)
    assert not set(DEPRECATED) & set(SHORTHAND)


@pytest.mark.parametrize("old", sorted(DEPRECATED))
def test_old_name_warns_once_and_gives_the_new_keyword(fresh_warnings, old):
    new = DEPRECATED[old]
    with pytest.warns(FutureWarning, match=f"graphpass option {old} is deprecated; use {new}"):
        by_old = Config(fp8="tensorwise", **{old: VALUES[new]})
    assert by_old == Config(fp8="tensorwise", **{new: VALUES[new]})
    assert by_old.changed()[new] == VALUES[new]
    assert getattr(by_old, old) == getattr(by_old, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per name: the second use is silent
        assert Config(fp8="tensorwise", **{old: VALUES[new]}) == by_old
        assert Config().replace(fp8="tensorwise", **{old: VALUES[new]}) == by_old


def test_old_and_new_name_together_is_an_error(fresh_warnings):
    with pytest.raises(ValueError, match="fp8_weight_once and fp8_save_quantized_weight given "
                                         "together"):
        Config(fp8_weight_once=True, fp8_save_quantized_weight=True)


def test_old_names_in_graphpass_options_and_policies(fresh_warnings):
    text = " ".join(f"{old}={TEXT[new]}" for old, new in DEPRECATED.items())
    options = env_options(f"fp8=tensorwise {text}")
    assert options == parse_policy(f"fp8=tensorwise {text}", config_flags())
    with pytest.warns(FutureWarning):
        by_old = Config.from_options(**options)
    assert by_old == Config(fp8="tensorwise", **VALUES)


def test_old_flags_on_the_command_line(fresh_warnings):
    parser = argparse.ArgumentParser()
    add_config_flags(parser, config_flags())
    args = parser.parse_args(["--fp8", "tensorwise", "--fp8-weight-once", "--memory", "default",
                              "--fp8-cache", "attn", "--save-original", "never"])
    given = {k.removeprefix("cfg_"): v for k, v in vars(args).items() if k.startswith("cfg_")}
    with pytest.warns(FutureWarning):
        config = Config.from_options(**given)
    assert config == Config(fp8="tensorwise", fp8_save_quantized_weight=True,
                            memory_planner="default", fp8_activation_cache="attn",
                            fp8_save_original_input="never")
    # the old flags are accepted, not advertised
    assert "--fp8-weight-once" not in parser.format_help()
    assert "--fp8-save-quantized-weight" in parser.format_help()


def test_a_group_in_an_old_keywords_place(fresh_warnings):
    with pytest.warns(FutureWarning):
        config = Config(memory=graphpass.MemoryPlan("default"),
                        fp8_cache=graphpass.ActivationCache("attn"))
    assert config.memory_planner == "default" and config.fp8_activation_cache == "attn"
