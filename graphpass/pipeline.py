"""The graphpass partition: our passes on the joint graph, then torch's min-cut, then the report.

This is the one place where the pass order is written down.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Sequence

import torch.fx as fx

from . import _compat
from .config import Config
from .graph.flops import node_flops
from .graph.saved import saved_rows
from .graph.outcome import outcome_notes
from .passes.lower_fp8 import lower_fp8
from .passes.offload import offload
from .passes.plan_memory import plan_memory
from .passes.recompute import recompute
from .passes.save_original import save_original
from .report import Report

# Each pass rewrites the joint graph or tags its nodes for torch's min-cut, and logs the
# decisions a user should see; listed in the order they run.
PASSES: tuple[Callable[[fx.GraphModule, Config, list[str]], None], ...] = (
    lower_fp8, save_original, recompute, offload, plan_memory)

_last_report: Report | None = None
_reports_sink: contextvars.ContextVar[list[Report] | None] = contextvars.ContextVar(
    "graphpass_reports", default=None
)
_input_sources: contextvars.ContextVar[Sequence[str | None]] = contextvars.ContextVar(
    "graphpass_input_sources", default=()
)


def partition(
    joint_module: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config | None = None,
    compiler: str = "inductor",
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ``partition_fn`` for ``aot_function``/``aot_module`` and any joint fw+bw graph.

    Runs graphpass's passes on the joint graph, partitions it with torch's min-cut
    rematerialization partitioner, records the saved-tensor report (``graphpass.last_report()``)
    and returns the forward and backward modules in torch's layout.
    """
    config = config or Config()
    static = list(static_lifetime_input_indices or [])
    primals = [n for n in joint_module.graph.find_nodes(op="placeholder") if "tangents" not in n.name]
    for i in static:
        if i < len(primals):
            primals[i].meta["graphpass_static"] = True
    log: list[str] = []
    for graph_pass in PASSES:
        graph_pass(joint_module, config, log)
    step_flops = sum(node_flops(n) for n in joint_module.graph.nodes)
    on_cuda = any(getattr(p.meta.get("val"), "is_cuda", False) for p in primals)
    with _compat.min_cut_settings(relaxed=config.memory_policy == "auto", offload=config.offload,
                                  offload_stream=config.offload_stream and on_cuda):
        fw, bw = _compat.min_cut_partition(
            joint_module,
            joint_inputs,
            compiler=compiler,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static,
        )
    if config.report:
        sources = list(_input_sources.get())
        named = dict(zip((p.name for p in primals), sources)) if len(sources) == len(primals) else {}
        rows = saved_rows(
            fw,
            bw,
            num_fwd_outputs=num_fwd_outputs,
            static_input_names={primals[i].name for i in static if i < len(primals)},
            input_sources={k: v for k, v in named.items() if v},
        )
        notes, recompute_flops = outcome_notes(fw, bw, num_fwd_outputs=num_fwd_outputs)
        report = Report(rows=rows, notes=log + notes, meta=_meta(config))
        report.meta.update(step_flops=step_flops, recompute_flops=recompute_flops)
        _record(report)
    return fw, bw


def last_report() -> Report | None:
    """The report of the most recent partition in this process (``None`` before any)."""
    return _last_report


def _record(report: Report) -> None:
    global _last_report
    _last_report = report
    sink = _reports_sink.get()
    if sink is not None:
        sink.append(report)


@contextlib.contextmanager
def collect_reports() -> Iterator[list[Report]]:
    """Collect every report made inside the block (one per compiled graph)."""
    sink: list[Report] = []
    token = _reports_sink.set(sink)
    try:
        yield sink
    finally:
        _reports_sink.reset(token)


@contextlib.contextmanager
def input_sources(sources: Sequence[str | None]) -> Iterator[None]:
    """Names of the graph inputs being compiled, so the report can name saved parameters."""
    token = _input_sources.set(tuple(sources))
    try:
        yield
    finally:
        _input_sources.reset(token)


def _meta(config: Config) -> dict[str, Any]:
    from . import __version__

    return {"graphpass": __version__, "torch": _compat.TORCH_VERSION_STR, "config": config.as_dict()}
