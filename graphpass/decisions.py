"""The passes' decisions as typed records, and the plan they share.

Every pass records what it decided as a :class:`Decision` (what, by whom, why, where); the report
renders them as notes and row decisions, and the assertions, snapshots and plots read their
fields. A decision about one node of the joint graph is kept in that node's metadata
(:class:`NodeFacts`), because torch's partitioner copies node metadata into the forward and
backward graphs it builds: that is how a saved value of the forward module finds what the passes
decided about the joint-graph node it came from (node names are no key: the partitioner reuses
them for other nodes).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


class What(enum.Enum):
    """What was decided or observed. Each value is the text the report shows for a decision, with
    its ``module``, ``why`` and ``by`` filled in."""

    # the config: an option that has no effect under the others (``Config.unused``)
    UNUSED = "unused: {why}"
    # the FP8 lowering
    LOWERED = "lowered: {module} ({why})"
    NOT_LOWERED = "not lowered: {module}: {why}"
    COST_NOT_JUDGED = "fp8_cost_model: not judged: {module}: {why}"
    KERNELS = "kernels: {why}"
    GROUPED_GEMMS = "grouped gemms: {module}: {why}"
    WEIGHT_QUANTIZE = "weight quantize: {module}: {why}"
    TOKEN_QUANTIZE = "token-grouped quantize: {module}: {why}"
    FUSE_QUANTIZE_OFF = "fuse_quantize: off: {why}"
    FP8_COPY = "fp8 copy ({why})"
    FP8_DISTRIBUTED = "fp8 under {why}"
    FP8_ALL_GATHER = "fp8 all-gather: {module}: {why}"
    NOT_FP8_ALL_GATHER = "fp8 all-gather: not for {module}: {why}"
    REQUANTIZED = "save original: {module} re-quantizes its saved input in the backward"
    WEIGHT_ONCE = "fp8_save_quantized_weight: {module}: {why}"
    WEIGHT_CACHED = "fp8_weight_cache: {module}: {why}"
    WEIGHT_NOT_CACHED = "fp8_weight_cache: not cached: {module}: {why}"
    WEIGHT_CACHE = "fp8_weight_cache: {why}"
    # quantize before dispatch: the routed experts' input re-gathered in the backward
    REGATHERED = "dispatch: {module}: {why}"
    NOT_REGATHERED = "dispatch: {module}: not re-gathered: {why}"
    # the FP8 activation cache (lossy, opt-in)
    FP8_CACHED = "fp8 cache (lossy): {why}"
    NOT_CACHED = "fp8 cache: not cached: {why}"
    # recompute and the planner
    SELECTED = "{by}: {why}"
    OVERRULED = "{by}: kept your checkpoint policy {why}"
    BUDGET = "{by}: recompute allowed for ops worth at most {why}"
    RECOMPUTED = "recomputed: {why}"
    RECOMPUTED_IN_BACKWARD = "recomputed: {why} in backward: {module}"
    SAVED = "{why}"
    KEPT_SAVED = "recompute: kept saved, not recomputed: {why}"
    # offload
    OFFLOAD = "offload: yes"
    OFFLOAD_ELIGIBLE = "offload: eligible"
    NOT_OFFLOADED = "offload: no ({why})"
    OFFLOADED = "offloaded to CPU, reloaded for the backward"
    OFFLOAD_COPY = "offload copy: {module}: {why}"
    OFFLOAD_NOT_HIDDEN = "offload copy not hidden: {module}: {why}"
    TORCH_OFFLOADING = "{by}: torch's activation offloading turned on ({why})"
    # the memory budget
    BUDGETED = "memory_budget: {why}"
    # what the report observed in the partitioned graphs
    FLOPS_ESTIMATED = "flops: estimated as one per element for {why}"
    COLLECTIVES = "collectives in the {why}"
    WEIGHT_ALL_GATHER = "weight all-gather: {module}: {why}"
    SIZES_ASSUMED = "sizes: {why}"
    RECOMPILED = "recompile: {why}"
    # the backward's order for Inductor
    BACKWARD_ORDER = "order_backward: {why}"
    # another library's layers (graph/foreign.py): its ops in the graph, or its module outside
    LIBRARY_OPS = "left to {by}: {module}: {why}"
    OUTSIDE_GRAPH = "outside the graph: {module}: {why}"
    # a frame whose code is a child module's forward (a graph break inside it)
    CHILD_FRAME = "compiled frame: {module}: {why}"
    # attention on the fake CPU tensors of plan and estimate (graph/cuda_attention.py)
    CUDA_ATTENTION = "attention as on CUDA: {module}: {why}"
    MATH_ATTENTION = "attention by the math path: {module}: {why}"


class OpaqueOpWarning(UserWarning):
    """A graphpass FP8 op that Inductor's code calls as the op, its dispatch and checks on the
    host every step, where graphpass inlines its code otherwise: the code did not trace (a GEMM
    per token group reads the group sizes on the host; a Triton launch torch cannot analyse)."""


@dataclass(frozen=True)
class Decision:
    """One decision of a pass (or one fact the report observed), in the user's words."""

    what: What
    by: str
    """The pass that decided, as the user names it: ``fp8``, ``recompute layernorm``, ``planner``."""
    why: str = ""
    """The reason or the detail, for people to read; no code reads it back."""
    module: str = ""
    """The module path it is about (several, comma-separated, for a summary over modules)."""
    node: str = ""
    """The joint-graph node it is about, where it is about one."""

    def __str__(self) -> str:
        return self.what.value.format(module=self.module or "<root>", why=self.why, by=self.by)

    def to_dict(self) -> dict[str, str]:
        return {"what": self.what.name.lower(), "by": self.by, "why": self.why,
                "module": self.module, "node": self.node}

    @classmethod
    def from_dict(cls, data: dict[str, str]) -> "Decision":
        return cls(What[data["what"].upper()], data["by"], data.get("why", ""),
                   data.get("module", ""), data.get("node", ""))


@dataclass(frozen=True)
class Quantized:
    """A node of an FP8 quantize (the op or one of its outputs): what it quantizes, and how."""

    role: str
    """``input``, ``weight`` or ``grad``: the GEMM operand it feeds."""
    columnwise: bool
    source: fx.Node
    """The joint-graph node it quantizes."""
    recipe: str


@dataclass(frozen=True)
class Cached:
    """A node of the FP8 activation cache's quantize (its data or its scale): which saved
    activation it stores, in what dtype it was, and in which format (``fp8_cache_format``)."""

    source: fx.Node
    """The joint-graph node whose value is cached."""
    dtype: str
    fmt: str


@dataclass(frozen=True)
class NodeFacts:
    """What the passes know and decided about one joint-graph node (``node.meta[FACTS]``).

    Frozen, and replaced rather than changed: a copy of the joint graph (the random-op weighing's)
    shares its nodes' metadata values with the original.
    """

    quantized: Quantized | None = None
    fp8_scale: bool = False
    """An FP8 scale (a quantize's second output)."""
    not_lowered: str = ""
    """For a GEMM the FP8 lowering left in high precision: why."""
    recompute: Decision | None = None
    """``RECOMPUTED`` for a node a recompute selection tagged, ``SAVED`` for one kept saved."""
    offload: Decision | None = None
    cached: Cached | None = None
    """For the FP8 activation cache's data and scale: what they store."""


FACTS = "graphpass"


def facts(node: fx.Node) -> NodeFacts:
    """The passes' facts about ``node`` (or a forward/backward copy of it)."""
    return node.meta.get(FACTS) or NodeFacts()


def record(node: fx.Node, **changes: Any) -> None:
    """Change some of ``node``'s facts (a new record: see :class:`NodeFacts`)."""
    node.meta[FACTS] = dataclasses.replace(facts(node), **changes)


@dataclass
class Plan:
    """What the passes share while they run over one joint graph: its inputs, and the decisions
    for the report's notes, in the order they were made."""

    primals: list[fx.Node] = field(default_factory=list)
    """The joint graph's forward inputs (its other placeholders are the backward's tangents)."""
    parameters: set[fx.Node] = field(default_factory=set)
    """The primals torch treats as parameters or buffers (static inputs)."""
    decisions: list[Decision] = field(default_factory=list)
    torch_offloading: str = ""
    """The pass whose offload marks turned torch's activation offloading on while
    ``config.offload`` is off (the memory budget), for every partition after it, the final one
    included; empty where none did. The report shows it as a note (``What.TORCH_OFFLOADING``)."""

    selected: dict[tuple[str, str], int] = field(default_factory=dict)
    """How many nodes (or linears, or saved tensors) each selection of the config found in this
    graph: ``("recompute", word)``, ``("recompute_include", pattern)``, ``("fp8_exclude",
    pattern)``, ``("fp8_activation_cache", level)``; the backend warns about one that finds nothing in any
    graph (``graphpass/selections.py``)."""

    def count(self, option: str, value: str, found: int) -> None:
        """Add ``found`` to what the selection ``option=value`` found in this graph."""
        self.selected[option, value] = self.selected.get((option, value), 0) + found

    def decide(self, decision: Decision, *, once: bool = False) -> None:
        """Record a decision for the report; with ``once``, unless an equal one is there already
        (a module's experts are several GEMMs: one note)."""
        if not (once and decision in self.decisions):
            self.decisions.append(decision)
