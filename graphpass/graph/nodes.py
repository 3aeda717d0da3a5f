"""Facts about single FX nodes of a joint, forward or backward graph."""

from __future__ import annotations

import re

import torch
import torch.fx as fx

from .. import _compat

_MODULE_SOURCE = re.compile(r"^L\['(?:self|fn|mod|model)'\]|\._(?:modules|parameters|buffers)\[")
_SOURCE_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_SUBSCRIPT = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_KEYWORD = re.compile(r"\[([^\]]+)\]")
_PRIVATE_DICTS = re.compile(r"\._(?:modules|parameters|buffers)\.")


def normalize_path(source: str, *, of_module: bool = True) -> str:
    """``L['self'].layers[0]._modules['attn']._parameters['weight']`` -> ``layers.0.attn.weight``.

    Graph-input sources (``of_module=False``) that are not attributes of the compiled module are
    the user's inputs: ``L['x']`` -> ``input:x``, and a keyword input that a ``**kwargs`` took
    by its keyword: ``L['kwargs']['input_ids']`` -> ``input:input_ids``.
    """
    if not source:
        return ""
    if not of_module and not _MODULE_SOURCE.search(source):
        name = source[3:].split("'", 1)[0]
        rest = _SUBSCRIPT.sub(r"[\1]", source[3 + len(name) + 2:])
        keyword = _KEYWORD.match(rest) if name == "kwargs" else None
        if keyword:  # a keyword input (a forward taking **kwargs): by its keyword
            name, rest = keyword.group(1), rest[keyword.end():]
        return f"input:{name}{rest}"
    path = _SOURCE_PREFIX.sub("", source)
    path = _SUBSCRIPT.sub(r".\1", path)
    path = _PRIVATE_DICTS.sub(".", "." + path).strip(".")
    return path


def module_stack(node: fx.Node) -> list[tuple[str, type]]:
    """The module nesting of a node; backward nodes carry their forward op's stack."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return [(normalize_path(path), cls) for path, cls in stack.values()]


def module_path(node: fx.Node) -> str:
    stack = module_stack(node)
    return stack[-1][0] if stack else ""


def op_name(node: fx.Node) -> str:
    """A short, version-stable op name: ``aten.addmm``, ``graphpass.quantize``, ``input``."""
    if node.op == "placeholder":
        return "input"
    if node.op != "call_function":
        return node.op
    target = node.target
    return _compat.op_name(target) or getattr(target, "__name__", str(target))


def producer(node: fx.Node) -> fx.Node:
    """The op that produced a value: for ``getitem`` of a multi-output op, that op."""
    while node.op == "call_function" and op_name(node) == "getitem":
        node = node.args[0]
    return node


def tensor_bytes(val: torch.Tensor, *, where: str) -> int:
    """A tensor's bytes; an unbacked element count is assumed, with a ``sizes:`` note naming
    ``where`` (``_compat.size_hint``)."""
    return _compat.size_hint(val.numel(), where=where) * val.element_size()


def is_backward(node: fx.Node) -> bool:
    return _compat.partition_side(node) == "is_backward"


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers: dropout, rand, Inductor's seeds, attention with dropout
    (not attention whose ``dropout_p`` is 0). Recomputing one draws new numbers unless torch
    replays its RNG state, which it saves for the backward."""
    return _compat.is_rng_op(node)


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None
