"""torch.compile's front end (``torch._dynamo``, ``torch._guards``, ``torch._subclasses``): the
frame being compiled and its sources, backend registration, AOTAutograd's backend factory, fake
tensors, dynamo's errors and recompile limits."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch.fx as fx


def placeholder_source(node: fx.Node) -> str | None:
    """The dynamo source of a graph input (``L['self'].layers[0].weight``), if dynamo made it."""
    grapharg = node.meta.get("grapharg")
    if grapharg is None or getattr(grapharg, "source", None) is None:
        return None
    name = grapharg.source.name
    return name() if callable(name) else name


def frame_scopes() -> dict[str, dict[str, Any]] | None:
    """The locals (``"L"``) and globals (``"G"``) of the frame dynamo is compiling, where a
    backend is called from its compile: the objects its sources name (``L['args'][0]`` is
    ``frame_scopes()["L"]["args"][0]``); None elsewhere."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except Exception:  # not inside a dynamo compile, or a torch without current_tx
        return None
    scopes = {"L": getattr(tx, "f_locals", None), "G": getattr(tx, "f_globals", None)}
    return {k: v for k, v in scopes.items() if isinstance(v, dict)} or None


def frame_varargs() -> str | None:
    """The name of the ``*args`` parameter of the function dynamo is compiling (``args`` in a
    ``(*args, **kwargs)`` decorator's wrapper), where a backend is called from its compile and
    the function takes one; None elsewhere."""
    import inspect

    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # not inside a dynamo compile, or a torch without current_tx
        return None
    if not getattr(code, "co_flags", 0) & inspect.CO_VARARGS:
        return None
    return code.co_varnames[code.co_argcount + code.co_kwonlyargcount]


def compile_id() -> tuple[int, int] | None:
    """The (frame id, compile of that frame) of the dynamo compile in progress: ``0/1`` is frame
    0's second compile, a recompile after a guard failed; a graph break's next graph is another
    frame (its resume function). None outside a dynamo compile, and under compiled autograd."""
    from torch._guards import CompileContext

    cid = CompileContext.current_compile_id()
    if cid is None or getattr(cid, "compiled_autograd_id", None) is not None:
        return None
    frame, compile_ = getattr(cid, "frame_id", None), getattr(cid, "frame_compile_id", None)
    return (frame, compile_) if isinstance(frame, int) and isinstance(compile_, int) else None


def compiled_frame() -> str | None:
    """The code dynamo is compiling, as ``forward (model.py:12)``; None outside a compile."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        code = InstructionTranslator.current_tx().f_code
    except Exception:  # not inside a dynamo compile, or a torch without current_tx
        return None
    return f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"


def fsdp_managed_input(node: fx.Node) -> bool:
    """A dynamo graph input read from a module FSDP manages (``fully_shard`` marks it; dynamo
    gives its parameters an FSDP guard source): under FSDP2, a weight FSDP all-gathered before
    the graph runs. ``Source.guard_source`` is a cached property in 2.11 through 2.15; the base
    class raises NotImplementedError, so a source kind without one is no FSDP module's."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    try:
        guard = source.guard_source
    except NotImplementedError:
        return False
    return bool(guard.is_fsdp_module())


@contextlib.contextmanager
def unlimited_recompiles() -> Iterator[None]:
    """Each ``plan()`` compiles a fresh fake copy of the same code; don't let dynamo's per-code
    recompile limit (8) turn the ninth plan of a model into an uncompiled run."""
    from torch._dynamo import config as dynamo_config

    names = [n for n in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit") if hasattr(dynamo_config, n)]
    with dynamo_config.patch({n: 10**9 for n in names}):
        yield


def backend_value_error(error: BaseException) -> ValueError | None:
    """The ValueError a backend raised, where dynamo wrapped it (``BackendCompilerFailed``)."""
    from torch._dynamo.exc import BackendCompilerFailed

    inner = getattr(error, "inner_exception", None) if isinstance(error, BackendCompilerFailed) else None
    return inner if isinstance(inner, ValueError) else None


def fake_tensor_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    """torch.compile's AOTAutograd backend factory (``fw_compiler``, ``bw_compiler``,
    ``partition_fn``, ``decompositions``)."""
    from torch._dynamo.backends.common import aot_autograd as factory

    return factory(**kwargs)


def register_backend(name: str, compiler_fn: Callable[..., Any]) -> None:
    """Register a torch.compile backend name, unless it is registered already. Not through
    ``torch._dynamo.list_backends``: that imports every backend module torch has, a second or so
    on every ``import graphpass``."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)
