"""``graphpass.plan``: the report of a module at real shapes, allocating nothing of its size."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from .backend import Partitioner, eager_compile
from .config import Config
from .pipeline import collect_reports, input_sources
from .report import Report
from . import _compat


def plan(module: nn.Module, *example_inputs: Any, config: Config | None = None) -> Report:
    """Trace and partition ``module(*example_inputs)`` on the meta device and return the report.

    Parameters, buffers and input tensors are replaced by meta tensors of the same shape, dtype
    and ``requires_grad`` (the caller's module is not touched), so a Llama-3-8B layer at sequence
    8192 plans in seconds on a laptop CPU. Graph breaks give one report per graph, merged.
    """
    config = config or Config()
    meta_module = _to_meta(module)
    meta_inputs = [_meta_like(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
    partitioner = Partitioner(config)

    def planning_backend(gm: torch.fx.GraphModule, inputs: Any):
        with input_sources([_compat.placeholder_source(n) for n in gm.graph.find_nodes(op="placeholder")]):
            return eager_compile(gm, inputs, partitioner)

    compiled = torch.compile(meta_module, backend=planning_backend, dynamic=False)
    with collect_reports() as reports:
        compiled(*meta_inputs)
    if not reports:
        return Report(rows=[], graphs=0, notes=[
            "nothing was partitioned: no input or parameter requires grad, so torch compiled an "
            "inference graph that saves nothing for backward"
        ])
    return Report.merge(reports)


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(meta, requires_grad=t.requires_grad)
    return meta.requires_grad_(t.requires_grad)


def _to_meta(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device."""
    memo: dict[int, Any] = {}
    for t in [*module.parameters(), *module.buffers()]:
        memo[id(t)] = _meta_like(t)
    return copy.deepcopy(module, memo)
