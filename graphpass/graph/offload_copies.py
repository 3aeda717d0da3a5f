"""Whether each offloaded tensor's copies hide under compute: a roofline of the two copy streams.

torch's activation offloading (separate-stream mode, torch 2.11 and 2.13 alike) issues a tensor's
copy to the host right after its last forward use, on a side stream, and waits for every such
copy at the forward's end; in the backward it issues the copy back ahead of the first use, as far
ahead as the compute in between takes to cover the copy (torch times that compute), and waits
just before the use. A copy adds no step time when it fits in its window on a free link:

* out: the forward's compute from the copy's issue to the forward's end, on a link that copies
  one tensor at a time (a copy waits for the ones issued before it);
* back: the backward's compute before the tensor's first use, the copies back scheduled as late
  as they can be, one at a time, in the order the backward uses them.

Times are :mod:`graph.roofline`'s (an H100 and its PCIe link): compute is each node's FLOPs or
bytes, whichever takes longer; the host link moves ``host_link`` bytes/s each way, both
directions at once. Where a copy does not fit, the step waits for the rest of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .._compat import tree_leaves
from ..decisions import Decision, What
from ..report import format_bytes
from .flops import node_flops
from .joint import is_offload_machinery, offloaded_source, reload_of
from .nodes import module_path, op_name, tensor_bytes
from .ops import VIEWS
from .roofline import H100, Device


@dataclass(frozen=True)
class Copy:
    """One offloaded tensor's two copies, in seconds on the roofline's device."""

    name: str
    """The offloaded tensor (the forward node torch copies to the host)."""
    module: str
    bytes: int
    seconds: float
    """One copy, one way, on a free link."""
    out_window: float
    """The forward's compute from the copy's issue to the forward's end."""
    out_late: float
    """How much later than the forward's end the copy out ends (0: hidden)."""
    back_window: float
    """The backward's compute before the tensor's first use."""
    back_late: float
    """How much earlier than the backward's start the copy back would have to start (0: hidden)."""

    @property
    def hidden(self) -> bool:
        return self.out_late <= 0 and self.back_late <= 0


def offload_copies(fw: fx.GraphModule, bw: fx.GraphModule, device: Device = H100) -> list[Copy]:
    """The copies of every tensor ``fw`` offloads, in the order the forward issues them (none,
    and no timing of the graphs, where nothing is offloaded)."""
    sources = [s for s in map(offloaded_source, fw.graph.nodes) if s is not None]
    if not sources:
        return []
    windows = partition_windows(fw, bw, device)
    sources.sort(key=lambda s: -windows.out[s.name])
    late = windows.schedule([(s.name, _bytes(s)) for s in sources], device)
    return [Copy(s.name, module_path(s), _bytes(s), device.copy(_bytes(s)), windows.out[s.name],
                 late[s.name][0], windows.back[s.name], late[s.name][1]) for s in sources]


def copy_notes(copies: list[Copy], *, synchronous: bool) -> list[Decision]:
    """One report note per offloaded tensor: its bytes and copy time against the compute it hides
    under; the copies that cannot hide (or run on the default stream) say what they add."""
    notes = []
    for c in copies:
        detail = (f"{c.name} ({format_bytes(c.bytes)}): {format_seconds(c.seconds)} each way; out under "
                  f"{format_seconds(c.out_window)} of forward compute after its last use, back under "
                  f"{format_seconds(c.back_window)} of backward compute before its first")
        if synchronous:
            notes.append(Decision(What.OFFLOAD_NOT_HIDDEN, "offload", (
                f"{detail}: offload_stream=False copies on the default stream, adding "
                f"{format_seconds(2 * c.seconds)}"), c.module, c.name))
        elif c.hidden:
            notes.append(Decision(What.OFFLOAD_COPY, "offload", f"{detail}: hidden", c.module, c.name))
        else:
            late = ", ".join(text for t, text in (
                (c.out_late, f"the copy out ends {format_seconds(c.out_late)} after the forward's end (the "
                             "step waits there)"),
                (c.back_late, f"the copy back would have to start {format_seconds(c.back_late)} before "
                              "the backward does")) if t > 0)
            notes.append(Decision(What.OFFLOAD_NOT_HIDDEN, "offload", (
                f"{detail}: the host link is slower than the compute in its window: {late}"),
                c.module, c.name))
    return notes


@dataclass(frozen=True)
class Windows:
    """The compute each saved tensor's copies could hide under, by the name of the forward node
    that computes it (the graphs run their nodes in order)."""

    forward: float
    """The forward's compute, in seconds."""
    backward: float
    out: dict[str, float]
    """Per saved tensor, the forward's compute after its last forward use."""
    back: dict[str, float]
    """Per saved tensor, the backward's compute before its first use."""

    def late(self, copies: list[tuple[str, int]], device: Device = H100) -> float:
        """How much step time the copies of ``copies`` (name, bytes) add, all offloaded
        (0.0: every copy hides under compute)."""
        each = self.schedule(copies, device).values()
        return max((o for o, _ in each), default=0.0) + max((b for _, b in each), default=0.0)

    def schedule(self, copies: list[tuple[str, int]], device: Device = H100
                 ) -> dict[str, tuple[float, float]]:
        """Per tensor of ``copies`` (name, bytes), how late its copies are: the copy out's end
        after the forward's end, the copies out one at a time from each tensor's last forward
        use; how much before the backward's start the copy back would have to start, the copies
        back one at a time, each as late as its first use (and the next copy) allows."""
        late = {name: [0.0, 0.0] for name, _ in copies}
        link_free = 0.0
        for name, nbytes in sorted(copies, key=lambda c: -self.out.get(c[0], 0.0)):
            link_free = max(link_free, self.forward - self.out.get(name, 0.0)) + device.copy(nbytes)
            late[name][0] = max(0.0, link_free - self.forward)
        next_start = float("inf")
        for name, nbytes in sorted(copies, key=lambda c: -self.back.get(c[0], 0.0)):
            next_start = min(next_start, self.back.get(name, 0.0)) - device.copy(nbytes)
            late[name][1] = max(0.0, -next_start)
        return {name: (o, b) for name, (o, b) in late.items()}


def partition_windows(fw: fx.GraphModule, bw: fx.GraphModule, device: Device = H100) -> Windows:
    """:class:`Windows` of every tensor ``fw`` saves for ``bw`` (offloaded ones included, by the
    name of the tensor offloaded)."""
    ends, forward = {}, 0.0
    for node in fw.graph.nodes:
        forward += compute_seconds(node, device)
        ends[node] = forward  # a use ends after the user's own compute
    starts, backward = {}, 0.0
    for node in bw.graph.nodes:
        starts[node] = backward
        backward += compute_seconds(node, device)
    output = fw.graph.find_nodes(op="output")[0]
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    out, back = {}, {}
    for saved in output.all_input_nodes:
        placeholder = bw_inputs.get(saved.name)
        if placeholder is None:  # one of the forward's own outputs
            continue
        source = offloaded_source(saved) or saved
        users = [u for u in source.users if u is not output and not is_offload_machinery(u)]
        out[source.name] = forward - max((ends[u] for u in users), default=ends.get(source, 0.0))
        reload = reload_of(placeholder)
        readers = [u for u in (reload[1] if reload else placeholder).users
                   if not is_offload_machinery(u)]
        back[source.name] = min((starts[u] for u in readers), default=backward)
    return Windows(forward, backward, out, back)


def compute_seconds(node: fx.Node, device: Device = H100) -> float:
    """A node's roofline time on ``device``: its FLOPs at its dtype's peak or the bytes it reads
    and writes at the memory bandwidth, whichever is longer; views, copies to or from the host
    and stream ops take none."""
    if node.op != "call_function" or is_offload_machinery(node) or op_name(node) in VIEWS \
            or op_name(node) == "getitem":
        return 0.0
    nbytes = _bytes(node) + sum(_bytes(i) for i in node.all_input_nodes)
    val = next((v for v in tree_leaves(node.meta.get("val")) if isinstance(v, torch.Tensor)), None)
    return device.compute(node_flops(node), nbytes, val.dtype if val is not None else None)


def _bytes(node: fx.Node) -> int:
    total = 0
    for val in tree_leaves(node.meta.get("val")):
        if isinstance(val, torch.Tensor):
            total += tensor_bytes(val, where=f"the copy size of {node.name}")
    return total


def format_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"
