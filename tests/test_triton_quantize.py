"""The Triton rowwise quantize of 3-D expert weights (graphpass.fp8.triton_quantize) against the
torch code it replaces, ``ops.experts_rowwise_torch``: same shapes, dtypes and contiguity,
data equal as bytes and scale_inv equal as bits, for ragged shapes, every usage, bf16/fp16/fp32
inputs, NaN, inf, zero and subnormal rows and columns, power-of-2 scales, an amax epsilon, E5M2,
and every rounding tie of the fp8 cast.

On the CPU the kernels run under Triton's interpreter, which must be on before triton is
imported: one subprocess (``TRITON_INTERPRET=1``, this file run as a script) runs every case once
per session and reports each case's result; the tests read them. The CUDA tests run the compiled
kernels in this process.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphpass.fp8 import ops, recipes

ROOT = Path(__file__).resolve().parents[1]

# Small tiles under the interpreter, so that ragged shapes span several tiles and chunks (the
# atomics then merge maxima from several programs): amax tile 16x32 down 32-row chunks, cast
# tile 16x32 along 64-column chunks, rowwise-only strips of 4 rows read 32 columns at a time.
# None: the default (Hopper) configuration, a few ragged tiles per expert here, which the
# interpreter runs fastest (its cost is per program and operation, not per element).
SMALL = dict(amax_block=(16, 32), amax_n_chunk=32, amax_warps=4, cast_block=(16, 32),
             cast_k_chunk=64, cast_warps=4, rows_block=(4, 32), rows_warps=4)

# id: (shape, input dtype, inputs, recipe, role, usage, power_2_scales, amax_epsilon,
#      KernelConfig settings)
CASES: dict[str, tuple] = {
    "ragged_bf16_both": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight", "both",
                         None, None, SMALL),
    "ragged_bf16_rows": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight", "rowwise",
                         None, None, SMALL),
    "ragged_bf16_rows_two_passes": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight",
                                    "rowwise", None, None, SMALL | dict(fuse_rows=False)),
    "ragged_bf16_rows_reversed": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight",
                                  "rowwise", None, None, SMALL | dict(rows_reverse=True)),
    "ragged_bf16_cols": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight", "columnwise",
                         None, None, SMALL),
    "ragged_bf16_both_pipelined": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight",
                                   "both", None, None,
                                   SMALL | dict(amax_stages=3, cast_stages=2)),
    "ragged_bf16_rows_pipelined": ((3, 37, 70), "bfloat16", "specials", "rowwise", "weight",
                                   "rowwise", None, None,
                                   SMALL | dict(rows_stages=3, rows_reverse=True)),
    "aligned_bf16_both": ((2, 128, 256), "bfloat16", "specials", "rowwise", "weight", "both",
                          None, None, dict(amax_block=(64, 128), amax_n_chunk=64,
                                           cast_block=(64, 128), cast_k_chunk=128,
                                           rows_block=(64, 128))),
    "one_row_default_tiles": ((1, 1, 5), "bfloat16", "random", "rowwise", "weight", "both",
                              None, None, None),
    "ragged_default_tiles": ((2, 37, 130), "bfloat16", "specials", "rowwise", "weight", "both",
                             None, None, None),
    "fp32_both": ((2, 33, 65), "float32", "specials", "rowwise", "weight", "both",
                  None, None, None),
    "fp16_both": ((2, 17, 40), "float16", "specials", "rowwise", "weight", "both",
                  None, None, None),
    "pow2_both": ((3, 37, 70), "bfloat16", "specials", "rowwise_pow2", "weight", "both",
                  None, None, None),
    "epsilon_both": ((3, 37, 70), "float32", "specials", "rowwise", "weight", "both",
                     None, 1e-3, None),
    "e5m2_both": ((3, 37, 70), "bfloat16", "specials", "tensorwise", "grad", "both",
                  None, None, None),
    "e5m2_pow2_epsilon": ((2, 33, 65), "float32", "specials", "tensorwise", "grad", "both",
                          True, 1e-30, None),
    "e4m3_cast_ties": ((1, 48, 40), "float32", "cast_edges", "rowwise", "weight", "both",
                       None, None, None),
    "e5m2_cast_ties": ((1, 48, 40), "float32", "cast_edges", "tensorwise", "grad", "both",
                       None, None, None),
    "empty_experts": ((0, 8, 16), "bfloat16", "random", "rowwise", "weight", "both",
                      None, None, None),
    "empty_rows": ((2, 0, 16), "bfloat16", "random", "rowwise", "weight", "both",
                   None, None, None),
    "empty_columns": ((2, 8, 0), "bfloat16", "random", "rowwise", "weight", "columnwise",
                      None, None, None),
}


def make_input(shape: tuple[int, int, int], dtype: torch.dtype, inputs: str, seed: int,
               fp8_dtype: torch.dtype = recipes.E4M3, device: str = "cpu") -> torch.Tensor:
    """Deterministic (E, N, K) weights. ``"random"``: normal values, rows of spread magnitudes.
    ``"specials"``: that plus NaN (both signs), ±inf, an all-zero row and column, an all-NaN row,
    a subnormal row (scale FLT_MAX), a row whose scale_inv is subnormal, a row near the dtype's
    largest values. ``"cast_edges"``: every finite ``fp8_dtype`` value, the midpoints between
    neighbours and the fp32 numbers next to them, each row led by fp8_max so its scale is 1."""
    g = torch.Generator().manual_seed(seed)
    e, n, k = shape
    if inputs == "cast_edges":
        return _cast_edges(shape, fp8_dtype, g).to(dtype).to(device)
    spread = 2.0 if dtype == torch.float16 else 4.0
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(e, n, 1, generator=g) * spread)
    if dtype == torch.float16:
        x = x.clamp(-6e4, 6e4)
    if inputs == "specials" and x.numel():
        fi = torch.finfo(dtype)
        x[0, 0, 0] = float("nan")
        x[-1, -1, -1] = -float("nan")
        x[0, -1, k // 2] = float("inf")
        x[-1, n // 2, 0] = -float("inf")
        rows = [(i % e, i % n) for i in range(1, 7)]
        x[rows[0]] = 0.0                                              # all zero
        x[rows[1]] = float("nan")                                     # all NaN: amax 0
        x[rows[2]] = torch.randn(k, generator=g) * fi.tiny * 0.25     # subnormal
        if dtype != torch.float16:                                    # scale_inv subnormal
            x[rows[3]] = torch.randn(k, generator=g) * 1e-36
            x[rows[3]][0] = 2.5e-36
        x[rows[4]] = torch.randn(k, generator=g).clamp(-3, 3) * (fi.max / 4)
        x[rows[5]] = torch.randn(k, generator=g) * 1e-3
        x[-1, :, k // 3] = 0.0                                        # a zero column
        x[0, :, -1] = torch.randn(n, generator=g) * fi.tiny * 0.25    # a subnormal column
    return x.to(dtype).to(device)


def _cast_edges(shape: tuple[int, int, int], fp8_dtype: torch.dtype,
                g: torch.Generator) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    values = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values
    mid = (values[1:] + values[:-1]) / 2  # exact in fp32: the round-to-nearest-even ties
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(0.0))
    pool = torch.cat([values, mid, up, down])
    e, n, k = shape
    # every pool value at least once (where e * n * (k - 1) allows), in a random order
    order = torch.arange(e * n * (k - 1)) % len(pool)
    picks = pool[order[torch.randperm(len(order), generator=g)]].reshape(e, n, k - 1)
    signs = torch.where(torch.rand((e, n, k - 1), generator=g) < 0.5, -1.0, 1.0)
    first = torch.full((e, n, 1), recipes.fp8_max(fp8_dtype))
    x = torch.cat([first, picks * signs], dim=-1)
    return x


def recipe_of(name: str, power_2_scales: bool | None, amax_epsilon: float | None
              ) -> recipes.Recipe:
    r = recipes.get_recipe(name)
    if power_2_scales is not None:
        r = dataclasses.replace(r, power_2_scales=power_2_scales)
    if amax_epsilon is not None:
        r = dataclasses.replace(r, amax_epsilon=amax_epsilon)
    return r


def mismatch(got: list[torch.Tensor], ref: list[torch.Tensor]) -> str | None:
    """None when ``got`` has ``ref``'s shapes, dtypes, contiguity and bits; else what differs."""
    if len(got) != len(ref):
        return f"{len(got)} outputs, expected {len(ref)}"
    for i, (g, r) in enumerate(zip(got, ref)):
        if g.shape != r.shape or g.dtype != r.dtype or not g.is_contiguous():
            return (f"output {i}: {tuple(g.shape)} {g.dtype} contiguous={g.is_contiguous()}, "
                    f"expected {tuple(r.shape)} {r.dtype}")
        bits = torch.int32 if r.dtype == torch.float32 else torch.uint8
        gb, rb = g.view(bits), r.view(bits)
        bad = gb != rb
        if bad.any():
            where = bad.nonzero()[:3]
            got_v = [hex(int(v)) for v in gb[tuple(where.T)]]
            ref_v = [hex(int(v)) for v in rb[tuple(where.T)]]
            return (f"output {i}: {int(bad.sum())} of {bad.numel()} differ, e.g. at "
                    f"{where.tolist()}: {got_v} vs {ref_v}")
    return None


def run_case(case: tuple, device: str = "cpu", cast: str | None = None) -> str | None:
    """Runs one case through the kernels and the torch code; None when bit-identical."""
    from graphpass.fp8 import triton_quantize as tq

    shape, dtype, inputs, name, role, usage, pow2, eps, settings = case
    recipe = recipe_of(name, pow2, eps)
    fp8 = recipes.fp8_dtype(recipe, role)
    x = make_input(shape, getattr(torch, dtype), inputs, seed=sum(shape), fp8_dtype=fp8,
                   device=device)
    config = tq.KernelConfig(**(settings or {}), cast=cast)
    got = tq.quantize_experts_rowwise_for(x, recipe, role, usage, config=config)
    return mismatch(got, ops.experts_rowwise_torch(x, recipe, role, usage))


def _interpreted_results(out: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, __file__, str(out / "results.json")], env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        raise RuntimeError(f"the interpreter run failed:\n{proc.stdout}\n{proc.stderr}")


def skip_without_interpreter() -> None:
    """Skip where Triton's interpreter cannot run the kernels
    (``triton_quantize.interpreter_unsupported``: no triton, or triton before 3.7)."""
    from graphpass.fp8 import triton_quantize

    why = triton_quantize.interpreter_unsupported()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict[str, str | None]:
    skip_without_interpreter()
    from _session import once

    out = once(tmp_path_factory, "triton_quantize_interpreted", _interpreted_results,
               timeout=600)
    return json.loads((out / "results.json").read_text())


@pytest.mark.every_param  # one interpreted run gives every case's results
@pytest.mark.parametrize("case", CASES)
def test_bit_identical_under_the_interpreter(interpreted, case):
    """Each case's four (or two) outputs equal the torch code's, bit for bit."""
    assert interpreted[case] is None, interpreted[case]


def test_available_and_import_without_triton(monkeypatch):
    """The module imports without triton (a fresh copy of it, loaded with triton unimportable),
    and ``available`` says why the kernels cannot run; with triton, a CPU tensor needs the
    interpreter."""
    from graphpass.fp8 import triton_quantize as tq

    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    spec = importlib.util.spec_from_file_location("graphpass.fp8._triton_quantize_copy",
                                                  tq.__file__)
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, copy)  # dataclasses look their module up
    spec.loader.exec_module(copy)
    assert copy.available(torch.zeros(1)) == "triton is not installed"
    with pytest.raises(RuntimeError, match="triton is not installed"):
        copy.quantize_experts_rowwise_for(torch.zeros(1, 2, 2), "rowwise", "weight", "both")
    monkeypatch.undo()
    if tq.triton is not None and not tq._interpreted():
        assert "TRITON_INTERPRET" in tq.available(torch.zeros(1))
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tq.quantize_experts_rowwise_for(torch.zeros(1, 2, 2), "rowwise", "weight", "both")


@pytest.mark.parametrize("x, kwargs, message", [
    (torch.zeros(4, 8), {}, "expected \\(E, N, K\\)"),
    (torch.zeros(2, 4, 8, dtype=torch.int32), {}, "bfloat16, float16 or float32"),
    (torch.zeros(2, 8, 4).transpose(1, 2), {}, "contiguous"),
    (torch.zeros(2, 4, 8), {"fp8_dtype": torch.bfloat16}, "fp8_dtype"),
    (torch.zeros(2, 4, 8), {"fp8_max": 500.0}, "fp8_max"),
])
def test_refuses_what_it_does_not_take(x, kwargs, message):
    from graphpass.fp8 import triton_quantize as tq

    args = dict(fp8_dtype=recipes.E4M3, fp8_max=448.0, power_2_scales=False, amax_epsilon=0.0,
                rows=True, cols=True) | kwargs
    with pytest.raises(ValueError, match=message):
        tq.quantize_experts_rowwise(x, **args)
    with pytest.raises(ValueError, match="usage"):
        tq.quantize_experts_rowwise_for(torch.zeros(2, 4, 8), "rowwise", "weight", "rows")


GPU_SHAPES = [(16, 512, 1024), (4, 4096, 7168)]
GPU_RECIPES = [("rowwise", "weight"), ("rowwise_pow2", "weight"), ("tensorwise", "grad")]
GPU_CASTS = ("soft",)  # the default, "ptx", runs in every case


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_bit_identical_on_cuda(shape):
    """The compiled kernels on a GPU against the torch code on the same GPU: every usage (the
    rowwise copy alone in one kernel and in two passes), E4M3 with and without power-of-2 scales,
    E5M2, bf16 (and fp32 at the small shape) with the special values, and every rounding tie;
    the PTX fp8 cast everywhere, the integer one for both copies."""
    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the fp8 conversion instructions need sm_89+")
    failures = []
    small = shape[0] * shape[1] * shape[2] <= 2**23
    runs = [(usage, None, settings) for usage in ("both", "rowwise", "columnwise")
            for settings in ([None, dict(fuse_rows=False)] if usage == "rowwise" else [None])]
    runs += [("both", cast, None) for cast in GPU_CASTS]
    for dtype in ["bfloat16", "float32"] if small else ["bfloat16"]:
        for name, role in GPU_RECIPES:
            for usage, cast, settings in runs:
                case = (shape, dtype, "specials", name, role, usage, None, None, settings)
                bad = run_case(case, device="cuda", cast=cast)
                if bad:
                    failures.append(f"{dtype} {name} {role} {usage} {cast} {settings}: {bad}")
    for name, role in (("rowwise", "weight"), ("tensorwise", "grad")):
        for usage, cast in [("rowwise", None), ("both", None)] + [("both", c)
                                                                  for c in GPU_CASTS]:
            case = ((1, 48, 40), "float32", "cast_edges", name, role, usage, None, None, None)
            bad = run_case(case, device="cuda", cast=cast)
            if bad:
                failures.append(f"cast ties {name} {role} {usage} {cast}: {bad}")
    assert not failures, "\n".join(failures)


if __name__ == "__main__":  # the interpreter run: TRITON_INTERPRET=1 set by the caller
    results = {}
    for case_id, spec in CASES.items():
        try:
            results[case_id] = run_case(spec)
        except Exception as exc:  # reported per case, so one failure does not hide the rest
            results[case_id] = f"{type(exc).__name__}: {exc}"
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


def test_benchmark_dry_run_checks_the_kernels_or_says_why_not():
    """``benchmarks/quantize_kernels.py --dry-run`` runs every section's kernels under the
    interpreter against the torch code ("= eager" True on each row), or, where the interpreter
    cannot run them (triton before 3.7), says so and exits 1 instead of failing inside triton."""
    from graphpass.fp8 import triton_quantize

    pytest.importorskip("triton")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quantize_kernels.py"),
                           "--dry-run"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    why = triton_quantize.interpreter_unsupported()
    if why is not None:
        assert proc.returncode == 1 and why in proc.stdout, proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "x" in line
            and not line.startswith("| ---") and "kernels ms" not in line]
    assert len(rows) == 8, proc.stdout  # 2 token-grouped shapes, 2 weights x 3 usages
    assert all(line.rstrip(" |").endswith("True") for line in rows), proc.stdout


def test_a_pipelining_depth_below_one_is_refused():
    from graphpass.fp8 import triton_grouped as tg, triton_quantize as tq

    for config, names in ((tq.KernelConfig, ("amax_stages", "cast_stages", "rows_stages")),
                          (tg.GroupedKernelConfig, ("amax_stages", "cast_stages"))):
        for name in names:
            with pytest.raises(ValueError, match=f"{name} must be positive"):
                config(**{name: 0})
