"""FSDP2's weight all-gathers in FP8 (``graphpass.fsdp_fp8_weights``, ``fp8/fsdp.py``,
``passes/fsdp_fp8_weights.py``).

On 2 gloo ranks (``tests/_gloo_fsdp_fp8_worker.py``, run in the 2-rank launch of
``tests/test_distributed_gloo.py``, ``two_ranks``): the tiny Llama LM in float32 under
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, FP8 tensorwise, 3 SGD steps, per
block and whole-model compile, with the weights all-gathered in bf16 and in FP8: the same bits,
and the collectives each step ran, counted by a recorder around torch.distributed's calls. In one
process (a 1-rank gloo group): the wrapper subclasses, the report's rows, bad input. The same
run also trains FP8 blockwise per block: the weights whose shards are whole 128-row blocks
gathered in FP8 with their tile scales, the others in bf16.
"""

from __future__ import annotations

import warnings
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphpass
from graphpass.distributed import FSDP_FP8_NOTE
from graphpass.fp8 import recipes
from graphpass.fp8.fsdp import FP8GatheredWeight, FP8GatherShard

from test_distributed_gloo import two_ranks

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo")

WORLD = 2
OPTIONS = dict(fp8="tensorwise", kernels="reference", codegen="eager")


def assert_same_bits(bf16: dict, fp8: dict, rank: int) -> None:
    """One rank's run with bf16 gathers and with FP8 gathers: the same losses, gradients at every
    step and parameters after the steps, bit for bit."""
    assert all(torch.equal(a, b) for a, b in zip(bf16["losses"], fp8["losses"])), rank
    for step, (a, b) in enumerate(zip(bf16["grads"], fp8["grads"])):
        differ = [n for n in a if not torch.equal(a[n], b[n])]
        assert not differ, (rank, step, differ)
    differ = [n for n in bf16["params"] if not torch.equal(bf16["params"][n], fp8["params"][n])]
    assert not differ, (rank, differ)


@pytest.fixture(scope="module")
def ranks(request):
    """The runs of ``tests/_gloo_fsdp_fp8_worker.py``, made in the session's 2-rank launch
    (``two_ranks``: the same 2 processes as the other gloo files' 2-rank scenarios)."""
    out = two_ranks(request)
    return [torch.load(out / f"fsdp_fp8-{r}.pt") for r in range(WORLD)]


@pytest.mark.every_param  # per-block and whole-model compile: one gloo run gives both
@pytest.mark.parametrize("whole", [False, True], ids=["per_block", "whole_model"])
def test_fsdp2_fp8_weight_gathers_are_bit_identical_to_bf16_gathers(ranks, whole):
    """Losses at every step, gradients at every step (gathered with ``full_tensor()``) and the
    parameters after 3 steps: the same bits with the weights all-gathered in FP8 as in bf16, on
    both ranks, compiled per block and as a whole model. The gathered bytes are the bf16
    weight quantized with the whole weight's amax, which graphpass's quantize of the gathered
    weight gives."""
    for r, rank in enumerate(ranks):
        bf16, fp8 = rank[whole, False], rank[whole, True]
        assert_same_bits(bf16, fp8, r)
        assert fp8["losses"][-1] < fp8["losses"][0] - 0.5  # it trains
        assert fp8["warnings"] == []  # the scales were reduced after each step: none stale


@pytest.mark.every_param  # per-block and whole-model compile: one gloo run gives both
@pytest.mark.parametrize("whole", [False, True], ids=["per_block", "whole_model"])
def test_fsdp2_fp8_weight_gathers_halve_the_lowered_weights_bytes(ranks, whole):
    """Counted from the collectives each step ran (a recorder around torch.distributed's): each
    block's all-gather (FSDP2 gathers a block's parameters in one call, before the forward and
    again before the backward) moves 1 byte per element of its 7 linear weights instead of 2,
    and 2 per element of its norms, as uint8; the root's (embedding, final norm, output head)
    is unchanged; and the amaxes of the 14 FP8-gathered weights take one all-reduce per step
    (after the optimizer step), none in the all-gathers."""
    shapes = ranks[0][whole, True]["shapes"]
    fp8_names = set(ranks[0][whole, True]["wrapped"][0])
    assert len(fp8_names) == 14 and "output.weight" not in fp8_names
    linears = sum(torch.Size(shapes[n]).numel() for n in fp8_names if n.startswith("layers.0."))
    norms = sum(torch.Size(s).numel() for n, s in shapes.items()
                if n.startswith("layers.0.") and n not in fp8_names)
    root = sum(torch.Size(s).numel() for n, s in shapes.items() if not n.startswith("layers."))
    for rank in ranks:
        for bf16_calls, fp8_calls in zip(rank[whole, False]["calls"], rank[whole, True]["calls"]):
            gathers = {k: sorted((str(d), b) for op, d, b in calls if op == "all_gather_into_tensor")
                       for k, calls in (("bf16", bf16_calls), ("fp8", fp8_calls))}
            block_bf16, block_fp8 = 2 * (linears + norms), linears + 2 * norms
            assert gathers["bf16"] == [("torch.bfloat16", 2 * root)] + [
                ("torch.bfloat16", block_bf16)] * 4
            assert gathers["fp8"] == [("torch.bfloat16", 2 * root)] + [
                ("torch.uint8", block_fp8)] * 4
            assert [c for c in fp8_calls if c[0] == "all_reduce"] == [
                ("all_reduce", torch.float32, 4 * 14)]
            assert not [c for c in bf16_calls if c[0] == "all_reduce"]
            # the gradients' reduce-scatters are the same (fp32, reduce_dtype)
            scatters = [[c for c in calls if c[0] == "reduce_scatter_tensor"]
                        for calls in (bf16_calls, fp8_calls)]
            assert scatters[0] == scatters[1] and scatters[0]


def test_fsdp2_fp8_weight_gathers_are_in_the_report(ranks):
    """Each rank's report lists each weight FSDP2 all-gathers for the block, with the dtype it
    moves and its bytes: the 7 linears FP8 (1 byte per element), the norms bf16; the FSDP2 note
    says which are FP8; every linear is lowered and reads the gathered bytes."""
    for rank in ranks:
        (report,) = [r for r in rank[False, True]["reports"]
                     if any(n.startswith("lowered:") for n in r["notes"])]
        notes = report["notes"]
        assert ("weight all-gather: self_attn.q_proj.weight: FSDP2 (before the graph), "
                "(256, 256), float8_e4m3fn (as uint8) (graphpass.fsdp_fp8_weights), 64.00 KiB "
                "each all-gather") in notes
        assert ("weight all-gather: input_layernorm.weight: FSDP2 (before the graph), (256,), "
                "bfloat16 (parameter dtype), 512 B each all-gather") in notes
        gathers = [n for n in notes if n.startswith("weight all-gather:")]
        assert len(gathers) == 9 and sum("float8_e4m3fn" in n for n in gathers) == 7
        assert sum(n.startswith("lowered:") for n in notes) == 7
        assert sum("FSDP2: all-gathered in FP8" in n for n in notes) == 7
        assert FSDP_FP8_NOTE in notes
        # the output head stays bf16, and fsdp_fp8_weights said why
        assert rank[False, True]["wrapped"][1] == (
            ("output.weight", "excluded by fp8_exclude pattern 'output'"),)


# the tiny Llama's lowered weights whose 2-rank shards are whole 128-row blocks (128 or 256
# rows): blockwise gathers them in FP8 with their tile scales; k and v (64-row shards) stay bf16
BLOCK_ALIGNED = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_fsdp2_blockwise_fp8_gathers_are_bit_identical_to_bf16_gathers(ranks):
    """FP8 blockwise, per block: losses, gradients (every step) and parameters (after 3 steps)
    with the 128-row-aligned weights all-gathered in FP8 with their 128x128 tile scales are the
    bits of the bf16 gathers quantized after; k and v, whose 64-row shards would cut a tile,
    gather bf16 with a warning naming each, its shard rows and the block."""
    for r, rank in enumerate(ranks):
        bf16, fp8 = rank["blockwise", False], rank["blockwise", True]
        assert_same_bits(bf16, fp8, r)
        assert fp8["losses"][-1] < fp8["losses"][0] - 0.5  # it trains
        assert sorted(fp8["warnings"]) == sorted(
            f"graphpass fsdp_fp8_weights: layers.{i}.self_attn.{m}.weight is all-gathered in "
            "torch.bfloat16, not FP8: its shards are 64 rows (128 rows over 2 ranks), not a "
            "multiple of the 128x128 scale block: a block would cross a shard boundary, so its "
            "scale needs rows of two shards" for i in (0, 1) for m in ("k_proj", "v_proj"))


def test_fsdp2_blockwise_fp8_gathers_move_data_and_tile_scales(ranks):
    """Counted from the collectives each step ran: each block's all-gather moves the aligned
    weights' FP8 bytes (1 per element) and their fp32 tile scales (4 bytes per 128x128 tile),
    k, v and the norms in bf16 (2 per element), all as uint8; no amax all-reduce (each tile's
    scale is its shard's own)."""
    shapes = ranks[0]["blockwise", True]["shapes"]
    block = {n: torch.Size(s) for n, s in shapes.items() if n.startswith("layers.0.")}
    aligned = {n for n in block if n.split(".")[-2] in BLOCK_ALIGNED}
    assert len(aligned) == 5
    tiles = sum(-(-block[n][0] // 128) * -(-block[n][1] // 128) for n in aligned)
    fp8_bytes = sum(block[n].numel() for n in aligned) + 4 * tiles
    bf16_bytes = 2 * sum(block[n].numel() for n in block if n not in aligned)
    everything = 2 * sum(s.numel() for s in block.values())
    for rank in ranks:
        for bf16_calls, fp8_calls in zip(rank["blockwise", False]["calls"],
                                         rank["blockwise", True]["calls"]):
            gathers = [sorted((str(d), b) for op, d, b in calls if op == "all_gather_into_tensor")
                       for calls in (bf16_calls, fp8_calls)]
            root = [g for g in gathers[0] if g[1] != everything]
            assert gathers[0] == sorted(root + [("torch.bfloat16", everything)] * 4)
            assert gathers[1] == sorted(root + [("torch.uint8", fp8_bytes + bf16_bytes)] * 4)
            assert not [c for c in fp8_calls if c[0] == "all_reduce"]
    # a block's all-gather: 656,512 bytes instead of 1,180,672 (55.6%); the 5 aligned weights'
    # 524,416 (524,288 FP8 bytes and 32 tile scales) instead of 1,048,576
    assert (fp8_bytes + bf16_bytes, everything) == (656512, 1180672)


def test_fsdp2_blockwise_fp8_gathers_are_in_the_report(ranks):
    """Each rank's report: the 5 aligned weights gathered as FP8 data and tile scales, k and v
    in the parameter dtype (quantized after the gather), every linear lowered."""
    for rank in ranks:
        (report,) = [r for r in rank["blockwise", True]["reports"]
                     if any(n.startswith("lowered:") for n in r["notes"])]
        notes = report["notes"]
        assert ("weight all-gather: self_attn.q_proj.weight: FSDP2 (before the graph), "
                "(256, 256), float8_e4m3fn (as uint8) and (2, 2) float32 tile scales "
                "(graphpass.fsdp_fp8_weights), 64.02 KiB each all-gather") in notes
        assert ("weight all-gather: self_attn.k_proj.weight: FSDP2 (before the graph), "
                "(128, 256), bfloat16 (parameter dtype), 64.00 KiB each all-gather") in notes
        assert sum("FSDP2: all-gathered in FP8 (float8_e4m3fn, with the 128x128 tile scales"
                   in n for n in notes) == 5


# --- one process ----------------------------------------------------------------------------


@pytest.fixture
def group(tmp_path):
    """A 1-rank gloo process group (FSDP2 needs one)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 96, bias=False)
        self.b = nn.Linear(96, 64)
        self.norm = nn.LayerNorm(64)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(self.norm(x))))


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(_Block(), _Block()).to(dtype)


def _train(model, *, wrap, mp=None, backend_options=None, steps=2, precompute=True):
    from torch.distributed.fsdp import fully_shard

    config = graphpass.Config(**OPTIONS)
    if wrap:
        graphpass.fsdp_fp8_weights(model, config)
    kw = {} if mp is None else dict(mp_policy=mp)
    backend = graphpass.backend(**(backend_options or OPTIONS))
    for block in model:
        fully_shard(block, **kw)
        block.compile(backend=backend)
    fully_shard(model, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    losses = []
    for _ in range(steps):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if wrap and precompute:
            graphpass.precompute_fsdp_fp8_scales(model)
        losses.append(loss.detach())
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, backend


def test_the_shard_wrapper_gathers_the_bits_of_quantizing_the_weight(group):
    """fsdp_pre_all_gather / fsdp_post_all_gather on one rank: the gathered E4M3 bytes and scale
    are graphpass's tensorwise quantize of the weight (rowwise), bit for bit; the shard wrapper
    behaves as its tensor (the ops FSDP2 shards with keep it wrapped)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    w = torch.randn(96, 64)
    linear = nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    model = nn.Sequential(linear)
    result = graphpass.fsdp_fp8_weights(model, graphpass.Config(**OPTIONS))
    assert result.fp8 == ("0.weight",) and result.kept == ()
    shard = linear.weight
    assert isinstance(shard, FP8GatherShard) and isinstance(shard, nn.Parameter)
    assert isinstance(shard.detach().chunk(2)[0], FP8GatherShard)
    assert torch.equal(shard * 2, w * 2) and type(shard * 2) is torch.Tensor
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    inputs, meta = shard.fsdp_pre_all_gather(mesh, w.shape, w.stride(), model, mp)
    (data,) = inputs
    assert data.dtype == torch.uint8 and data.shape == w.shape
    gathered, inner = shard.fsdp_post_all_gather((data,), meta, torch.bfloat16)
    assert isinstance(gathered, FP8GatheredWeight) and gathered.dtype == torch.bfloat16
    want_data, want_scale = recipes.quantize(w.to(torch.bfloat16), "tensorwise", "weight")
    assert torch.equal(gathered._data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(gathered._scale_inv, want_scale)
    # read outside a graph graphpass partitions: a clear error, never a dequantized weight
    with pytest.raises(RuntimeError, match="read outside a graph compiled by graphpass"):
        torch.relu(gathered)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape", [(512, 256), (512, 200)], ids=["whole_tiles", "partial_cols"])
def test_blockwise_shards_quantized_alone_are_slices_of_the_whole_quantize(world, shape):
    """A weight whose dim-0 shards are whole 128-row blocks: each shard quantized alone
    (blockwise, 128x128 tiles) is the whole weight's quantize sliced, data and tile scales, bit
    for bit (a partial last column block too, outliers, an inf, a NaN and an all-zero tile
    included); the columnwise copy (dgrad's) is the rowwise copy transposed, scales too."""
    from graphpass.fp8.fsdp import block_shards

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[3, 7], w[200, 5], w[300, 1] = 3e4, float("inf"), float("nan")
    w[384:, :128] = 0
    assert block_shards("blockwise", shape, world) is None
    data, scale = recipes.quantize(w, "blockwise", "weight")
    rows = shape[0] // world
    for r, shard in enumerate(w.chunk(world)):
        d, s = recipes.quantize(shard, "blockwise", "weight")
        assert torch.equal(d.view(torch.uint8), data[r * rows:(r + 1) * rows].view(torch.uint8))
        assert torch.equal(s, scale[r * rows // 128:(r + 1) * rows // 128])
    col_data, col_scale = recipes.quantize(w, "blockwise", "weight", columnwise=True)
    assert torch.equal(col_data.view(torch.uint8), data.t().contiguous().view(torch.uint8))
    assert torch.equal(col_scale, scale.t().contiguous())


def test_blockwise_shard_layouts_that_cut_a_tile_are_said():
    """Shards that are not whole 128-row blocks, or uneven ones (FSDP2 pads them), gather in
    the parameter dtype: the reason names the shard rows and the block."""
    from graphpass.fp8.fsdp import block_shards

    assert block_shards("blockwise", (256, 256), 4) == (
        "its shards are 64 rows (256 rows over 4 ranks), not a multiple of the 128x128 scale "
        "block: a block would cross a shard boundary, so its scale needs rows of two shards")
    assert block_shards("blockwise", (384, 256), 2).startswith(
        "its shards are 192 rows (384 rows over 2 ranks)")
    assert block_shards("blockwise", (255, 256), 2) == (
        "uneven shards (255 rows over 2 ranks, each padded to 128 rows): a blockwise weight's "
        "128x128 scale blocks are quantized shard by shard on even shards only")


class _TwoRanks:
    """A stand-in for a 2-rank DeviceMesh (what the pre-all-gather asks of it)."""

    def size(self) -> int:
        return 2


def test_the_blockwise_shard_wrapper_gathers_data_and_tile_scales(group):
    """fsdp_pre_all_gather / fsdp_post_all_gather, blockwise, the all-gather of 2 ranks done
    by hand (each rank's inputs concatenated along dim 0): two all-gather inputs per rank, its
    shard's E4M3 bytes and fp32 tile scales, which gathered are graphpass's blockwise quantize
    of the whole weight, bit for bit. A 96-row weight (48-row shards: not a whole tile) gathers
    bf16 with a warning, and so does any weight on a 1-rank mesh (FSDP2 keeps a 1-rank group's
    first all-gather input only)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    w = torch.randn(512, 256)
    model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Linear(512, 96, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
    result = graphpass.fsdp_fp8_weights(model, graphpass.Config(fp8="blockwise"))
    assert result.fp8 == ("0.weight", "1.weight")
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    shards = model[0].weight.detach().chunk(2)
    assert all(isinstance(s, FP8GatherShard) for s in shards)
    per_rank = [s.fsdp_pre_all_gather(_TwoRanks(), w.shape, w.stride(), model, mp)
                for s in shards]
    assert [(t.dtype, tuple(t.shape)) for t in per_rank[0][0]] == [(torch.uint8, (256, 256)),
                                                                  (torch.float32, (2, 2))]
    outputs = tuple(torch.cat(parts) for parts in zip(*(inputs for inputs, _ in per_rank)))
    gathered, inner = shards[0].fsdp_post_all_gather(outputs, per_rank[0][1], torch.bfloat16)
    assert isinstance(gathered, FP8GatheredWeight) and len(inner) == 2
    want_data, want_scale = recipes.quantize(w.to(torch.bfloat16), "blockwise", "weight")
    assert torch.equal(gathered._data.view(torch.uint8), want_data.view(torch.uint8))
    assert torch.equal(gathered._scale_inv, want_scale)
    small = model[1].weight
    with pytest.warns(graphpass.FSDPFP8Warning, match=r"1\.weight is all-gathered in "
                      r"torch\.bfloat16, not FP8: its shards are 48 rows \(96 rows over 2 "
                      r"ranks\), not a multiple of the 128x128 scale block"):
        (full,), meta = small.detach().chunk(2)[0].fsdp_pre_all_gather(
            _TwoRanks(), small.shape, small.stride(), model, mp)
    assert meta is None and full.dtype == torch.bfloat16 and full.shape == (48, 512)
    one = nn.Sequential(nn.Linear(256, 512, bias=False))
    graphpass.fsdp_fp8_weights(one, graphpass.Config(fp8="blockwise"))
    with pytest.warns(graphpass.FSDPFP8Warning, match="not FP8: one rank: FSDP2 gathers nothing"):
        (full,), meta = one[0].weight.fsdp_pre_all_gather(init_device_mesh("cpu", (1,)), w.shape,
                                                          w.stride(), one, mp)
    assert meta is None and full.dtype == torch.bfloat16


def test_one_rank_fp8_gathers_reduce_a_stale_amax_again(group):
    """One rank, fp32 parameters under MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32),
    2 steps, without precompute_fsdp_fp8_scales: after the optimizer step each changed weight
    reduces its own amax before its all-gather, with a warning (once): the bits of the bf16
    gathers, never a stale scale. (With the precompute, the 2-rank test above.) The report
    lists each weight's gather."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    want = _train(_model(torch.float32), wrap=False, mp=mp)
    torch._dynamo.reset()
    with pytest.warns(graphpass.FSDPFP8Warning, match="changed since its amax was reduced"):
        got = _train(_model(torch.float32), wrap=True, mp=mp, precompute=False)
    assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))
    assert all(torch.equal(want[1][n], got[1][n]) for n in want[1])
    notes = got[2].report().notes
    assert ("weight all-gather: a.weight: FSDP2 (before the graph), (96, 64), float8_e4m3fn "
            "(as uint8) (graphpass.fsdp_fp8_weights), 6.00 KiB each all-gather") in notes
    assert ("weight all-gather: norm.weight: FSDP2 (before the graph), (64,), bfloat16 "
            "(parameter dtype), 128 B each all-gather") in notes


def test_a_cost_choice_does_not_keep_an_fp8_gathered_linear_in_bf16(group):
    """fp8_min_gemm_flops (like the cost model's roofline, lower_fp8's other cost choice) would
    keep these linears in bf16, but their weights arrive in FP8 (there is no bf16 weight to
    run): lowered, with a note saying so."""
    options = dict(OPTIONS, fp8_min_gemm_flops=10**12)
    _, _, backend = _train(_model(), wrap=True, backend_options=options, steps=1)
    notes = backend.report().notes
    assert ("fp8_cost_model: not judged: a: the weight arrives all-gathered in FP8 "
            "(graphpass.fsdp_fp8_weights), so the linear is lowered; in bf16 otherwise: GEMM of "
            "393,216 FLOPs is below fp8_min_gemm_flops=1,000,000,000,000") in notes
    assert "lowered: a (reference/tensorwise)" in notes


def test_a_graph_that_reads_an_fp8_gathered_weight_otherwise_is_an_error(group):
    """A backend whose fp8_exclude keeps a wrapped linear in bf16 (not the config
    fsdp_fp8_weights was given) would read a dequantized weight: a clear error at compile
    time naming the linear, never a silently different number."""
    options = dict(OPTIONS, fp8_exclude=("b",))
    with pytest.raises(Exception, match=r"the weight of b arrives all-gathered in FP8 by FSDP2"):
        _train(_model(), wrap=True, backend_options=options, steps=1)


def test_weights_not_gathered_in_fp8_are_said(group):
    """Each case gathers in the parameter dtype, with a warning naming the reason: rowwise and
    mxfp8 (dgrad's columnwise copy scales along dim 0), fp8_weight_all_gather=False, a
    model sharded already (an error: wrap before fully_shard), a MixedPrecisionPolicy
    param_dtype graphpass does not quantize (float64: the bits of the plain run)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for options, why in ((dict(fp8="rowwise"), "fp8='rowwise': dgrad's columnwise copy of a "
                          "weight has one scale per column of the whole weight"),
                         (dict(fp8="mxfp8"), "fp8='mxfp8': dgrad's columnwise copy of a weight "
                          "has 1x32 blocks down each column"),
                         (dict(OPTIONS, fp8_weight_all_gather=False),
                          "fp8_weight_all_gather=False")):
        model = _model()
        with pytest.warns(graphpass.FSDPFP8Warning, match=why):
            result = graphpass.fsdp_fp8_weights(model, graphpass.Config(**options))
        assert result.fp8 == () and len(result.kept) == 4
        assert not any(isinstance(p, FP8GatherShard) for p in model.parameters())
    model = _model()
    fully_shard(model)
    with pytest.raises(ValueError, match="call it before fully_shard"):
        graphpass.fsdp_fp8_weights(model, graphpass.Config(**OPTIONS))
    mp = MixedPrecisionPolicy(param_dtype=torch.float64)
    want = _train(_model(torch.float32), wrap=False, mp=mp, backend_options=dict(codegen="eager"),
                  steps=1)
    torch._dynamo.reset()
    with pytest.warns(graphpass.FSDPFP8Warning, match="is all-gathered in torch.float64, not FP8"):
        got = _train(_model(torch.float32), wrap=True, mp=mp,
                     backend_options=dict(codegen="eager"), steps=1)
    assert all(torch.equal(want[1][n], got[1][n]) for n in want[1])


def test_fp8_all_gather_is_a_deprecated_name_of_fp8_sequence_all_gather():
    """The sequence-parallel option's old name still works, with a FutureWarning once."""
    from graphpass import config as config_module

    config_module._warned.discard("fp8_all_gather")
    with pytest.warns(FutureWarning, match="fp8_all_gather is deprecated; use "
                                           "fp8_sequence_all_gather"):
        config = graphpass.Config(fp8="tensorwise", fp8_all_gather=False)
    assert config.fp8_sequence_all_gather is False and config.fp8_all_gather is False
    assert config.changed() == {"fp8": "tensorwise", "fp8_sequence_all_gather": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert graphpass.Config.from_options(fp8_all_gather=True).fp8_sequence_all_gather
    with pytest.raises(ValueError, match="given together"):
        graphpass.Config(fp8_all_gather=True, fp8_sequence_all_gather=False)
