"""The FP8 activation cache (``fp8_cache``, issue 12): options, error bounds, exact saved sets,
which value the backward reads, reuse of the FP8 lowering's copies, report rows."""

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.models import llama
from graphpass.decisions import What
from graphpass.fp8 import recipes
from graphpass.fp8.cache import FORMATS, cache_dequantize, cache_quantize, error_bound


class MLP(nn.Module):
    """x (8x256) -> fc1 (256->512) -> GELU -> fc2 (512->256), no biases."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(256, 512, bias=False)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(512, 256, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def _mlp(seed=0):
    torch.manual_seed(seed)
    return MLP(), torch.randn(8, 256, requires_grad=True)


def _activations(report):
    return {(r.module, r.op, r.dtype, r.shape, r.kind, r.bytes) for r in report.rows
            if r.kind != "parameter"}


# --- options --------------------------------------------------------------------------------------

def test_bad_values_name_the_fix():
    with pytest.raises(ValueError, match=r"fp8_activation_cache='everything'; valid values are: "
                                         r"None, 'act_input', 'attn', 'layer_input', 'all'"):
        graphpass.Config(fp8_activation_cache="everything")
    with pytest.raises(ValueError, match="fp8_activation_cache_format='e4m3'; valid values are"):
        graphpass.Config(fp8_activation_cache="all", fp8_activation_cache_format="e4m3")
    unused = graphpass.Config(fp8_activation_cache_format="e5m2_tensor").unused()
    assert [str(u) for u in unused] == [
        "fp8_activation_cache_format='e5m2_tensor' has no effect without "
        "fp8_activation_cache='act_input' (or another level)"]
    with pytest.raises(ValueError,
                       match="fp8_activation_cache_min_bytes=-1; expected a count of 0 or more"):
        graphpass.Config(fp8_activation_cache="all", fp8_activation_cache_min_bytes=-1)
    assert graphpass.Config().fp8_activation_cache is None  # off by default


# --- formats and their error bounds ---------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_bound_holds_and_is_tight(fmt, dtype):
    """|x̂ - x| <= 2**-(m+1) |x| + 2**(e_min-m-1) / s (graphpass/fp8/cache.py), plus the rounding
    back to bf16; elements whose scaled value is normal see at most 2**-(m+1) relative error, and
    some come close to it (the bound is no loose constant)."""
    torch.manual_seed(0)
    # values over 12 binades, zeros, and a row (two blocks) of tiny ones
    x = (torch.randn(3, 5, 256) * torch.exp2(torch.randint(-6, 6, (3, 5, 256)).float()))
    x[0, 0, :7] = 0
    x[1, 2] *= 2.0 ** -30
    x = x.to(dtype)
    data, scale_inv = cache_quantize(x, fmt)
    assert data.shape == x.shape and data.dtype == recipes.fp8_dtype(*FORMATS[fmt])
    back = cache_dequantize(data, scale_inv, fmt, dtype, list(x.stride()))
    assert back.dtype == dtype and back.shape == x.shape
    err = (back.float() - x.float()).abs()
    bound = error_bound(x.float(), fmt)
    if dtype == torch.bfloat16:
        bound = bound + 2.0 ** -9 * back.float().abs()
    assert (err <= bound).all(), (err - bound).max()
    mantissa = 3 if "e4m3" in fmt else 2
    rel = err / x.float().abs().clamp_min(1e-30)
    normal = bound < 2.0 ** -mantissa * x.float().abs()  # the subnormal term is below the relative one
    assert (rel[normal] <= 2.0 ** -(mantissa + 1) * (1 + 2.0 ** -20) + (2.0 ** -9 if dtype != torch.float32 else 0)).all()
    assert rel[normal].max() > 0.8 * 2.0 ** -(mantissa + 1)
    assert (back[x == 0] == 0).all()


def test_pow2_scales_are_e8m0_bytes_and_blocks_are_1x128():
    x = torch.randn(4, 300)
    data, scale = cache_quantize(x, "e4m3_1x128_pow2")
    assert scale.dtype == torch.uint8 and scale.shape == (4, 3)  # ceil(300/128) blocks per row
    _, scale32 = cache_quantize(x, "e4m3_1x128")
    assert scale32.dtype == torch.float32 and scale32.shape == (4, 3)
    assert recipes.e8m0_to_float(scale).log2().frac().eq(0).all()
    _, tensor_scale = cache_quantize(x, "e5m2_tensor")
    assert tensor_scale.shape == ()


# --- exact saved sets, by hand --------------------------------------------------------------------

def test_mlp_act_input_saved_set_by_hand():
    """Exact (float32, torch's default min-cut): fc1 wgrad needs x (8x256 f32, 8192 B), GELU's
    backward fc1's output h (8x512, 16384 B), fc2's wgrad GELU's output (8x512, 16384 B).
    act_input caches h, the GELU input: 8x512 e4m3 (4096 B) and one E8M0 scale per 1x128 block
    (8x4, 32 B); x and GELU's output are no activation inputs and stay."""
    model, x = _mlp()
    exact = graphpass.plan(model, x)
    assert _activations(exact) == {
        ("input:x", "input", "float32", (8, 256), "activation", 8192),
        ("fc1", "aten.mm", "float32", (8, 512), "activation", 16384),
        ("act", "aten.mul", "float32", (8, 512), "activation", 16384),
    }
    cached = graphpass.plan(model, x, config=graphpass.Config(fp8_cache="act_input",
                                                              fp8_cache_min_bytes=0))
    assert _activations(cached) == {
        ("input:x", "input", "float32", (8, 256), "activation", 8192),
        ("fc1", "graphpass.cache_quantize", "float8_e4m3fn", (8, 512), "fp8_data", 4096),
        ("fc1", "graphpass.cache_quantize", "uint8", (8, 4), "fp8_scale", 32),
        ("act", "aten.mul", "float32", (8, 512), "activation", 16384),
    }
    assert cached.activation_bytes == 8192 + 4096 + 32 + 16384
    rows = [r for r in cached.rows if r.decided(What.FP8_CACHED)]
    assert len(rows) == 2 and all(r.copy_of == "mm" for r in rows)
    assert [str(d) for r in rows for d in r.decisions] == [
        "fp8 cache (lossy): float32 mm as e4m3_1x128_pow2 (data)",
        "fp8 cache (lossy): float32 mm as e4m3_1x128_pow2 (scales)"]
    # all, per-tensor E5M2: all three, each with one fp32 scale
    everything = graphpass.plan(model, x, config=graphpass.Config(
        fp8_cache="all", fp8_cache_min_bytes=0, fp8_cache_format="e5m2_tensor"))
    assert _activations(everything) == {
        ("input:x", "graphpass.cache_quantize", "float8_e5m2", (8, 256), "fp8_data", 2048),
        ("input:x", "graphpass.cache_quantize", "float32", (), "fp8_scale", 4),
        ("fc1", "graphpass.cache_quantize", "float8_e5m2", (8, 512), "fp8_data", 4096),
        ("fc1", "graphpass.cache_quantize", "float32", (), "fp8_scale", 4),
        ("act", "graphpass.cache_quantize", "float8_e5m2", (8, 512), "fp8_data", 4096),
        ("act", "graphpass.cache_quantize", "float32", (), "fp8_scale", 4),
    }


def test_too_small_and_not_cacheable_are_notes():
    model, x = _mlp()
    report = graphpass.plan(model, x, config=graphpass.Config(fp8_cache="all"))  # 64 KiB minimum
    assert _activations(report) == _activations(graphpass.plan(model, x))
    assert ("fp8 cache: not cached: 3 saved tensor(s) below fp8_cache_min_bytes=65,536 "
            "(40,960 B in all)") in report.notes
    # attention's log-sum-exp stays exact, and says why
    model, inputs = llama.build("tiny", layers=1, seq=64)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(fp8_cache="attn",
                                                                    fp8_cache_min_bytes=0))
    lse = [n for n in report.notes if "log-sum-exp" in n]
    assert len(lse) == 1 and lse[0].startswith("fp8 cache: not cached: getitem_5 in layers.0.self_attn")
    assert any(r.dtype == "float32" and r.shape == (2, 4, 64) for r in report.rows)


# --- which value the backward reads ---------------------------------------------------------------

def _grads(model, x, codegen="eager", **cfg):
    torch._dynamo.reset()
    x = x.detach().requires_grad_()
    out = torch.compile(model, backend=graphpass.backend(codegen=codegen, **cfg))(x)
    torch.manual_seed(1)
    (out * torch.randn(out.shape)).sum().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    return out.detach(), grads


def test_forward_exact_backward_dequantized_and_nothing_else_lossy():
    """The forward computes with exact values (outputs bit-identical); the backward reads the
    dequantized ones. Values FP8 holds exactly give gradients bit-identical to the exact plan's:
    nothing else is lossy."""
    model, x = _mlp()
    cfg = dict(fp8_cache="all", fp8_cache_min_bytes=0)
    out, exact = _grads(model, x)
    out_c, cached = _grads(model, x, **cfg)
    assert torch.equal(out, out_c)
    assert not all(torch.equal(a, b) for a, b in zip(exact, cached))  # random values: lossy
    # fc1's output h = x @ W1.T: multiples of 1/32 in [-4/32, 4/32] (x: 0, +-1; W1: four
    # +-1/32 per row), exactly representable in E4M3 with a power-of-two scale; x too
    with torch.no_grad():
        w = torch.zeros(model.fc1.weight.shape)
        for row in w:
            row[torch.randperm(256)[:4]] = torch.randint(0, 2, (4,)).float() * 2 - 1
        model.fc1.weight.copy_(w / 32)
        x = torch.randint(-1, 2, x.shape).float()
    h = x @ model.fc1.weight.T
    assert torch.equal(cache_dequantize(*cache_quantize(h, "e4m3_1x128_pow2"), "e4m3_1x128_pow2",
                                        torch.float32, [512, 1]), h)
    cfg = dict(fp8_cache="act_input", fp8_cache_min_bytes=0)  # h only (GELU's output is not exact)
    out, exact = _grads(model, x)
    out_c, cached = _grads(model, x, **cfg)
    assert torch.equal(out, out_c)
    assert all(torch.equal(a, b) for a, b in zip(exact, cached))
    report = graphpass.last_report()
    assert any(r.decided(What.FP8_CACHED) for r in report.rows)


class DropoutMLP(MLP):
    """MLP with dropout (p=0.5) on its output (GPT-2's residual dropout)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc2(self.act(self.fc1(x))))


@pytest.mark.parametrize("codegen", ["eager"])  # "inductor" passes too: 55 s, too slow for CI
def test_dropout_mask_not_redrawn_bit_identical(codegen):
    """With dropout, caching fc1's output h (exactly representable in E4M3, as above) changes
    nothing: the forward is bit-identical to the exact plan's and so are the gradients, so the
    backward applies the forward's dropout mask (a redrawn mask would change them; another seed
    does)."""
    torch.manual_seed(0)
    model, x = DropoutMLP(), torch.randint(-1, 2, (8, 256)).float()
    with torch.no_grad():
        w = torch.zeros(model.fc1.weight.shape)
        for row in w:
            row[torch.randperm(256)[:4]] = torch.randint(0, 2, (4,)).float() * 2 - 1
        model.fc1.weight.copy_(w / 32)
    runs = {}
    for name, seed, cfg in (("exact", 0, {}), ("cached", 0, dict(fp8_cache="act_input",
                                                                 fp8_cache_min_bytes=0)),
                            ("other seed", 5, {})):
        torch.manual_seed(seed)
        runs[name] = _grads(model, x, codegen=codegen, **cfg)
        if name == "cached":
            report = graphpass.last_report()
    assert any(r.decided(What.FP8_CACHED) for r in report.rows)  # it did cache h
    (out, grads), (out_c, grads_c), (out_o, grads_o) = runs.values()
    assert torch.equal(out, out_c)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_c))
    assert not torch.equal(out, out_o)  # the mask matters


class T5MLP(MLP):
    """MLP with dropout between GELU and fc2 (T5's feed-forward)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def test_act_input_looks_through_a_dropout_before_the_next_gemm():
    """Run eagerly, the dropout stays one native_dropout between GELU and fc2; act_input still
    caches GELU's input h = fc1(x) (before, the activation region ended at the dropout and
    nothing was cached, with no note). Saved, by hand: x (8x256 f32, 8,192 B), h's FP8 copy
    (8x512 E4M3, 4,096 B) and its E8M0 scales (8x4, 32 B), the dropout's output fc2's wgrad
    reads (8x512 f32, 16,384 B) and its mask (8x512 bool, 4,096 B)."""
    torch.manual_seed(0)
    model, x = T5MLP(), torch.randn(8, 256)
    torch.manual_seed(2)
    out, _ = _grads(model, x)
    torch.manual_seed(2)
    out_c, _ = _grads(model, x, fp8_cache="act_input", fp8_cache_min_bytes=0)
    assert torch.equal(out, out_c)  # the forward computes with the exact h
    saved = sorted((r.module, r.op, r.dtype, r.bytes) for r in graphpass.last_report().rows
                   if r.is_activation)
    assert saved == [("drop", "aten.native_dropout", "bool", 4096),
                     ("drop", "aten.native_dropout", "float32", 16384),
                     ("fc1", "graphpass.cache_quantize", "float8_e4m3fn", 4096),
                     ("fc1", "graphpass.cache_quantize", "uint8", 32),
                     ("input:x", "input", "float32", 8192)]


def test_layer_input_caches_the_residual_stream_and_keeps_norm_statistics_exact():
    """layer_input caches the tensors saved for norms (the layer input x, o_proj's output, which
    the backward re-adds to x for the second norm, and the layer output the final norm reads);
    each norm's saved rstd (2x64x1 f32) stays exact."""
    model, inputs = llama.build("tiny", layers=1, seq=64)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(fp8_cache="layer_input",
                                                                    fp8_cache_min_bytes=0))
    assert [r.module for r in report.rows if r.decided(What.FP8_CACHED) and r.kind == "fp8_data"] \
        == ["input:x", "layers.0.self_attn.o_proj", "layers.0"]
    assert sorted(r.module for r in report.rows if r.op == "aten.rsqrt") == [
        "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"]


def test_layer_input_caches_residual_summands_saved_for_norms():
    """Under FP8 lowering the exact plan saves the residual stream's summands (o_proj's and
    down_proj's outputs), not their sums: the backward re-adds them for the norms. layer_input
    caches them (it once took only tensors a norm reads directly, so it cached nothing inside
    the layer, silently)."""
    model, inputs = llama.build("tiny", layers=1, seq=64)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(
        fp8="tensorwise", fp8_cache="layer_input", fp8_cache_min_bytes=0))
    cached = {r.module for r in report.rows if r.decided(What.FP8_CACHED) and r.kind == "fp8_data"}
    assert {"layers.0.self_attn.o_proj", "layers.0.mlp.down_proj"} <= cached, cached
    assert not [r for r in report.rows if r.kind == "activation" and r.module in cached]


# --- with the FP8 lowering ------------------------------------------------------------------------
def test_a_tensor_the_cached_graph_saves_exact_is_not_read_lossy():
    """On the tiny Llama under all, torch's min-cut of the cached graph saves o_proj's output
    exact (a backward recompute reads it). The cache is then undone for it: no quantize runs
    in the backward on a value saved exact (a lossy read that saves no byte)."""
    model, _ = llama.build("tiny_lm", layers=1, seq=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as examples/train.py trains it
        report = graphpass.plan(model, torch.zeros(2, 64, dtype=torch.long),
                                config=graphpass.Config(fp8="tensorwise", fp8_cache="all"))
    lossy_reads = [r.name for r in report.rows if r.kind == "activation"
                   and any("cache_quantize" in c for c in r.consumers)]
    assert not lossy_reads, lossy_reads
    assert any(n.startswith("fp8 cache: not cached: fp8_gemm_default_9 ") for n in report.notes)



@pytest.mark.parametrize("recipe, scale_shape", [("tensorwise", ()), ("rowwise", (256, 1))])
def test_reuses_the_lowerings_columnwise_copy(recipe, scale_shape):
    """Under fp8='tensorwise' (or 'rowwise'), attention's output is also o_proj's input: its
    columnwise FP8 copy (for wgrad) is the cache, dequantized in the backward; no second
    quantize of it."""
    model, inputs = llama.build("tiny", layers=1, seq=64)
    report = graphpass.plan(model, *inputs, config=graphpass.Config(
        fp8=recipe, fp8_cache="attn", fp8_cache_min_bytes=0))
    copy = [r for r in report.rows if r.decided(What.FP8_COPY) and r.decided(What.FP8_CACHED)]
    assert {(r.module, r.op, r.dtype, r.shape, r.kind) for r in copy} == {
        ("layers.0.self_attn.o_proj", "graphpass.quantize", "float8_e4m3fn", (256, 128), "fp8_data"),
        ("layers.0.self_attn.o_proj", "graphpass.quantize", "float32", scale_shape, "fp8_scale")}
    assert f"the fp8 lowering's columnwise {recipe} copy" in copy[0].decision
    assert not [r for r in report.rows if "scaled_dot_product" in r.op and len(r.shape) == 4]
    cached_sources = [r.copy_of for r in report.rows if r.op == "graphpass.cache_quantize"]
    assert copy[0].copy_of not in cached_sources


@pytest.mark.parametrize("model", ["llama", "gpt", "deepseek"])
def test_every_saved_activation_is_cached_or_named_in_a_note(model):
    """Never silent: under ``all`` with no minimum size, every saved floating activation is an
    FP8 cache row or named in a ``not cached`` note. On the tiny GPT, torch's min-cut of the
    cached graph runs backward nodes of the final LayerNorm in the forward (``div``, and on torch
    2.14 ``mul_12``) and, on 2.11/2.13, saves its output exact (``mul_10``): notes, not silence."""
    import importlib

    module = importlib.import_module(f"graphpass.models.{model}")
    net, inputs = module.build("tiny", layers=1, seq=64)
    report = graphpass.plan(net, *inputs, config=graphpass.Config(fp8_cache="all",
                                                                  fp8_cache_min_bytes=0))
    noted = " ".join(n for n in report.notes if n.startswith("fp8 cache: not cached: "))
    silent = [r.name for r in report.rows
              if r.kind not in ("parameter", "fp8_scale") and r.dtype.startswith(("float", "bfloat"))
              and not r.dtype.startswith("float8") and not r.decision.startswith("fp8 cache (lossy)")
              and f"not cached: {r.name} in " not in noted]
    assert not silent, (silent, report.notes)
    if model == "gpt":  # the final LayerNorm: on torch 2.11/2.13 also mul_10 (its output, saved
        # exact after the rewrite), on 2.14 the backward node mul_12 (2.14's min-cut runs it early)
        assert ("fp8 cache: not cached: div in norm: a backward node (it reads no gradient) that "
                "torch's min-cut runs in the forward; the cache takes forward tensors only") in report.notes
