"""The torch.compile backend: Inductor (or eager) code generation around the graphpass partition."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import inspect
import re
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.fx as fx

from . import _compat
from .config import Config
from .decisions import Decision, What
from .graph.nodes import Root, Step, frame_arguments, frame_roots, parse_source, root_steps
from .graph import cuda_attention
from .graph.foreign import frame_library_modules, library_modules
from .pipeline import run
from .report import Report
from .reporting import remember
from .selections import Selections

class GraphInputs(NamedTuple):
    """What the report needs to know of the inputs of the graph dynamo is compiling."""

    sources: tuple[str | None, ...] = ()
    """The user's names of the inputs (dynamo's sources), for the report's parameter rows."""
    fsdp: bool = False
    """Whether any is a weight FSDP2 manages (all-gathered before the graph runs)."""
    child_frames: tuple[Decision, ...] = ()
    """Where the frame is a child module's forward: its note (``_child_frame``)."""
    attention: tuple[Decision, ...] = ()
    """On fake tensors: the attention traced as CUDA's kernel (``graph/cuda_attention.py``)."""


# Set around a compile, read by the partitioner that compile calls.
_graph_inputs: contextvars.ContextVar[GraphInputs] = contextvars.ContextVar(
    "graphpass_graph_inputs", default=GraphInputs())


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """A hash of graphpass's own source, so caches never serve another version's partition."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(str(path.relative_to(Path(__file__).parent)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


class Partitioner(_compat.custom_partitioner_base()):  # type: ignore[misc]
    """graphpass's partition as Inductor's ``custom_partitioner_fn``; keeps the report of every
    graph it partitions (``reports``), in order."""

    def __init__(self, config: Config, name: str = "graphpass") -> None:
        self.config = config
        self.reports: list[Report] = []
        self.selections = Selections(config, name)
        self.options_from: str | None = None  # a backend chosen by name: the name and variable

    def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], *,
                 num_fwd_outputs: int, static_lifetime_input_indices: list[int] | None = None,
                 compiler: str = "inductor") -> tuple[fx.GraphModule, fx.GraphModule]:
        fw, bw, report, selected = run(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                       static_lifetime_input_indices=static_lifetime_input_indices,
                                       config=self.config, compiler=compiler,
                                       input_sources=_graph_inputs.get().sources,
                                       fsdp=_graph_inputs.get().fsdp)
        self.selections.add(selected)
        if report is not None:
            for decision in (*_graph_inputs.get().child_frames, *_graph_inputs.get().attention):
                report.decisions.append(decision)
                report.notes.append(str(decision))
            if self.options_from:
                report.meta["options_from"] = self.options_from
            compile_id, frame = _compat.compile_id(), _compat.compiled_frame()
            if compile_id is not None:  # Report.merge tells a recompile from a graph break
                report.meta["compile_id"] = list(compile_id)
            if frame is not None:
                report.meta["frame"] = frame
            self.reports.append(report)
            remember(report)
        return fw, bw

    def uuid(self) -> str:
        from .fp8.providers import environment_key

        # The kernel provider is baked into the graph: key on what `kernels` resolves to here.
        env = environment_key(self.config.kernels, self.config.fp8_recipe)
        key = f"{_source_hash()}|{torch.__version__}|{sorted(self.config.as_dict().items())!r}|{env}"
        return hashlib.sha256(key.encode()).hexdigest()


class Backend:
    """A torch.compile backend; ``graphpass.backend(**options)`` makes one."""

    def __init__(self, config: Config, options: dict[str, Any] | None = None, *,
                 options_from: str | None = None) -> None:
        self.config = config
        # The options as the user wrote them: torch repeats this repr in every error that names
        # the backend, where twenty default fields would bury the ones that matter.
        self.options = dict(options) if options is not None else config.changed()
        self.partitioner = Partitioner(config, options_from or repr(self))
        self.partitioner.options_from = options_from

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"graphpass.backend({args})"

    def report(self) -> Report | None:
        """What every graph this backend partitioned saves, merged: a model with graph breaks
        compiles to several graphs (and a break repeated per layer, to one graph per layer), all
        of which run. A frame compiled again (a recompile: a guard failed) counts once, as its
        latest compile, with a ``recompile:`` note (``Report.merge``). ``None`` before the first
        backward graph."""
        reports = self.partitioner.reports
        return Report.merge(reports) if reports else None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        with input_sources(gm):
            if self.config.codegen == "inductor":
                compiled = _compat.compile_fx(
                    gm, example_inputs, config_patches=self._inductor_patches(example_inputs))
            else:
                compiled = eager_compile(gm, example_inputs, self.partitioner, runs=True)
        if self.config.fp8_weight_cache and any(map(_compat.is_dtensor, example_inputs)):
            from .fp8.weight_cache import track_dtensors

            # the cache keys on a DTensor's local tensor, whose version no DTensor op moves
            return track_dtensors(compiled)
        return compiled

    def _inductor_patches(self, example_inputs: Sequence[Any]) -> dict[str, Any]:
        """Inductor settings for one compile: our partitioner, and the quantize inlining where
        Inductor keeps its bits exact on every device of the graph (the pipeline notes when not)."""
        from .fp8.inductor import inlinable, post_grad_pass

        patches: dict[str, Any] = {"custom_partitioner_fn": self.partitioner}
        if self.config.fp8_weight_cache:
            from .fp8.weight_cache import QUANTIZE_WEIGHT, QUANTIZE_WEIGHT_SHARDS

            _compat.register_persistent_outputs(QUANTIZE_WEIGHT)
            _compat.register_persistent_outputs(QUANTIZE_WEIGHT_SHARDS)
        device_types = [x.device.type for x in example_inputs if isinstance(x, torch.Tensor)]
        exact = _compat.inductor_rounds_fused_casts(device_types=device_types)
        recipe = self.config.recipe
        if self.config.fuse_quantize and recipe is not None and inlinable(recipe) and exact:
            if "cpu" in device_types:  # columnwise copies: bf16 tile transposes in C++
                _compat.guard_cpp_bf16_transpose()
            patches["post_grad_custom_pre_pass"] = post_grad_pass(
                _source_hash(), _compat.inductor_config().post_grad_custom_pre_pass,
                order_backward=self.config.order_backward)
            patches["emulate_precision_casts"] = True
            # Triton lowers fp32 x / y to the approximate div.full: the recipe's scale (fmax /
            # amax) and its reciprocal would be off by an ulp, and with them the FP8 bits.
            patches["eager_numerics.division_rounding"] = True
        return patches


def eager_compile(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Partitioner,
                  *, runs: bool, fake: bool = False):
    """AOTAutograd with Inductor's decompositions and joint-graph passes, but no code generation.

    The joint graph our partition sees is then the same as under Inductor, so reports agree
    between code generations and with ``graphpass.plan``. Inductor's uniform-value constant
    folding is off: on meta tensors (``plan``) it would fold every op into ``empty_strided``.

    One exception when the graphs will run (``runs``, not ``plan``): random ops keep torch's
    eager RNG (Inductor's ``fallback_random``). Inductor replaces dropout by per-graph seeds and
    a seeded ``inductor_random`` that only its generated kernels honour; run as-is, that op
    ignores its seed, so a mask recomputed in the backward would differ from the forward's.

    ``fake``: ``gm``'s tensors are fake CPU tensors standing for a GPU's (``plan``, ``estimate``;
    never a graph that runs on real tensors): an attention the CPU would run by SDPA's math path
    is traced as the kernel CUDA runs (``graph/cuda_attention.py``), with a note.
    """
    from functorch.compile import make_boxed_func

    if fake and (attention := cuda_attention.rewrite(gm)):
        _graph_inputs.set(_graph_inputs.get()._replace(attention=tuple(attention)))

    def run_as_is(graph: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        return make_boxed_func(graph.forward)

    with _compat.inductor_config().patch(custom_partitioner_fn=partitioner,
                                         joint_graph_constant_folding=False, fallback_random=runs):
        return _compat.aot_autograd(
            fw_compiler=run_as_is,
            bw_compiler=run_as_is,
            partition_fn=_compat.inductor_partition_fn(),
            decompositions=_compat.inductor_decompositions(),
        )(gm, example_inputs)


@contextlib.contextmanager
def input_sources(gm: fx.GraphModule) -> Iterator[None]:
    """Around the compile of dynamo's graph ``gm``: what its inputs are, for the partitioner."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    sources = tuple(_compat.placeholder_source(n) for n in placeholders)
    roots, models, child_frames = _module_roots(gm, sources)
    token = _graph_inputs.set(GraphInputs(
        sources=sources, fsdp=any(_compat.fsdp_managed_input(n) for n in placeholders),
        child_frames=child_frames))
    roots_token = frame_roots.set(roots)
    arguments_token = frame_arguments.set(_positional_arguments(models))
    libraries_token = frame_library_modules.set(library_modules(models))
    try:
        yield
    finally:
        frame_library_modules.reset(libraries_token)
        frame_arguments.reset(arguments_token)
        frame_roots.reset(roots_token)
        _graph_inputs.reset(token)


def module_roots(gm: fx.GraphModule, sources: Sequence[str | None] = ()) -> dict[
        tuple[str, tuple[Step, ...]], Root]:
    """Where the model is in the sources of dynamo's graph ``gm`` (its module stacks and input
    sources), found from the objects of the frame being compiled: the first module the names
    lead to (``args[0]`` behind a decorator, ``func`` of a partial, but a child named ``func`` of
    the compiled module itself), then through torch's data-parallel wrappers (``wrapper_child``).
    Outside a dynamo compile, the names alone decide (``graph.nodes.normalize_path``)."""
    return _module_roots(gm, sources).roots


# The models of the frames compiled so far (weakly): a graph break's resume frame holds modules of
# them under the names of dynamo's stack (``___stack1``), whose paths are found here.
_models_seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_STACK_LOCAL = re.compile(r"___stack\d+$")


class FrameRoots(NamedTuple):
    roots: dict[tuple[str, tuple[Step, ...]], Root]
    models: list[torch.nn.Module]
    """The models the roots lead to."""
    child_frames: tuple[Decision, ...] = ()
    """A note for each root that is a child of a model an earlier frame compiled."""


def _module_roots(gm: fx.GraphModule, sources: Sequence[str | None] = ()) -> FrameRoots:
    """:func:`module_roots`, and the models its roots lead to. A module a resume frame holds on
    dynamo's stack (the callee of an expression the graph broke in: ``self.fc2(f(x))`` breaking
    at ``f``) is a root too, at its path in the model of an earlier frame that holds it, and so
    is the module of a frame that is a child's forward (a graph break inside ``self.child(x)``:
    dynamo compiles the child's forward as a frame of its own, whose ``self`` is the child;
    other modules of its class may run that compiled code, which a note says)."""
    scopes = _compat.frame_scopes()
    if scopes is None:
        return FrameRoots({}, [])
    names = {*filter(None, sources)}
    for node in gm.graph.nodes:
        names.update(path for path, _ in (node.meta.get("nn_module_stack") or {}).values())
    roots: dict[tuple[str, tuple[Step, ...]], Root] = {}
    models: list[torch.nn.Module] = []
    notes: dict[str, Decision] = {}
    for name in names:
        parsed = parse_source(name) if isinstance(name, str) else None
        if parsed is None:
            continue
        local, steps = parsed
        scope, variable = scopes.get(local[0], {}), local[3:-2]  # "L['args']": L, args
        key = (local, tuple(steps[:root_steps(steps)]))
        if key not in roots and variable in scope:
            roots[key], model = _root(scope[variable], list(key[1]))
            if model is None:
                continue
            # A module of a model an earlier frame compiled has its path there: a resume frame's
            # module on dynamo's stack, or the `self` of a child's forward that dynamo compiles as
            # a frame of its own after a graph break inside it (T5's decoder stack on torch 2.11).
            prefix, owner = _seen_path(model)
            if prefix:
                roots[key] = roots[key]._replace(prefix=prefix)
                if not _STACK_LOCAL.match(variable):
                    notes[prefix] = _child_frame(prefix, model, owner)
            elif not _STACK_LOCAL.match(variable):
                _models_seen.add(model)
            if all(model is not m for m in models):
                models.append(model)
    return FrameRoots(roots, models, tuple(notes.values()))


def _seen_path(module: torch.nn.Module) -> tuple[str, torch.nn.Module | None]:
    """``module``'s path in a model of an earlier frame, and that model (``""`` and None where
    none holds it)."""
    for model in list(_models_seen):
        for path, sub in model.named_modules():
            if sub is module:
                return path, model
    return "", None


def _child_frame(path: str, module: torch.nn.Module, model: torch.nn.Module) -> Decision:
    """The note of a frame whose code is the forward of ``model``'s child ``module`` at ``path``:
    dynamo's cache serves that code to every module of the class whose guards pass, each running
    it with the decisions made for this one."""
    cls = type(module)
    why = (f"{cls.__name__}.forward compiled as a frame of its own (a graph break inside it), "
           f"its paths from {path}")
    others = [p for p, sub in model.named_modules() if type(sub) is cls and sub is not module]
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        why += (f"; dynamo serves this compiled code to the other modules of its class "
                f"({shown}) wherever their forward runs as a frame and the guards pass, with the "
                f"decisions made for {path}: options naming only their paths do not reach it")
    return Decision(What.CHILD_FRAME, "backend", why, path)


def _root(obj: Any, steps: list[Step]) -> tuple[Root, torch.nn.Module | None]:
    """The root of sources that begin with ``steps`` after a local holding ``obj``, and the
    model there (None where the walk finds no module)."""
    n = 0
    while not isinstance(obj, torch.nn.Module) and n < len(steps):
        try:
            obj = obj[_index(steps[n].name)] if steps[n].subscript else getattr(obj, steps[n].name)
        except Exception:  # not an object this walk can follow: the names decide
            return Root(len(steps)), None
        n += 1
    if not isinstance(obj, torch.nn.Module):
        return Root(len(steps)), None
    through = []
    while (child := wrapper_child(obj)) is not None:
        through.append(child[0])
        obj = child[1]
    return Root(n, tuple(through)), obj


def _positional_arguments(models: list[torch.nn.Module]
                          ) -> tuple[str, tuple[str | None, ...]] | None:
    """Where the frame being compiled takes its inputs as ``*args`` and passes them on to the one
    model its sources lead to (a ``(*args, **kwargs)`` decorator's wrapper, a partial, a wrapper
    module's forward): that local's name and the model forward's argument each item binds to,
    by the forward's signature (``inspect.signature`` follows ``functools.wraps``), the model
    itself skipped where it is the first item. None elsewhere: the frame's own names are the
    arguments' names, or there is no one model to read them from."""
    varargs = _compat.frame_varargs()
    scope = (_compat.frame_scopes() or {}).get("L", {})
    items = scope.get(varargs) if varargs else None
    if not isinstance(items, tuple) or len(models) != 1:
        return None
    model = models[0]
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):  # a forward without a signature to read
        return None
    if any(p.name == varargs for p in parameters):
        return None  # the model's own forward, taking *args: its name is the argument's
    fixed = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    rest = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None)
    offset = 1 if items and items[0] is model else 0
    names = [fixed[i] if i < len(fixed) else f"{rest}[{i - len(fixed)}]" if rest else None
             for i in range(len(items) - offset)]
    return varargs, (None,) * offset + tuple(names)


def _index(key: str) -> Any:
    return int(key) if key.lstrip("-").isdigit() else key


def wrapper_child(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The module that ``module`` wraps, where it is one of torch's data-parallel wrappers
    (``DataParallel``, ``DistributedDataParallel``: ``module``). torch's other wrappers
    (``torch.compile``'s ``_orig_mod``, FSDP1, ``checkpoint_wrapper``) are left out by their
    attributes' names (``graph.nodes.TORCH_WRAPPERS``). A module of your own that holds the model
    is part of the paths (``model.lm_head``): only its code says it is a wrapper."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(module, (DataParallel, DistributedDataParallel)):
        return "module", module.module
    return None


def backend(**options: Any) -> Backend:
    """A graphpass backend for ``torch.compile(model, backend=graphpass.backend(...))``.

    Options are the keywords of :class:`graphpass.Config`; an unknown or invalid option raises a
    ValueError naming the valid ones.
    """
    return Backend(Config.from_options(**options), options)
