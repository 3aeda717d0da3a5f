"""``python -m graphpass``: saved-tensor reports of example models or any model factory."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Callable, Sequence

EXAMPLES = ("llama", "gpt", "deepseek")


class CLIError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


def resolve_factory(model: str) -> Callable[..., Any]:
    """``llama`` -> ``examples.llama:build``; ``pkg.mod:fn`` -> that function."""
    spec = f"examples.{model}:build" if model in EXAMPLES else model
    if ":" not in spec:
        raise CLIError(
            f"unknown model {model!r}: use one of {', '.join(EXAMPLES)} or a factory "
            "'package.module:function' returning (model, example_inputs)"
        )
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:  # factories in the user's working directory, as uvicorn does
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CLIError(f"cannot import {module_name!r} for model {model!r}: {e}; "
                       "check the module path and that it is importable from here") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise CLIError(f"{module_name!r} has no function {attr!r}; name a function returning "
                       "(model, example_inputs)")
    return factory


def _build(model: str, size: str, layers: int | None) -> tuple[Any, tuple[Any, ...]]:
    factory = resolve_factory(model)
    kwargs: dict[str, Any] = {"size": size}
    if layers is not None:
        kwargs["layers"] = layers
    try:
        return factory(**kwargs)
    except ValueError as e:
        raise CLIError(f"model {model!r}: {e}") from None


def _config(args: argparse.Namespace):
    from .config import Config

    try:
        return Config.from_options(codegen="eager")
    except ValueError as e:
        raise CLIError(str(e)) from None


def cmd_report(args: argparse.Namespace) -> int:
    from .plan import plan

    model, inputs = _build(args.model, args.size, args.layers)
    report = plan(model, *inputs, config=_config(args))
    print(report.to_json() if args.json else report.table())
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="graphpass", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("report", help="plan a model under fake tensors and print what it saves")
    r.add_argument("--model", default="llama",
                   help=f"{', '.join(EXAMPLES)} or 'package.module:factory' (default llama)")
    r.add_argument("--size", default="tiny", help="tiny or real (example models; default tiny)")
    r.add_argument("--layers", type=int, default=None, help="number of layers to build")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(run=cmd_report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except CLIError as e:
        print(f"graphpass: error: {e}", file=sys.stderr)
        return 2
