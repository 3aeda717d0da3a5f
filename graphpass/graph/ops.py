"""Op categories, by the short op names of ``nodes.op_name`` (``aten.mm``): the one place that
says which ops are views, casts, GEMMs, elementwise or bookkeeping. Each category is what one
question needs; they overlap on purpose."""

from __future__ import annotations

# Results that alias their input's storage (torch offloads and counts only the base).
VIEWS = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.permute", "aten.t", "aten.transpose",
    "aten.expand", "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.alias",
    "aten.as_strided", "aten.split", "aten.unbind", "aten.diagonal",
})
# (and the value of a weight FSDP2 all-gathered in FP8, which is its data: fp8/fsdp.py)
CASTS = frozenset({"prims.convert_element_type", "aten._to_copy", "graphpass.fsdp_fp8_weight"})
TRANSPOSES = frozenset({"aten.permute", "aten.t"})
# Results holding their input's data, element for element: views, copies and re-layouts (a saved
# FP8 copy's original is found through them).
SAME_DATA = frozenset({"aten.view", "aten.reshape", "aten._unsafe_view", "aten.permute", "aten.t",
                       "aten.transpose", "aten.clone", "aten.expand", "aten.contiguous"})
# What a GEMM operand passes through on its way from the tensor it reads.
PASS_THROUGH = VIEWS | CASTS | {"aten.clone", "aten.contiguous"}
# Too cheap to mention when recomputed: views, casts, tuple access.
BOOKKEEPING = frozenset({
    "getitem", "aten.view", "aten.permute", "aten.t", "aten.expand", "aten.reshape",
    "aten._unsafe_view", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select",
    "aten.transpose", "aten.alias", "prims.convert_element_type", "aten.clone",
})
# What an activation function decomposes into (plus views and casts).
ELEMENTWISE = frozenset({
    "aten.silu", "aten.gelu", "aten.relu", "aten.sigmoid", "aten.tanh", "aten.erf", "aten.exp",
    "aten.mul", "aten.add", "aten.sub", "aten.div", "aten.neg", "aten.pow", "aten.where",
    "aten.clamp_min", "aten.le", "aten.gt", "aten.view", "aten.reshape", "aten._unsafe_view",
    "aten.permute", "aten.clone", "prims.convert_element_type", "aten._to_copy", "getitem",
    # a fused gate/up GEMM's output split in two (transformers' experts: chunk(2))
    "aten.split", "aten.split_with_sizes",
})
# The GEMMs of linear layers: where an activation chain ends, and what the planner never
# recomputes.
LINEAR_GEMMS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_mm",
                          "graphpass.fp8_gemm"})
# GEMMs behind custom ops of libraries, by op name: the phases of its GEMMs. transformers'
# grouped_mm fallback (its MoE experts where torch's grouped_mm cannot run, e.g. float32 on CPU)
# computes input (T, K) x weight (E, K, N) per group; its backward op both gradients, one GEMM
# each of the same size.
LIBRARY_GEMMS = {
    "transformers.grouped_mm_fallback": ("forward",),
    "transformers.grouped_mm_fallback_backward": ("dgrad", "wgrad"),
}
# Every matrix product, for FP8 coverage: dense, batched, grouped, vector, their FP8 (scaled)
# variants and the libraries' GEMM ops.
GEMM_OPS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten.mv", "aten.addmv",
    "aten.dot", "aten._grouped_mm", "aten._scaled_mm", "aten._scaled_mm_v2",
    "aten._scaled_grouped_mm", "aten._scaled_grouped_mm_v2", "graphpass.fp8_gemm",
    *LIBRARY_GEMMS,
})
FP8_GEMMS = frozenset({"graphpass.fp8_gemm", "aten._scaled_mm", "aten._scaled_mm_v2",
                       "aten._scaled_grouped_mm", "aten._scaled_grouped_mm_v2"})
# Rows of a weight picked per token or per expert (transformers' batched_mm experts), and the
# ops their gradients are scattered back with.
GATHERS = frozenset({"aten.index", "aten.index_select", "aten.embedding", "aten.gather"})
SCATTERS = frozenset({"aten.index_put", "aten._unsafe_index_put", "aten.index_add",
                      "aten.scatter_add", "aten.embedding_dense_backward"})
# Substrings of the ops that make or replay RNG states.
RNG_MARKERS = ("rng", "seed", "philox")
# torch's functional collectives (tensor/sequence parallel graphs): the all-gather, the wait
# that completes any collective, and the layout ops DTensor puts between an all-gather along dim
# 0 and its user (a gather along another dim is a split and a cat), each keeping every element.
COLLECTIVE_GATHERS = frozenset({"_c10d_functional.all_gather_into_tensor"})
COLLECTIVE_WAITS = frozenset({"_c10d_functional.wait_tensor"})
GATHER_LAYOUT = frozenset({
    "aten.view", "aten.reshape", "aten._unsafe_view", "aten.alias", "aten.permute", "aten.t",
    "aten.transpose", "aten.clone", "aten.contiguous", "aten.split", "aten.split_with_sizes",
    "aten.cat",
})
