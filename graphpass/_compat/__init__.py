"""torch's internals, in one package: every private torch module graphpass touches
(``torch._inductor``, ``torch._functorch``, ``torch._dynamo``, ``torch._guards``,
``torch._subclasses``, ``torch._ops``, ``torch._C``, ``torch._prims_common``,
``torch.utils._pytree``, ``torch.testing._internal``...) is reached from here and nowhere else
(``tests/test_layering.py::test_private_torch_modules_only_in_compat``).

For torch 2.11 through 2.15 (``pyproject.toml``: ``torch>=2.11,<2.16``). CI runs the whole suite
on 2.13.0, 2.11.0 and 2.15.0 (``.ci/run``); 2.14.1 runs by ``make test TORCH=2.14.1``; 2.12 is
not tested.

One module per concern; this package re-exports their functions, so callers write
``_compat.size_hint(...)`` whichever module holds it:

* ``versions``: the version shims, where torch versions differ (size hints, FLOP formulas,
  random ops, Inductor's rounding and realization rules, the CUDA build);
* ``partitioner``: torch's min-cut call, its settings for one partition, its failures;
* ``partitioner_patch``: graphpass's process-global patches of torch's partitioner module, and
  when each could be removed;
* ``inductor``, ``inductor_cpp``: Inductor's hooks, config and op tables; the guards of its C++
  code generation;
* ``dynamo``: torch.compile's front end (the frame being compiled, backends, fake tensors);
* ``distributed``: DTensor's internals, functional collectives, the fake process group's store;
* ``ops``: op classes and names, storages, memory layout, pytrees.

What is not torch's internals lives with its readers: the vocabulary of AOTAutograd's joint graph
and of the partitioned graphs (``Side``, primals, tangents, checkpoint and offload markers) in
``graph/joint.py``; torch's FP8 GEMMs (``torch._scaled_mm``, ``torch._scaled_grouped_mm``,
``torch.nn.functional.scaled_mm``) in ``fp8/torch_gemms.py``, beside the providers that call them.

Everything version-specific is called with keyword arguments, so that a signature change upstream
fails loudly in one module instead of silently elsewhere.
"""

from __future__ import annotations

from .distributed import (dtensor_from_local, dtensor_local, fake_store,
                          fsdp_all_gather_extension, fsdp_param_dtypes, fsdp_shard_params,
                          functional_collective, is_dtensor, is_fsdp_module)
from .dynamo import (aot_autograd, backend_value_error, compile_id, compiled_frame,
                     fake_tensor_mode, frame_scopes, frame_varargs, fsdp_managed_input,
                     placeholder_source, register_backend, unlimited_recompiles)
from .inductor import (compile_fx, control_dependencies, custom_graph_pass_base,
                       custom_partitioner_base, inductor_config, inductor_decompositions,
                       inductor_lowering_tables, inductor_partition_fn, inductor_pattern_matcher,
                       register_persistent_outputs, remove_noop_ops)
from .inductor_cpp import guard_cpp_bf16_transpose, guard_cpp_loop_split
from .ops import (DISABLED_TORCH_FUNCTION, has_storage, is_higher_order,
                  is_non_overlapping_and_dense, is_op_overload, op_name, storage_id,
                  tensor_metadata, tree_leaves, tree_map)
from .partitioner import min_cut_dumps, min_cut_failure, min_cut_partition, min_cut_settings
from .partitioner_patch import MinCutDumps
from .versions import (INDUCTOR_REALIZE_HEAVY_OPS, TORCH_VERSION, TORCH_VERSION_STR,
                       UNBACKED_SIZE_HINT, assumed_sizes, assumed_sizes_why, cuda_version,
                       flop_formula, inductor_rounds_fused_casts, is_rng_op, size_hint)

__all__ = [
    "DISABLED_TORCH_FUNCTION", "INDUCTOR_REALIZE_HEAVY_OPS", "MinCutDumps", "TORCH_VERSION",
    "TORCH_VERSION_STR",
    "UNBACKED_SIZE_HINT", "aot_autograd", "assumed_sizes", "assumed_sizes_why",
    "backend_value_error", "compile_fx", "compile_id", "compiled_frame", "control_dependencies",
    "cuda_version",
    "custom_graph_pass_base", "custom_partitioner_base", "dtensor_from_local", "dtensor_local",
    "fake_store", "fake_tensor_mode", "flop_formula", "frame_scopes", "frame_varargs",
    "fsdp_all_gather_extension", "fsdp_managed_input", "fsdp_param_dtypes",
    "fsdp_shard_params", "functional_collective", "guard_cpp_bf16_transpose", "guard_cpp_loop_split", "has_storage",
    "inductor_config", "inductor_decompositions", "inductor_lowering_tables",
    "inductor_partition_fn", "inductor_pattern_matcher", "inductor_rounds_fused_casts",
    "is_dtensor", "is_fsdp_module", "is_higher_order", "is_non_overlapping_and_dense", "is_op_overload",
    "is_rng_op", "min_cut_dumps", "min_cut_failure", "min_cut_partition", "min_cut_settings",
    "op_name", "placeholder_source", "register_backend", "register_persistent_outputs",
    "remove_noop_ops", "size_hint", "storage_id", "tensor_metadata", "tree_leaves", "tree_map",
    "unlimited_recompiles",
]
