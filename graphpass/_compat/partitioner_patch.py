"""graphpass's monkeypatches of torch's partitioner (``torch._functorch.partitioners``), process
global: each replaces a function of torch's module for the length of one ``with`` (one min-cut
call, ``partitioner.min_cut_partition``) and puts torch's own back after, so any other thread
that partitions a graph in the meantime runs the patched function too.

``random_ops_only``: torch 2.11 and 2.13 save an RNG state (5,056 B on the CPU) for every
recomputed op tagged ``nondeterministic_seeded``, dropout-free attention included, which draws no
random number; the patch hides those ops from the partitioner's RNG functionalization, so every
version saves what 2.14 saves. It can be removed when graphpass's oldest supported torch
(``pyproject.toml``'s ``torch>=``) is 2.14 or later: there torch decides so itself
(``partitioners.is_rng_op``, pytorch/pytorch#187985) and the patch already does nothing
(``versions.is_rng_op``'s own rule goes with it).

``debug_files_in``: torch's min-cut writes its debug files, when it fails, into the working
directory (``partitioners._get_unique_path``, 2.11 through 2.15); the patch sends them to a
temporary directory. It can be removed when torch's min-cut takes a directory for its debug
files (none does up to 2.15), or once graphpass no longer needs them kept out of the user's
working directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Iterator

import torch
import torch.fx as fx

from .versions import is_rng_op


class MinCutDumps:
    """Where torch's min-cut wrote its debug files (``min_cut_failed_graph.txt``, an SVG with
    pydot) when it failed: a temporary directory, made at the first file; None while none."""

    directory: str | None = None


@contextlib.contextmanager
def debug_files_in(partitioners: Any) -> Iterator[MinCutDumps]:
    """Send the debug files torch's min-cut writes when it fails to a temporary directory,
    made at the first file (``MinCutDumps.directory``)."""
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


@contextlib.contextmanager
def random_ops_only(partitioners: Any) -> Iterator[None]:
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
