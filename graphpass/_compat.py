"""The torch internals graphpass touches, in one place, for torch 2.11 through 2.14.1.

Tested on 2.11.0, 2.13.0 and 2.14.1 (``make test TORCH=...``, all three in CI).

Everything version-specific lives here and is called with keyword arguments, so that a
signature change upstream fails loudly in one module instead of silently elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import contextvars
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

TORCH_VERSION_STR = torch.__version__.split("+")[0]
TORCH_VERSION = tuple(int(p) for p in TORCH_VERSION_STR.split(".")[:2])

# The size assumed for an unbacked symbol (a data-dependent size: nonzero, .item()).
UNBACKED_SIZE_HINT = 4096
# What size_hint assumed while recording: {symbol: [where, ...]} (see ``assumed_sizes``).
_assumed: contextvars.ContextVar[dict[str, list[str]] | None] = contextvars.ContextVar(
    "graphpass_assumed_sizes", default=None)


def size_hint(expr: Any, fallback: int = UNBACKED_SIZE_HINT, *, where: str = "") -> int:
    """A concrete int for a possibly symbolic size (2.12 renamed the hint helpers).

    A backed symbol has a hint (the example input's size); an unbacked one has none and counts as
    ``fallback``: inside ``assumed_sizes()`` that assumption is recorded with ``where`` it was made.
    """
    if isinstance(expr, int):
        return expr
    from torch.fx.experimental import symbolic_shapes as ss

    unbacked = ss.free_unbacked_symbols(expr)
    assumed = _assumed.get()
    if unbacked and assumed is not None:
        for sym in sorted(unbacked, key=str):
            places = assumed.setdefault(str(sym), [])
            if where not in places:
                places.append(where)
    if hasattr(ss, "optimization_hint"):  # torch >= 2.12
        return int(ss.optimization_hint(expr, fallback=fallback))
    return int(ss.size_hint(expr, fallback=fallback))  # torch 2.11


@contextlib.contextmanager
def assumed_sizes() -> Iterator[dict[str, list[str]]]:
    """Record the unbacked symbols ``size_hint`` gave its fallback for: ``{"u0": [where, ...]}``."""
    token = _assumed.set({})
    try:
        yield _assumed.get()
    finally:
        _assumed.reset(token)


def _sdpa_flops_know_gqa() -> bool:
    from torch.utils.flop_counter import sdpa_flop_count

    try:
        sdpa_flop_count((1, 2, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))
    except AssertionError:  # torch 2.11: key/value heads must equal the query's
        return False
    return True


def flop_formula(packet: Any) -> Callable[..., int] | None:
    """torch's FLOP formula for an op (``torch.utils.flop_counter``), or None.

    torch 2.11's attention formulas reject grouped-query attention (key/value with fewer heads
    than the query, what ``enable_gqa`` and the CPU flash kernel take); later versions count it as
    the kernel runs it, with key/value broadcast to the query's heads. On 2.11 the formula gets
    those broadcast shapes.
    """
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(packet)
    if formula is None or packet not in _SDPA_QUERY_ARG or _sdpa_flops_know_gqa():
        return formula
    q_at = _SDPA_QUERY_ARG[packet]

    def broadcast_heads(*args: Any, **kwargs: Any) -> int:
        args = list(args)
        heads = args[q_at].shape[1]
        for i in (q_at + 1, q_at + 2):  # key, value
            shape = args[i].shape
            args[i] = torch.Size((shape[0], heads, *shape[2:]))
        return formula(*args, **kwargs)

    return broadcast_heads


_aten = torch.ops.aten
# Where the query is in the SDPA ops' arguments (key and value follow it).
_SDPA_QUERY_ARG = {
    **{op: 0 for op in (_aten._scaled_dot_product_flash_attention,
                        _aten._scaled_dot_product_efficient_attention,
                        _aten._scaled_dot_product_cudnn_attention)},
    **{op: 1 for op in (_aten._scaled_dot_product_flash_attention_backward,
                        _aten._scaled_dot_product_efficient_attention_backward,
                        _aten._scaled_dot_product_cudnn_attention_backward)},
}


def inductor_rounds_fused_casts(*, device_types: Iterable[str]) -> bool:
    """Whether Inductor's generated code for all of ``device_types`` rounds fused bf16/fp16
    intermediates as eager does under ``emulate_precision_casts``, which fused FP8 quantizes need
    for the recipe's bits: Triton (CUDA) in every supported torch, the C++ backend (CPU) from 2.13
    (2.11's ``codegen/cpp.py`` ignores the setting; 2.12 is not tested)."""
    return "cpu" not in set(device_types) or TORCH_VERSION >= (2, 13)


def assumed_sizes_why(assumed: dict[str, list[str]]) -> list[str]:
    """For the report, after ``assumed_sizes()``: each symbol, the size assumed, where (the first
    three places)."""
    def places(p: list[str]) -> str:
        return ", ".join(p[:3]) + (f" and {len(p) - 3} more" if len(p) > 3 else "")

    return [f"unbacked {sym} assumed {UNBACKED_SIZE_HINT} in {places(p)}" for sym, p in assumed.items()]


def is_rng_op(node: fx.Node) -> bool:
    """Whether recomputing ``node`` would draw new random numbers: an op tagged
    ``nondeterministic_seeded`` (dropout, rand, Inductor's seeds, attention), except attention
    whose ``dropout_p`` is statically 0, which draws none and recomputes bit-identically.

    torch 2.14 decides so itself (``partitioners.is_rng_op``, pytorch/pytorch#187985) and saves
    no RNG state for a recomputed dropout-free attention; 2.11 and 2.13 treat every tagged op as
    random. graphpass uses torch 2.14's rule on every version (see ``min_cut_partition``).
    """
    from torch._functorch import partitioners

    if hasattr(partitioners, "is_rng_op"):  # torch >= 2.14
        return partitioners.is_rng_op(node)
    target = node.target
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    if not isinstance(target, torch._ops.OpOverload):
        return True
    names = [a.name for a in target._schema.arguments]
    if "dropout_p" not in names:
        return True
    at = names.index("dropout_p")
    default = target._schema.arguments[at].default_value
    dropout_p = (node.args[at] if len(node.args) > at
                 else node.kwargs.get("dropout_p", default))
    if dropout_p is None:
        return True
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return not statically_known_true(dropout_p == 0.0)


def min_cut_partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    compiler: str = "inductor",
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut rematerialization partitioner (same signature in 2.11 through 2.14.1).

    A recomputed random op runs in the backward under an RNG state the forward saves for it. On
    torch 2.11 and 2.13 the partitioner does that for dropout-free attention too, saving a CPU
    generator state (5,056 B) per recomputed attention that replays no random number; there
    graphpass hides such ops from the partitioner's RNG functionalization, so every version saves
    the same tensors as 2.14, which skips them itself (``is_rng_op``).
    """
    from torch._functorch import partitioners

    with _rng_functionalization_of_random_ops_only(partitioners):
        return partitioners.min_cut_rematerialization_partition(
            joint,
            joint_inputs,
            compiler=compiler,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )


class MinCutDumps:
    """Where torch's min-cut wrote its debug files (``min_cut_failed_graph.txt``, an SVG with
    pydot) when it failed: a temporary directory, made at the first file; None while none."""

    directory: str | None = None


@contextlib.contextmanager
def min_cut_dumps() -> Iterator[MinCutDumps]:
    """torch's min-cut writes its debug files, when it fails, into a temporary directory rather
    than the working directory (``partitioners._get_unique_path``, 2.11 through 2.15)."""
    import os
    import tempfile

    from torch._functorch import partitioners

    dumps = MinCutDumps()
    original = getattr(partitioners, "_get_unique_path", None)
    if original is None:
        yield dumps
        return

    def unique_path(base_name: str, extension: str) -> str:
        if dumps.directory is None:
            dumps.directory = tempfile.mkdtemp(prefix="graphpass_min_cut_")
        return original(os.path.join(dumps.directory, base_name), extension)

    partitioners._get_unique_path = unique_path
    try:
        yield dumps
    finally:
        partitioners._get_unique_path = original


def min_cut_failure(error: BaseException) -> bool:
    """Whether ``error`` is torch's min-cut failing: networkx's unbounded cut (a value the
    backward needs can be neither saved nor recomputed), raised as is or as the RuntimeError
    torch raises from it."""
    import networkx as nx

    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, nx.NetworkXUnbounded):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return isinstance(error, RuntimeError) and "failed to partition" in str(error)


@contextlib.contextmanager
def _rng_functionalization_of_random_ops_only(partitioners: Any) -> Iterator[None]:
    """On torch < 2.14: ``functionalize_rng_ops`` skips recomputed ops that ``is_rng_op`` calls
    deterministic. It picks the ops to wrap from the joint graph's ``recompute`` tags, so each
    such op's tag is lifted for the call and put back after (the forward and backward graphs
    are already split by then: the tag has done its work)."""
    if hasattr(partitioners, "is_rng_op"):  # torch >= 2.14 does it itself
        yield
        return
    original = partitioners.functionalize_rng_ops

    def functionalize_rng_ops(joint_module: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        lifted = {n: n.meta.pop("recompute") for n in joint_module.graph.nodes
                  if "recompute" in n.meta and n.op == "call_function"
                  and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
                  and not is_rng_op(n)}
        try:
            return original(joint_module, *args, **kwargs)
        finally:
            for node, policy in lifted.items():
                node.meta["recompute"] = policy

    partitioners.functionalize_rng_ops = functionalize_rng_ops
    try:
        yield
    finally:
        partitioners.functionalize_rng_ops = original


@contextlib.contextmanager
def min_cut_settings(*, relaxed: bool, offload: bool, offload_stream: bool) -> Iterator[None]:
    """torch's partitioner settings for one partition.

    ``relaxed`` turns off the min-cut's recompute heuristics (allowlist, reductions, fusible
    chains, distance), leaving bans to ``recompute`` tags; ``offload`` turns on torch's
    activation offloading of nodes tagged ``should_offload``, and ``offload_stream`` its
    separate-stream mode (CUDA only) with its sink-wait and reload-prefetch options (every
    supported version has the three; 2.11 builds them from ``streams::`` fork/join/event ops
    around ``device_put``, 2.13 from ``ao::offload``/``ao::reload``/``ao::wait_tensor``; 2.12,
    2.14 and 2.15 were not inspected).
    """
    from torch._functorch import config as functorch_config

    patch: dict[str, Any] = {"enable_activation_offloading": offload}
    if offload and offload_stream:
        _repair_record_stream_fake()
        for key in ("activation_offload_separate_stream", "activation_offload_sink_wait",
                    "activation_reload_prefetch"):
            if hasattr(functorch_config, key):
                patch[key] = True
    if relaxed:
        patch.update(ban_recompute_used_far_apart=False, ban_recompute_long_fusible_chains=False,
                     ban_recompute_materialized_backward=False,
                     ban_recompute_not_in_allowlist=False, ban_recompute_reductions=False,
                     max_dist_from_bw=10**9)
    with functorch_config.patch(patch):
        yield


def _repair_record_stream_fake() -> None:
    """torch 2.11 registers ``streams::record_stream``'s fake implementation with
    ``sync_dealloc``'s signature (``src_stream_index, wait_event_index, to_dealloc``), so every
    separate-stream offload fails under fake tensors with "missing 1 required positional argument:
    'to_dealloc'". Give it the op's own signature; later versions, which have it right, are left
    alone."""
    try:
        from torch._dynamo.variables import streams
    except ImportError:
        return
    op = getattr(streams, "record_stream", None)
    fake = getattr(op, "_abstract_fn", None)
    if fake is None or "to_dealloc" not in inspect.signature(fake).parameters:
        return

    def record_stream_fake(tensor: torch.Tensor, stream_index: int) -> None:
        return None

    op.register_fake(record_stream_fake)


def storage_id(val: torch.Tensor) -> int | None:
    """An id shared by all tensors (fake, meta or real) that alias one storage."""
    if not torch._C._has_storage(val):
        return None
    from torch._inductor.fx_utils import get_storage

    return get_storage(val)


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
    the graph runs. ``Source.guard_source`` is a cached property in 2.11 through 2.14.1; the base
    class raises NotImplementedError, so a source kind without one is no FSDP module's."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return False
    try:
        guard = source.guard_source
    except NotImplementedError:
        return False
    return bool(guard.is_fsdp_module())


def custom_partitioner_base() -> type:
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    return CustomPartitionerFn


def inductor_partition_fn() -> Callable[..., Any]:
    """Inductor's partition step: its joint-graph passes, then ``custom_partitioner_fn``.

    Outside ``compile_fx`` nobody installs Inductor's virtualized fake mode, which its random-op
    joint pass (dropout) reads; install the joint graph's own.
    """
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    def partition_fn(gm: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return compile_fx.partition_fn(gm, joint_inputs, **kwargs)

    return partition_fn


@contextlib.contextmanager
def unlimited_recompiles() -> Iterator[None]:
    """Each ``plan()`` compiles a fresh fake copy of the same code; don't let dynamo's per-code
    recompile limit (8) turn the ninth plan of a model into an uncompiled run."""
    from torch._dynamo import config as dynamo_config

    names = [n for n in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit") if hasattr(dynamo_config, n)]
    with dynamo_config.patch({n: 10**9 for n in names}):
        yield


def remove_noop_ops(graph: fx.Graph) -> bool:
    """Inductor's joint-graph removal of no-op ``alias``/``clone``/same-shape views (never one that
    would make a graph output alias an input); True if it removed any. Same call in 2.11-2.14."""
    from torch._inductor.fx_passes.post_grad import remove_noop_ops as remove

    before = len(graph.nodes)
    remove(graph)
    return len(graph.nodes) != before


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (public under that path in 2.11 through 2.14.1);
    False where torch was built without distributed."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def dtensor_local(t: Any) -> torch.Tensor:
    """This rank's shard of a DTensor, without the autograd op ``to_local`` records (which
    fake-tensor mode refuses on a real shard)."""
    return t._local_tensor


def dtensor_from_local(local: torch.Tensor, like: Any) -> Any:
    """A DTensor over ``local`` with ``like``'s mesh, placements, global shape and stride; no
    communication (``run_check=False``)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def is_tangent(node: fx.Node) -> bool:
    """A backward input of an AOTAutograd joint graph (a gradient), which it names
    ``tangents_N``."""
    return node.op == "placeholder" and "tangents" in node.name


def primals(joint: fx.GraphModule) -> list[fx.Node]:
    """The forward inputs of an AOTAutograd joint graph: its placeholders but the tangents."""
    return [n for n in joint.graph.find_nodes(op="placeholder") if not is_tangent(n)]


def _input_descriptors(primals: list[fx.Node]) -> list[Any] | None:
    """Each primal's input descriptor walked down to the input it came from (through a tensor
    subclass's attributes: from torch 2.13 a DTensor input becomes two primals, its
    ``_local_tensor`` and its ``device_mesh``, each a ``SubclassGetAttrAOTInput`` over the
    ``PlainAOTInput(idx)`` of the DTensor). None where nothing was flattened (no subclass
    descriptors: torch 2.11, or no subclass input): the primals are the inputs then."""
    descs = [n.meta.get("desc") for n in primals]
    if not all(descs) or not any(getattr(d, "base", None) is not None for d in descs):
        return None
    walked = []
    for desc in descs:
        while getattr(desc, "base", None) is not None:
            desc = desc.base
        walked.append(desc)
    return walked


def primal_input_indices(primals: list[fx.Node]) -> list[int | None]:
    """For each primal, the index of the AOTAutograd input (dynamo's graph input) it comes
    from: a DTensor's local shard and mesh both map to the DTensor's input."""
    descs = _input_descriptors(primals)
    if descs is None:
        return list(range(len(primals)))
    return [getattr(desc, "idx", None) for desc in descs]


def static_primal_positions(primals: list[fx.Node], static: list[int]) -> list[int]:
    """Positions among the joint graph's primals of the inputs torch calls static (parameters,
    buffers). ``static`` counts AOTAutograd's inputs before tensor subclasses are flattened
    (``_input_descriptors``), so from torch 2.13 the positions of a graph with DTensor inputs
    shift."""
    descs = _input_descriptors(primals)
    if descs is None:
        return [i for i in static if i < len(primals)]  # nothing flattened: positions as given
    wanted = set(static)
    positions = []
    for pos, desc in enumerate(descs):
        idx = getattr(desc, "idx", None)
        if idx is not None and idx in wanted:
            positions.append(pos)
        elif idx is None and type(desc).__name__ in ("ParamAOTInput", "BufferAOTInput"):
            positions.append(pos)
    return positions


def fake_store() -> Any:
    """The store of torch's fake process group (a test utility of torch's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


# -- ops and the nodes of AOTAutograd's graphs ----------------------------------------------------

def op_name(target: Any) -> str | None:
    """``aten.mm``, ``graphpass.quantize``, ``higher_order.run_with_rng_state`` for a node's
    target, or None for a plain Python callable."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    return None


def functional_collective(name: str) -> Any:
    """torch's functional collective op ``name`` (``all_reduce``, ``wait_tensor``), default
    overload: what DTensor's collectives trace into."""
    return getattr(torch.ops._c10d_functional, name).default


def is_op_overload(target: Any) -> bool:
    """An operator overload (``torch.ops.aten.mm.default``), which FLOP formulas and tags know."""
    return isinstance(target, torch._ops.OpOverload)


def is_higher_order(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def partition_side(node: fx.Node) -> str | None:
    """The side AOTAutograd's joint graph puts a node on (``meta["partitioner_tag"]``, read by its
    partitioner): ``is_forward``, ``is_backward`` or ``must_be_in_backward``, None if untagged.
    The partitioner copies the tag with the node, so a recomputed node keeps ``is_forward``."""
    return node.meta.get("partitioner_tag")


def set_partition_side(node: fx.Node, side: str) -> None:
    node.meta["partitioner_tag"] = side


def is_non_overlapping_and_dense(val: torch.Tensor) -> bool:
    """Whether a tensor's elements fill its storage span once each (no expanded view)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as dense

    return bool(dense(val))


def offloaded_source(node: fx.Node) -> fx.Node | None:
    """The tensor a node of torch's activation offloading moves to the host, or None for any
    other node. The node is ``cpu_offload_<name>``: a ``prims.device_put`` to the host (torch
    2.11, and every version without the separate stream), or on 2.13's separate stream the
    ``ao.wait_tensor`` of an ``ao.offload``."""
    if not node.name.startswith("cpu_offload_") or node.op != "call_function":
        return None
    if node.target is torch.ops.prims.device_put.default:
        return node.args[0]
    issue = offload_issue(node)
    return issue.args[0] if issue is not node else None


def offload_issue(node: fx.Node) -> fx.Node:
    """Where the copy of an offloaded tensor (``offloaded_source(node)`` is not None) starts:
    ``node`` itself (a ``device_put``), or the ``ao.offload`` its ``ao.wait_tensor`` waits for."""
    if _target_name(node) == "ao.wait_tensor.default" and isinstance(node.args[0], fx.Node) \
            and _target_name(node.args[0]) == "ao.offload.default":
        return node.args[0]
    return node


def reload_of(offloaded: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """For a backward input that torch's offloading reloads (a ``cpu_offload_<name>``
    placeholder): the node that starts the copy back (a ``device_put``, or 2.13's
    ``ao.reload``) and the node whose value the backward reads (the ``device_put`` itself, or
    the ``ao.wait_tensor`` of the ``ao.reload``); None for any other node."""
    for user in offloaded.users:
        if user.target is torch.ops.prims.device_put.default:
            return user, user
        if _target_name(user) == "ao.reload.default":
            wait = next((u for u in user.users if _target_name(u) == "ao.wait_tensor.default"), user)
            return user, wait
    return None


def is_offload_machinery(node: fx.Node) -> bool:
    """A node of torch's activation offloading that computes nothing on the device: a copy, a
    wait, or a stream/event op of its separate-stream mode."""
    name = _target_name(node)
    return (node.target is torch.ops.prims.device_put.default
            or name.startswith(("streams.", "ao.offload", "ao.reload", "ao.wait_tensor")))


def _target_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "call_function" else ""


# -- torch.compile's pieces ------------------------------------------------------------------------

def backend_value_error(error: BaseException) -> ValueError | None:
    """The ValueError a backend raised, where dynamo wrapped it (``BackendCompilerFailed``)."""
    from torch._dynamo.exc import BackendCompilerFailed

    inner = getattr(error, "inner_exception", None) if isinstance(error, BackendCompilerFailed) else None
    return inner if isinstance(inner, ValueError) else None


def fake_tensor_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def compile_fx(gm: fx.GraphModule, example_inputs: Any, *, config_patches: dict[str, Any]) -> Any:
    """Inductor's compile, with ``config_patches`` for this compile only."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile

    return inductor_compile(gm, example_inputs, config_patches=config_patches)


def inductor_config() -> Any:
    from torch._inductor import config

    return config


def aot_autograd(**kwargs: Any) -> Callable[..., Any]:
    """torch.compile's AOTAutograd backend factory (``fw_compiler``, ``bw_compiler``,
    ``partition_fn``, ``decompositions``)."""
    from torch._dynamo.backends.common import aot_autograd as factory

    return factory(**kwargs)


def inductor_decompositions() -> Callable[[], Any]:
    """Inductor's ``select_decomp_table``: AOTAutograd calls it for the table when it needs it."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table


def guard_cpp_loop_split() -> None:
    """Keep Inductor's C++ (CPU) loop split off the fused groups it mishandles; idempotent.

    ``CppScheduling.try_loop_split`` (torch 2.11-2.13 at least) splits a loop ``i`` indexed as
    ``i // d`` into ``d * i0 + i1`` to avoid a division in the inner loop. It does not check that
    ``d`` divides the loop's size: for a size that is no multiple of ``d`` the split loop runs
    ``d * (size // d)`` times and the tail is never written (seen as wrong FP8 bytes of a 1x128
    quantize of a (2, 200, 136) stack, K = 136). And it checks that the fused nodes have as many
    loop dimensions as each other, not the same sizes: two nodes of shapes (512, 128) and
    (128, 512), a quantize's rowwise and columnwise copies fused into one kernel, end in
    ``AssertionError: ({y0: 512, y1: 1, y2: 128}, {y0: 128, y1: 4, y2: 128})`` (torch 2.13;
    2.11 has no assertion there). The guard leaves such groups unsplit, as torch itself does
    for any group it cannot split; every other group is split as before. It wraps the method
    on torch's class, so it holds for every compile in the process once installed (by
    ``fp8.inductor.post_grad_pass``): only the groups above compile differently.
    """
    try:
        from torch._inductor.codegen import cpp
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    scheduling = getattr(cpp, "CppScheduling", None)
    split = getattr(scheduling, "try_loop_split", None)
    if split is None or getattr(split, "graphpass_guard", False):
        return

    def try_loop_split(self: Any, nodes: Any) -> Any:
        return nodes if _loop_split_unsafe(nodes) else split(self, nodes)

    try_loop_split.graphpass_guard = True  # type: ignore[attr-defined]
    scheduling.try_loop_split = try_loop_split


def _loop_split_unsafe(nodes: Any) -> bool:
    """Whether the fused ``nodes`` have loops of different sizes, or a loop ``i`` indexed as
    ``i // d`` whose size ``d`` may not divide (``guard_cpp_loop_split``)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    sizes = set()
    for node in nodes:
        buffer = getattr(node, "node", None)
        if not hasattr(buffer, "get_default_sizes_body"):
            return False  # not a group torch splits (it asserts ComputedBuffers): its decision
        (index_size, _), body, _ = buffer.get_default_sizes_body()
        sizes.add(tuple(index_size))
        for expr in body.indexing_exprs.values():
            if not isinstance(expr, sympy.Expr):
                continue
            for div in expr.find(FloorDiv):
                var, divisor = div.args
                size = body.var_ranges.get(var)  # None: the dividend is no loop variable
                if size is None:
                    continue
                divides = (isinstance(divisor, sympy.Integer)
                           and isinstance(size, (int, sympy.Integer))
                           and int(size) % int(divisor) == 0)
                if not divides:
                    return True
    return len(sizes) > 1


def guard_cpp_bf16_transpose() -> None:
    """Compile Inductor's C++ (CPU) code with ``-fno-dse`` where the compiler otherwise gets its
    512-bit bf16 tile transpose wrong (``_cpp_bf16_tile_transpose_miscompiled``); idempotent.

    A columnwise copy is a transposed load: on an AVX-512 CPU Inductor's C++ code reads a bf16
    input in 32x32 tiles, each through ``transpose_mxn<at::BFloat16, 32, 32>`` into a stack
    buffer (ATen's ``vec512_bfloat16.h``, torch 2.11 and 2.13 alike). GCC 12.2 (Debian 12's g++)
    at Inductor's -O3 gives wrong code for a kernel that calls it twice, two columnwise copies
    fused into one kernel (the wgrad operands of ``o_proj`` in the tiny Llama's backward): it
    clones the function for the constant sizes (ipa-cp), turns the loop that stores the
    transposed rows into ``memcpy(dst, d, 2048)`` from the local ``__m512i d[32]`` and expands it
    inline as ``rep movsq``; its RTL dead-store elimination then deletes the stores of ``d[1..30]``
    that the copy reads. The tile is stack garbage, NaN FP8 bytes among it (tens of thousands of
    NaNs in o_proj's weight gradient, a different count each run). Plain ``torch.compile`` of
    ``a.t().contiguous(), b.t().contiguous()`` on two bf16 (128, 256) tensors is wrong the same
    way; a kernel with one transpose inlines it and is right, and so is an AVX2 CPU (16x16 tiles,
    another code path). ``-fno-dse`` keeps those stores (as do -fno-ipa-cp-clone,
    -fno-tree-loop-distribute-patterns or -O2); it changes no arithmetic, so every kernel keeps
    its bits, and the fused quantizes stay fused at full vector width. Inductor has no setting
    for the compiler's flags: the guard wraps ``cpp_builder._get_optimization_cflags``, which
    every C++ build's command line (part of each kernel's cache key) takes its -O flags from,
    so it holds for every compile in the process once installed (by the backend, where it
    inlines quantizes). Where the probe passes (no AVX-512, a 256-bit ``simdlen``, a compiler
    that gets it right) nothing is installed and nothing changes."""
    try:
        from torch._inductor import cpp_builder
    except ImportError:  # pragma: no cover - every supported torch has it
        return
    cflags = getattr(cpp_builder, "_get_optimization_cflags", None)
    if cflags is None or getattr(cflags, "graphpass_guard", False):
        return
    if not _cpp_bf16_tile_transpose_miscompiled():
        return
    is_gcc = getattr(cpp_builder, "_is_gcc", lambda compiler: True)

    def optimization_cflags(cpp_compiler: str, *args: Any, **kwargs: Any) -> Any:
        flags, ldflags = cflags(cpp_compiler, *args, **kwargs)
        if is_gcc(cpp_compiler) and "fno-dse" not in flags:
            flags = [*flags, "fno-dse"]
        return flags, ldflags

    optimization_cflags.graphpass_guard = True  # type: ignore[attr-defined]
    cpp_builder._get_optimization_cflags = optimization_cflags


_TRANSPOSE_PROBE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C" void kernel(const at::BFloat16* in_ptr0, const at::BFloat16* in_ptr1,
                       at::BFloat16* out_ptr0, at::BFloat16* out_ptr1)
{
    #pragma omp parallel
    {
        #pragma omp for
        for (int64_t x0 = 0; x0 < 64; x0 += 32)
            for (int64_t x1 = 0; x1 < 64; x1 += 32)
            {
                alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp0[32*32];
                transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr0 + x0 + 64L*x1, 64L, tmp0, 32L);
                for (long x0_inner = 0; x0_inner < 32; x0_inner++)
                {
                    auto tmp1 = at::vec::Vectorized<at::BFloat16>::loadu(tmp0 + 32L*x0_inner, 32);
                    tmp1.store(out_ptr0 + x1 + 64L*x0 + 64L*x0_inner, 32);
                }
            }
        #pragma omp for
        for (int64_t x0 = 0; x0 < 64; x0 += 32)
            for (int64_t x1 = 0; x1 < 64; x1 += 32)
            {
                alignas(std::max(std::size_t(32), alignof(at::BFloat16))) at::BFloat16 tmp0[32*32];
                transpose_mxn<at::BFloat16, 32, 32, false>(in_ptr1 + x0 + 64L*x1, 64L, tmp0, 32L);
                for (long x0_inner = 0; x0_inner < 32; x0_inner++)
                {
                    auto tmp1 = at::vec::Vectorized<at::BFloat16>::loadu(tmp0 + 32L*x0_inner, 32);
                    tmp1.store(out_ptr1 + x1 + 64L*x0 + 64L*x0_inner, 32);
                }
            }
    }
}
"""


def _cpp_bf16_tile_transpose_miscompiled() -> bool:
    """Whether Inductor's C++ toolchain here, at the vector width it picks now, miscompiles its
    32x32 bf16 tile transpose (``guard_cpp_bf16_transpose``): only with 512-bit vectors, found
    by compiling and running the kernel Inductor writes for two transposed bf16 copies (its own
    compiler, flags and code cache: about 1 s of g++ once per machine, a load afterwards)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = pick_vec_isa()
    except Exception:  # pragma: no cover - no C++ vector ISA: no 32x32 tiles
        return False
    if not isa or isa.bit_width() != 512:
        return False
    return _transpose_probe_fails(str(isa))


@functools.lru_cache(maxsize=None)
def _transpose_probe_fails(isa: str) -> bool:
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    try:
        kernel = CppPythonBindingsCodeCache.load_pybinding(
            ["const at::BFloat16*"] * 2 + ["at::BFloat16*"] * 2, _TRANSPOSE_PROBE)
    except Exception:  # pragma: no cover - no compiler: Inductor's CPU code fails on its own
        return False
    a = torch.arange(64 * 64, dtype=torch.float32).view(64, 64).to(torch.bfloat16)
    b = -a
    out_a, out_b = torch.empty_like(a), torch.empty_like(b)
    kernel(a, b, out_a, out_b)
    return not (torch.equal(out_a, a.t()) and torch.equal(out_b, b.t()))


def custom_graph_pass_base() -> type:
    from torch._inductor.custom_graph_pass import CustomGraphPass

    return CustomGraphPass


def inductor_pattern_matcher() -> Any:
    """Inductor's pattern matcher module (``PatternMatcherPass``, ``register_graph_pattern``...);
    slow to import, so on first use."""
    from torch._inductor import pattern_matcher

    return pattern_matcher


@functools.lru_cache(maxsize=1)
def inductor_lowering_tables() -> tuple[Any, frozenset[Any], frozenset[Any]]:
    """Inductor's op tables (``torch._inductor.lowering``): the ops it lowers to its own IR, the
    ops it runs as extern fallback kernels, and the ops whose inputs it materializes (GEMMs,
    convolutions, attention). Slow to import, so on first use."""
    from torch._inductor import lowering

    return (lowering.lowerings, frozenset(lowering.fallbacks),
            frozenset(lowering.needs_realized_inputs))


def register_persistent_outputs(op: Any) -> None:
    """Lower ``op`` (an OpOverload) as Inductor's extern fallback kernel whose outputs Inductor
    never reuses: no later buffer is allocated in their memory and no kernel updates them in
    place once the graph stops reading them (``GraphLowering.never_reuse_buffers``, read by the
    wrapper's ``can_reuse``). For an op whose outputs outlive the graph (the weight cache's
    copies). Idempotent."""
    from torch._inductor import lowering
    from torch._inductor.virtualized import V
    from torch.utils import _pytree

    if getattr(lowering.lowerings.get(op), "graphpass_persistent", False):
        return
    fallback = lowering.fallback_handler(op, add_to_fallback_set=False)

    def lower(*args: Any, **kwargs: Any) -> Any:
        outputs = fallback(*args, **kwargs)
        for out in _pytree.tree_leaves(outputs):
            if hasattr(out, "get_name"):
                V.graph.never_reuse_buffers.add(out.get_name())
        return outputs

    lowering.register_lowering(op, type_promotion_kind=None)(lower)
    lowering.lowerings[op].graphpass_persistent = True


# The ops that make Inductor realize an elementwise value read more than once, on a CPU
# (``StorageBox.should_realize_on_reuse``'s ``heavy_ops``): 2.13 and 2.15 list these seven, 2.11
# only exp and sigmoid (2.12 not checked).
INDUCTOR_REALIZE_HEAVY_OPS = frozenset(
    ("aten.exp", "aten.sigmoid") if TORCH_VERSION < (2, 13) else
    ("aten.exp", "aten.log", "aten.log10", "aten.log1p", "aten.log2", "aten.sigmoid", "aten.tanh"))


def register_backend(name: str, compiler_fn: Callable[..., Any]) -> None:
    """Register a torch.compile backend name, unless it is registered already. Not through
    ``torch._dynamo.list_backends``: that imports every backend module torch has, a second or so
    on every ``import graphpass``."""
    from torch._dynamo.backends import registry

    if name not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=compiler_fn, name=name)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype,
              use_fast_accum: bool = False) -> torch.Tensor:
    """torch's FP8 GEMM (``torch._scaled_mm``), tensorwise or rowwise scales. torch 2.11's CPU
    kernel (oneDNN) takes one scale per tensor only: there a rowwise call is its arithmetic, the
    dequantized operands multiplied in fp32 and rounded once (what 2.13's CPU kernel computes)."""
    if (a.device.type == "cpu" and TORCH_VERSION < (2, 13)
            and (scale_a.numel() != 1 or scale_b.numel() != 1)):
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def blockwise_scaled_mm_missing() -> str | None:
    """None where this torch has the blockwise FP8 GEMM (``torch.nn.functional.scaled_mm`` with
    ``ScalingType.BlockWise1x128``/``BlockWise128x128``, torch >= 2.10), else why not."""
    functional = torch.nn.functional
    scaling = getattr(functional, "ScalingType", None)
    if not hasattr(functional, "scaled_mm") or scaling is None or not all(
            hasattr(scaling, n) for n in ("BlockWise1x128", "BlockWise128x128")):
        return (f"torch {TORCH_VERSION_STR} has no blockwise FP8 GEMM "
                "(torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128, torch >= 2.10)")
    return None


def blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
                        recipe_a: str, scale_b: torch.Tensor, recipe_b: str,
                        out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    """torch's blockwise FP8 GEMM ``a @ b``: a (M, K) row-major, b (K, N) column-major; the
    recipes are ``ScalingType`` member names."""
    functional = torch.nn.functional
    return functional.scaled_mm(a, b, scale_a, getattr(functional.ScalingType, recipe_a),
                                scale_b, getattr(functional.ScalingType, recipe_b),
                                output_dtype=out_dtype, use_fast_accum=use_fast_accum)


def cuda_version() -> tuple[int, int] | None:
    """The CUDA version this torch was built with, (major, minor), or None for a CPU build."""
    if not torch.version.cuda:
        return None
    return tuple(int(p) for p in torch.version.cuda.split(".")[:2])  # type: ignore[return-value]


def has_scaled_grouped_mm() -> bool:
    """Whether this torch has ``torch._scaled_grouped_mm`` (2.11.0, 2.13.0 and 2.14.1 all do, with
    one schema: ``(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None,
    out_dtype=None, use_fast_accum=False)``; CUDA kernels only, E4M3 operands, fp32 rowwise
    scales)."""
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor,
                      out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``): a (T, K) row-major, b (G, K, N)
    column-major, scale_a (T,), scale_b (G, N), token groups ending at ``offs``."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype,
                                    use_fast_accum=use_fast_accum)


def in_user_checkpoint(node: fx.Node) -> bool:
    """Inside the user's own checkpoint region (``torch.utils.checkpoint``, a selective-checkpoint
    policy): torch marks its nodes with ``meta["ac_graph_id"]`` beside their ``recompute`` tag."""
    return "ac_graph_id" in node.meta


def copy_checkpoint_tags(source: fx.Node, to: fx.Node) -> None:
    """Put ``to`` in ``source``'s checkpoint region, with its policy, if it is in one."""
    for key in ("recompute", "ac_graph_id"):
        if key in source.meta:
            to.meta[key] = source.meta[key]


def mark_for_offload(node: fx.Node) -> None:
    """Ask torch's activation offloading (``enable_activation_offloading``) to offload the node's
    output if it is saved."""
    node.meta["should_offload"] = True
