"""First-step compile time of tiny Hugging Face models: plain Inductor, graphpass, torchao float8.

    PYTHONPATH=. python benchmarks/compile_time.py                 # every config, 3 runs each
    PYTHONPATH=. python benchmarks/compile_time.py --runs 5 --configs inductor graphpass-bf16
    PYTHONPATH=. python benchmarks/compile_time.py --quick         # one process, small: a test

A random-config ``transformers`` model (bf16, no downloads; ``--arch``: ``llama`` by default,
``mixtral``, ``gpt_neox``, ``phi3``); one training step (forward and
backward) of ``torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss, backend=...)``.
Each run is a cold compile: dynamo reset, Inductor's FX graph, AOTAutograd and autotune caches
off, a fresh ``TORCHINDUCTOR_CACHE_DIR`` (every C++ kernel compiled by the compiler again), and,
outside ``--quick``, a process of its own (graphpass's once-per-process work, its C++ probes and
its pattern pass, is in every run as in a user's first step). Two things are left out of the
clock, being the same for every config: imports, and Inductor's once-per-process probe of the
CPU's vector ISA (a few seconds of g++, kept in a cache of its own). The compile time is the
first step's wall time less a compiled step's (the median of the two steps after it).

Configs: ``inductor`` (``torch.compile`` defaults, bf16), ``graphpass-bf16``
(``graphpass.backend(fp8=None)``), ``graphpass-fp8`` (``fp8="tensorwise"``),
``graphpass-fp8-unfused`` (``fuse_quantize=False``), ``graphpass-fp8-linears`` (the expert GEMMs
kept in bf16: the ``nn.Linear`` modules alone in FP8, what torchao converts), ``torchao-fp8``
(``torchao.float8.convert_to_float8_training``, the output head excluded as graphpass does, then
``torch.compile`` with Inductor; left out where torchao does not import). Prints a markdown
table: the median compile seconds of the runs, the ratio to plain Inductor's, and where the time
of graphpass's configs goes: its partition (every pass, torch's min-cut, the report), the min-cut
runs and peak predictions in it, the quantize inlining pattern pass, and Inductor's lowering and
code generation with the wait for its C++ compiles.

``--quick`` compiles a one-layer model with plain Inductor then graphpass bf16 in one process
(each under a fresh cache), once, under ``--serial``: ``tests/test_compile_time.py`` runs it.
``--serial`` has Inductor compile its C++ kernels one at a time in the compiling process and adds
each first step's CPU seconds, the process's and the compiler's: the compile's work, which a
loaded machine changes far less than its wall time. ``--json`` prints the
runs as JSON instead of the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = ("inductor", "graphpass-bf16", "graphpass-fp8", "graphpass-fp8-unfused",
           "graphpass-fp8-linears", "torchao-fp8")
BASELINE = "inductor"
# (hidden, intermediate, layers, heads, kv heads, vocab, batch, sequence)
SIZES = {"tiny": (256, 512, 2, 4, 2, 256, 2, 64), "quick": (64, 128, 1, 2, 1, 128, 2, 16)}


def _cold_settings() -> tuple[dict[str, Any], dict[str, Any]]:
    """Inductor's and AOTAutograd's settings for cold compiles (a fresh cache directory is set
    around each compile: ``_cold``): their caches off, and under ``--serial`` one C++ compile
    at a time, in this process."""
    inductor = {"fx_graph_cache": False, "fx_graph_remote_cache": False,
                "autotune_local_cache": False, "autotune_remote_cache": False}
    if _serial():
        inductor["compile_threads"] = 1
    return inductor, {"enable_autograd_cache": False, "enable_remote_autograd_cache": False}


def _configure_cold() -> None:
    """``_cold_settings`` for every compile of this process (a child's)."""
    import torch._functorch.config
    import torch._inductor.config

    inductor, functorch = _cold_settings()
    for key, value in inductor.items():
        setattr(torch._inductor.config, key, value)
    for key, value in functorch.items():
        setattr(torch._functorch.config, key, value)


@contextlib.contextmanager
def _cold() -> Iterator[None]:
    """A fresh ``TORCHINDUCTOR_CACHE_DIR`` and Inductor's in-memory code caches cleared."""
    import torch
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    with fresh_cache():
        yield
    torch._dynamo.reset()


def _warm_isa() -> None:
    """Inductor's once-per-process probe of the CPU's vector ISA, outside the clock (a cache
    directory of its own, kept between runs: its g++ runs once per machine)."""
    from torch._inductor import cpu_vec_isa

    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir())
                                                / "graphpass-compile-time-isa")
    try:
        cpu_vec_isa.pick_vec_isa()
    finally:
        if saved is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


# The architectures, by their transformers classes (config, causal LM) and the options their
# config needs beside the sizes: a dense decoder, an MoE one (4 experts, 2 per token), a parallel
# residual one (attention and MLP read one norm's output and add into one residual) and one whose
# forward carries transformers' ``deprecate_kwarg`` decorator.
ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"use_parallel_residual": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1,
                                               "eos_token_id": 2}),
}


def _model(size: str, arch: str = "llama"):
    import torch
    import transformers

    hidden, intermediate, layers, heads, kv, vocab, batch, seq = SIZES[size]
    torch.manual_seed(0)
    config_class, model_class, extra = ARCHS[arch]
    cfg = getattr(transformers, config_class)(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
        max_position_embeddings=seq, **extra)
    model = getattr(transformers, model_class)(cfg).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return model, ids


def _backend(config: str, model: Any) -> Any:
    if config in ("inductor", "torchao-fp8"):
        if config == "torchao-fp8":
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=lambda _, name: name != "lm_head")
        return "inductor"
    import graphpass

    options: dict[str, Any] = {"graphpass-bf16": {"fp8": None},
                               "graphpass-fp8": {"fp8": "tensorwise"},
                               "graphpass-fp8-linears": {
                                   "fp8": "tensorwise",
                                   "fp8_exclude": ("lm_head", "output", "*.gate", "*.router",
                                                   "*.experts")},
                               "graphpass-fp8-unfused": {"fp8": "tensorwise",
                                                         "fuse_quantize": False}}[config]
    return graphpass.backend(**options)


class Phases:
    """Counts and seconds of the phases of a compile, by wrapping their functions."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._running: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, name: str, owner: Any, attribute: str, *also: Any,
             within: str | None = None) -> None:
        """Time ``owner.attribute`` (a module's function, found the same in the modules
        ``also`` that imported it by name, or a class's method) as phase ``name``: wall seconds,
        and the CPU seconds of the calling thread (``cpu``: what a loaded machine changes little,
        for the phases that run in this thread). ``within``: only calls made inside that
        phase."""
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if within is not None and not self._running.get(within):
                return original(*args, **kwargs)
            self._running[name] = self._running.get(name, 0) + 1
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self._running[name] -= 1
                self.counts[name] = self.counts.get(name, 0) + 1
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - cpu

        for holder in (owner, *also):
            if getattr(holder, attribute, None) is original:
                setattr(holder, attribute, timed)
                self._undo.append(functools.partial(setattr, holder, attribute, original))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def _instrument(phases: Phases) -> None:
    from torch._inductor import async_compile, graph, pattern_matcher

    phases.wrap("inductor lowering", graph.GraphLowering, "run")
    phases.wrap("inductor codegen+compile", graph.GraphLowering, "compile_to_module")
    phases.wrap("inductor C++ wait", async_compile.AsyncCompile, "wait")
    phases.wrap("C++ kernels", async_compile.AsyncCompile, "cpp_pybinding")
    try:  # the modules (graphpass.backend is also the package's function)
        backend, fp8_inductor, min_cut, pipeline, reporting = (
            importlib.import_module(f"graphpass.{name}")
            for name in ("backend", "fp8.inductor", "min_cut", "pipeline", "reporting"))
    except ImportError:  # graphpass is not on the path: the plain configs still run
        return
    phases.wrap("graphpass partition", pipeline, "run", backend)
    phases.wrap("min-cut runs", min_cut, "_partition")
    phases.wrap("peak predictions", min_cut, "step_peak", reporting)
    phases.wrap("report", reporting.ReportBuilder, "build")
    phases.wrap("quantize inlining", fp8_inductor, "inline_quantizes")
    phases.wrap("quantize traces", pattern_matcher, "fwd_only", within="quantize inlining")
    phases.wrap("backend patches", backend.Backend, "_inductor_patches")


SERIAL = "GRAPHPASS_COMPILE_TIME_SERIAL"


def _serial() -> bool:
    """``--serial``: Inductor compiles its C++ kernels one at a time in this process
    (``compile_threads=1``), so the compiler's CPU seconds are this process's children's."""
    return os.environ.get(SERIAL) == "1"


def _cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its waited-for children (the C++
    compiler, under ``--serial``)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def measure(config: str, size: str, arch: str = "llama") -> dict[str, Any]:
    """One cold first step of ``config`` on ``arch``: its compile seconds and phases."""
    import torch

    model, ids = _model(size, arch)
    backend = _backend(config, model)
    phases = Phases()
    _instrument(phases)
    cpu = _cpu_seconds()
    try:
        with _cold():
            compiled = torch.compile(lambda ids: model(input_ids=ids, labels=ids).loss,
                                     backend=backend)
            steps: list[float] = []
            cpu_s: list[float] = []
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                compiled(ids).backward()
                steps.append(time.perf_counter() - start)
                if not cpu_s:
                    cpu_s.append(_cpu_seconds() - cpu)
    finally:
        phases.restore()
    step = statistics.median(steps[1:])
    return {"config": config, "size": size, "arch": arch, "first_step_s": steps[0],
            "step_s": step,
            "compile_s": steps[0] - step, "counts": phases.counts, "seconds": phases.seconds,
            "cpu": phases.cpu, "serial": _serial(),
            "first_step_cpu_s": cpu_s[0] if _serial() else None,
            "reports": len(getattr(getattr(backend, "partitioner", None), "reports", ()))}


def _child(config: str, size: str, arch: str) -> dict[str, Any]:
    """``measure`` in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, "--child", config, "--size", size,
                          "--arch", arch],
                         env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{config}: exit {out.returncode}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except Exception:
        return False
    return True


def quick() -> list[dict[str, Any]]:
    """Plain Inductor then graphpass bf16 on the one-layer model, in this process, serially
    (``--serial``: their CPU seconds compared); the process's settings are restored after."""
    import torch._functorch.config
    import torch._inductor.config

    saved = os.environ.get(SERIAL)
    os.environ[SERIAL] = "1"
    try:
        inductor, functorch = _cold_settings()
        with torch._inductor.config.patch(inductor), torch._functorch.config.patch(functorch):
            _warm_isa()
            with _cold():  # imports and Inductor's first-use work, outside the clock
                torch.compile(lambda x: (x.sin() * 2).sum())(
                    torch.ones(4, requires_grad=True)).backward()
            return [measure(config, "quick") for config in ("inductor", "graphpass-bf16")]
    finally:
        if saved is None:
            os.environ.pop(SERIAL)
        else:
            os.environ[SERIAL] = saved


PHASE_COLUMNS = ("graphpass partition", "min-cut runs", "peak predictions", "quantize inlining",
                 "quantize traces", "inductor lowering", "inductor codegen+compile",
                 "inductor C++ wait", "C++ kernels")
COUNTED = ("min-cut runs", "peak predictions", "C++ kernels", "quantize traces")
IN_THREAD = ("graphpass partition", "min-cut runs", "peak predictions", "quantize inlining",
             "quantize traces", "inductor lowering")  # CPU seconds shown too


def table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of ``runs``: per config the median compile seconds and phases."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        by_config.setdefault(run["config"], []).append(run)
    base = statistics.median(r["compile_s"] for r in by_config.get(BASELINE, [])) if (
        BASELINE in by_config) else None
    serial = all(r.get("first_step_cpu_s") is not None for r in runs)
    head = ["config", "compile s (median)", "runs", f"x {BASELINE}",
            *(["first step CPU s", f"x {BASELINE}"] if serial else []), *PHASE_COLUMNS]
    base_cpu = statistics.median(r["first_step_cpu_s"] for r in by_config[BASELINE]) if (
        serial and BASELINE in by_config) else None
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for config, rs in by_config.items():
        seconds = statistics.median(r["compile_s"] for r in rs)
        cells = [config, f"{seconds:.2f}", ", ".join(f"{r['compile_s']:.1f}" for r in rs),
                 f"{seconds / base:.2f}x" if base else "-"]
        if serial:
            cpu = statistics.median(r["first_step_cpu_s"] for r in rs)
            cells += [f"{cpu:.1f}", f"{cpu / base_cpu:.2f}x" if base_cpu else "-"]
        for phase in PHASE_COLUMNS:
            if phase not in rs[0]["counts"]:
                cells.append("-")
                continue
            s = statistics.median(r["seconds"].get(phase, 0.0) for r in rs)
            cpu = statistics.median(r.get("cpu", {}).get(phase, 0.0) for r in rs)
            n = rs[0]["counts"][phase]
            cell = f"{s:.2f}" + (f" (cpu {cpu:.2f})" if phase in IN_THREAD else "")
            cells.append(str(n) if phase == "C++ kernels" else
                         f"{n}: {cell}" if phase in COUNTED else cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=None, choices=CONFIGS)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serial", action="store_true",
                        help="C++ kernels compiled one at a time, and each first step's CPU "
                        "seconds (this process's and the compiler's) in a column: the compile "
                        "work, which a loaded machine changes little")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serial:
        os.environ[SERIAL] = "1"  # the children's too

    if args.child:
        _configure_cold()
        _warm_isa()
        print(json.dumps(measure(args.child, args.size, args.arch)))
        return 0
    if args.quick:
        runs = quick()
    else:
        configs = list(args.configs or CONFIGS)
        if "torchao-fp8" in configs and not torchao_available():
            print("torchao does not import here: torchao-fp8 left out", file=sys.stderr)
            configs.remove("torchao-fp8")
        runs = []
        for _ in range(args.runs):  # interleaved: a slow spell of the machine hits every config
            for config in configs:
                runs.append(_child(config, args.size, args.arch))
                print(f"{config}: {runs[-1]['compile_s']:.2f} s", file=sys.stderr, flush=True)
    print(json.dumps(runs, indent=1) if args.json else table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
