"""torch's min-cut partitioner: the call (``min_cut_partition``), its settings for one partition
(``min_cut_settings``), its failures and their debug files. The patches of torch's partitioner
module these calls make are ``partitioner_patch``'s."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.fx as fx

from .partitioner_patch import MinCutDumps, debug_files_in, random_ops_only


def min_cut_partition(
    joint: fx.GraphModule,
    joint_inputs: Any,
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    compiler: str = "inductor",
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut rematerialization partitioner (same signature in 2.11 through 2.15).

    A recomputed random op runs in the backward under an RNG state the forward saves for it. On
    torch 2.11 and 2.13 the partitioner does that for dropout-free attention too, saving a CPU
    generator state (5,056 B) per recomputed attention that replays no random number; there
    graphpass hides such ops from the partitioner's RNG functionalization, so every version saves
    the same tensors as 2.14, which skips them itself (``is_rng_op``;
    ``partitioner_patch.random_ops_only``).
    """
    from torch._functorch import partitioners

    with random_ops_only(partitioners):
        return partitioners.min_cut_rematerialization_partition(
            joint,
            joint_inputs,
            compiler=compiler,
            num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices,
        )


@contextlib.contextmanager
def min_cut_dumps() -> Iterator[MinCutDumps]:
    """torch's min-cut writes its debug files, when it fails, into a temporary directory rather
    than the working directory (``partitioner_patch.debug_files_in``)."""
    from torch._functorch import partitioners

    with debug_files_in(partitioners) as dumps:
        yield dumps


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
