"""graphpass.fp8.recipes against hand-computed Transformer Engine numerics.

Expected values are worked out by hand from the rules of Transformer Engine's quantize kernels
(``transformer_engine/common``: the cast kernels and their scale computation), never produced by
the code under test.
Bit patterns: E4M3 is s|eeee|mmm with bias 7 (0x7E = 448, 0x38 = 1, 0x01 = 2**-9);
E5M2 is s|eeeee|mm with bias 15 (0x7B = 57344, 0x3C = 1, 0x01 = 2**-16).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from graphpass.fp8.recipes import (
    BLOCKWISE,
    E4M3,
    E5M2,
    MXFP8,
    RECIPE_NAMES,
    ROLES,
    TENSORWISE,
    Recipe,
    block_shape,
    compute_scale_from_amax,
    dequantize,
    float_to_e8m0,
    fp8_dtype,
    fp8_max,
    get_recipe,
    qdq,
    quantize,
    requires_divisibility,
)

INF = float("inf")
NAN = float("nan")
FLT_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)  # 0x7F7F0000 as fp32


def bits(t: torch.Tensor) -> list:
    return t.view(torch.uint8).tolist()


def f32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def recip(v: float) -> float:
    """fp32 1/v, as TE's reciprocal computes scale_inv."""
    return float(np.float32(1) / np.float32(v))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values and dtype, NaN matching NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


# --- recipes, roles, names ---------------------------------------------------------------------


def test_fp8_max():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(ValueError):
        fp8_max(torch.bfloat16)


def test_default_recipes_match_te():
    assert get_recipe("tensorwise") == TENSORWISE == Recipe("tensorwise", "HYBRID", False, 0.0)
    assert get_recipe("blockwise") == BLOCKWISE == Recipe("blockwise", "E4M3", True, 0.0)
    assert get_recipe("mxfp8") == MXFP8 == Recipe("mxfp8", "E4M3", True, 0.0)


@pytest.mark.parametrize(
    "recipe, role, dtype",
    [
        (TENSORWISE, "input", E4M3),
        (TENSORWISE, "weight", E4M3),
        (TENSORWISE, "grad", E5M2),
        (BLOCKWISE, "input", E4M3),
        (BLOCKWISE, "weight", E4M3),
        (BLOCKWISE, "grad", E4M3),
        (dataclasses.replace(BLOCKWISE, fp8_format="HYBRID"), "grad", E5M2),
        (MXFP8, "input", E4M3),
        (MXFP8, "weight", E4M3),
        (MXFP8, "grad", E4M3),
        (dataclasses.replace(MXFP8, fp8_format="HYBRID"), "grad", E5M2),
    ],
)
def test_role_picks_fp8_dtype(recipe, role, dtype):
    assert fp8_dtype(recipe, role) == dtype
    data, _ = quantize(torch.ones(32, 32), recipe, role)
    assert data.dtype == dtype


def test_block_shapes():
    assert block_shape("tensorwise", "weight") is None
    assert block_shape("blockwise", "input") == (1, 128)
    assert block_shape("blockwise", "grad") == (1, 128)
    assert block_shape("blockwise", "weight") == (128, 128)
    assert block_shape("mxfp8", "weight") == (1, 32)


def test_requires_divisibility():
    assert [requires_divisibility(n) for n in RECIPE_NAMES] == [16, 128, 32, 16]
    assert requires_divisibility(MXFP8) == 32


def test_delayed_scaling_is_refused_with_alternatives():
    with pytest.raises(ValueError, match="torch.compile") as info:
        get_recipe("delayed")
    message = str(info.value)
    assert "check_recipe_support" in message
    for name in RECIPE_NAMES:
        assert repr(name) in message


def test_unknown_recipe_and_role_name_valid_values():
    with pytest.raises(ValueError, match="'tensorwise', 'blockwise', 'mxfp8'"):
        get_recipe("nvfp4")
    with pytest.raises(ValueError, match="'input', 'weight', 'grad'"):
        quantize(torch.ones(2, 2), "tensorwise", "output")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(name="mxfp8", fp8_format="E4M3", power_2_scales=False),
        dict(name="mxfp8", fp8_format="E4M3", power_2_scales=True, amax_epsilon=1e-6),
        dict(name="tensorwise", fp8_format="E5M2", power_2_scales=False),
        dict(name="tensorwise", fp8_format="HYBRID", power_2_scales=False, amax_epsilon=-1.0),
        dict(name="delayed", fp8_format="HYBRID", power_2_scales=False),
    ],
)
def test_invalid_recipes_rejected(kwargs):
    with pytest.raises(ValueError):
        Recipe(**kwargs)


def test_quantize_rejects_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.ones(2, 2, 2), "tensorwise", "input")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        quantize(torch.ones(2, 2, dtype=torch.float64), "tensorwise", "input")


# --- compute_scale_from_amax (TE recipe_common.cuh) ---------------------------------------------


def test_scale_degenerate_amax_gives_one():
    amax = f32([0.0, INF, NAN, 2.0])
    assert compute_scale_from_amax(amax, 448.0).tolist() == [1.0, 1.0, 1.0, 224.0]


def test_scale_overflow_becomes_value_for_inf():
    # 448 / 1e-38 overflows fp32.
    amax = f32([1e-38])
    assert compute_scale_from_amax(amax, 448.0).item() == FLT_MAX
    assert compute_scale_from_amax(amax, 448.0, value_for_inf=BF16_MAX).item() == BF16_MAX
    assert compute_scale_from_amax(amax, 448.0, power_2_scales=True).item() == 2.0**127


def test_scale_epsilon_floors_amax_before_the_zero_check():
    amax = f32([0.0, 0.25, 1.0])
    assert compute_scale_from_amax(amax, 448.0, amax_epsilon=0.5).tolist() == [896.0, 896.0, 448.0]


def test_scale_power_2_rounds_down():
    # 448/3 = 149.33 -> 128; 448/448 = 1 stays; 448/0.3 = 1493.3 -> 1024; 448/500 = 0.896 -> 0.5
    amax = f32([3.0, 448.0, 0.3, 500.0])
    scale = compute_scale_from_amax(amax, 448.0, power_2_scales=True)
    assert scale.tolist() == [128.0, 1.0, 1024.0, 0.5]


def test_scale_is_ieee_division():
    amax = f32([3.0, 7.0, 0.1])
    expected = [float(np.float32(448) / np.float32(a)) for a in (3.0, 7.0, np.float32(0.1))]
    assert compute_scale_from_amax(amax, 448.0).tolist() == expected


# --- tensorwise (Float8CurrentScaling) ----------------------------------------------------------


def test_tensorwise_e4m3_input():
    # amax 2 -> scale 224: [224, -448, 112, 0] = [1.75*2^7, -1.75*2^8, 1.75*2^6, 0]
    data, scale_inv = quantize(f32([[1.0, -2.0, 0.5, 0.0]]), TENSORWISE, "input")
    assert data.dtype == E4M3 and bits(data) == [[0x76, 0xFE, 0x6E, 0x00]]
    assert scale_inv.shape == () and scale_inv.dtype == torch.float32
    assert scale_inv.item() == recip(224.0)


def test_tensorwise_e5m2_grad():
    # amax 2 -> scale 57344/2 = 28672: [1.75*2^14, -1.75*2^15, 1.75*2^13, 0]
    data, scale_inv = quantize(f32([[1.0, -2.0, 0.5, 0.0]]), TENSORWISE, "grad")
    assert data.dtype == E5M2 and bits(data) == [[0x77, 0xFB, 0x73, 0x00]]
    assert scale_inv.item() == recip(28672.0)


def test_tensorwise_zeros_scale_one():
    data, scale_inv = quantize(torch.zeros(3, 5), TENSORWISE, "weight")
    assert scale_inv.item() == 1.0 and bits(data) == [[0] * 5] * 3


def test_tensorwise_empty_tensor():
    data, scale_inv = quantize(torch.zeros(0, 16), TENSORWISE, "input")
    assert data.shape == (0, 16) and scale_inv.item() == 1.0


def test_tensorwise_inf_gives_scale_one_and_saturates():
    # amax inf -> scale 1; the cast is satfinite: +-inf -> +-448, 1 -> 0x38, -2 -> 0xC0.
    data, scale_inv = quantize(f32([[1.0, -2.0, INF, -INF]]), TENSORWISE, "input")
    assert scale_inv.item() == 1.0 and bits(data) == [[0x38, 0xC0, 0x7E, 0xFE]]
    assert_same(dequantize(data, scale_inv, TENSORWISE, "input"), f32([[1.0, -2.0, 448.0, -448.0]]))


def test_tensorwise_saturation_beyond_fp8_max():
    # Scale 1 (amax inf); 500 and 1e30 exceed 448 (E4M3) / 1e6 exceeds 57344 (E5M2, where an
    # unclamped cast would give inf).
    data, _ = quantize(f32([[500.0, -1e30, INF]]), TENSORWISE, "input")
    assert bits(data) == [[0x7E, 0xFE, 0x7E]]
    data, _ = quantize(f32([[1.0, 1e6, -1e6, INF, -INF]]), TENSORWISE, "grad")
    assert bits(data) == [[0x3C, 0x7B, 0xFB, 0x7B, 0xFB]]


def test_tensorwise_nan_is_ignored_by_amax_and_stays_nan():
    # TE's amax uses fmaxf, which drops NaN: amax is 2, scale 224.
    data, scale_inv = quantize(f32([[1.0, -2.0, NAN, 0.5]]), TENSORWISE, "input")
    assert scale_inv.item() == recip(224.0)
    b = bits(data)[0]
    assert [b[0], b[1], b[3]] == [0x76, 0xFE, 0x6E]
    assert torch.isnan(data.float()[0, 2])
    # All NaN: amax 0 -> scale 1, data all NaN.
    data, scale_inv = quantize(f32([[NAN, NAN]]), TENSORWISE, "grad")
    assert scale_inv.item() == 1.0 and torch.isnan(data.float()).all()


def test_tensorwise_tiny_amax_uses_flt_max_scale():
    # amax 2^-127 (fp32 subnormal): 448 * 2^127 overflows -> scale FLT_MAX = (2 - 2^-23) * 2^127,
    # data 2 - 2^-23 -> E4M3 2.0 (0x40), scale_inv 1/FLT_MAX rounds to 2^-128.
    x = f32([[2.0**-127]])
    data, scale_inv = quantize(x, TENSORWISE, "input")
    assert bits(data) == [[0x40]] and scale_inv.item() == 2.0**-128
    # Power-of-2: FLT_MAX -> 2^127, data 1.0 exactly.
    data, scale_inv = quantize(x, dataclasses.replace(TENSORWISE, power_2_scales=True), "input")
    assert bits(data) == [[0x38]] and scale_inv.item() == 2.0**-127


def test_tensorwise_e4m3_rne_ties_and_subnormals():
    # amax 448 -> scale exactly 1, so these are the cast's own rounding.
    x = f32(
        [
            [
                448.0,
                1 + 1 / 16,  # tie 1 | 1.125 -> even 1 (0x38)
                1 + 3 / 16,  # tie 1.125 | 1.25 -> even 1.25 (0x3A)
                -(1 + 1 / 16),  # -> -1 (0xB8)
                2.0**-9,  # smallest subnormal (0x01)
                2.0**-10,  # tie 0 | 2^-9 -> 0
                3 * 2.0**-10,  # tie 1 | 2 subnormal units -> 2 (0x02)
                1.25 * 2.0**-10,  # above the tie -> 2^-9
                7 * 2.0**-9,  # largest subnormal (0x07)
                2.0**-6,  # smallest normal (0x08)
            ]
        ]
    )
    data, scale_inv = quantize(x, TENSORWISE, "input")
    assert scale_inv.item() == 1.0
    assert bits(data) == [[0x7E, 0x38, 0x3A, 0xB8, 0x01, 0x00, 0x02, 0x01, 0x07, 0x08]]


def test_tensorwise_e5m2_rne_ties_and_subnormals():
    # amax 57344 -> scale 1.
    x = f32(
        [
            [
                57344.0,
                1 + 1 / 8,  # tie 1 | 1.25 -> 1 (0x3C)
                1 + 3 / 8,  # tie 1.25 | 1.5 -> 1.5 (0x3E)
                2.0**-16,  # smallest subnormal (0x01)
                2.0**-17,  # tie 0 | 2^-16 -> 0
                3 * 2.0**-17,  # tie 1 | 2 units -> 2 (0x02)
                3 * 2.0**-16,  # largest subnormal (0x03)
                2.0**-14,  # smallest normal (0x04)
            ]
        ]
    )
    data, scale_inv = quantize(x, TENSORWISE, "grad")
    assert scale_inv.item() == 1.0
    assert bits(data) == [[0x7B, 0x3C, 0x3E, 0x01, 0x00, 0x02, 0x03, 0x04]]


def test_tensorwise_power_2_scales():
    x = f32([[3.0, 1.0, -1.5]])
    # 448/3 -> 128: [384, 128, -192] = [1.5*2^8, 2^7, -1.5*2^7]; dequantization is exact.
    recipe = dataclasses.replace(TENSORWISE, power_2_scales=True)
    data, scale_inv = quantize(x, recipe, "input")
    assert scale_inv.item() == 2.0**-7 and bits(data) == [[0x7C, 0x70, 0xF4]]
    assert_same(dequantize(data, scale_inv, recipe, "input"), x)
    # fp32 scale 149.33: [448, 149.33 -> 144 (1.125*2^7), -224]
    data, scale_inv = quantize(x, TENSORWISE, "input")
    assert scale_inv.item() == recip(float(np.float32(448) / np.float32(3)))
    assert bits(data) == [[0x7E, 0x71, 0xF6]]


def test_tensorwise_columnwise_is_the_transpose():
    x = torch.randn(48, 80, generator=torch.Generator().manual_seed(0))
    row, row_s = quantize(x, TENSORWISE, "input")
    col, col_s = quantize(x, TENSORWISE, "input", columnwise=True)
    assert col.shape == (80, 48) and col.is_contiguous()
    assert bits(col) == bits(row.t().contiguous()) and col_s.item() == row_s.item()
    assert_same(dequantize(col, col_s, TENSORWISE, "input", columnwise=True),
                dequantize(row, row_s, TENSORWISE, "input"))


# --- blockwise (Float8BlockScaling) -------------------------------------------------------------


def test_blockwise_1x128_block_edge():
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 127], x[0, 128], x[0, 255] = 1.0, 2.0, 8.0, 1.0
    x[1, 5] = -3.0
    data, scale_inv = quantize(x, BLOCKWISE, "input")
    # Row 0: block 0 amax 2 -> 224 -> pow2 128; block 1 amax 8 -> 56 -> 32.
    # Row 1: block 0 amax 3 -> 149.3 -> 128; block 1 all zero -> 1.
    assert scale_inv.dtype == torch.float32
    assert scale_inv.tolist() == [[2.0**-7, 2.0**-5], [2.0**-7, 1.0]]
    expected = torch.zeros(2, 256, dtype=torch.uint8)
    expected[0, 0] = 0x70  # 128
    expected[0, 127] = 0x78  # 256
    expected[0, 128] = 0x78  # 256
    expected[0, 255] = 0x60  # 32
    expected[1, 5] = 0xFC  # -384
    assert torch.equal(data.view(torch.uint8), expected)
    assert_same(dequantize(data, scale_inv, BLOCKWISE, "input"), x)

    # fp32 scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1): 224, 56, 448/3, 1.
    recipe = dataclasses.replace(BLOCKWISE, power_2_scales=False)
    data, scale_inv = quantize(x, recipe, "input")
    assert scale_inv.tolist() == [
        [recip(224.0), recip(56.0)],
        [recip(float(np.float32(448) / np.float32(3))), 1.0],
    ]
    d = data.view(torch.uint8)
    assert [d[0, 0].item(), d[0, 127].item(), d[0, 128].item(), d[0, 255].item()] == [
        0x76,  # 224
        0x7E,  # 448
        0x7E,  # 448
        0x66,  # 56 = 1.75*2^5
    ]
    assert d[1, 5].item() == 0xFE  # -448


def test_blockwise_partial_last_block():
    # K = 200: block 1 holds columns 128..199 and gets its own amax.
    x = torch.zeros(1, 200)
    x[0, 0], x[0, 199] = 1.0, 4.0
    data, scale_inv = quantize(x, BLOCKWISE, "input")
    assert data.shape == (1, 200) and scale_inv.shape == (1, 2)
    assert scale_inv.tolist() == [[2.0**-8, 2.0**-6]]  # 448 -> 256, 112 -> 64
    d = data.view(torch.uint8)
    assert d[0, 0].item() == 0x78 and d[0, 199].item() == 0x78  # both 256
    assert_same(dequantize(data, scale_inv, BLOCKWISE, "input"), x)


def test_blockwise_weight_128x128_tiles():
    x = torch.zeros(256, 130)
    x[0, 0], x[0, 127] = 1.0, 0.25  # tile (0, 0): amax 1 -> 448 -> 256
    x[127, 129] = 2.0  # tile (0, 1): 224 -> 128
    x[128, 0] = 4.0  # tile (1, 0): 112 -> 64
    x[255, 128] = 0.5  # tile (1, 1): 896 -> 512
    data, scale_inv = quantize(x, BLOCKWISE, "weight")
    assert data.shape == (256, 130)
    assert scale_inv.tolist() == [[2.0**-8, 2.0**-7], [2.0**-6, 2.0**-9]]
    d = data.view(torch.uint8)
    assert d[0, 0].item() == 0x78 and d[0, 127].item() == 0x68  # 256, 64
    assert d[127, 129].item() == d[128, 0].item() == d[255, 128].item() == 0x78
    assert_same(dequantize(data, scale_inv, BLOCKWISE, "weight"), x)

    # Columnwise: the same tiles, transposed.
    col, col_s = quantize(x, BLOCKWISE, "weight", columnwise=True)
    assert col.shape == (130, 256)
    assert torch.equal(col.view(torch.uint8), d.t())
    assert torch.equal(col_s, scale_inv.t())

    # As an activation the same tensor gets one scale per row and 128 columns.
    _, act_s = quantize(x, BLOCKWISE, "input")
    assert act_s.shape == (256, 2) and act_s[0].tolist() == [2.0**-8, 1.0]


def test_blockwise_columnwise_blocks_run_down_columns():
    x = torch.zeros(2, 128)
    x[0, 0], x[0, 1], x[1, 0], x[1, 1] = 1.0, 2.0, 4.0, 0.5
    row, row_s = quantize(x, BLOCKWISE, "input")
    # Rows: amax 2 -> 128 and amax 4 -> 64.
    assert row_s.tolist() == [[2.0**-7], [2.0**-6]]
    assert bits(row)[0][:2] == [0x70, 0x78] and bits(row)[1][:2] == [0x78, 0x60]
    col, col_s = quantize(x, BLOCKWISE, "input", columnwise=True)
    # Columns (a partial block of M = 2): col 0 amax 4 -> 64, col 1 amax 2 -> 128, rest 1.
    assert col.shape == (128, 2) and col_s.shape == (128, 1)
    assert col_s[:3].flatten().tolist() == [2.0**-6, 2.0**-7, 1.0]
    assert bits(col)[0] == [0x68, 0x78] and bits(col)[1] == [0x78, 0x68]
    assert_same(dequantize(col, col_s, BLOCKWISE, "input", columnwise=True), x)


def test_blockwise_inf_only_affects_its_block():
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1], x[0, 128] = INF, 3.0, 1.0
    data, scale_inv = quantize(x, BLOCKWISE, "input")
    assert scale_inv.tolist() == [[1.0, 2.0**-8]]
    d = data.view(torch.uint8)
    assert [d[0, 0].item(), d[0, 1].item(), d[0, 128].item()] == [0x7E, 0x44, 0x78]


def test_blockwise_inf_scale_uses_input_dtype_max():
    # amax 2^-130: 448 * 2^130 overflows, TE substitutes the INPUT dtype's max.
    for dtype, value_for_inf in ((torch.float32, FLT_MAX), (torch.bfloat16, BF16_MAX)):
        x = torch.full((1, 4), 2.0**-130, dtype=dtype)
        data, scale_inv = quantize(x, BLOCKWISE, "input")  # pow2: both max -> 2^127
        assert scale_inv.item() == 2.0**-127 and bits(data) == [[0x20] * 4]  # 2^-3
        fp32_scales = dataclasses.replace(BLOCKWISE, power_2_scales=False)
        data, scale_inv = quantize(x, fp32_scales, "input")
        assert scale_inv.item() == recip(value_for_inf)
        assert bits(data) == [[0x28] * 4]  # ~0.249 -> 0.25


def test_blockwise_hybrid_grad_is_e5m2():
    recipe = dataclasses.replace(BLOCKWISE, fp8_format="HYBRID")
    # amax 2 -> 28672 -> pow2 16384: [2^14, -2^15]
    data, scale_inv = quantize(f32([[1.0, -2.0]]), recipe, "grad")
    assert data.dtype == E5M2 and bits(data) == [[0x74, 0xF8]]
    assert scale_inv.tolist() == [[2.0**-14]]


# --- mxfp8 (MXFP8BlockScaling) ------------------------------------------------------------------


def test_float_to_e8m0():
    val = f32([0.0, 2.0**-127, 1.5 * 2.0**-127, 2.0**-130, 1.0, 1.0000001, 3.0, INF, NAN, FLT_MAX])
    assert float_to_e8m0(val).tolist() == [0, 0, 1, 0, 127, 128, 129, 254, 255, 254]
    assert float_to_e8m0(val).dtype == torch.uint8


def test_mxfp8_exponent_rounds_up():
    x = torch.zeros(32, 64)
    # amax * fp32(1/448): 448 -> exactly 1 -> e 127; 449 -> 1.0022 -> e 128 (multiplier 1/2).
    x[0, 0], x[0, 32] = 448.0, 449.0
    # 896 -> exactly 2 -> e 128; 1 -> 2^-9 * 1.14 -> e 119 (multiplier 2^8).
    x[1, 0], x[1, 32] = 896.0, 1.0
    # 28 = 448 * 2^-4 -> e 123; 28.5 -> e 124 (multiplier 8: 228 -> 224).
    x[2, 0], x[2, 32] = 28.0, 28.5
    data, scale_inv = quantize(x, MXFP8, "input")
    assert scale_inv.dtype == torch.uint8 and scale_inv.shape == (32, 2)
    expected_e = torch.zeros(32, 2, dtype=torch.uint8)  # zero blocks: byte 0 (2^-127)
    expected_e[0] = torch.tensor([127, 128])
    expected_e[1] = torch.tensor([128, 119])
    expected_e[2] = torch.tensor([123, 124])
    assert torch.equal(scale_inv, expected_e)
    d = data.view(torch.uint8)
    assert [d[0, 0].item(), d[0, 32].item()] == [0x7E, 0x76]  # 448, 224.5 -> 224
    assert [d[1, 0].item(), d[1, 32].item()] == [0x7E, 0x78]  # 448, 256
    assert [d[2, 0].item(), d[2, 32].item()] == [0x7E, 0x76]  # 448, 228 -> 224
    assert int((d != 0).sum()) == 6
    y = dequantize(data, scale_inv, MXFP8, "input")
    expected_y = x.clone()
    expected_y[0, 32], expected_y[2, 32] = 448.0, 28.0
    assert_same(y, expected_y)


def test_mxfp8_inf_and_nan():
    x = torch.zeros(32, 32)
    x[0, 0], x[0, 1] = INF, 1.0  # amax inf -> e 254: inf -> 448, 1 * 2^-127 -> 0
    x[1, 0], x[1, 1] = NAN, 2.0  # NaN ignored: amax 2 -> e 120 (multiplier 2^7)
    x[2, 0] = -INF
    data, scale_inv = quantize(x, MXFP8, "input")
    assert scale_inv[:3, 0].tolist() == [254, 120, 254]
    d = data.view(torch.uint8)
    assert [d[0, 0].item(), d[0, 1].item(), d[1, 1].item(), d[2, 0].item()] == [
        0x7E,
        0x00,
        0x78,
        0xFE,
    ]
    assert torch.isnan(data.float()[1, 0])
    # 448 * 2^(254-127) overflows fp32: inf comes back as inf.
    y = dequantize(data, scale_inv, MXFP8, "input")
    assert y[0, :2].tolist() == [INF, 0.0] and y[2, 0].item() == -INF
    assert torch.isnan(y[1, 0]) and y[1, 1].item() == 2.0


def test_mxfp8_columnwise_uses_32x1_blocks():
    x = torch.zeros(64, 32)
    x[0, 0], x[0, 1], x[40, 0] = 448.0, 1.0, 1.0
    row, row_s = quantize(x, MXFP8, "weight")
    assert row.shape == (64, 32) and row_s.shape == (64, 1)
    # Row 0 amax 448 -> e 127 (multiplier 1): x[0, 1] stays 1.0 (0x38).
    assert row_s[0, 0].item() == 127 and row.view(torch.uint8)[0, 1].item() == 0x38
    col, col_s = quantize(x, MXFP8, "weight", columnwise=True)
    assert col.shape == (32, 64) and col_s.shape == (32, 2)
    # Column 0: rows 0-31 amax 448 -> 127, rows 32-63 amax 1 -> 119;
    # column 1: rows 0-31 amax 1 -> 119 (x[0, 1] becomes 256, 0x78), rows 32-63 zero -> 0.
    assert col_s[:2].tolist() == [[127, 119], [119, 0]]
    assert col.view(torch.uint8)[1, 0].item() == 0x78
    assert_same(dequantize(col, col_s, MXFP8, "weight", columnwise=True), x)
    assert_same(dequantize(row, row_s, MXFP8, "weight"), x)


def test_mxfp8_hybrid_grad_is_e5m2():
    recipe = dataclasses.replace(MXFP8, fp8_format="HYBRID")
    x = torch.zeros(32, 32)
    x[0, 0] = 57344.0  # 57344 * fp32(1/57344) = 1 -> e 127
    data, scale_inv = quantize(x, recipe, "grad")
    assert data.dtype == E5M2 and scale_inv[0, 0].item() == 127
    assert data.view(torch.uint8)[0, 0].item() == 0x7B


@pytest.mark.parametrize("shape", [(32, 48), (48, 32), (50, 50)])
@pytest.mark.parametrize("columnwise", [False, True])
def test_mxfp8_requires_multiples_of_32(shape, columnwise):
    with pytest.raises(ValueError, match=r"multiples of 32.*" + str(shape).replace("(", r"\(")
                       .replace(")", r"\)")):
        quantize(torch.ones(shape), MXFP8, "input", columnwise=columnwise)


# --- dequantize, qdq, tracing -------------------------------------------------------------------


def test_dequantize_validates_its_inputs():
    data, scale_inv = quantize(torch.ones(32, 64), MXFP8, "input")
    with pytest.raises(ValueError, match="float8_e5m2"):
        dequantize(data, scale_inv, TENSORWISE, "grad")
    with pytest.raises(ValueError, match=r"\(32, 2\)"):
        dequantize(data, scale_inv[:, :1], MXFP8, "input")
    data, scale_inv = quantize(torch.ones(4, 4), TENSORWISE, "input")
    one = dequantize(data, scale_inv.reshape(1), TENSORWISE, "input")  # TE's [1] layout
    assert_same(one, torch.ones(4, 4))


def test_qdq_keeps_dtype_and_orientation():
    x = torch.linspace(-3, 3, 64 * 96).reshape(64, 96).to(torch.bfloat16)
    for name in RECIPE_NAMES:
        for columnwise in (False, True):
            y = qdq(x, name, "input", columnwise=columnwise)
            assert y.shape == x.shape and y.dtype == torch.bfloat16


@pytest.mark.parametrize("name", RECIPE_NAMES)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("columnwise", [False, True])
def test_meta_and_fake_tensors(name, role, columnwise):
    m, k = (96, 224) if name == "mxfp8" else (100, 200)
    block = (1, None) if name == "rowwise" else block_shape(name, role)
    r, c = (k, m) if columnwise else (m, k)
    expected_scale = () if block is None else (-(-r // block[0]), -(-c // (block[1] or c)))
    x = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
    data, scale_inv = quantize(x, name, role, columnwise=columnwise)
    assert data.shape == (r, c) and data.dtype == fp8_dtype(name, role)
    assert scale_inv.shape == expected_scale
    assert scale_inv.dtype == (torch.uint8 if name == "mxfp8" else torch.float32)
    assert dequantize(data, scale_inv, name, role, columnwise=columnwise).shape == (m, k)
    with FakeTensorMode():
        data, scale_inv = quantize(torch.empty(m, k), name, role, columnwise=columnwise)
        assert data.shape == (r, c) and scale_inv.shape == expected_scale


def special_values_tensor(seed: int) -> torch.Tensor:
    """Random magnitudes over 2^±40 with zeros, ±inf and NaN sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    exponent = torch.randint(-40, 40, (160, 256), generator=g).float()
    x = torch.randn(160, 256, generator=g) * torch.exp2(exponent)
    x[torch.rand(160, 256, generator=g) < 0.05] = 0.0
    x[3, 7], x[9, 100], x[100, 200], x[150, 31] = INF, -INF, NAN, 2.0**-140
    return x


def test_traces_without_graph_breaks():
    torch._dynamo.reset()
    x = special_values_tensor(1)

    def all_recipes(t: torch.Tensor) -> list:
        return [qdq(t, name, "grad", columnwise=True) for name in RECIPE_NAMES]

    compiled = torch.compile(all_recipes, backend="eager", fullgraph=True, dynamic=True)
    for got, want in zip(compiled(x), all_recipes(x)):
        assert_same(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_matches_cpu(compiled):
    """Every recipe's quantize on CUDA, eager and under Inductor, bit-identical to the CPU's.
    Compiled, with the Inductor settings graphpass's backend sets where it inlines quantizes:
    exact fp32 division (Triton lowers ``x / y`` to the approximate ``div.full``; without it the
    rowwise scales of this tensor came out an ulp off on an H200) and eager's bf16 roundings."""
    from torch._inductor import config as inductor_config

    cases = [(n, r, c) for n in RECIPE_NAMES for r in ROLES for c in (False, True)]

    def all_cases(t: torch.Tensor) -> list:
        return [quantize(t, n, r, columnwise=c) for n, r, c in cases]

    x = special_values_tensor(2)
    fn = torch.compile(all_cases, fullgraph=True) if compiled else all_cases
    with inductor_config.patch({"eager_numerics.division_rounding": True,
                                "emulate_precision_casts": True}):
        got_all = fn(x.cuda())
    for case, (got_data, got_scale), (want_data, want_scale) in zip(
        cases, got_all, all_cases(x)
    ):
        got_bits, want_bits = got_data.cpu().view(torch.uint8), want_data.view(torch.uint8)
        nan = torch.isnan(want_data.float())
        assert torch.equal(torch.isnan(got_data.cpu().float()), nan), case
        assert torch.equal(got_bits[~nan], want_bits[~nan]), case  # NaN's sign bit may differ
        assert torch.equal(got_scale.cpu(), want_scale), case


# --- property: round-trip error -----------------------------------------------------------------


@settings(max_examples=20, deadline=None, database=None)
@given(
    m=st.sampled_from([32, 160]),
    k=st.sampled_from([96, 256]),
    center=st.integers(-60, 60),
    zero_fraction=st.sampled_from([0.0, 0.25]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_relative_error(m, k, center, zero_fraction, dtype, seed):
    """Every recipe keeps each value within the fp8 format's half-ulp: 2^-4 (E4M3), 2^-3 (E5M2).

    Magnitudes span 2^12 around 2^center, so after scaling (which loses at most a factor 2 to
    power-of-2 rounding) every non-zero value lands in the fp8 normal range, where the relative
    error bound holds. The 2^-10 slack covers the fp32 rounding of scale and scale_inv.
    """
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(center + 12 * torch.rand(m, k, generator=g) - 6)
    sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    zero = torch.rand(m, k, generator=g) < zero_fraction
    x = torch.where(zero, 0.0, sign * magnitude).to(dtype)
    x32 = x.float()
    for name in RECIPE_NAMES:
        for role in ROLES:
            bound = 2.0**-4 if fp8_dtype(name, role) == E4M3 else 2.0**-3
            for columnwise in (False, True):
                data, scale_inv = quantize(x, name, role, columnwise=columnwise)
                y = dequantize(data, scale_inv, name, role, columnwise=columnwise)
                err = (y - x32).abs()
                assert bool((err <= bound * (1 + 2.0**-10) * x32.abs()).all()), (name, role)
                assert bool((y[zero] == 0).all())
    # One scale per tensor: both orientations hold the same values.
    assert torch.equal(
        qdq(x, "tensorwise", "input"), qdq(x, "tensorwise", "input", columnwise=True)
    )


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_quantize_op_fake_metadata_equals_the_real_outputs(name):
    """graphpass::quantize's fake implementation traces the recipe once per input layout and
    then serves the outputs' metadata from a cache: the first (traced) and second (cached)
    fake calls, and the real op on real tensors, give the same sizes, strides and dtypes, for
    every role and usage, contiguous, transposed and 3-D (per expert) inputs."""
    from graphpass.fp8 import ops

    m, k = (64, 96) if name == "mxfp8" else (128, 256)
    layouts = [t.to(torch.bfloat16) for t in (torch.randn(m, k), torch.randn(k, m).t(),
                                              torch.randn(3, m, k))]
    meta = lambda ts: [(tuple(t.shape), tuple(t.stride()), t.dtype) for t in ts]  # noqa: E731
    ops._FAKE_OUTPUTS.clear()  # one cache over all cases: a key missing a field serves another's
    cases = 0
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in layouts]
    for role in ROLES:
        for usage in ops.USAGES:
            for x, fx in zip(layouts, fakes):
                real = meta(torch.ops.graphpass.quantize(x, name, role, usage))
                with mode:
                    first = meta(torch.ops.graphpass.quantize(fx, name, role, usage))
                    second = meta(torch.ops.graphpass.quantize(fx, name, role, usage))
                assert first == second == real, (role, usage, x.shape, x.stride())
                cases += 1
    assert len(ops._FAKE_OUTPUTS) == cases
