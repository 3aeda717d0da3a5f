"""The saved-tensor edges of a partitioned graph: what the forward keeps alive for the backward."""

from __future__ import annotations

import torch
import torch.fx as fx

from .._compat import size_hint, storage_id
from ..decisions import Decision, What, facts
from ..report import Row
from .joint import offloaded_source
from .nodes import module_path, normalize_path, op_name, producer, tensor_val
from .ops import RNG_MARKERS, SAME_DATA
from .outcome import rng_state_decision



def saved_rows(
    fw: fx.GraphModule,
    bw: fx.GraphModule,
    *,
    num_fwd_outputs: int,
    static_input_names: set[str],
    input_sources: dict[str, str],
) -> list[Row]:
    """One row per saved value, bytes counted once per storage and parameters kept apart.

    ``static_input_names`` are the joint placeholders torch treats as parameters or buffers;
    ``input_sources`` maps placeholder names to the user's names for them (``layers.0.q.weight``).
    """
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    saved = [n for n in outputs[num_fwd_outputs:] if isinstance(n, fx.Node)]
    bw_inputs = {n.name: n for n in bw.graph.find_nodes(op="placeholder")}
    placeholders = {n.name: n for n in fw.graph.find_nodes(op="placeholder")}

    param_storages = {
        storage_id(placeholders[name].meta["val"])
        for name in static_input_names
        if name in placeholders and tensor_val(placeholders[name]) is not None
    }
    first_of_storage: dict[int, str] = {}
    saved_origins = {_origin(n).name: n.name for n in saved}
    rows = []
    for node in saved:
        val = node.meta.get("val")
        consumers = _consumers(bw_inputs.get(node.name))
        decisions = _decisions(node)
        if not isinstance(val, torch.Tensor):
            rows.append(
                Row(node.name, op_name(producer(node)), module_path(node), (), _dtype_name(val),
                    0, 0, "symint" if _is_sym(val) else "other", consumers, decisions)
            )
            continue
        sid = storage_id(val)
        where = f"the saved-tensor row of {node.name}"
        nbytes = size_hint(val.untyped_storage().nbytes(), where=where) if sid is not None else 0
        alias_of = first_of_storage.get(sid, "") if sid is not None else ""
        if sid is not None and not alias_of:
            first_of_storage[sid] = node.name
        kind = _kind(node, val, is_param=sid in param_storages)
        offloaded = offloaded_source(node)
        source = offloaded or node
        named = source
        if facts(node).cached is not None and not module_path(source):  # a cached graph input
            named = facts(node).cached.source
        path = module_path(named) or normalize_path(input_sources.get(named.name, ""), of_module=False)
        rows.append(
            Row(
                name=node.name,
                op=op_name(producer(source)),
                module=path,
                shape=tuple(size_hint(s, where=where) for s in val.shape),
                dtype=str(val.dtype).removeprefix("torch."),
                bytes=0 if alias_of else nbytes,
                tensor_bytes=size_hint(val.numel(), where=where) * val.element_size(),
                kind=kind,
                consumers=consumers,
                decisions=(Decision(What.OFFLOADED, "offload", node=offloaded.name),) if offloaded
                else decisions,
                alias_of=alias_of,
                copy_of=_copy_of(node, saved_origins),
                offloaded=offloaded is not None,
            )
        )
    return rows


def _decisions(node: fx.Node) -> tuple[Decision, ...]:
    """What the passes decided for a saved value. The RNG state torch saves for a recomputed
    random op is saved for that recompute, so it carries the op's recompute decision."""
    if op_name(producer(node)) == "higher_order.run_and_save_rng_state":
        return (rng_state_decision(producer(node)),)
    known = facts(node)
    decisions = []
    if known.quantized is not None:
        usage = ", columnwise" if known.quantized.columnwise else ""
        decisions.append(Decision(What.FP8_COPY, "fp8", known.quantized.role + usage, node=node.name))
    if known.cached is not None:
        part = "scales" if known.fp8_scale else "data"
        decisions.append(Decision(What.FP8_CACHED, "fp8_cache", (
            f"{known.cached.dtype} {known.cached.source.name} as {known.cached.fmt} ({part})"),
            module_path(node), node.name))
    if known.recompute is not None and known.recompute.what is What.SAVED:
        decisions.append(known.recompute)
    if known.offload is not None:
        decisions.append(known.offload)
    return tuple(decisions)


def _origin(node: fx.Node) -> fx.Node:
    """The tensor whose data ``node`` holds, through views, copies and re-layouts."""
    while node.op == "call_function" and op_name(node) in SAME_DATA:
        node = node.args[0]
    return node


def _copy_of(node: fx.Node, saved_origins: dict[str, str]) -> str:
    """For an FP8 copy: the saved row holding the same data in high precision, if any, else the
    name of the tensor it quantizes. Names, not nodes: the source is a joint-graph node, the
    saved values are nodes of the forward module (copies with the same names)."""
    known = facts(node)
    source = (known.quantized.source if known.quantized is not None
              else known.cached.source if known.cached is not None else None)
    if source is None:
        return ""
    return saved_origins.get(_origin(source).name, source.name)


def _kind(node: fx.Node, val: torch.Tensor, *, is_param: bool) -> str:
    if is_param:
        return "parameter"
    if facts(node).fp8_scale:
        return "fp8_scale"
    if val.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8_data"
    if any(m in op_name(producer(node)) for m in RNG_MARKERS):
        return "rng_state"
    return "activation"


def _consumers(placeholder: fx.Node | None) -> tuple[str, ...]:
    if placeholder is None:
        return ()
    return tuple(dict.fromkeys(op_name(user) for user in placeholder.users))


def _is_sym(val: object) -> bool:
    return isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int))


def _dtype_name(val: object) -> str:
    return type(val).__name__
