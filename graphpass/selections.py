"""Never silent about a selection that finds nothing: a recompute word, a ``recompute_include``
pattern, an ``fp8_exclude`` pattern or an FP8 cache level that selected nothing in any graph a
backend compiled is one warning per backend, naming it and what it looked for (each graph's report
says it too, in a note). The passes count what each selection finds (``Plan.selected``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from .config import DEFAULTS, Config
from .graph.regions import LOOKS_FOR

_CACHE_LOOKS_FOR = {
    "act_input": "saved tensors an activation reads (the elementwise chain between two GEMMs)",
    "attn": "saved tensors attention reads or makes",
    "layer_input": "saved tensors a norm reads (the residual stream)",
    "all": "saved activations",
}


class EmptySelectionWarning(UserWarning):
    """A selection of graphpass's config found nothing in any graph compiled so far."""


def expected(config: Config) -> dict[tuple[str, str], str]:
    """Each selection the config makes, with what it looks for. ``recompute_include`` and
    ``fp8_exclude`` patterns only where they differ from the defaults (``*``; the output head and
    routers, which many models lack) and where the option is in effect."""
    out = {("recompute", w): LOOKS_FOR.get(w, "its nodes") for w in config.recompute}
    if config.recompute:
        default = DEFAULTS["recompute_include"]
        out |= {("recompute_include", p): "module paths of the nodes the recompute words selected"
                for p in config.recompute_include if p not in default}
    if config.fp8 is not None:
        default = DEFAULTS["fp8_exclude"]
        out |= {("fp8_exclude", p): "module paths of linear layers"
                for p in config.fp8_exclude if p not in default}
    if config.fp8 is not None and config.fp8_weight_cache is True:  # "auto": the planner's notes
        out[("fp8_weight_cache", "weights")] = "lowered weights that are parameters"
    if config.fp8_activation_cache is not None:
        out[("fp8_activation_cache", config.fp8_activation_cache)] = _CACHE_LOOKS_FOR.get(config.fp8_activation_cache, "saved tensors")
    return out


class Selections:
    """What a backend's selections found over the graphs it compiled; warns once per selection
    that found nothing in all of them so far."""

    def __init__(self, config: Config, name: str = "graphpass") -> None:
        self.expected = expected(config)
        self.name = name
        self.found: dict[tuple[str, str], int] = {}
        self.graphs = 0
        self.warned: set[tuple[str, str]] = set()

    def add(self, selected: Mapping[tuple[str, str], int]) -> None:
        """One more graph's counts (``Partition.selected``)."""
        self.graphs += 1
        for key, n in selected.items():
            self.found[key] = self.found.get(key, 0) + n
        words_found = any(n for (option, _), n in self.found.items() if option == "recompute")
        for key, looks_for in self.expected.items():
            option, value = key
            if self.found.get(key, 0) or key in self.warned:
                continue
            if option == "recompute_include" and not words_found:
                continue  # the words' own warnings say it
            self.warned.add(key)
            warnings.warn(EmptySelectionWarning(
                f"{self.name}: {option}={value!r} selected nothing in the {self.graphs} graph(s) "
                f"compiled so far; it looks for {looks_for}"), stacklevel=3)
