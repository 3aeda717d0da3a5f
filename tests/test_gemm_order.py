"""fp8/gemm_order.py: ``order_backward``'s order of a GPU backward's FP8 GEMMs, as torch's
``control_deps`` constraints on the post-grad graph (each GEMM's operand copies after the GEMM
before it). Checked here on a graph written by hand; ``tests/test_cuda_peak.py`` checks what
it does to Inductor's CUDA code of a Llama-3-8B layer."""

import operator

import pytest
import torch
import torch.fx as fx

from graphpass import _compat
from graphpass.fp8 import gemm_order, ops

pytestmark = pytest.mark.skipif(_compat.control_dependencies() is None,
                                reason="this torch has no control_deps")


def _graph():
    """Three inlined FP8 GEMMs, as ``fp8/inductor.py`` writes them: each data operand a
    ``prims.inductor_force_stride_order`` (the second one seen through a transpose); the third
    GEMM reads the first one's copy again."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers inductor_force_stride_order)

    force = torch.ops.prims.inductor_force_stride_order.default
    mm = torch.ops.aten._scaled_mm.default
    g = fx.Graph()
    x, w, s = g.placeholder("tangents_1"), g.placeholder("w"), g.placeholder("s")
    a1, b1 = g.call_function(force, (x, [1, 0])), g.call_function(force, (w, [1, 0]))
    y1 = g.call_function(mm, (a1, g.call_function(torch.ops.aten.permute.default, (b1, [1, 0])),
                              s, s))
    a2 = g.call_function(force, (y1, [1, 0]))
    b2 = g.call_function(force, (w, [0, 1]))
    y2 = g.call_function(mm, (a2, g.call_function(torch.ops.aten.t.default, (b2,)), s, s))
    a3 = g.call_function(force, (y2, [1, 0]))
    y3 = g.call_function(mm, (a3, b1, s, s))
    g.output((y1, y2, y3))
    return fx.GraphModule(torch.nn.Module(), g)


def test_each_gemms_operand_copies_follow_the_gemm_before_it():
    gm = _graph()
    names = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert gemm_order.operand_copies(gm.graph.find_nodes(
        op="call_function", target=torch.ops.aten._scaled_mm.default)[0]) != []
    ordered = gemm_order.order_gemm_operands(gm.graph)
    # the second GEMM's two copies after the first GEMM, the third's own copy after the second;
    # the first GEMM's weight copy, which the third reads again, stays where it is
    first, second, _ = names
    assert ordered == {"inductor_force_stride_order_default_2": first,
                       "inductor_force_stride_order_default_3": first,
                       "inductor_force_stride_order_default_4": second}
    from torch._inductor.fx_passes.control_dependencies import control_deps

    wrapped = {n.name: n for n in gm.graph.nodes if n.target is control_deps}
    assert set(wrapped) == set(ordered)  # the copies keep their names
    for copy, after in ordered.items():
        assert [d.name for d in wrapped[copy].args[0]] == [after]
    gm.graph.lint()


def test_a_forward_is_left_alone():
    gm = _graph()
    gm.graph.find_nodes(op="placeholder")[0].name = "primals_1"
    assert not gemm_order.is_backward(gm.graph)
    assert gemm_order.order_gemm_operands(gm.graph) == {}


def test_the_step_peak_model_plans_the_same_order_on_the_ops():
    """Before the inlining (the partitioned graphs the step-peak model reads), the copies are
    the quantize ops' outputs: within ``ordered_gemms`` (``order_backward``), each quantize that
    makes a later GEMM's operand runs after the GEMM before it; a quantize two GEMMs read (the
    gradient's, for its data and weight gradients) is placed by the first."""
    g = fx.Graph()
    grad, x, w = g.placeholder("tangents_1"), g.placeholder("x"), g.placeholder("primals_1")

    def quantize(t, role, usage):
        q = g.call_function(ops.QUANTIZE, (t, "tensorwise", role, usage))
        return q, g.call_function(operator.getitem, (q, 0)), g.call_function(operator.getitem,
                                                                              (q, 1))

    qg, gd, gs = quantize(grad, "grad", "both")
    qw, wd, ws = quantize(w, "weight", "columnwise")
    dgrad = g.call_function(ops.FP8_GEMM, (gd, gs, wd, ws, "tensorwise", "grad,weight"))
    qx, xd, xs = quantize(x, "input", "columnwise")
    wgrad = g.call_function(ops.FP8_GEMM, (gd, gs, xd, xs, "tensorwise", "grad,input"))
    qh, hd, hs = quantize(dgrad, "grad", "rowwise")
    again = g.call_function(ops.FP8_GEMM, (hd, hs, wd, ws, "tensorwise", "grad,weight"))
    g.output((dgrad, wgrad, again))
    assert gemm_order.operand_quantizes(dgrad) == [qg, qw]
    assert gemm_order.planned_order(g) == {}  # without order_backward
    with gemm_order.ordered_gemms():
        assert gemm_order.planned_order(g) == {qx: dgrad, qh: wgrad}
        g.find_nodes(op="placeholder")[0].name = "x_grad"  # no tangents: a forward
        assert gemm_order.planned_order(g) == {}


def test_a_graph_with_one_gemm_or_the_op_itself_is_left_alone():
    g = fx.Graph()
    a, b = g.placeholder("tangents_1"), g.placeholder("b")
    q = g.call_function(ops.QUANTIZE, (a, "tensorwise", "grad", "rowwise"))
    data = g.call_function(operator.getitem, (q, 0))
    out = g.call_function(ops.FP8_GEMM, (data, b, data, b, "tensorwise", "grad,weight"))
    g.output(out)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert gemm_order.is_gemm(out) and gemm_order.operand_copies(out) == []
    assert gemm_order.order_gemm_operands(gm.graph) == {}
    assert gemm_order.order_gemm_operands(_graph().graph)  # the hand-written graph is ordered


def test_stored_gradients_store_a_gradients_quantize_input_only():
    """Within ``stored_gradients`` an inlined quantize of a gradient reads it from a buffer of
    its own on CUDA too, and the step-peak model is told (``computes_input_in_loops``)."""
    from graphpass.fp8 import inductor

    g = fx.Graph()
    x = g.placeholder("x")
    with torch._subclasses.fake_tensor.FakeTensorMode():
        x.meta["val"] = torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    grad = g.call_function(ops.QUANTIZE, (x, "tensorwise", "grad", "rowwise"))
    inp = g.call_function(ops.QUANTIZE, (x, "tensorwise", "input", "rowwise"))
    cuda = torch.empty(64, 64, dtype=torch.bfloat16, device="meta")
    assert not inductor._stores_input(cuda, "grad")
    with inductor.stored_gradients():
        assert inductor._stores_input(cuda, "grad") and not inductor._stores_input(cuda, "input")
        assert not inductor.computes_input_in_loops(grad)
        assert inductor.computes_input_in_loops(inp)
    assert inductor.computes_input_in_loops(grad)


def test_an_ops_computed_operands_get_a_realization_to_order():
    """A ``graphpass::fp8_gemm`` op (TE's, cuBLASLt's blockwise GEMM) reads the copies an inlined
    quantize computes: each gets an ``inductor_force_stride_order`` of its own strides (the op
    fixes its inputs' stride order anyway), which the order then constrains like an inlined
    GEMM's. A placeholder operand is left as it is."""
    import torch._inductor.inductor_prims  # noqa: F401

    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    g = fx.Graph()
    grad, w, s = g.placeholder("tangents_1"), g.placeholder("w"), g.placeholder("s")
    with mode:
        for p in (grad, w, s):
            p.meta["val"] = torch.empty(8, 8)
    gemms = []
    source = grad
    for _ in range(2):
        copy = g.call_function(torch.ops.aten.mul.Tensor, (source, s))
        copy.meta["val"] = grad.meta["val"]
        gemm = g.call_function(ops.FP8_GEMM, (copy, s, w, s, "blockwise", "grad,weight"))
        gemm.meta["val"] = grad.meta["val"]
        gemms.append(gemm)
        source = gemm
    g.output(tuple(gemms))
    gm = fx.GraphModule(torch.nn.Module(), g)
    ordered = gemm_order.order_gemm_operands(gm.graph)
    gm.graph.lint()
    force = torch.ops.prims.inductor_force_stride_order.default
    first, second = gm.graph.find_nodes(op="call_function", target=ops.FP8_GEMM)
    held = [first.args[0], second.args[0]]
    assert first.args[2] is w and second.args[2] is w  # placeholders: nothing to realize
    assert held[0].target is force and held[0].args[1] == [8, 1]
    assert held[0].meta["val"] is not held[0].args[0].meta["val"]  # a fake of its own
    assert ordered == {held[1].name: first.name}
