"""One node per tensor: remove the joint graph's no-op aliases and copies before any pass runs.

A joint graph traced without Inductor's joint-graph passes (``aot_function``/``aot_module`` with
Inductor's decompositions, which turn ``detach`` into ``aten.alias``) routes a tensor to its
backward users through ``aten.alias`` nodes. torch's min-cut counts an alias and its base as two
tensors, so it would save the alias for one backward user and, for another, a second copy of the
same data (the o-projection's FP8 columnwise copy of the attention output): the same tensor saved
twice. ``graphpass.backend`` and ``graphpass.plan`` never saw this because Inductor's joint-graph
passes remove those nodes first; running torch's own no-op removal here gives every entry point
the same graph, and so the same saved set.
"""

from __future__ import annotations

import torch.fx as fx

from .. import _compat
from ..config import Config
from ..decisions import Plan
from .partitioner import TrialPartitioner


def canonicalize(joint: fx.GraphModule, plan: Plan, config: Config,
                 partitioner: TrialPartitioner) -> None:
    if _compat.remove_noop_ops(joint.graph):
        joint.graph.lint()
        joint.recompile()
