"""Backends chosen by name, for tools that take only a string (``torch.compile(backend="...")``,
a trainer's ``torch_compile_backend``, a config file): registered presets, plus options read from
the ``GRAPHPASS_OPTIONS`` environment variable.

    GRAPHPASS_OPTIONS="kernels=reference codegen=eager" python train.py   # backend="graphpass_fp8"

The variable takes the CLI's ``--policy`` syntax (space-separated ``key=value``; tuple options
comma-separated: ``recompute=core_attn,act``) or a JSON object (``{"fp8": "tensorwise"}``). Its
options apply on top of the name's preset and are validated as ``graphpass.backend(...)``'s are:
one ValueError naming the fix. They are read when torch looks the name up (so a bad value fails
at ``torch.compile``) and again at each compile; the report's ``meta["options_from"]`` says
where the options came from.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import torch.fx as fx

from . import _compat
from .backend import Backend
from .cli_flags import config_flags, parse_policy
from .config import Config

ENV = "GRAPHPASS_OPTIONS"

PRESETS: dict[str, dict[str, Any]] = {
    "graphpass": {},
    # FP8 tensorwise (current scaling) with the planner (memory=None means "auto" under FP8).
    "graphpass_fp8": {"fp8": "tensorwise"},
    # The same partition without Inductor's code generation (debugging, CPU tests).
    "graphpass_eager": {"codegen": "eager"},
    "graphpass_fp8_eager": {"fp8": "tensorwise", "codegen": "eager"},
}
"""Registered backend names and their options (also ``torch_dynamo_backends`` entry points)."""


def env_options(text: str | None = None) -> dict[str, Any]:
    """The options ``GRAPHPASS_OPTIONS`` (or ``text``) asks for; a ValueError naming the fix."""
    text = os.environ.get(ENV, "") if text is None else text
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            options = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid {ENV}={text!r}: not a JSON object ({e}); write e.g. "
                             f"{ENV}='{{\"fp8\": \"tensorwise\"}}' or {ENV}='fp8=tensorwise'") from None
        if not isinstance(options, dict):
            raise ValueError(f"invalid {ENV}={text!r}: expected a JSON object")
        return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    try:
        return parse_policy(text.replace(";", " "), config_flags())
    except ValueError as e:
        raise ValueError(f"invalid {ENV}={text!r}: {e}; write space-separated key=value items "
                         f"such as {ENV}='fp8=tensorwise kernels=reference'") from None


class NamedBackend:
    """The backend behind a registered name: its preset plus ``GRAPHPASS_OPTIONS``."""

    def __init__(self, name: str, *, check: bool = True) -> None:
        self.__name__ = name  # torch names the backend by this in its errors
        self.name = name
        self._backends: dict[str, Backend] = {}
        if check:
            self.resolve()  # a bad GRAPHPASS_OPTIONS fails when torch looks the name up

    def __repr__(self) -> str:
        return f"graphpass backend {self.name!r}"

    def resolve(self) -> Backend:
        """The backend for the options in effect now (one per distinct GRAPHPASS_OPTIONS)."""
        text = os.environ.get(ENV, "").strip()
        if text not in self._backends:
            given = env_options(text)
            options = {**PRESETS[self.name], **given}
            try:
                config = Config.from_options(**options)
            except ValueError as e:
                if not given:
                    raise
                raise ValueError(f"{e} (from {ENV}={text!r} on backend {self.name!r})") from None
            self._backends[text] = Backend(config, options, options_from=(
                f"backend name {self.name!r}" + (f" + {ENV}={text!r}" if text else "")))
        return self._backends[text]

    def report(self):
        """The merged report of what the backend in effect now partitioned (see ``Backend.report``)."""
        return self.resolve().report()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return self.resolve()(gm, example_inputs)


def __getattr__(name: str) -> NamedBackend:
    """``graphpass.named:graphpass_fp8`` (the entry points): made when torch loads the name."""
    if name in PRESETS:
        return NamedBackend(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the names that no installed entry point of ours provides (a source tree, or an
    install whose entry points lack a name). torch loads our entry points by itself on first use,
    and registering such a name here too would make its registry refuse the duplicate."""
    from importlib.metadata import entry_points

    ours = {ep.name for ep in entry_points(group="torch_dynamo_backends")
            if ep.value == f"{__name__}:{ep.name}"}
    for name in PRESETS:
        if name not in ours:
            # Checked at each compile instead: `import graphpass` never fails on the variable.
            _compat.register_backend(name, NamedBackend(name, check=False))
