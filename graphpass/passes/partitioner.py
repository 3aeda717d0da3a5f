"""What a pass may ask of torch's min-cut while the passes run: the partitioner handed to each.

A pass that weighs its choices against the plan the passes before it tagged (the FP8 activation
cache caches what that plan saves, the memory budget recomputes or offloads until its peak fits)
asks a :class:`TrialPartitioner`. Each question partitions a copy of the joint graph as it is
tagged at that moment with torch's min-cut, under the same settings as the final partition,
``Plan.torch_offloading`` included; the joint graph itself is left as it was. ``min_cut.py``
implements it; the pipeline makes one per joint graph and hands it to every pass (a pass that
asks nothing just accepts it).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch.fx as fx

from ..graph.offload_copies import Windows
from ..report.peak import StepPeak


class Saves(NamedTuple):
    """What torch's min-cut of the joint graph as tagged saves and recomputes."""

    saved: list[fx.Node]
    """The joint nodes the forward saves, in the order it returns them."""
    recomputed: set[fx.Node]
    """The joint forward nodes the backward recomputes."""


class PeakPrediction(NamedTuple):
    """The step's predicted peak under torch's min-cut of the joint graph as tagged."""

    peak: StepPeak
    """The step's predicted peak (``graph/peak.py``)."""
    saved: dict[str, fx.Node]
    """The joint nodes the forward saves, by the name the forward gives them (the names
    ``peak.live`` lists)."""
    windows: Windows
    """The compute each saved tensor's copies to the host could hide under
    (``graph/offload_copies.py``)."""


class TrialPartitioner(Protocol):
    """torch's min-cut of a copy of the joint graph as the passes tagged it so far."""

    def saves(self, joint: fx.GraphModule) -> Saves:
        """What the min-cut saves and recomputes."""
        ...

    def predict_peak(self, joint: fx.GraphModule) -> PeakPrediction:
        """The step's predicted peak of the min-cut, what it saves by name and the copy windows:
        one partition."""
        ...
