"""Every entry point gives one answer: the same layer traced through ``aot_function``,
``aot_module``, the backend and ``plan`` saves the same bytes, whatever aliases the trace adds.

``aot_function`` with Inductor's decompositions turns the attention backward's ``detach`` into an
``aten.alias`` of the attention output; before the canonicalize pass, torch's min-cut saved that
alias *and* the o-projection's FP8 columnwise copy of the same tensor (one seq x hidden byte more
than ``plan``). The alias test pins that case on a graph small enough to read.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, aot_module, make_boxed_func
from torch._inductor.decomposition import select_decomp_table

import graphpass

CONFIG = graphpass.Config(fp8="tensorwise")


def _run_as_is(gm, _inputs):
    return make_boxed_func(gm.forward)


def _partition_marking(n_params: int):
    """The docs' wrapper: parameters come first and are static."""
    def partition_fn(joint, joint_inputs, **kwargs):
        kwargs["static_lifetime_input_indices"] = list(range(n_params))
        return graphpass.partition(joint, joint_inputs, config=CONFIG, **kwargs)
    return partition_fn


def _aot_function(model, x, decompositions):
    params = dict(model.named_parameters())

    def f(p, x):
        return torch.func.functional_call(model, p, (x,))

    g = aot_function(f, fw_compiler=_run_as_is, bw_compiler=_run_as_is,
                     partition_fn=_partition_marking(len(params)), decompositions=decompositions)
    return _reported(lambda: g(params, x).sum().backward())


def _aot_module(model, x, decompositions):
    m = aot_module(model, fw_compiler=_run_as_is, bw_compiler=_run_as_is,
                   partition_fn=_partition_marking(len(list(model.parameters()))),
                   decompositions=decompositions)
    return _reported(lambda: m(x).sum().backward())


def _backend(model, x):
    backend = graphpass.backend(fp8="tensorwise", codegen="eager")
    torch.compile(model, backend=backend)(x).sum().backward()
    return backend.report()


def _reported(step):
    """The report of the one graph ``step`` partitions through ``graphpass.partition``."""
    before = graphpass.last_report()
    step()
    assert graphpass.last_report() is not before
    return graphpass.last_report()


@pytest.mark.parametrize("name", ["llama", "gpt", "deepseek"])
def test_every_entry_point_saves_the_same_bytes(name):
    model, (x,) = importlib.import_module(f"graphpass.models.{name}").build("tiny", layers=1,
                                                                     dtype=torch.bfloat16)
    planned = graphpass.plan(model, x, config=CONFIG)
    assert planned.activation_bytes > 0
    expected = (planned.activation_bytes, planned.bytes_by("kind"))
    traced = {
        "aot_function": _aot_function(model, x, None),
        "aot_function + Inductor decompositions": _aot_function(model, x, select_decomp_table()),
        "aot_module": _aot_module(model, x, None),
        "aot_module + Inductor decompositions": _aot_module(model, x, select_decomp_table()),
        "backend": _backend(model, x),
    }
    got = {path: (r.activation_bytes, r.bytes_by("kind")) for path, r in traced.items()}
    assert got == {path: expected for path in traced}


def _attention_then_linear(x, wq, wo):
    """The shape of the bug: SDPA's output read by the SDPA backward and by a lowered linear."""
    b, s, h = x.shape
    q = F.linear(x, wq).view(b, s, 2, h // 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    return F.linear(out.transpose(1, 2).reshape(b * s, h), wo)


def test_alias_of_a_saved_tensor_is_saved_once():
    # x: 1x32x64 bf16 (not static); wq, wo: 64x64 bf16 parameters. The saved set, by hand:
    #   q (SDPA's input, 1x2x32x32 bf16)          4096 B
    #   out (SDPA's output, 1x2x32x32 bf16)       4096 B  read by SDPA's backward and, re-quantized
    #                                                     columnwise, by wo's wgrad: saved once
    #   logsumexp (1x2x32 fp32)                    256 B
    #   x's FP8 columnwise copy (64x32) + scale   2048 + 4 B  (for wq's wgrad; x itself is 4096 B)
    # Before the fix: out saved as its alias, plus out's FP8 columnwise copy (2048 + 4 B more).
    x = torch.randn(1, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    wq = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)
    wo = torch.randn(64, 64, dtype=torch.bfloat16, requires_grad=True)

    def partition_fn(joint, joint_inputs, **kwargs):
        assert any(n.target is torch.ops.aten.alias.default for n in joint.graph.nodes)
        kwargs["static_lifetime_input_indices"] = [1, 2]
        return graphpass.partition(joint, joint_inputs, config=CONFIG, **kwargs)

    f = aot_function(_attention_then_linear, fw_compiler=_run_as_is, bw_compiler=_run_as_is,
                     partition_fn=partition_fn, decompositions=select_decomp_table())
    f(x, wq, wo).sum().backward()
    report = graphpass.last_report()
    assert report.bytes_by("kind") == {"activation": 4096 * 2 + 256, "fp8_data": 2048, "fp8_scale": 4}
    assert report.activation_bytes == 10_500
    assert not [r for r in report.rows if r.op == "aten.alias"]
    fp8 = [r for r in report.rows if r.kind == "fp8_data"]
    # out's copy would be 64x32 too; this one quantizes `view`, the graph's 2-D view of x
    assert [(r.shape, r.copy_of) for r in fp8] == [((64, 32), "view")]
