"""graphpass's Transformer Engine provider against the installed TE's real API.

Skipped unless ``transformer_engine.pytorch`` imports (``scripts/te_env.sh`` builds such an
environment; no GPU needed). Without a GPU TE runs no kernel, so these check what can be checked
on CPU: every entry point graphpass calls exists and takes the keywords graphpass passes, the
dtype enums exist, and the operands graphpass hands TE dequantize (TE's CPU fallback) to what
graphpass's own recipe says. Test names contain ``te_`` so that ``-k te_`` selects them.
"""

import importlib
import inspect

import pytest
import torch

from graphpass.fp8 import providers, recipes

pytestmark = [
    pytest.mark.te,
    pytest.mark.skipif(not providers.te_available(),
                       reason="transformer_engine.pytorch does not import"),
]


def _te_calls() -> dict[str, tuple[str, ...]]:
    from graphpass.fp8 import te

    return te.CALLS


@pytest.mark.parametrize("path", list(_te_calls()))
def test_te_call_accepts_graphpass_keywords(path):
    module, _, name = path.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    signature = inspect.signature(fn)
    params = signature.parameters
    # A **kwargs catch-all would accept any name, so it must not hide a misspelt keyword.
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    missing = [k for k in _te_calls()[path] if k not in params or params[k].kind not in by_keyword]
    assert not missing, f"{path}{signature} takes no keyword(s) {missing}"


def test_te_dtype_enums():
    import transformer_engine_torch as tex

    from graphpass.fp8.te import TransformerEngine

    provider = TransformerEngine()  # its __init__ only imports, so it constructs on CPU
    assert provider._te_dtype == {torch.float8_e4m3fn: tex.DType.kFloat8E4M3,
                                  torch.float8_e5m2: tex.DType.kFloat8E5M2}


def test_te_provider_supports():
    from graphpass.fp8.te import TransformerEngine

    provider = TransformerEngine()
    assert provider.supports("tensorwise", torch.device("cuda")) is None
    assert "CUDA" in provider.supports("tensorwise", torch.device("cpu"))
    for recipe in ("blockwise", "mxfp8"):
        assert provider.supports(recipe, torch.device("cuda"))


@pytest.mark.parametrize("role", ["input", "weight", "grad"])
def test_te_operand_dequantizes_like_the_recipe(role):
    """The storage graphpass wraps its operands in means what graphpass means: data * scale_inv."""
    from graphpass.fp8.te import TransformerEngine

    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3
    data, scale_inv = recipes.quantize(x, "tensorwise", role)
    storage = TransformerEngine()._wrap(data, scale_inv)
    torch.testing.assert_close(storage.dequantize(dtype=torch.float32),
                               recipes.dequantize(data, scale_inv, "tensorwise", role),
                               rtol=0, atol=0)


def test_te_grouped_gemm_operands_mean_the_reference(monkeypatch):
    """The TE storages graphpass builds for the experts' grouped GEMMs (per-group slices, tokens
    zero-padded to 16, scales copied into their own allocations) dequantize, by TE's own code, to
    what the reference provider multiplies. TE's kernels need a GPU, so TE's grouped GEMM is
    computed here from the operands exactly as graphpass hands them to it."""
    from test_fp8_experts import _compiled_token_groups

    from graphpass.fp8 import providers
    from graphpass.fp8.te import TransformerEngine

    calls, real_get = [], providers.get
    te = TransformerEngine()

    def grouped(A, B, out, *, quantization_params, out_dtype, layout, single_output,
                use_split_accumulator):
        calls.append(len(A))
        for a, b, o in zip(A, B, out):  # TN: out = B @ A.T
            o.copy_((b.dequantize(dtype=torch.float32) @ a.dequantize(dtype=torch.float32).t())
                    .to(o.dtype))
        return out, None, None

    te._grouped_gemm = grouped
    te.supports = lambda recipe, device: None
    ref = _compiled_token_groups("tensorwise", "reference", "cpu")
    monkeypatch.setattr(providers, "get", lambda name: te if name == "te" else real_get(name))
    got = _compiled_token_groups("tensorwise", "te", "cpu")
    assert calls == [3, 3, 3]  # forward, dgrad, wgrad: each one grouped call of 3 groups
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # wgrad over zero-padded tokens: fp32 sums in another order, one bf16 ulp apart (or a few
    # fp32 ulps where they cancel to near 0: 1.9e-6 seen on torch 2.11)
    torch.testing.assert_close(got[2], ref[2], rtol=2**-7, atol=1e-5)


_AFTER_CUDNN = """
import torch, torch.nn.functional as F
q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
    F.scaled_dot_product_attention(q, q, q).sum().item()  # torch has used its cuDNN
from graphpass.fp8 import providers
status = providers.te_status()
folders = sorted({line.split()[-1].rsplit("/", 1)[0] for line in open("/proc/self/maps")
                  if "/libcudnn" in line})
print(status.describe(), folders)
assert status.version is not None, status.describe()
assert len(folders) == 1, folders
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_imports_after_torch_used_cudnn_on_gpu():
    """TE imported once torch has run cuDNN attention (a compile with ``kernels="te"`` after
    bf16 steps, as the GPU report runs): it imports, and every cuDNN library in the process is
    from one folder. On the H200 image, without graphpass pointing TE at torch's cuDNN, the
    system's ``libcudnn_heuristic.so.9`` was loaded beside torch's ``libcudnn_graph.so.9`` and
    the import failed. A fresh interpreter: this one has imported TE already."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _AFTER_CUDNN], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_te_modules_compiled_with_graphpass_on_gpu():
    """TE's own modules (``te.LayerNormLinear``, ``te.Linear``) beside a torch linear, compiled
    with graphpass in FP8: the step runs, its gradients are eager's within bf16's rounding plus
    the FP8 linear's bound, the torch linear is lowered, and each TE module has one note: its
    ops ``left to Transformer Engine`` where TE traces it as its own custom ops (TE 2.20 on a
    torch with opaque constant types), else ``outside the graph`` (TE keeps it from Dynamo).
    Whichever happened is printed, for the issue's note."""
    import graphpass
    from graphpass import What

    te = importlib.import_module("transformer_engine.pytorch")

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            kw = dict(params_dtype=torch.bfloat16, device="cuda")
            self.ln_fc1 = te.LayerNormLinear(256, 512, **kw)
            self.fc2 = te.Linear(512, 256, **kw)
            self.out = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

        def forward(self, x):
            return self.out(self.fc2(torch.nn.functional.gelu(self.ln_fc1(x))))

    def step(model, run):
        torch.manual_seed(1)
        x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        run(x).float().square().mean().backward()
        grads = [x.grad, *(p.grad for p in model.parameters())]
        model.zero_grad(set_to_none=True)
        return grads

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Model()
    eager = step(model, model)
    backend = graphpass.backend(fp8="tensorwise", kernels="scaled_mm")
    compiled = step(model, torch.compile(model, backend=backend))
    report = backend.report()
    notes = [n for n in report.notes if n.startswith(("left to", "outside the graph"))]
    print(f"{report.graphs} graph(s); " + "; ".join(notes))
    for module in ("ln_fc1", "fc2"):
        said = [d for d in report.decisions if d.module == module
                and d.what in (What.LIBRARY_OPS, What.OUTSIDE_GRAPH)]
        assert len(said) == 1 and said[0].by == "Transformer Engine", (module, notes)
    assert "lowered: out (scaled_mm/tensorwise)" in report.notes, report.notes
    for e, c in zip(eager, compiled):
        assert torch.isfinite(c).all()
        torch.testing.assert_close(c.float(), e.float(), rtol=0.1, atol=0.02 * e.abs().max())
