"""The saved-tensor edges of a partitioned graph: what the forward keeps alive for the backward."""

from __future__ import annotations

import torch
import torch.fx as fx

from .._compat import size_hint, storage_id
from ..report import Row
from .nodes import module_path, normalize_path, op_name, producer, tensor_val

_RNG_MARKERS = ("rng", "seed", "philox")


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
    rows = []
    for node in saved:
        val = node.meta.get("val")
        consumers = _consumers(bw_inputs.get(node.name))
        decision = "; ".join(node.meta.get("graphpass_decisions", ())) or "saved"
        if not isinstance(val, torch.Tensor):
            rows.append(
                Row(node.name, op_name(producer(node)), module_path(node), (), _dtype_name(val),
                    0, 0, "symint" if _is_sym(val) else "other", consumers, decision)
            )
            continue
        sid = storage_id(val)
        nbytes = size_hint(val.untyped_storage().nbytes()) if sid is not None else 0
        alias_of = first_of_storage.get(sid, "") if sid is not None else ""
        if sid is not None and not alias_of:
            first_of_storage[sid] = node.name
        kind = _kind(node, val, is_param=sid in param_storages)
        path = module_path(node) or normalize_path(input_sources.get(node.name, ""), of_module=False)
        rows.append(
            Row(
                name=node.name,
                op=op_name(producer(node)),
                module=path,
                shape=tuple(size_hint(s) for s in val.shape),
                dtype=str(val.dtype).removeprefix("torch."),
                bytes=0 if alias_of else nbytes,
                tensor_bytes=size_hint(val.numel()) * val.element_size(),
                kind=kind,
                consumers=consumers,
                decision=decision,
                alias_of=alias_of,
            )
        )
    return rows


def _kind(node: fx.Node, val: torch.Tensor, *, is_param: bool) -> str:
    if is_param:
        return "parameter"
    marked = node.meta.get("graphpass_kind")
    if marked:
        return marked
    if val.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8_data"
    if any(m in op_name(producer(node)) for m in _RNG_MARKERS):
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
