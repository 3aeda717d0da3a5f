"""The step's memory peak, predicted from the partitioned forward and backward graphs.

A liveness walk over the two graphs in the order they run, sizes from each node's fake-tensor
metadata, bytes counted once per storage (views and multi-output ops share one), as the report
counts saved bytes. A storage is live from the node that allocates it to its last use; what the
forward returns (the user's outputs, the saved tensors) stays live into the backward, the
backward's outputs (the gradients) to its end. Parameters and the graph's other inputs are live
throughout: they exist before the step and after it.

How the backward frees its inputs depends on the code that runs it: Inductor's code clears its
argument list and frees each saved tensor after its last use (``runtime="inductor"``); the
graphs run as-is (``codegen="eager"``) hold every saved tensor until the backward returns
(``runtime="eager"``: the boxed call's argument list stays referenced while the graph runs;
measured with MemTracker, tests/test_peak.py).

torch's ``_inductor.fx_passes.memory_estimator.get_peak_memory`` estimates the same kind of
forward/backward profile but counts accelerator storages only (nothing on a CPU run) and its
alias tracker's name and fields differ between the torch versions graphpass supports; this walk
counts every device and reports the peak of the compute device (the one holding the most
parameter and input bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .._compat import offloaded_source, size_hint, storage_id
from ..report.peak import peak_dict
from .nodes import module_path, op_name


@dataclass
class _Storage:
    bytes: int
    device: str
    node: fx.Node
    kind: str


def step_peak(fw: fx.GraphModule, bw: fx.GraphModule, *, num_fwd_outputs: int,
              parameter_names: set[str], runtime: str = "inductor") -> dict[str, Any]:
    """The step's predicted peak on the compute device (``report.peak.peak_dict``)."""
    storages: dict[int, _Storage] = {}
    alias: dict[int, int] = {}  # a backward input's storage -> the forward's storage it is

    def sids(node: fx.Node) -> list[int]:
        out = []
        for val in tree_leaves(node.meta.get("val")):
            if isinstance(val, torch.Tensor):
                sid = storage_id(val)
                if sid is not None:
                    out.append(alias.get(sid, sid))
        return out

    def allocate(node: fx.Node, kind: str) -> None:
        for val in tree_leaves(node.meta.get("val")):
            if not isinstance(val, torch.Tensor):
                continue
            sid = storage_id(val)
            sid = alias.get(sid, sid)
            if sid is None or sid in storages:
                continue
            nbytes = size_hint(val.untyped_storage().nbytes(), where=f"the step peak's {node.name}")
            storages[sid] = _Storage(nbytes, str(val.device.type), node, kind)

    live: set[int] = set()
    fw_inputs = fw.graph.find_nodes(op="placeholder")
    for node in fw_inputs:
        allocate(node, "parameter" if node.name in parameter_names else "input")
        live.update(sids(node))
    resident = set(live)
    device = _compute_device(storages, resident)

    # forward
    fw_output = fw.graph.find_nodes(op="output")[0]
    outputs = list(fw_output.args[0])
    returned = {s for n in outputs[:num_fwd_outputs] if isinstance(n, fx.Node) for s in sids(n)}
    fw_best = _walk(fw, storages, live, allocate, sids, device, frees=lambda s: s not in resident,
                    kind="transient")
    for sid in live - resident:
        storages[sid].kind = "output" if sid in returned else "saved"
        if offloaded_source(storages[sid].node) is not None:
            storages[sid].kind = "offloaded"

    # backward: its inputs are the forward's saved values (same storages) and the tangents
    fw_by_name = {n.name: n for n in fw.graph.nodes}
    for node in bw.graph.find_nodes(op="placeholder"):
        source = fw_by_name.get(node.name)
        if source is not None:
            for bw_sid, fw_sid in zip(_raw_sids(node), sids(source)):
                if bw_sid != fw_sid:
                    alias[bw_sid] = fw_sid
        else:  # a tangent
            allocate(node, "transient")
            live.update(sids(node))
    user_outputs = returned - resident
    bw_inputs = {s for n in bw.graph.find_nodes(op="placeholder") for s in sids(n)}
    held = resident | user_outputs | (bw_inputs if runtime == "eager" else set())
    if runtime != "eager":  # saved values the backward never reads are freed as it starts
        read = {s for n in bw.graph.nodes if n.op != "placeholder"
                for i in n.all_input_nodes for s in sids(i)}
        live -= {s for s in live if s not in held and s not in read and storages[s].kind == "saved"}
    bw_best = _walk(bw, storages, live, allocate, sids, device, frees=lambda s: s not in held, kind="transient",
                    output_kind="gradient")

    best = max(fw_best, bw_best, key=lambda p: p[0])
    peak_bytes, node, at = best
    return peak_dict(
        bytes=peak_bytes, device=device, phase="forward" if best is fw_best else "backward",
        node=node.name if node is not None else "-", module=module_path(node) if node else "",
        op=op_name(node) if node is not None else "-",
        live=[{"name": storages[s].node.name, "op": op_name(storages[s].node),
               "module": module_path(storages[s].node), "kind": storages[s].kind,
               "bytes": storages[s].bytes} for s in at if storages[s].device == device],
        forward_peak=fw_best[0], backward_peak=bw_best[0], runtime=runtime)


def _walk(gm: fx.GraphModule, storages: dict[int, _Storage], live: set[int], allocate: Any,
          sids: Any, device: str, *, frees: Any, kind: str, output_kind: str | None = None
          ) -> tuple[int, fx.Node | None, set[int]]:
    """Run ``gm``'s nodes in order, updating ``live``: each node's new storages are live after it
    runs, storages are freed after their last use when ``frees`` allows. The peak on ``device``
    (bytes, the node, the live storages there)."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    output = gm.graph.find_nodes(op="output")[0]
    last_use: dict[int, fx.Node] = {}
    for node in [*nodes, output]:
        for i in node.all_input_nodes:
            for s in sids(i):
                last_use[s] = node
    if output_kind is not None:  # the backward's outputs (gradients) live to its end
        for i in output.all_input_nodes:
            allocate(i, output_kind)

    def size(s: int) -> int:
        return storages[s].bytes if storages[s].device == device else 0

    now = sum(size(s) for s in live)
    best: tuple[int, fx.Node | None, set[int]] = (now, None, set(live))
    for node in nodes:
        allocate(node, kind)
        mine = set(sids(node)) - live
        live |= mine
        now += sum(size(s) for s in mine)
        if now > best[0]:
            best = (now, node, set(live))
        dead = {s for s in mine if s not in last_use}  # never read: freed at once
        dead |= {s for i in node.all_input_nodes for s in sids(i) if last_use.get(s) is node}
        freed = {s for s in dead if frees(s)} & live
        live -= freed
        now -= sum(size(s) for s in freed)
    return best


def _raw_sids(node: fx.Node) -> Iterator[int]:
    for val in tree_leaves(node.meta.get("val")):
        if isinstance(val, torch.Tensor):
            sid = storage_id(val)
            if sid is not None:
                yield sid


def _compute_device(storages: dict[int, _Storage], resident: set[int]) -> str:
    by_device: dict[str, int] = {}
    for s in resident:
        by_device[storages[s].device] = by_device.get(storages[s].device, 0) + storages[s].bytes
    return max(by_device, key=by_device.__getitem__) if by_device else "cpu"
