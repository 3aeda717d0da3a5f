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
        base = plan(module, *inputs, config=Config(codegen="eager", memory_planner="default")).activation_bytes
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


# -- fit --------------------------------------------------------------------------------------------

OPTIMIZERS = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``80GiB``, ``141GB``, ``1.5 TiB`` or a number of bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS and unit:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write bytes or a number with a unit ({', '.join(_UNITS)}), "
            "such as 80GiB or 141GB")
    return int(float(m.group(1)) * _UNITS[unit or "b"])


def cmd_fit(args: argparse.Namespace) -> int:
    """Exit 0 when the step fits the device (with --search: when an option set fits), 1 when it
    does not; bad input is a CLIError (exit 2)."""
    import functools

    import torch

    from .job import models

    given = {k.removeprefix("cfg_"): v for k, v in vars(args).items() if k.startswith("cfg_")}
    try:
        config = Config.from_options(**given)
        parallel = _parallel(args, models)
        sources = [x for x in (args.config, args.model_type, args.preset, args.model) if x is not None]
        if len(sources) != 1:
            raise CLIError("give one model: --config FILE, --model-type TYPE, --preset NAME or "
                           "--model package.module:factory")
        if args.model is not None and (args.overrides or args.search):
            raise CLIError("--set and --search take a transformers config (--config, --model-type "
                           "or --preset), not a factory")
        hf = None if args.model else models.load_config(
            config_file=args.config, model_type=args.model_type, preset=args.preset,
            overrides=[models.parse_override(o) for o in args.overrides])
    except (models.JobError, ValueError) as e:
        raise CLIError(str(e)) from None
    optimizer = functools.partial(getattr(torch.optim, OPTIMIZERS[args.optimizer]), lr=1e-4)
    start = time.perf_counter()
    with _fit_process_group(parallel.world_size):
        try:
            job = _fit_job(args, hf, parallel, models)
        except models.JobError as e:
            raise CLIError(str(e)) from None
        what = (f"{job.name}; sequence {args.seq}, micro-batch {args.micro_batch_size} x "
                f"{args.micro_batches}" if hf is not None else job.name)
        print(f"graphpass fit: {what}; {_ranks(parallel)}; {args.optimizer}; "
              f"{' '.join(f'{k}={show(v)}' for k, v in given.items()) or 'default options'}",
              file=sys.stderr, flush=True)
        est = _estimate(job, optimizer, config, args.micro_batches)
        elapsed = time.perf_counter() - start
        fits = est.fits(args.device_memory)
        result = None
        if args.search:
            result = _search(args, hf, parallel, given, optimizer, models, est)
    if args.json:
        out: dict[str, Any] = {"model": job.name, "estimate": est.to_dict(), "notes": job.notes,
                               "device_memory": args.device_memory, "fits": fits,
                               "seconds": round(elapsed, 1)}
        if result is not None:
            out["search"] = [{"options": c.options.label(), "backend": c.options.backend_call(given),
                              "peak_bytes": c.peak_bytes, "counted": c.counted,
                              "layer_seconds": c.layer_seconds} for c in result.candidates]
        print(json.dumps(out, indent=1))
    else:
        print(est)
        for note in job.notes:
            print(f"note: {note}")
        verdict = "fits" if fits else "does not fit"
        print(f"{verdict} in {format_bytes(args.device_memory)} "
              f"({format_bytes(abs(est.headroom(args.device_memory)))} "
              f"{'free' if fits else 'over'}; the allocator's fragmentation, the CUDA context and "
              f"communication buffers are not counted); estimated in {elapsed:.0f} s")
        if result is not None:
            from .job.search import format_result

            print()
            print(format_result(result, given))
    if result is not None:
        return 0 if result.candidates else 1
    return 0 if fits else 1


def _parallel(args: argparse.Namespace, models: Any) -> Any:
    tp = args.tp
    world = args.world_size or (args.fsdp or 1) * tp
    fsdp = args.fsdp or world // max(tp, 1)
    return models.Parallel(world_size=world, fsdp=fsdp, tp=tp,
                           reshard_after_forward=args.reshard_after_forward,
                           mp=models.MixedPrecision(args.mp))


@contextlib.contextmanager
def _fit_process_group(world_size: int):
    if world_size == 1:
        yield
        return
    from .distributed import fake_process_group

    with fake_process_group(world_size):
        yield


def _ranks(parallel: Any) -> str:
    parts = [f"{parallel.world_size} rank(s)"]
    if parallel.sharded:
        parts.append(f"FSDP {parallel.fsdp}" + (f" x replicate {parallel.replicate}"
                                                 if parallel.replicate > 1 else ""))
    if parallel.tp > 1:
        parts.append(f"TP {parallel.tp}")
    return ", ".join(parts)


def _fit_job(args: argparse.Namespace, hf: Any, parallel: Any, models: Any,
             layers: int | None = None, micro_batch: int | None = None) -> Any:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[args.dtype]
    if hf is None:
        module, inputs = build_model(args.model, args.size, args.layers,
                                     parallel.tp if parallel.tp > 1 else None)
        return models.build_module(module, inputs, parallel=parallel, name=args.model)
    if layers is not None:
        hf = models.with_layers(hf, layers)
    return models.build_hf(hf, seq=args.seq, micro_batch=micro_batch or args.micro_batch_size,
                           parallel=parallel, dtype=dtype)


def _estimate(job: Any, optimizer: Any, config: Config, micro_batches: int) -> Any:
    from .job.estimate import EstimateError, estimate

    try:
        return estimate(job.model, *job.inputs, optimizer=optimizer, config=config,
                        micro_batches=micro_batches, **job.input_kwargs)
    except EstimateError as e:
        raise CLIError(f"{job.name}: {e}") from None


def _search(args: argparse.Namespace, hf: Any, parallel: Any, given: dict[str, Any],
            optimizer: Any, models: Any, counted: Any) -> Any:
    from .job import search

    kinds = models.layer_kinds(hf, parallel=parallel)
    moe = len(kinds.kinds) > 1 or any(
        getattr(hf, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    pair = search.scaling_layers(hf)
    notes = []

    def estimate(options: Any) -> Any:
        config = Config.from_options(**options.backend_options(given))
        if pair is None:
            job = _fit_job(args, hf, parallel, models, micro_batch=options.micro_batch)
            return _estimate(job, optimizer, config, options.micro_batches)
        ests = [(n, _estimate(_fit_job(args, hf, parallel, models, layers=n,
                                       micro_batch=options.micro_batch),
                              optimizer, config, options.micro_batches)) for n in pair]
        return search.scaled(ests[0], ests[1], hf.num_hidden_layers)

    if pair is not None:
        notes.append(f"the job as given is counted at all {hf.num_hidden_layers} decoder layers; "
                     f"other option sets at {pair[0]} and {pair[1]} layers, each phase's peak "
                     f"extended linearly to {hf.num_hidden_layers}")

    def progress(text: str) -> None:
        print(f"  search: {text}", file=sys.stderr, flush=True)

    problem = search.Problem(
        layer_kinds=lambda mb: kinds.with_inputs(mb, args.seq), estimate=estimate, given=given,
        micro_batch=args.micro_batch_size, micro_batches=args.micro_batches,
        recompute_words=search.recompute_ladder(hf.model_type, moe), verify=args.count,
        progress=progress)
    problem.known[search.Options.as_given(given, args.micro_batch_size, args.micro_batches)] = counted
    try:
        result = search.search(problem, args.device_memory)
    except ValueError as e:
        raise CLIError(f"search: {e}") from None
    result.notes.extend(notes)
    return result


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

    f = sub.add_parser(
        "fit", help="will a training job fit: its peak per device, and with --search the fastest "
                    "options that fit",
        description="Predict one training step's peak memory per device (graphpass.estimate, on "
                    "fake tensors and torch's fake process group: no weights, no GPU, no network) "
                    "of a transformers model built from its config, and whether it fits "
                    "--device-memory. Exit status 0 when it fits (with --search: when an option "
                    "set fits), 1 when it does not, 2 on bad input.")
    src = f.add_argument_group("model (one of)")
    src.add_argument("--config", metavar="CONFIG.json", help="a transformers config.json")
    src.add_argument("--model-type", metavar="TYPE", help="a transformers model type (llama, mixtral, "
                     "qwen3_moe, deepseek_v3, ...) with its defaults and --set overrides")
    src.add_argument("--preset", metavar="NAME", help="a config shipped with graphpass: "
                     "llama-3-8b, mixtral-8x7b, qwen3-30b-a3b, deepseek-v3")
    src.add_argument("--model", metavar="package.module:factory",
                     help="a factory returning (model, example_inputs), as 'graphpass report' takes")
    src.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field (e.g. --set num_hidden_layers=4); repeat")
    src.add_argument("--size", default="real", help="size passed to a factory (default real)")
    src.add_argument("--layers", type=int, default=None, help="layers passed to a factory")
    job = f.add_argument_group("job")
    job.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    job.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch "
                     "(default 1)")
    job.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer "
                     "step: gradient accumulation (default 1)")
    job.add_argument("--world-size", type=int, default=None, help="ranks (default fsdp x tp)")
    job.add_argument("--fsdp", type=int, default=None, help="FSDP2 degree (default world size / tp)")
    job.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    job.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                     help="FSDP2 frees each layer's gathered parameters after its forward "
                          "(default true)")
    job.add_argument("--mp", choices=("none", "bf16"), default="none",
                     help="FSDP2's MixedPrecisionPolicy: bf16 computes fp32 parameters in bf16 "
                          "and reduces gradients in fp32 (default none)")
    job.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                     help="the parameters' dtype (default bf16; fp32 under --mp bf16)")
    job.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                     help="the optimizer (default adamw)")
    job.add_argument("--device-memory", type=parse_bytes, default=parse_bytes("80GiB"),
                     metavar="SIZE", help="memory of one device: 80GiB, 141GB, bytes (default 80GiB)")
    f.add_argument("--search", action="store_true",
                   help="list the option sets that fit (FP8 recipe, recompute, offload, weight "
                        "cache, micro-batch size), fastest first by the roofline, and print the "
                        "best as a graphpass.backend(...) call")
    f.add_argument("--count", type=int, default=2, metavar="N",
                   help="with --search: count the N fastest that fit with graphpass.estimate "
                        "itself (default 2; the others are predicted)")
    f.add_argument("--json", action="store_true", help="print the estimate as JSON")
    add_config_flags(f, flags)
    f.set_defaults(run=cmd_fit, config_flags=flags)

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
