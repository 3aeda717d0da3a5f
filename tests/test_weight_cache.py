"""``fp8_weight_cache``: each lowered weight quantized once per optimizer step, reused by the
other micro-batches, never stale, bit-identical to quantizing every micro-batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import graphpass
from graphpass.fp8 import ops, weight_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _experts  # noqa: E402

MICRO = 4  # micro-batches per optimizer step


def _experts_model():
    model, (x, offs) = _experts.build("tiny")
    return model, x.detach(), offs


def _grad_out(x: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(x.shape, generator=g).to(device=x.device, dtype=x.dtype)


def _accumulate(compiled, x, offs, step: int) -> None:
    """One optimizer step's micro-batches: each its own tokens and output gradient."""
    for m in range(MICRO):
        xm = (x * (1 + 0.25 * m)).requires_grad_()
        compiled(xm, offs).backward(_grad_out(x, 100 * step + m))


def _compiled(model, codegen: str, cache: bool):
    torch._dynamo.reset()
    backend = graphpass.backend(fp8="rowwise", kernels="reference", codegen=codegen,
                                fp8_weight_cache=cache)
    return torch.compile(model, backend=backend), backend


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_quantized_once_per_step_and_bit_identical(codegen):
    """Four micro-batches: each of the two expert weights quantized once (forward and backward
    look it up on the others), the accumulated gradients bit for bit those of quantizing every
    micro-batch; after the optimizer step the next micro-batch quantizes again."""
    if codegen == "inductor" and not graphpass._compat.inductor_rounds_fused_casts(
            device_types=["cpu"]):
        pytest.skip(f"torch {torch.__version__}'s Inductor CPU code does not round fused bf16 "
                    "values as eager does (docs/fp8.md#fuse_quantize)")
    ref_model, x, offs = _experts_model()
    model, _, _ = _experts_model()
    ref, _ = _compiled(ref_model, codegen, cache=False)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    weight_cache.clear()
    for step in range(2):
        _accumulate(ref, x, offs, step)
        ref_grads = _grads(ref_model)
        ref_opt.step()
        ref_opt.zero_grad()
    assert weight_cache.stats().quantized == 0  # the uncached model never reaches the cache

    compiled, _ = _compiled(model, codegen, cache=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(2):
        _accumulate(compiled, x, offs, step)
        # two weights, each quantized on the first micro-batch (forward), looked up by its
        # backward and by the three other micro-batches' forward and backward
        assert (weight_cache.stats().quantized, weight_cache.stats().reused) == (
            2 * (step + 1), 2 * (2 * MICRO - 1) * (step + 1))
        grads = _grads(model)
        opt.step()
        opt.zero_grad()
    assert _same_bits(grads, ref_grads)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
    # the cache's copies are what quantizing the weights now gives: nothing wrote into them
    _ = compiled(x.requires_grad_(), offs)
    for entry, p in zip(weight_cache._CACHE.values(), model.parameters()):
        fresh = ops._quantize_op(p.detach(), "rowwise", "weight", "both")
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1
                   else torch.equal(a, b) for a, b in zip(entry.outputs, fresh))


def test_never_stale():
    """An in-place edit under no_grad and load_state_dict bump the parameter's version: the next
    call quantizes again and its gradients are those of an uncached model with the same weights.
    A write through ``p.data`` does not (its own version counter); ``clear`` is the way out."""
    model, x, offs = _experts_model()
    compiled, _ = _compiled(model, "eager", cache=True)
    weight_cache.clear()
    g = _grad_out(x, 0)

    def grads_after(edit) -> list[torch.Tensor]:
        with torch.no_grad():
            edit()
        model.zero_grad()
        compiled(x.requires_grad_(), offs).backward(g)
        return _grads(model)

    def uncached() -> list[torch.Tensor]:
        twin, _, _ = _experts_model()
        twin.load_state_dict(model.state_dict())
        c, _ = _compiled(twin, "eager", cache=False)
        c(x.requires_grad_(), offs).backward(g)
        torch._dynamo.reset()
        return _grads(twin)

    grads_after(lambda: None)
    quantized = weight_cache.stats().quantized
    gate_up = model.mlp.experts.gate_up_proj
    edited = grads_after(lambda: gate_up.mul_(-1.5))
    assert weight_cache.stats().quantized == quantized + 1  # gate_up only
    assert _same_bits(edited, uncached())
    compiled, _ = _compiled(model, "eager", cache=True)
    state = {k: v * 0.5 for k, v in model.state_dict().items()}
    loaded = grads_after(lambda: model.load_state_dict(state))
    assert weight_cache.stats().quantized == quantized + 3  # both weights
    assert _same_bits(loaded, uncached())
    # .data has a version counter of its own: stale until cleared
    gate_up.data.mul_(2.0)
    before = weight_cache.stats().quantized
    grads_after(lambda: None)
    assert weight_cache.stats().quantized == before
    weight_cache.clear()
    assert _same_bits(grads_after(lambda: None), uncached())
    assert weight_cache.stats().quantized == 2


def test_report_and_step_peak():
    """The report names each cached weight with the bytes its copies hold, the step peak counts
    them as ``cached`` for the whole step, and nothing of the weights is saved for the
    backward (it looks the copies up)."""
    model, x, offs = _experts_model()
    config = graphpass.Config(fp8="rowwise", kernels="reference", fp8_weight_cache=True)
    report = graphpass.plan(model, x.requires_grad_(), offs, config=config)
    notes = [str(n) for n in report.notes if "fp8_weight_cache" in str(n)]
    e, h, i = 4, 256, 128  # tiny: experts, hidden, inter
    # gate_up (E, 2I, H): both copies E*2I*H bytes each, scales E*2I and E*H fp32
    gate_up = 2 * e * 2 * i * h + 4 * (e * 2 * i + e * h)
    down = 2 * e * h * i + 4 * (e * h + e * i)  # down (E, H, I)
    assert notes == [
        f"fp8_weight_cache: mlp.experts: the 4x256x256 weight's both FP8 copies quantized once "
        f"per optimizer step and held between steps ({gate_up:,} B)",
        f"fp8_weight_cache: mlp.experts: the 4x256x128 weight's both FP8 copies quantized once "
        f"per optimizer step and held between steps ({down:,} B)"]
    assert report.meta["step_peak"]["by_kind"]["cached"] == gate_up + down
    assert not [r for r in report.rows if "quantize_weight" in r.op]


def test_a_weight_that_is_not_a_parameter_is_noted():
    """A weight given as an input (as an all-gathered one is) is new every step: not cached,
    and the report says so."""

    class Given(nn.Module):
        def forward(self, x, w):
            return nn.functional.linear(x, w)

    config = graphpass.Config(fp8="tensorwise", kernels="reference", fp8_weight_cache=True)
    with pytest.warns(graphpass.EmptySelectionWarning, match="fp8_weight_cache"):
        report = graphpass.plan(Given(), torch.randn(32, 64, requires_grad=True),
                                torch.randn(64, 64, requires_grad=True), config=config)
    assert [str(n) for n in report.notes if "fp8_weight_cache" in str(n)] == [
        "fp8_weight_cache: not cached: <root>: the 64x64 weight is not a parameter (a gathered "
        "or computed weight is new every step), so it is quantized every step"]


def test_a_cache_that_caches_nothing_warns():
    """No weight of any compiled graph cached (here the one weight is an input): an
    EmptySelectionWarning, as for any selection that finds nothing."""

    class Given(nn.Module):
        def forward(self, x, w):
            return nn.functional.linear(x, w)

    torch._dynamo.reset()
    compiled = torch.compile(Given(), backend=graphpass.backend(
        fp8="tensorwise", kernels="reference", codegen="eager", fp8_weight_cache=True))
    with pytest.warns(graphpass.EmptySelectionWarning,
                      match="fp8_weight_cache='weights' selected nothing in the 1 graph"):
        compiled(torch.randn(32, 64, requires_grad=True),
                 torch.randn(64, 64, requires_grad=True)).sum().backward()


def test_needs_a_recipe():
    for value in (True, "auto"):
        config = graphpass.Config(fp8_weight_cache=value)
        assert [str(u) for u in config.unused()] == [
            f"fp8_weight_cache={value!r} has no effect without fp8='tensorwise' (or another recipe)"]
        assert config.fp8_weight_cache is False  # runs as without it


@pytest.mark.parametrize("value", [1, 0, "on", None])
def test_values_are_false_true_or_auto(value):
    with pytest.raises(ValueError, match=r"fp8_weight_cache=.*valid values are: False, True, 'auto'"):
        graphpass.Config(fp8="tensorwise", fp8_weight_cache=value)


def test_dense_weights_cached_too():
    """nn.Linear weights under tensorwise scaling: quantized once over the micro-batches,
    gradients bit-identical to quantizing each time."""

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    x = torch.randn(32, 64)
    grads = []
    for cache in (False, True):
        model = build()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=graphpass.backend(
            fp8="tensorwise", kernels="reference", codegen="eager", fp8_weight_cache=cache))
        weight_cache.clear()
        for m in range(MICRO):
            compiled(x * (1 + m)).backward(_grad_out(x, m))
        grads.append([p.grad for p in model.parameters()])
    # the first layer has no dgrad (x needs no gradient): its one copy is read by the forward
    # only; the second layer's by the forward and, for dgrad, the backward
    calls = MICRO + 2 * MICRO
    assert (weight_cache.stats().quantized, weight_cache.stats().reused) == (2, calls - 2)
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_expert_weights_on_cuda_run_the_triton_kernels():
    """A rowwise quantize of contiguous 3-D CUDA expert weights runs graphpass's Triton kernels
    and is left as the op by Inductor's inlining, cached or not (the same bits either way); any
    other layout or device keeps the recipe's torch code. Fake CUDA tensors: no GPU needed."""
    pytest.importorskip("triton")
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        # empty_strided: a fake CUDA tensor where torch is built without CUDA
        def cuda(shape, stride, dtype=torch.bfloat16):
            return torch.empty_strided(shape, stride, device="cuda", dtype=dtype)

        assert ops.uses_triton_weight_kernel(cuda((16, 64, 32), (2048, 32, 1)))
        assert ops.uses_triton_weight_kernel(cuda((16, 64, 32), (2048, 32, 1), torch.float32))
        assert not ops.uses_triton_weight_kernel(cuda((16, 64, 32), (2048, 1, 64)))  # transposed
        assert not ops.uses_triton_weight_kernel(cuda((64, 32), (32, 1)))  # a dense weight
        assert not ops.uses_triton_weight_kernel(
            cuda((16, 64, 32), (2048, 32, 1), torch.float8_e4m3fn))
        # the lowering's note for each expert linear on CUDA says which ran, and why
        from graphpass.passes.lower_fp8 import _weight_kernel

        assert _weight_kernel(cuda((16, 64, 32), (2048, 32, 1))).startswith(
            "graphpass's Triton kernels")
        assert _weight_kernel(cuda((16, 64, 32), (2048, 1, 64))) == (
            "Inductor's fused code, not graphpass's Triton kernels: the weight is not "
            "contiguous (the same bits, one more read of the weight per copy)")
    assert not ops.uses_triton_weight_kernel(torch.empty(16, 64, 32, dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_and_uncached_steps_are_bit_identical_on_cuda():
    """CUDA, Inductor, torch._scaled_grouped_mm: four micro-batches with the weight cache give
    the gradients of quantizing every micro-batch, bit for bit, each weight quantized once."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    grads = []
    for cache in (False, True):
        model, (x, offs) = _experts.build("tiny", device="cuda")
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=graphpass.backend(
            fp8="rowwise", kernels="scaled_mm", fp8_weight_cache=cache))
        weight_cache.clear()
        _accumulate(compiled, x.detach(), offs, 0)
        grads.append(_grads(model))
    assert (weight_cache.stats().quantized, weight_cache.stats().reused) == (2, 2 * (2 * MICRO - 1))
    assert _same_bits(*grads)


def test_the_cached_lookup_runs_outside_cuda_graphs():
    """Tagged cudagraph-unsafe: Inductor's graph partition runs it outside the captured graphs
    (a replayed lookup would return the copies of the step it was captured in)."""
    assert torch.Tag.cudagraph_unsafe in weight_cache.QUANTIZE_WEIGHT.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.graphpass.quantize.default.tags


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weight_cache_under_cuda_graphs_is_never_stale():
    """Inductor's CUDA graphs on: two optimizer steps of four micro-batches each, with the cache
    and without, give the same gradient bits at each step: the second step's micro-batches read
    the copies of the updated weights, not those of the step the graphs were captured in."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm90+")
    from torch._inductor import config as inductor_config

    grads = {}
    for cache in (False, True):
        model, (x, offs) = _experts.build("tiny", device="cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        torch._dynamo.reset()
        weight_cache.clear()
        with inductor_config.patch({"triton.cudagraphs": True}):
            compiled = torch.compile(model, backend=graphpass.backend(
                fp8="rowwise", kernels="scaled_mm", fp8_weight_cache=cache))
            for step in range(2):
                optimizer.zero_grad(set_to_none=True)
                _accumulate(compiled, x.detach(), offs, step)
                grads[cache, step] = _grads(model)
                optimizer.step()
    for step in range(2):
        assert _same_bits(grads[False, step], grads[True, step]), step


# --- fp8_weight_cache="auto": the weights the memory budget chooses ------------------------------

def _mlp():
    """Three fp32 linears, no bias: 256x64 (A), 128x256 (B), 64x128 (C). Under tensorwise
    scaling each cached weight holds both copies, 1 byte per element each, and two fp32 scales:
    A 32,776 B, B 65,544 B, C 16,392 B."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256, bias=False), nn.GELU(),
                         nn.Linear(256, 128, bias=False), nn.GELU(),
                         nn.Linear(128, 64, bias=False))


_HELD = {"0": 2 * 256 * 64 + 8, "2": 2 * 128 * 256 + 8, "4": 2 * 64 * 128 + 8}
_AUTO = dict(fp8="tensorwise", kernels="reference", codegen="eager")


def _mlp_input() -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)


def _cached_modules(report) -> set[str]:
    return {n.module for n in report.decisions if n.what is graphpass.What.WEIGHT_CACHED}


def _unbudgeted_peak() -> int:
    report = graphpass.plan(_mlp(), _mlp_input(), config=graphpass.Config(
        **_AUTO, fp8_weight_cache="auto"))
    return report.meta["step_peak"]["bytes"]


@pytest.mark.parametrize("room, cached", [
    (_HELD["0"] + _HELD["2"] + _HELD["4"], {"0", "2", "4"}),
    (_HELD["2"] + _HELD["4"] + 100, {"2", "4"}),
    (_HELD["2"] + 100, {"2"}),
    (_HELD["4"] + 100, {"4"}),
    (_HELD["4"] - 1, set()),
], ids=["all", "B+C", "B", "C", "none"])
def test_auto_caches_the_weights_a_budget_leaves_room_for(room, cached):
    """By hand: the weights' cached copies are live for the whole step, so each cached weight
    raises this model's peak (in the backward, where no weight quantize runs) by exactly what it
    holds. The order is the most quantize work per cached byte first: each weight's two
    quantizes read 4 B per element and write 1 B per element and a 4 B scale, against 2 B per
    element and two scales held, (10N + 8) / (2N + 8), highest for the largest (B, A, C). With
    room for B and C but not A besides B, the run that fits is [B], A is over, C fits on top;
    with room for C alone, B and A are over and C fits. Every weight gets a note, and so does
    the summary; the report's peak counts the cached bytes and is within the budget."""
    peak = _unbudgeted_peak()
    budget = peak + room
    report = graphpass.plan(_mlp(), _mlp_input(), config=graphpass.Config(
        **_AUTO, fp8_weight_cache="auto", memory_budget=budget))
    assert _cached_modules(report) == cached
    step = report.meta["step_peak"]
    held = sum(_HELD[m] for m in cached)
    assert step["by_kind"].get("cached", 0) == held
    assert step["bytes"] == peak + held <= budget
    notes = [n for n in report.notes if n.startswith("fp8_weight_cache")]
    shapes = {"0": "256x64", "2": "128x256", "4": "64x128"}
    for m in ("2", "0", "4"):
        if m in cached:
            assert any(n.startswith(f"fp8_weight_cache: {m}: the {shapes[m]} weight's both FP8 "
                                    f"copies quantized once per optimizer step and held between "
                                    f"steps ({_HELD[m]:,} B); chosen within memory_budget")
                       for n in notes)
        else:
            assert (f"fp8_weight_cache: not cached: {m}: the {shapes[m]} weight's copies "
                    f"({_HELD[m]:,} B) would take the predicted peak over memory_budget "
                    f"({graphpass.report.format_bytes(budget)})") in notes
    assert notes[-1].startswith(
        f"fp8_weight_cache: 'auto' under memory_budget: {len(cached)} of 3 weight(s) cached "
        f"({held:,} B)")


def test_auto_without_a_budget_caches_nothing_and_says_so():
    """No budget to choose within: nothing cached, one note with what could be, no warning
    (the note is the answer), and the plan is the uncached one."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", graphpass.EmptySelectionWarning)
        report = graphpass.plan(_mlp(), _mlp_input(), config=graphpass.Config(
            **_AUTO, fp8_weight_cache="auto"))
    off = graphpass.plan(_mlp(), _mlp_input(), config=graphpass.Config(**_AUTO))
    assert [n for n in report.notes if "fp8_weight_cache" in n] == [
        "fp8_weight_cache: 'auto' caches weights within memory_budget, and none is set: no "
        f"weight cached (3 could be, {sum(_HELD.values()):,} B; set memory_budget, or "
        "fp8_weight_cache=True to cache every one)"]
    assert report.meta["step_peak"] == off.meta["step_peak"]
    assert "cached" not in report.meta["step_peak"]["by_kind"]


def test_auto_peak_is_measured_and_gradients_are_bit_identical():
    """Four micro-batches under False, True and "auto" with room for B and C: the accumulated
    gradients bit for bit the same; under "auto" two weights quantized once per step; and the
    first micro-batch's peak (the cache cleared: its copies allocated in the step) measured by
    MemTracker equals the prediction, the cached bytes counted."""
    from test_peak import measured_step

    budget = _unbudgeted_peak() + _HELD["2"] + _HELD["4"] + 100
    x = _mlp_input().detach()
    grads, peaks = {}, {}
    for cache in (False, True, "auto"):
        model = _mlp()
        torch._dynamo.reset()
        backend = graphpass.backend(**_AUTO, fp8_weight_cache=cache,
                                    **({"memory_budget": budget} if cache == "auto" else {}))
        step = torch.compile(lambda t: model(t).pow(2).mean(), backend=backend)
        weight_cache.clear()
        for m in range(MICRO):
            step((x * (1 + m)).requires_grad_()).backward()
        if cache == "auto":  # B and C: forward and backward, on each micro-batch
            assert (weight_cache.stats().quantized, weight_cache.stats().reused) == (
                2, 2 * (2 * MICRO) - 2)
        grads[cache] = [p.grad.clone() for p in model.parameters()]
        weight_cache.clear()
        model.zero_grad(set_to_none=True)
        peaks[cache] = (backend.report().meta["step_peak"]["bytes"],
                        measured_step(model, step, x.clone().requires_grad_()))
    assert _same_bits(grads[True], grads[False]) and _same_bits(grads["auto"], grads[False])
    for cache, (predicted, measured) in peaks.items():
        assert measured == predicted, (cache, predicted, measured)
    assert peaks["auto"][0] - peaks[False][0] == _HELD["2"] + _HELD["4"]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_a_dtensors_writes_reach_its_local_tensors_version():
    """The cache keys on a DTensor parameter's local tensor (what a compiled graph reads), whose
    version no DTensor op moves: a graph the backend compiled with DTensor inputs bumps it where
    the DTensor's own version moved (an in-place op, ``load_state_dict``), and the optimizer step
    hook bumps it for a ``foreach`` step, which moves neither. Each write misses the cache once;
    calls between writes hit it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from graphpass.distributed import fake_process_group

    weight_cache.clear()
    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        p = nn.Parameter(DTensor.from_local(torch.randn(64, 32), mesh, [Shard(0)],
                                            run_check=False))
        local = p._local_tensor
        # what a compiled graph does with it: the cache's op on the local tensor
        step = weight_cache.track_dtensors(
            lambda w: weight_cache.quantize_weight(w._local_tensor, "tensorwise", "weight", "both"))
        opt = torch.optim.SGD([p], lr=0.1, foreach=True)
        bits = []
        for write in (None, None, "mul_", None, "foreach step", "load_state_dict", None):
            if write == "mul_":
                with torch.no_grad():
                    p.mul_(0.5)
            elif write == "foreach step":
                p.grad = DTensor.from_local(torch.ones(64, 32), mesh, [Shard(0)],
                                            run_check=False)
                opt.step()
            elif write == "load_state_dict":
                nn.ParameterDict({"p": p}).load_state_dict({"p": p.detach() * 2})
            bits.append(step(p)[0].view(torch.uint8).clone())
            assert torch.equal(bits[-1], ops.quantize(local, "tensorwise", "weight",
                                                      "both")[0].view(torch.uint8)), write
    assert weight_cache.stats().quantized == 4 and weight_cache.stats().reused == 3
    weight_cache.clear()
