"""torch.distributed's internals: DTensor's local shard and its construction without
communication, functional collectives, the fake process group's store."""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    """A ``torch.distributed.tensor.DTensor`` (public under that path in 2.11 through 2.15);
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


def fake_store() -> Any:
    """The store of torch's fake process group (a test utility of torch's)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def functional_collective(name: str) -> Any:
    """torch's functional collective op ``name`` (``all_reduce``, ``wait_tensor``), default
    overload: what DTensor's collectives trace into."""
    return getattr(torch.ops._c10d_functional, name).default


def fsdp_all_gather_extension() -> bool:
    """Whether this torch's FSDP2 calls a parameter shard's ``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather`` (its all-gather extension: 2.11 through 2.15 have it)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return False
    return hasattr(FSDPParam, "_init_extensions")


def fsdp_param_dtypes(model: torch.nn.Module) -> dict[int, Any]:
    """The dtype FSDP2 all-gathers each parameter of ``model`` in, by ``id`` of its sharded
    parameter: its ``MixedPrecisionPolicy.param_dtype``, or None for the parameter's own dtype
    (read from each ``fully_shard`` module's parameter group; empty where that is not found)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return {}
    out: dict[int, Any] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        for fsdp_param in getattr(group, "fsdp_params", ()):
            # each parameter's policy from 2.15 (a per-parameter override), the group's before
            policy = getattr(fsdp_param, "mp_policy", None) or getattr(group, "mp_policy", None)
            if policy is not None:  # else unknown: left out, not guessed
                out[id(fsdp_param.sharded_param)] = policy.param_dtype
    return out


def is_fsdp_module(module: torch.nn.Module) -> bool:
    """A module ``fully_shard`` was applied to (FSDP2's ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def fsdp_shard_params(model: torch.nn.Module) -> dict[int, tuple[Any, int]]:
    """For each parameter of ``model`` that FSDP2 shards, by ``id`` of its sharded parameter:
    the mesh FSDP2 all-gathers it over (its shard mesh: the data-parallel mesh, one dimension
    of a 2-D mesh under tensor parallelism) and the dimension it shards (0 unless a
    ``shard_placement_fn`` says otherwise). Empty where that is not found."""
    out: dict[int, tuple[Any, int]] = {}
    for module in model.modules():
        if not is_fsdp_module(module):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            mesh = getattr(fsdp_param, "shard_mesh", None)
            placement = getattr(fsdp_param, "fsdp_placement", None)
            if mesh is not None:
                out[id(fsdp_param.sharded_param)] = (mesh, getattr(placement, "dim", 0))
    return out
