"""Facts about single FX nodes of a joint, forward or backward graph."""

from __future__ import annotations

import contextvars
import re
from typing import NamedTuple

import torch
import torch.fx as fx

from .. import _compat
from .joint import Side, partition_side

_MODULE_SOURCE = re.compile(r"^L\['(?:self|fn|mod|model)'\]|\._(?:modules|parameters|buffers)\[")
_SUBSCRIPT = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_KEYWORD = re.compile(r"\[([^\]]+)\]")
_LOCAL = re.compile(r"^([LG])\['([^']*)'\]")  # a local or a global of the frame
_SOURCE_PREFIX = re.compile(r"^[LG]\['[^']*'\]\.?")
_PRIVATE_DICTS = re.compile(r"\._(?:modules|parameters|buffers)\.")
# One step of a source after its local: ``._modules['x']`` (also ``_parameters``/``_buffers``),
# ``.x`` or ``[x]``.
_STEP = re.compile(r"\._(?:modules|parameters|buffers)\[['\"]?([^\]'\"]+)['\"]?\]"
                   r"|\.(\w+)|\[['\"]?([^\]'\"]*)['\"]?\]")
# Attributes of a function object, never a module's child: a functools.partial's ``func``, a
# bound method's ``__self__``, a functools.wraps wrapper's ``__wrapped__``.
_FUNCTION_ATTRS = frozenset({"func", "__self__", "__wrapped__", "__func__"})
# The attributes torch's own wrappers hold the wrapped module in (torch.compile's
# OptimizedModule, FSDP1, checkpoint_wrapper); torch's state-dict names leave them out too.
TORCH_WRAPPERS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


class Step(NamedTuple):
    name: str
    subscript: bool
    """``[x]`` rather than an attribute (``.x``, ``._modules['x']``)."""


class Root(NamedTuple):
    """Where the model's module paths begin in the sources of one compiled frame."""

    steps: int
    """How many steps after the local lead to the model (``args[0]``: one)."""
    through: tuple[str, ...] = ()
    """Wrapper modules' attributes after those steps that paths leave out (``module``)."""
    prefix: str = ""
    """The root's own path in the model, where the frame holds a module of it under a name of
    its own (a graph break's resume frame: ``L['___stack1']`` for ``fc2``, see
    ``backend._module_roots``)."""


# Set by the backend around a compile: the frame's roots, found from its objects
# (``backend.module_roots``), keyed by the local and the steps the names alone take as the root.
frame_roots: contextvars.ContextVar[dict[tuple[str, tuple[Step, ...]], Root]] = \
    contextvars.ContextVar("graphpass_frame_roots", default={})
# Set by the backend around a compile: the ``*args`` local of a frame that passes its positional
# inputs on to the model (a ``(*args, **kwargs)`` decorator's wrapper), and the model forward's
# argument each of its items binds to (None: the model itself, or past the forward's arguments).
frame_arguments: contextvars.ContextVar[tuple[str, tuple[str | None, ...]] | None] = \
    contextvars.ContextVar("graphpass_frame_arguments", default=None)


def parse_source(source: str) -> tuple[str, list[Step]] | None:
    """``L['args'][0]._modules['body'].fc`` -> ``("L['args']", [Step('0', True),
    Step('body', False), Step('fc', False)])``; None for a source that is no local's or
    global's."""
    local = _LOCAL.match(source)
    if local is None:
        return None
    steps, at = [], local.end()
    while at < len(source):
        step = _STEP.match(source, at)
        if step is None:  # a form this parser does not know: the rest as one step
            steps.append(Step(source[at:].lstrip("."), False))
            break
        module, attr, item = step.groups()
        steps.append(Step(item, True) if item is not None else Step(module or attr, False))
        at = step.end()
    return local.group(0), steps


def root_steps(steps: list[Step]) -> int:
    """How many leading steps lead to the model by their names alone: subscripts of the local
    (the ``args`` of a ``(*args, **kwargs)`` decorator) and function attributes (a partial's
    ``func``, a bound method's ``__self__``)."""
    n = 0
    while n < len(steps) and (steps[n].subscript or steps[n].name in _FUNCTION_ATTRS):
        n += 1
    return n


def normalize_path(source: str, *, of_module: bool = True) -> str:
    """``L['self'].layers[0]._modules['attn']._parameters['weight']`` -> ``layers.0.attn.weight``.

    The path begins at the model, whatever the compiled frame calls it: ``L['self']``,
    ``L['args'][0]`` (a forward behind a ``(*args, **kwargs)`` decorator), ``L['fn'].func`` (a
    ``functools.partial``), ``L['fn'].func.__self__`` (a partial of a bound method), the module
    a DataParallel or DDP holds (``frame_roots``, found by the backend from the frame's
    objects); torch's wrapper attributes (``_orig_mod``, ``_checkpoint_wrapped_module``,
    ``_fsdp_wrapped_module``) are left out.

    Graph-input sources (``of_module=False``) that are not attributes of the compiled module are
    the user's inputs: ``L['x']`` -> ``input:x``, a keyword input that a ``**kwargs`` took by its
    keyword: ``L['kwargs']['input_ids']`` -> ``input:input_ids``, and a positional input that a
    ``*args`` took by the model forward's argument it binds to (``frame_arguments``):
    ``L['args'][1]`` -> ``input:x`` behind a decorator of ``forward(self, x)``.
    """
    if not source:
        return ""
    if not of_module and not _MODULE_SOURCE.search(source):
        name = source[3:].split("'", 1)[0]
        rest = _SUBSCRIPT.sub(r"[\1]", source[3 + len(name) + 2:])
        item = _KEYWORD.match(rest)
        arguments = frame_arguments.get()
        if item and name == "kwargs":  # a keyword input (a forward taking **kwargs): by its keyword
            name, rest = item.group(1), rest[item.end():]
        elif item and arguments and name == arguments[0] and item.group(1).isdigit():
            names = arguments[1]
            index = int(item.group(1))
            if index < len(names) and names[index] is not None:
                name, rest = names[index], rest[item.end():]
        return f"input:{name}{rest}"
    parsed = parse_source(source)
    if parsed is None:  # a form parse_source does not know: the names as they are
        path = _SUBSCRIPT.sub(r".\1", _SOURCE_PREFIX.sub("", source))
        return _PRIVATE_DICTS.sub(".", "." + path).strip(".")
    local, steps = parsed
    n = root_steps(steps)
    root = frame_roots.get().get((local, tuple(steps[:n])), Root(n))
    steps = steps[root.steps:]
    through = len(root.through)
    if tuple(s.name for s in steps[:through]) == root.through:
        steps = steps[through:]
    return ".".join([*filter(None, [root.prefix]),
                     *(s.name for s in steps if s.name not in TORCH_WRAPPERS)])


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


def viewed(value: object) -> object:
    """What ``value`` views, through aten view ops (each one's first argument); ``value`` itself
    where it is no view (or no node)."""
    while isinstance(value, fx.Node) and value.op == "call_function" and value.args \
            and _compat.is_op_overload(value.target) and value.target.is_view:
        value = value.args[0]
    return value


def tensor_bytes(val: torch.Tensor, *, where: str) -> int:
    """A tensor's bytes; an unbacked element count is assumed, with a ``sizes:`` note naming
    ``where`` (``_compat.size_hint``)."""
    return _compat.size_hint(val.numel(), where=where) * val.element_size()


def is_backward(node: fx.Node) -> bool:
    return partition_side(node) is Side.BACKWARD


def is_random(node: fx.Node) -> bool:
    """An op that draws random numbers: dropout, rand, Inductor's seeds, attention with dropout
    (not attention whose ``dropout_p`` is 0). Recomputing one draws new numbers unless torch
    replays its RNG state, which it saves for the backward."""
    return _compat.is_rng_op(node)


def tensor_val(node: fx.Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def replace_tuple_node(graph: fx.Graph, node: fx.Node, outputs: list[fx.Node]) -> None:
    """Replace ``node``, an op returning a tuple read through ``getitem`` users, by ``outputs``
    (one node per tuple element), and erase it and its ``getitem`` users."""
    for user in list(node.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)
