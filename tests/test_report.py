"""Saved-tensor reports on graphs whose answer was computed by hand."""

import json

import pytest
import torch
import torch.nn as nn
from functorch.compile import aot_function, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import graphpass
from graphpass.graph.saved import saved_rows
from graphpass.report import Report, format_bytes


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 256)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_mlp_exact_saved_set_and_bytes(codegen):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(8, 64)  # does not require grad: fc1 needs no dgrad
    torch.compile(model, backend=graphpass.backend(codegen=codegen))(x).sum().backward()
    report = graphpass.last_report()
    # By hand: fc1 wgrad needs x (8x64 f32 = 2048 B); GELU backward needs fc1's output
    # (8x256 f32 = 8192 B); fc2 wgrad needs GELU's output (8192 B); fc2 dgrad needs fc2.weight
    # (a parameter: 64x256 f32 = 65536 B, listed but not counted). fc1.weight is never needed.
    saved = {(r.module, r.op, r.shape, r.kind, r.bytes) for r in report.rows}
    assert saved == {
        ("input:x", "input", (8, 64), "activation", 2048),
        ("fc1", "aten.addmm", (8, 256), "activation", 8192),
        ("act", "aten.mul", (8, 256), "activation", 8192),
        ("fc2.weight", "input", (64, 256), "parameter", 65536),
    }
    assert report.activation_bytes == 2048 + 8192 + 8192
    assert report.parameter_bytes == 65536
    assert report.bytes_by("dtype") == {"float32": 18432}


class _Keywords(nn.Module):
    """A forward taking its inputs through ``**kwargs``, as transformers' decorated forwards do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)

    def forward(self, **kwargs):
        return (self.fc(kwargs["x"]) * kwargs["scale"]).sum()


def test_plan_takes_keyword_inputs_and_names_them_by_keyword():
    """``graphpass.plan(module, **inputs)``: keyword tensors are faked and passed on as keywords.
    By hand: fc's wgrad saves x, the product's backward (into fc's output) saves scale, 8x64 f32
    = 2048 B each; a keyword input is named by its keyword, whether the forward takes it through
    ``**kwargs`` or names the argument."""
    x, scale = torch.randn(8, 64), torch.randn(8, 64)
    report = graphpass.plan(_Keywords(), x=x, scale=scale)
    assert sorted((r.module, r.bytes) for r in report.rows if r.kind == "activation") == [
        ("input:scale", 2048), ("input:x", 2048)]
    report = graphpass.plan(MLP(), x=x, config=graphpass.Config())
    assert ("input:x", 2048) in {(r.module, r.bytes) for r in report.rows}


def test_views_are_counted_once_per_storage():
    """Saved h and a view of h: the storage is counted once, the view names its base."""
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(8, 16))

        def fw(x):
            h = x.exp()
            return h.sum(), h, h.view(-1), h.t()

        fw_gm = make_fx(fw)(x)

    def bw(h, h_flat, h_t, tangent):
        return (h * tangent + h_flat.view(8, 16) + h_t.t(),)

    with FakeTensorMode():
        bw_gm = make_fx(bw)(torch.empty(8, 16), torch.empty(128), torch.empty(16, 8), torch.empty(()))
    # Rename the backward placeholders as the partitioner does: same names as the fw outputs.
    saved_names = [n.name for n in fw_gm.graph.find_nodes(op="output")[0].args[0][1:]]
    for ph, name in zip(bw_gm.graph.find_nodes(op="placeholder"), saved_names):
        ph.name = name

    rows = saved_rows(fw_gm, bw_gm, num_fwd_outputs=1, static_input_names=set(), input_sources={})
    assert [(r.name, r.bytes, r.tensor_bytes, r.alias_of) for r in rows] == [
        ("exp", 512, 512, ""),
        ("view", 0, 512, "exp"),
        ("t", 0, 512, "exp"),
    ]
    assert Report(rows=rows).activation_bytes == 512
    assert [r.consumers for r in rows] == [("aten.mul",), ("aten.view",), ("aten.t",)]


def test_parameter_views_are_parameters():
    """A saved transpose of a weight aliases the parameter: listed, never counted."""
    model = nn.Linear(16, 32, bias=False)
    x = torch.randn(4, 16, requires_grad=True)
    torch.compile(model, backend=graphpass.backend(codegen="eager"))(x).sum().backward()
    report = graphpass.last_report()
    params = [r for r in report.rows if r.kind == "parameter"]
    assert [(r.module, r.shape) for r in params] == [("weight", (32, 16))]
    assert report.parameter_bytes == 32 * 16 * 4
    assert report.activation_bytes == 4 * 16 * 4  # x, for wgrad


def test_partition_fn_for_aot_function():
    def f(x, w):
        return (x @ w).sin()

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    nop = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    out = aot_function(f, fw_compiler=nop, bw_compiler=nop, partition_fn=graphpass.partition)(x, w)
    out.sum().backward()
    ref_x, ref_w = x.detach().requires_grad_(), w.detach().requires_grad_()
    f(ref_x, ref_w).sum().backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(w.grad, ref_w.grad)
    report = graphpass.last_report()
    # sin backward needs mm (8x32 f32); wgrad needs x.t() and dgrad w.t(), views of the inputs
    # (aot_function passes no parameters, so both count as activations).
    assert [(r.op, r.shape, r.bytes) for r in report.rows] == [
        ("aten.mm", (8, 32), 1024), ("aten.t", (16, 8), 512), ("aten.t", (32, 16), 2048)]
    assert report.activation_bytes == 1024 + 512 + 2048


def test_json_round_trip_and_table():
    model = MLP()
    torch.compile(model, backend=graphpass.backend(codegen="eager"))(torch.randn(8, 64)).sum().backward()
    report = graphpass.last_report()
    again = Report.from_json(report.to_json())
    assert again.rows == report.rows and again.activation_bytes == report.activation_bytes
    data = json.loads(report.to_json())
    assert data["meta"]["config"]["codegen"] == "eager"
    assert data["meta"]["graphpass"] == graphpass.__version__
    table = report.table()
    assert "fc1" in table and "18.00 KiB (18,432 B)" in table
    header, rule = table.splitlines()[:2]
    starts = [i for i in range(1, len(rule)) if rule[i - 1] == " " and rule[i] == "-"]
    assert all(header[i - 1] == " " and header[i] != " " for i in starts)  # columns aligned


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 3 << 20, 5 << 30)] == [
        "512 B", "2.00 KiB", "3.00 MiB", "5.00 GiB"]
