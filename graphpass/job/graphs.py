"""The compiled graphs of ``graphpass.estimate``: graphpass's partition, run op by op under the
tracker, and what Inductor's code would allocate instead.

Contract: :class:`EstimateGraphs` is a torch.compile backend. It partitions every graph as
``graphpass.backend(config)`` does (the same joint graph, passes and report: ``eager_compile``)
and runs the partitioned forward and backward as-is, so torch's ``MemTracker`` counts every
tensor they allocate; while a graph pass runs, ``current`` names it (``tracker.GraphPass``).
Under ``codegen="inductor"`` Inductor's code allocates less than the graphs run as-is (a fused
chain allocates nothing, a backward frees each saved tensor after its last use): for each graph
pass, ``correction`` is graphpass's step-peak model of Inductor's code minus its model of the
same graphs run as-is (``graph/peak.py``), the bytes the estimate adds to the highest total
counted inside that pass (negative: Inductor needs less).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..backend import Partitioner, eager_compile, input_sources
from ..config import Config
from ..fp8.inductor import quantize_code
from ..graph.peak import step_peak
from ..report import Report
from .tracker import GraphPass


class _Partitioner(Partitioner):
    """graphpass's partitioner, which also times its graphs' passes and models Inductor's."""

    def __init__(self, config: Config, owner: "EstimateGraphs") -> None:
        # The config as given: the partition and the report's step peak are those of its code
        # generation, though the graphs run as-is here (``eager_compile``).
        super().__init__(config, "graphpass.estimate")
        self.owner = owner

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], *,
                 num_fwd_outputs: int, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw = super().__call__(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        index = len(self.owner.corrections)
        self.owner.corrections.append(self.owner.correct(fw, bw, num_fwd_outputs))
        _time(fw, GraphPass(index, backward=False), self.owner)
        _time(bw, GraphPass(index, backward=True), self.owner)
        return fw, bw


def _time(gm: fx.GraphModule, graph_pass: GraphPass, owner: "EstimateGraphs") -> None:
    """Make ``gm``'s forward (which ``eager_compile`` runs) name ``graph_pass`` while it runs."""
    if hasattr(gm, "real_recompile"):  # a lazy GraphModule: its code, not the lazy stub
        gm.real_recompile()
    forward: Callable[..., Any] = gm.forward

    def timed(*args: Any) -> Any:
        owner.count(graph_pass)
        outer, owner.current = owner.current, graph_pass
        try:
            return forward(*args)
        finally:
            owner.current = outer

    gm.forward = timed  # type: ignore[method-assign]


def _graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """What decides a graph's partition: its code and its inputs' shapes, strides and dtypes.
    Dynamo traces each block of a model whose blocks it specializes (a Hugging Face layer's
    ``layer_idx``) into a graph of its own; the graphs of identical blocks are one."""
    metas = tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.requires_grad, x.device.type)
                  if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs)
    return (gm.code, metas)


class EstimateGraphs:
    """The torch.compile backend of ``graphpass.estimate`` (see the module's contract)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.partitioner = _Partitioner(config, self)
        self.current: GraphPass | None = None
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
        self.runs: dict[int, int] = {}
        """How many times each graph's forward ran (reset by the estimate before the step it
        counts): a graph dynamo traced once per block runs once per block."""
        self.corrections: list[tuple[int, int]] = []
        """Per graph, in partition order: the bytes to add to its forward's and its backward's
        highest counted total."""

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        key = _graph_key(gm, example_inputs)
        if key not in self._compiled:  # a repeated block's graph: compiled and counted once
            with input_sources(gm):
                self._compiled[key] = eager_compile(gm, example_inputs, self.partitioner,
                                                    runs=True, fake=True)
        return self._compiled[key]

    def count(self, graph_pass: GraphPass) -> None:
        """A forward of ``graph_pass``'s graph ran (``runs``)."""
        if not graph_pass.backward:
            self.runs[graph_pass.graph] = self.runs.get(graph_pass.graph, 0) + 1

    def correct(self, fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int
                ) -> tuple[int, int]:
        """Inductor's modelled forward and backward peaks minus those of the graphs run as-is
        (zero under ``codegen="eager"``: what runs is what Inductor would not change)."""
        if self.config.codegen == "eager":
            return (0, 0)
        with quantize_code(self.config):
            inductor = step_peak(fw, bw, num_fwd_outputs=num_fwd_outputs, parameter_names=set(),
                                 runtime="inductor")
            as_is = step_peak(fw, bw, num_fwd_outputs=num_fwd_outputs, parameter_names=set(),
                              runtime="eager")
        return (inductor.forward_peak - as_is.forward_peak,
                inductor.backward_peak - as_is.backward_peak)

    def correction(self, graph_pass: GraphPass) -> int:
        fw, bw = self.corrections[graph_pass.graph]
        return bw if graph_pass.backward else fw

    @property
    def reports(self) -> list[Report]:
        return self.partitioner.reports

    def report(self) -> Report | None:
        return Report.merge(self.reports) if self.reports else None
