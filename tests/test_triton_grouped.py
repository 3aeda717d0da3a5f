"""The Triton kernels of graphpass.fp8.triton_grouped against the torch code of a token-grouped
rowwise quantize (``ops._quantize(x, recipe, role, usage, offs)``), bit for bit.

On the CPU the kernels run under Triton's interpreter, which must be on before triton is
imported: one subprocess (``TRITON_INTERPRET=1``, this file run as a script) runs every case once
per session and reports each case's result; the tests read them. The CUDA test runs the compiled
kernels in this process. The interpreter's cost is per program and operation: the cases are
small, most with tiles small enough that groups span several tiles and tiles several groups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphpass.fp8 import ops, providers, recipes
from test_triton_quantize import make_input, mismatch, recipe_of, skip_without_interpreter

ROOT = Path(__file__).resolve().parents[1]

# amax tile 16x32 down 32-row chunks, cast tile 16x32 along 64-column chunks; None: the defaults
SMALL = dict(amax_block=(16, 32), amax_t_chunk=32, cast_block=(16, 32), cast_k_chunk=64)
# 16 (exactly one aligned block), empty, 34, 40, empty; rows 90-99 past offs[-1]
RAGGED = [16, 16, 50, 90, 90]

# id: (T, K, offs, input dtype, inputs, recipe, role, usage, power_2_scales, amax_epsilon,
#      GroupedKernelConfig settings)
CASES: dict[str, tuple] = {
    "ragged_bf16_both": (100, 64, RAGGED, "bfloat16", "specials", "rowwise", "input", "both",
                         None, None, SMALL),
    "ragged_bf16_cols": (100, 64, RAGGED, "bfloat16", "specials", "rowwise", "grad",
                         "columnwise", None, None, None),
    # cast blocks of 64 and 8 aligned columns: runs of 16 (or 8) columns in different groups
    # (and past the last group's aligned end) in one block; every loop pipelined
    "ragged_bf16_both_wide_cast_block": (100, 64, RAGGED, "bfloat16", "specials", "rowwise",
                                         "input", "both", None, None,
                                         SMALL | dict(cast_block=(64, 32))),
    "ragged_bf16_both_pipelined": (100, 64, RAGGED, "bfloat16", "specials", "rowwise",
                                   "input", "both", None, None,
                                   SMALL | dict(cast_block=(32, 32), amax_stages=3,
                                                cast_stages=2)),
    "ragged_bf16_cols_narrow_cast_block": (100, 64, RAGGED, "bfloat16", "specials", "rowwise",
                                           "grad", "columnwise", None, None,
                                           SMALL | dict(cast_block=(8, 32), cast_stages=3)),
    "ragged_bf16_rows": (37, 64, [16, 16, 30], "bfloat16", "specials", "rowwise", "input",
                         "rowwise", None, None, None),
    "one_group_fp32": (130, 96, [130], "float32", "specials", "rowwise", "input", "both",
                       None, None, None),
    "tiny_groups_k5": (37, 5, [0, 3, 4, 20, 36], "bfloat16", "specials", "rowwise", "input",
                       "both", None, None, SMALL),
    "three_groups_default_tiles": (37, 5, [0, 10, 30], "bfloat16", "specials", "rowwise",
                                   "input", "both", None, None, None),
    "pow2": (100, 64, RAGGED, "bfloat16", "specials", "rowwise_pow2", "input", "both",
             None, None, None),
    "epsilon_fp32": (37, 96, [5, 21, 21], "float32", "specials", "rowwise", "input", "both",
                     None, 1e-3, None),
    "fp16": (37, 64, [16, 32, 37], "float16", "specials", "rowwise", "input", "both",
             None, None, None),
    "e5m2": (100, 64, RAGGED, "bfloat16", "specials", "tensorwise", "grad", "both",
             None, None, None),
    "e5m2_pow2_epsilon": (37, 96, [5, 21, 21], "float32", "specials", "tensorwise", "grad",
                          "both", True, 1e-30, None),
    "e4m3_cast_ties": (48, 40, [16, 48], "float32", "cast_edges", "rowwise", "input", "both",
                       None, None, None),
    "one_row": (1, 5, [1], "bfloat16", "specials", "rowwise", "input", "both",
                None, None, None),
    "one_row_past_the_end": (1, 5, [0], "bfloat16", "specials", "rowwise", "input", "both",
                             None, None, None),
    "all_rows_past_the_end": (37, 5, [0, 0, 0], "bfloat16", "specials", "rowwise", "input",
                              "both", None, None, None),
    "no_columns": (8, 0, [4, 8], "bfloat16", "random", "rowwise", "input", "both",
                   None, None, None),
}


def make_grouped(t: int, k: int, offs: list[int], dtype: str, inputs: str, seed: int,
                 fp8_dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """(T, K) tokens: ``test_triton_quantize.make_input``'s rows (NaN, ±inf, zero, all-NaN,
    subnormal and huge rows, a zero and a subnormal column) plus, per group, values that decide a
    group's column amax: a column all NaN in the first non-empty group (amax 0: scale 1), an inf
    in the last, and large values in the rows past ``offs[-1]`` (in no group's amax)."""
    x = make_input((1, t, k), getattr(torch, dtype), inputs, seed=seed, fp8_dtype=fp8_dtype)[0]
    if inputs == "specials" and x.numel():
        bounds = list(zip([0] + offs[:-1], offs))
        full = [(s, e) for s, e in bounds if e > s]
        if full:
            s, e = full[0]
            x[s:e, k // 2] = float("nan")
            s, e = full[-1]
            x[e - 1, k - 1] = float("inf")
        if offs[-1] < t:
            x[offs[-1]:, :] *= 64
    return x.to(device)


def reference(x: torch.Tensor, recipe: recipes.Recipe, role: str, usage: str,
              offs: torch.Tensor) -> list[torch.Tensor]:
    """The torch code of a grouped quantize (``ops.groups_torch``: what ``ops._quantize(x,
    recipe, role, usage, offs)`` runs where the kernels do not, CUDA included) for a rowwise
    recipe; for another recipe's parameters (E5M2), the same functions it calls under the
    rowwise recipe."""
    if recipes.is_rowwise(recipe):
        return ops.groups_torch(x, recipe, role, usage, offs)
    out: list[torch.Tensor] = []
    if usage != "columnwise":
        out += recipes.rowwise_quantize(x.to(torch.float32), recipe, role)
    if usage != "rowwise":
        out += ops._quantize_groups_rowwise(x, recipe, role, offs)
    return out


def run_case(case: tuple, device: str = "cpu", cast: str | None = None) -> str | None:
    """Runs one case through the kernels and the torch code; None when bit-identical."""
    from graphpass.fp8 import triton_grouped as tg

    t, k, offs, dtype, inputs, name, role, usage, pow2, eps, settings = case
    recipe = recipe_of(name, pow2, eps)
    fp8 = recipes.fp8_dtype(recipe, role)
    x = make_grouped(t, k, offs, dtype, inputs, seed=t + k, fp8_dtype=fp8, device=device)
    o = torch.tensor(offs, dtype=torch.int32, device=device)
    config = tg.GroupedKernelConfig(**(settings or {}), cast=cast)
    got = tg.quantize_groups_rowwise_for(x, recipe, role, usage, o, config=config)
    return mismatch(got, reference(x, recipe, role, usage, o))


def no_tokens() -> str | None:
    """T = 0 (the torch code's amax refuses it): the layout of no tokens, 16 * G zero columns,
    and scales 1."""
    from graphpass.fp8 import triton_grouped as tg

    x = torch.zeros((0, 24), dtype=torch.bfloat16)
    got = tg.quantize_groups_rowwise_for(x, "rowwise", "input", "both",
                                         torch.zeros(3, dtype=torch.int32))
    e4m3 = recipes.E4M3
    want = [torch.empty((0, 24), dtype=e4m3), torch.ones((0, 1)),
            torch.zeros((24, providers.aligned_tokens(0, 3)), dtype=torch.uint8).view(e4m3),
            torch.ones((3, 24))]
    return mismatch(got, want)


def _interpreted_results(out: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, str(out / "results.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"the interpreter run failed:\n{proc.stdout}\n{proc.stderr}")


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str | None]:
    skip_without_interpreter()
    from _session import once

    out = once(tmp_path_factory, "triton_grouped_interpreted", _interpreted_results,
               timeout=600)
    return json.loads((out / "results.json").read_text())


@pytest.mark.every_param  # one interpreted run gives every case's results
@pytest.mark.parametrize("case", [*CASES, "no_tokens"])
def test_bit_identical_under_the_interpreter(interpreted, case):
    """Each case's outputs equal the torch code's, bit for bit (shapes, dtypes, contiguity)."""
    assert interpreted[case] is None, interpreted[case]


@pytest.mark.parametrize("x, offs, kwargs, message", [
    (torch.zeros(2, 4, 8), [1], {}, "expected token-grouped \\(T, K\\)"),
    (torch.zeros(4, 8, dtype=torch.int32), [4], {}, "bfloat16, float16 or float32"),
    (torch.zeros(8, 4).t(), [4], {}, "contiguous"),
    (torch.zeros(4, 8), [], {}, "G >= 1"),
    (torch.zeros(4, 8), [4], {"fp8_dtype": torch.bfloat16}, "fp8_dtype"),
    (torch.zeros(4, 8), [4], {"fp8_max": 500.0}, "fp8_max"),
])
def test_refuses_what_it_does_not_take(x, offs, kwargs, message):
    from graphpass.fp8 import triton_grouped as tg

    args = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False,
                amax_epsilon=0.0) | kwargs
    with pytest.raises(ValueError, match=message):
        tg.quantize_groups_rowwise_both(x, torch.tensor(offs, dtype=torch.int32), **args)
    with pytest.raises(ValueError, match="int32"):
        tg.quantize_groups_rowwise_both(torch.zeros(4, 8), torch.tensor([4]), **args)
    with pytest.raises(ValueError, match="usage"):
        tg.quantize_groups_rowwise_for(torch.zeros(4, 8), "rowwise", "input", "rows",
                                       torch.tensor([4], dtype=torch.int32))


def ragged_offs(t: int, groups: int, seed: int) -> list[int]:
    """Group ends over ``t`` tokens: random sizes, two empty groups, one of exactly 16 tokens,
    and about 1% of the tokens past the last group."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(groups, generator=g) + 0.05
    weights[1] = weights[groups // 2] = weights[2] = 0.0
    sizes = (weights / weights.sum() * (t - t // 100 - 16)).floor().long()
    sizes[2] = 16
    return torch.cumsum(sizes, 0).tolist()


def _fake_cuda(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return torch.empty(shape, dtype=dtype, device="cuda")


def test_which_grouped_quantizes_the_kernels_run():
    """The kernels run a token-grouped quantize under a rowwise recipe of a contiguous 2-D CUDA
    tensor with int32 group ends (checked on fake CUDA tensors, which need no GPU); anything
    else says why not and keeps the torch code (Inductor's fusion of it)."""
    pytest.importorskip("triton")
    x, offs = _fake_cuda(64, 32), _fake_cuda(4, dtype=torch.int32)
    assert ops.why_not_triton_group_kernel(x, "rowwise", offs) is None
    assert ops.why_not_triton_group_kernel(x, "rowwise_pow2", offs) is None
    cpu = torch.zeros(64, 32, dtype=torch.bfloat16)
    refusals = {
        "tensorwise scales are not rowwise": (x, "tensorwise", offs),
        "blockwise scales are not rowwise": (x, "blockwise", offs),
        "the tokens are on cpu": (cpu, "rowwise", torch.zeros(4, dtype=torch.int32)),
        "the tokens are not contiguous": (_fake_cuda(32, 64).t(), "rowwise", offs),
        "the tokens are 3-D": (_fake_cuda(2, 64, 32), "rowwise", offs),
        "their dtype is torch.float8_e4m3fn": (_fake_cuda(64, 32, dtype=torch.float8_e4m3fn),
                                              "rowwise", offs),
        "the group ends are torch.int64": (x, "rowwise", _fake_cuda(4, dtype=torch.int64)),
        "past 2**31 elements": (_fake_cuda(2**20, 2**11), "rowwise", offs),
    }
    for why, args in refusals.items():
        got = ops.why_not_triton_group_kernel(*args)
        assert got is not None and why in got, (why, got)


def test_inductor_leaves_the_kernels_quantize_as_one_op():
    """``inductor.triton_group_quantize``, the pattern pass's exclusion: True for a rowwise
    grouped quantize of CUDA tokens (the op runs the kernels), False where Inductor inlines the
    recipe (another recipe, CPU tokens)."""
    pytest.importorskip("triton")
    from graphpass.fp8 import inductor

    def node(x: torch.Tensor, recipe: str, offs: torch.Tensor):
        graph = torch.fx.Graph()
        xn, on = graph.placeholder("x"), graph.placeholder("offs")
        xn.meta["val"], on.meta["val"] = x, offs
        return graph.call_function(ops.QUANTIZE, (xn, recipe, "input", "both", on))

    x, offs = _fake_cuda(64, 32), _fake_cuda(4, dtype=torch.int32)
    assert inductor.triton_group_quantize(node(x, "rowwise", offs))
    assert not inductor.triton_group_quantize(node(x, "tensorwise", offs))
    assert not inductor.triton_group_quantize(
        node(torch.zeros(64, 32), "rowwise", torch.zeros(4, dtype=torch.int32)))


GPU_SHAPES = [(8192, 7168, 16), (8192 - 37, 2048 + 16, 16), (4099, 1040, 64)]
GPU_RECIPES = [("rowwise", "input"), ("rowwise_pow2", "grad"), ("tensorwise", "grad")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_bit_identical_on_cuda(shape):
    """The compiled kernels on a GPU against the torch code on the same GPU: equal groups and
    ragged ones (empty groups, a group of 16, rows past offs[-1]), every usage, E4M3 with and
    without power-of-2 scales, E5M2, bf16 with the special values; the PTX fp8 cast everywhere,
    the integer one for both copies of the ragged groups."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the fp8 conversion instructions need sm_89+")
    t, k, groups = shape
    failures = []
    even = [t // groups * (i + 1) for i in range(groups)]
    for offs in (even, ragged_offs(t, groups, seed=t)):
        for name, role in GPU_RECIPES:
            runs = [(u, None) for u in ("both", "rowwise", "columnwise")]
            runs += [("both", "soft")] if offs is not even and name == "rowwise" else []
            for usage, cast in runs:
                case = (t, k, offs, "bfloat16", "specials", name, role, usage, None, None, None)
                bad = run_case(case, device="cuda", cast=cast)
                if bad:
                    failures.append(f"{shape} {'even' if offs is even else 'ragged'} {name} "
                                    f"{role} {usage} {cast}: {bad}")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":  # the interpreter run: TRITON_INTERPRET=1 set by the caller
    results = {}
    for case_id, spec in [*CASES.items(), ("no_tokens", None)]:
        try:
            results[case_id] = run_case(spec) if spec else no_tokens()
        except Exception as exc:  # reported per case, so one failure does not hide the rest
            results[case_id] = f"{type(exc).__name__}: {exc}"
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))
