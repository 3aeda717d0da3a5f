"""``graphpass.plan``: the report of a module at real shapes, allocating nothing of its size."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from .backend import Partitioner, eager_compile, input_sources
from .config import Config, given
from .min_cut import PartitionError
from .report import Report
from . import _compat


def plan(module: nn.Module, *example_inputs: Any, config: Config | None = None,
         **example_kwargs: Any) -> Report:
    """Trace and partition ``module(*example_inputs, **example_kwargs)`` under fake tensors and
    return the report.

    Keyword inputs are passed on as keywords, so a Hugging Face batch plans as it trains:
    ``plan(model, **batch, config=...)``; ``config`` is the one keyword plan keeps for itself.
    The report names a keyword input by its keyword (``input:input_ids``), a positional one by
    its argument name. Parameters, buffers and input tensors (keyword ones too) are replaced by
    fake tensors of the same shape, dtype, strides and ``requires_grad`` (the caller's module is
    untouched), so a Llama-3-8B layer at sequence 8192 plans in seconds on a laptop CPU. Tensors
    on the meta device are planned as CPU tensors: meta has no fused attention kernel, and its
    math-path attention would save a seq x seq matrix that no real device saves; an SDPA whose
    value head dim differs from the query's, which the CPU's flash kernel does not take, is
    traced as CUDA's memory-efficient kernel, with a note (``graph/cuda_attention.py``). Graph
    breaks give one report per graph, merged.
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"graphpass.plan takes an nn.Module, not {type(module).__name__}; wrap a "
                         "function in a module, or trace it with graphpass.partition "
                         "(docs/traced-graphs.md)")
    config = given(config)
    mode = _compat.fake_tensor_mode()
    with mode:
        fake_module = _to_fake(module)
        fake_inputs = [_fake_like(x) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        fake_kwargs = {k: _fake_like(x) if isinstance(x, torch.Tensor) else x
                       for k, x in example_kwargs.items()}
    partitioner = Partitioner(config, "graphpass.plan")

    def planning_backend(gm: torch.fx.GraphModule, inputs: Any):
        with input_sources(gm):
            return eager_compile(gm, inputs, partitioner, runs=False, fake=True)

    compiled = torch.compile(fake_module, backend=planning_backend, dynamic=False)
    with mode, _compat.unlimited_recompiles():
        try:
            compiled(*fake_inputs, **fake_kwargs)
        except Exception as e:  # a budget no plan meets: the ValueError itself
            error = _compat.backend_value_error(e) or _partition_error(e)
            if error is None:
                raise
            raise error from None
    reports = partitioner.reports
    if not reports:
        return Report(rows=[], graphs=0, notes=[
            "nothing was partitioned: no input or parameter requires grad, so torch compiled an "
            "inference graph that saves nothing for backward"
        ])
    return Report.merge(reports)


def _partition_error(error: BaseException) -> PartitionError | None:
    """The PartitionError of a min-cut that failed, where dynamo wrapped it: its first line
    names the modules, the options and the policy."""
    inner = getattr(error, "inner_exception", None)
    return inner if isinstance(inner, PartitionError) else None


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """Call under a FakeTensorMode: a fake tensor like ``t`` (meta becomes CPU). A DTensor (a
    tensor- or sequence-parallel shard) stays a DTensor on the same mesh and placements over a
    fake local shard, so the plan is the plan of this rank."""
    if _compat.is_dtensor(t):
        local = _fake_like(_compat.dtensor_local(t))
        fake = _compat.dtensor_from_local(local.detach(), t)
        if isinstance(t, nn.Parameter):
            return nn.Parameter(fake, requires_grad=t.requires_grad)
        return fake.requires_grad_(t.requires_grad)
    device = "cpu" if t.device.type == "meta" else t.device
    fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(fake, requires_grad=t.requires_grad)
    return fake.requires_grad_(t.requires_grad)


def _to_fake(module: nn.Module) -> nn.Module:
    """Call under a FakeTensorMode: a copy of ``module`` with fake parameters and buffers."""
    memo: dict[int, Any] = {id(t): _fake_like(t) for t in [*module.parameters(), *module.buffers()]}
    return copy.deepcopy(module, memo)
