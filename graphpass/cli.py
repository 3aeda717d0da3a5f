"""``python -m graphpass``: saved-tensor reports of example models or any model factory, and diffs.

    graphpass report --model llama --size real --fp8 tensorwise
    graphpass report --model mypkg.models:build --policy fp8=none --policy fp8=tensorwise --plot m.png
    graphpass diff before.json after.json     # exit 1 when activation bytes grew
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import sys
import time
from typing import Any, Callable, NoReturn, Sequence

from .cli_flags import ConfigFlag, add_config_flags, config_flags, parse_policy, show
from .config import Config
from .models import MODELS as EXAMPLES
from .report import Report, Snapshot, diff, format_bytes

PLOT_INSTALL = "pip install 'graphpass[plot]'"
# plan() traces without generating code, so its reports say so.
PLAN_DEFAULTS = {"codegen": "eager"}


class CLIError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise CLIError(f"{message} (see '{self.prog} --help')")


# -- models -------------------------------------------------------------------------------------

def resolve_factory(model: str, tp: int | None = None) -> Callable[..., Any]:
    """``llama`` -> ``graphpass.models.llama:build`` (``build_tp`` with ``tp``); ``pkg.mod:fn``
    -> that function."""
    spec = f"graphpass.models.{model}:{'build_tp' if tp else 'build'}" if model in EXAMPLES else model
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
        if model in EXAMPLES:  # part of graphpass: an incomplete installation, not a user error
            raise
        raise CLIError(f"cannot import {module_name!r} for model {model!r} ({e}); check the module "
                       "path and that it is importable from here") from None
    factory = getattr(module, attr, None)
    if tp and model in EXAMPLES and factory is None:
        raise CLIError(f"example {model!r} has no tensor-parallel plan (only llama's build_tp); "
                       "drop --tp, or pass a factory 'package.module:function' accepting tp=")
    if not callable(factory):
        raise CLIError(f"{module_name!r} has no function {attr!r}; name a function returning "
                       "(model, example_inputs)")
    return factory


def build_model(model: str, size: str, layers: int | None,
                tp: int | None = None) -> tuple[Any, tuple[Any, ...]]:
    factory = resolve_factory(model, tp)
    kwargs: dict[str, Any] = {"size": size} if layers is None else {"size": size, "layers": layers}
    if tp:
        kwargs["tp"] = tp
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError:
        raise CLIError(f"factory {model!r} must accept {', '.join(f'{k}=' for k in kwargs)}") from None
    except ValueError:  # no signature to check (a builtin): let the call itself tell
        pass
    try:
        built = factory(**kwargs)
    except ValueError as e:
        raise CLIError(f"model {model!r}: {e}") from None
    if not (isinstance(built, (tuple, list)) and len(built) == 2 and isinstance(built[1], (tuple, list))):
        raise CLIError(f"factory {model!r} returned {type(built).__name__}; it must return "
                       "(model, example_inputs) with example_inputs a tuple")
    return built[0], tuple(built[1])


# -- commands -----------------------------------------------------------------------------------

def cmd_report(args: argparse.Namespace) -> int:
    if args.plot:
        _require_matplotlib()
    models = args.model or ["llama"]
    given = {k.removeprefix("cfg_"): v for k, v in vars(args).items() if k.startswith("cfg_")}
    if args.policy:
        specs = [(spec, _policy(spec, args.config_flags)) for spec in args.policy]
    else:
        specs = [(" ".join(f"{k}={show(v)}" for k, v in given.items()) or "default options", {})]
    policies = []
    for label, options in specs:
        try:
            policies.append((label, Config.from_options(**{**PLAN_DEFAULTS, **given, **options})))
        except ValueError as e:
            raise CLIError(str(e)) from None
    for model_name in models:  # a bad name fails now, not after planning the models before it
        resolve_factory(model_name, args.tp)
    if args.tp and args.layers is not None:
        raise CLIError("--tp plans one rank of one tensor-parallel layer; drop --layers")
    if args.tp is not None and args.tp < 1:
        raise CLIError(f"--tp must be at least 1, got {args.tp}")

    with contextlib.ExitStack() as stack:
        if args.tp:  # the mesh and the DTensor shards need a default process group
            from .distributed import fake_process_group

            stack.enter_context(fake_process_group(args.tp))
        results = _plan_all(args, models, policies)
        _print_results(args, results)  # its bf16 comparison plans the same rank
    return 0


def _plan_all(args: argparse.Namespace, models: list[str], policies: list[tuple[str, Config]]):
    from .plan import plan

    results = []
    step, steps = 0, len(models) * len(policies)
    for model_name in models:
        module, inputs = build_model(model_name, args.size, args.layers, args.tp)
        for label, config in policies:
            step += 1
            print(f"[{step}/{steps}] planning {model_name} {args.size} {label} ...",
                  end="", file=sys.stderr, flush=True)
            start = time.perf_counter()
            report = plan(module, *inputs, config=config)
            print(f" {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
            results.append((model_name, label, report))
    return results


def _print_results(args: argparse.Namespace, results: list[tuple[str, str, Report]]) -> None:
    if args.json:
        if len(results) == 1:
            print(results[0][2].to_json())
        else:
            print(json.dumps({"reports": [
                {"model": m, "size": args.size, "policy": label, "report": r.to_dict()}
                for m, label, r in results
            ]}, indent=1))
    else:
        print("\n\n".join(r.table() if len(results) == 1 else f"== {m} {args.size} {label} ==\n{r.table()}"
                          for m, label, r in results))
        _print_against_high_precision(results, args.size, args.layers, args.tp)
    if args.plot:
        from .report.plot import plot_saved_bytes

        panels: dict[str, list[tuple[str, Report]]] = {}
        for m, label, r in results:
            panels.setdefault(f"{m} ({args.size})", []).append((label, r))
        plot_saved_bytes(panels, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)


def _print_against_high_precision(results: list[tuple[str, str, Report]], size: str, layers: int | None,
                                  tp: int | None = None) -> None:
    """Under FP8, the saved bytes next to the model's own dtype with torch's default partitioner."""
    from .plan import plan

    fp8_models = {m for m, _, r in results if r.meta.get("config", {}).get("fp8")}
    if not fp8_models:
        return
    print()
    for model_name in sorted(fp8_models):
        module, inputs = build_model(model_name, size, layers, tp)
        base = plan(module, *inputs, config=Config(codegen="eager", memory="default")).activation_bytes
        rank = f" (one rank of TP={tp})" if tp else ""
        print(f"{model_name} {size}{rank}: without FP8, torch's default partitioner saves {format_bytes(base)}")
        for m, label, r in results:
            if m == model_name:
                print(f"  {label}: {format_bytes(r.activation_bytes)} ({r.activation_bytes / base - 1:+.1%})")


def _policy(spec: str, flags: Sequence[ConfigFlag]) -> dict[str, Any]:
    try:
        return parse_policy(spec, flags)
    except ValueError as e:
        raise CLIError(f"policy {spec!r}: {e}") from None


def cmd_diff(args: argparse.Namespace) -> int:
    changes = diff(_load(args.before), _load(args.after))
    print(f"graphpass diff {args.before} -> {args.after}")
    print(changes)
    return 1 if changes.grew else 0


def _load(path: str) -> Snapshot:
    try:
        return Snapshot.load(path)
    except OSError as e:
        raise CLIError(f"cannot read {path!r} ({e.strerror}); pass files written by "
                       "'graphpass report --json' or graphpass snapshot files") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CLIError(f"{path!r} is not one graphpass report ({type(e).__name__}: {e}); pass the JSON of "
                       "'graphpass report --json' for one model and policy, or a snapshot file") from None


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CLIError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphpass", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("report", help="plan models under fake tensors and print what they save",
                       description="Plan models under fake tensors and print what they save for backward.")
    r.add_argument("--model", action="append",
                   help=f"{', '.join(EXAMPLES)} (graphpass.models) or 'package.module:factory', a function accepting size= "
                        "and returning (model, example_inputs); repeat for several (default llama)")
    r.add_argument("--size", default="tiny", help="size passed to the factory: tiny or real for the reference models "
                                                 "(default tiny)")
    r.add_argument("--layers", type=int, default=None, help="number of layers to build (passed as layers=)")
    r.add_argument("--tp", type=int, default=None, metavar="N",
                   help="plan one rank of a tensor- and sequence-parallel layer over N ranks, on "
                        "torch's fake process group (llama's build_tp, or a factory accepting tp=)")
    r.add_argument("--policy", action="append", metavar="'KEY=VALUE ...'",
                   help="plan once per policy, each the options below plus these items "
                        "(e.g. --policy fp8=none --policy 'fp8=tensorwise kernels=reference')")
    r.add_argument("--json", action="store_true", help="print the report as JSON (several: under 'reports')")
    r.add_argument("--plot", metavar="OUT.png",
                   help=f"bar chart of saved bytes per layer and kind, policies side by side ({PLOT_INSTALL})")
    flags = config_flags()
    add_config_flags(r, flags)
    r.set_defaults(run=cmd_report, config_flags=flags)

    d = sub.add_parser("diff", help="what changed between two reports; exit 1 when activation bytes grew",
                       description="Rows added, removed and changed between two reports (JSON from "
                                   "'graphpass report --json', or snapshot files); exit status 1 when "
                                   "activation bytes grew, 0 otherwise.")
    d.add_argument("before")
    d.add_argument("after")
    d.set_defaults(run=cmd_diff)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        return args.run(args)
    except CLIError as e:
        print(f"graphpass: error: {e}", file=sys.stderr)
        return 2
