"""The quantize inlining pass traces each kind of quantize once per graph
(``graphpass.fp8.replacements``): the same code and bits as a trace per quantize."""

import re

import pytest
import torch

from graphpass import _compat

pytestmark = pytest.mark.skipif(
    not _compat.inductor_rounds_fused_casts(device_types=["cpu"]),
    reason="this torch's Inductor CPU code does not round fused bf16 values as eager does: "
    "graphpass inlines no quantize on the CPU")


def _compile(monkeypatch, cached: bool):
    """Three tensorwise quantizes (two of one shape) compiled with the inlining pass: outputs,
    Inductor's code, and the replacement traces the pass made."""
    from torch._inductor import config as inductor_config
    from torch._inductor import pattern_matcher
    from torch._inductor.utils import run_and_get_code

    from graphpass.fp8 import inductor, ops, replacements

    traces, inside = [], []
    real_trace, real_inline = pattern_matcher.fwd_only, inductor.inline_quantizes

    def counting_trace(*args, **kwargs):
        if inside:
            traces.append(1)
        return real_trace(*args, **kwargs)

    def inline(graph):
        inside.append(1)
        try:
            return real_inline(graph)
        finally:
            inside.pop()

    monkeypatch.setattr(pattern_matcher, "fwd_only", counting_trace)
    monkeypatch.setattr(inductor, "inline_quantizes", inline)
    if not cached:
        monkeypatch.setattr(replacements, "tracer", lambda kind: None)

    def f(a, b, c):
        return [*ops.quantize(a * 2, "tensorwise", "input", "both"),
                *ops.quantize(b * 2, "tensorwise", "input", "both"),
                *ops.quantize(c + 1, "tensorwise", "input", "rowwise")]

    torch.manual_seed(0)
    args = [torch.randn(64, 32, dtype=torch.bfloat16) for _ in range(2)] + [
        torch.randn(32, 64, dtype=torch.bfloat16)]
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_pre_pass=inductor.post_grad_pass("test", None),
                               emulate_precision_casts=True,
                               **{"eager_numerics.division_rounding": True}):
        out, code = run_and_get_code(torch.compile(f, backend="inductor"), *args)
    monkeypatch.undo()
    code = re.sub(r"# AOT ID: .*", "", "\n".join(code))  # the compile's number in the process
    return out, code, len(traces)


def test_each_kind_of_quantize_is_traced_once_per_graph(monkeypatch):
    out, code, traces = _compile(monkeypatch, cached=True)
    reference, reference_code, reference_traces = _compile(monkeypatch, cached=False)
    assert "graphpass.quantize" not in code
    assert (traces, reference_traces) == (2, 3)  # a's and b's quantizes are one kind
    assert code == reference_code
    for o, r in zip(out, reference):
        assert torch.equal(o.view(torch.uint8) if o.element_size() == 1 else o,
                           r.view(torch.uint8) if r.element_size() == 1 else r)
