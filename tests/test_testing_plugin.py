"""graphpass.testing: the snapshot plugin, the snapshot format and diff, the contract assertions."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import graphpass
from graphpass.models import MODELS, llama
from graphpass import Config, Decision, Report, Row, What
from graphpass.testing import (
    Snapshot,
    assert_activation_bytes_at_most,
    assert_activation_growth_at_most,
    assert_fp8_lowered,
    assert_matches_snapshot,
    assert_no_parameter_offloaded,
    assert_recomputed,
    assert_saved_in_one_dtype,
    diff,
)

ROOT = Path(__file__).resolve().parents[1]
# Installed graphpass loads the plugin through its pytest11 entry point, and pytest refuses a
# module registered twice; a source tree that is not installed loads it by module name.
INSTALLED = bool(entry_points(group="pytest11", name="graphpass"))
PLUGIN_ARGS = () if INSTALLED else ("-p", "graphpass.testing.plugin")
pytest_plugins = ["pytester"] + ([] if INSTALLED else ["graphpass.testing.plugin"])


def _plan(name: str) -> Report:
    model, inputs = importlib.import_module(f"graphpass.models.{name}").build("tiny")
    return graphpass.plan(model, *inputs, config=Config(codegen="eager"))


@pytest.fixture(scope="module")
def tiny() -> dict[str, Report]:
    return {name: _plan(name) for name in MODELS}


# -- the plugin on the example models: these snapshots are committed ----------------------------

@pytest.mark.parametrize("name", MODELS)
def test_example_model_snapshot(name: str, tiny: dict[str, Report], graphpass_snapshot) -> None:
    graphpass_snapshot(tiny[name])


# -- the plugin end to end, in inner pytest sessions ----------------------------------------------

INNER_TEST = """
import os

import torch
import torch.nn as nn

import graphpass


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        # GELU's backward needs its input, ReLU's only its output: GROW saves fc1's output too.
        self.act = nn.GELU() if os.environ.get("GROW") else nn.ReLU()
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_mlp(graphpass_snapshot):
    if os.environ.get("PLAN_ANOTHER_FIRST"):  # another compile history in this process
        graphpass.plan(nn.Sequential(nn.Linear(16, 16), nn.Tanh()), torch.randn(4, 16, requires_grad=True))
    graphpass_snapshot(graphpass.plan(MLP(), torch.randn(8, 16, requires_grad=True)))
"""


# the plugin's files in a pytester session, on one torch version; the snapshot tests run on all
@pytest.mark.one_version
def test_snapshot_round_trip(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    pytester.makepyfile(INNER_TEST)
    snapshot = pytester.path / "__graphpass_snapshots__" / "test_snapshot_round_trip" / "test_mlp.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("GROW", raising=False)
    monkeypatch.delenv("CI", raising=False)

    def run(*args: str, fresh_process: bool = False) -> pytest.RunResult:
        runner = pytester.runpytest_subprocess if fresh_process else pytester.runpytest_inprocess
        return runner(*PLUGIN_ARGS, "-p", "no:cacheprovider", *args)

    result = run()  # first run: written, passes with a warning
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*GraphpassSnapshotWarning: wrote new graphpass snapshot*",
                                 "written: *test_mlp.txt"])
    written = snapshot.read_text()
    assert "\nact | aten.relu | 8x64 | float32 | activation | 2,048 | " in written

    # Unchanged, in a fresh process that compiled something else first: identical.
    monkeypatch.setenv("PLAN_ANOTHER_FIRST", "1")
    result = run("--graphpass-ci", fresh_process=True)
    result.assert_outcomes(passed=1)
    assert "GraphpassSnapshotWarning" not in result.stdout.str()
    monkeypatch.delenv("PLAN_ANOTHER_FIRST")

    monkeypatch.setenv("GROW", "1")
    result = run()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E *AssertionError: saved tensors differ from graphpass snapshot *test_mlp.txt",
        "E *activation bytes: 2,560 -> 4,608 B (+2,048 B, +80.00%)",
        "E *fc1: +2,048 B (aten.addmm float32 8x64 now saved*",
        "E *act: -2,048 B (aten.relu float32 8x64 no longer saved)",
        "E *if the change is intended, rerun with --graphpass-update and commit the snapshot",
    ])
    assert snapshot.read_text() == written

    result = run("--graphpass-update")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["updated: *test_mlp.txt"])
    assert "\nfc1 | aten.addmm | 8x64 | float32 | activation | 2,048 | " in snapshot.read_text()


INNER_NEW_SNAPSHOT = """
from graphpass import Report, Row


def test_new(graphpass_snapshot):
    graphpass_snapshot(Report(rows=[Row("mm", "aten.mm", "fc", (2, 2), "float32", 16, 16, "activation")]))
"""


@pytest.mark.parametrize("ci", ["env", "flag"])
def test_ci_mode_fails_on_a_missing_snapshot(
    ci: str, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(INNER_NEW_SNAPSHOT)
    monkeypatch.setenv("CI", "true" if ci == "env" else "false")
    result = pytester.runpytest_inprocess(*PLUGIN_ARGS, *(["--graphpass-ci"] if ci == "flag" else []))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E *AssertionError: graphpass snapshot *test_new.txt does not exist; "
                                 "run pytest once outside CI mode (or with --graphpass-update) and commit it"])
    assert not (pytester.path / "__graphpass_snapshots__").exists()


# -- stability: between plan() and a real compile (across processes: the round trip above) ------

def test_snapshot_of_plan_equals_snapshot_of_real_compile(tiny: dict[str, Report]) -> None:
    model, (x,) = llama.build("tiny")
    compiled = torch.compile(model, backend=graphpass.backend(codegen="eager"))
    compiled(x).float().pow(2).mean().backward()
    compiled_snapshot = Snapshot.from_report(graphpass.last_report())
    assert compiled_snapshot.render() == Snapshot.from_report(tiny["llama"]).render()


# -- the format -----------------------------------------------------------------------------------

def test_format_has_no_node_names_and_reads_back(tiny: dict[str, Report]) -> None:
    for report in tiny.values():
        snap = Snapshot.from_report(report)
        text = snap.render()
        assert Snapshot.parse(text) == snap
        assert re.search(r"\b(primals|mm|view|add|getitem|permute|rsqrt|bmm)_\d+\b", text) is None
        rows = [line for line in text.splitlines() if " | " in line and not line.startswith("#")]
        assert len(rows) == len(report.rows)
        assert f"\nactivation: {report.activation_bytes:,} B\n" in text
        assert text.splitlines()[-1].startswith("layer layers.1: ")


def test_ties_natural_order_and_views() -> None:
    rows = [_row(f"layers.{i}.mlp", "aten.mm", (4, 8), "bfloat16", name=f"mm_{i}") for i in (10, 2, 2)]
    rows.append(_row("layers.2.mlp", "aten.t", (8, 4), "bfloat16", nbytes=0, name="t", alias_of="mm_2"))
    rows.append(_row("layers.3.mlp", "aten.mm", (4, 8), "bfloat16", offloaded=True))
    text = Snapshot.from_report(Report(rows=rows)).render()
    assert "layers.3.mlp | aten.mm | 4x8 | bfloat16 | activation | 64 (offloaded) | saved" in text
    assert "\nactivation: 192 B\nparameters: 0 B\noffloaded: 64 B\n" in text
    assert text.index("layers.2.mlp |") < text.index("layers.10.mlp |")
    # A second row alike in module, op, shape, dtype and kind is "#2".
    assert "layers.2.mlp | aten.mm#2 | 4x8 | bfloat16 | activation | 64 | saved" in text
    view = "layers.2.mlp | aten.t | 8x4 | bfloat16 | activation | 0 (view of layers.2.mlp aten.mm 4x8) | saved"
    assert view in text
    assert Snapshot.parse(text) == Snapshot.from_report(Report(rows=rows))


def test_diff_names_module_and_bytes() -> None:
    before = Report(rows=[_row("layers.0.mlp.up_proj", "aten.view", (8192, 4096), "bfloat16")])
    after = Report(rows=[*before.rows, _row("layers.0.mlp.up_proj", "aten.mm", (8192, 14336), "bfloat16")])
    changes = diff(before, after)
    assert changes.grew and changes.activation_delta == 8192 * 14336 * 2
    assert "  layers.0.mlp.up_proj: +234,881,024 B (aten.mm bfloat16 8192x14336 now saved)" in changes.lines()
    assert not diff(after, after) and not diff(after, before).grew

    offloaded = Report(rows=[before.rows[0], dataclasses.replace(after.rows[1], offloaded=True)])
    changes = diff(after, offloaded)
    assert not changes.grew and changes.activation_delta == -234_881_024
    assert changes.lines()[1:] == [
        "offloaded bytes (not counted): 0 -> 234,881,024 B",
        "  layers.0.mlp.up_proj: -234,881,024 B (aten.mm bfloat16 8192x14336 now offloaded)",
    ]


def test_assert_matches_snapshot_without_pytest(tmp_path: Path, tiny: dict[str, Report]) -> None:
    path = tmp_path / "llama.txt"
    assert assert_matches_snapshot(tiny["llama"], path) == "written"
    assert assert_matches_snapshot(tiny["llama"], path, write_missing=False) == "matched"
    with pytest.raises(AssertionError, match="does not exist"):
        assert_matches_snapshot(tiny["llama"], tmp_path / "missing.txt", write_missing=False)
    big = _largest(tiny["llama"])
    with pytest.raises(AssertionError, match=rf"\n  {re.escape(big.module)}: -{big.bytes:,} B \({big.op} "):
        assert_matches_snapshot(_without(tiny["llama"], big), path)
    with pytest.raises(AssertionError, match="no report"):
        assert_matches_snapshot(None, path)
    path.write_text(re.sub(r" \| [\d,]+ \| ", " | lots | ", path.read_text(), count=1))  # a bad hand edit
    with pytest.raises(AssertionError, match=r"does not parse \(line 3 is not a snapshot row"):
        assert_matches_snapshot(tiny["llama"], path)
    assert assert_matches_snapshot(tiny["llama"], path, update=True) == "updated"
    assert assert_matches_snapshot(tiny["llama"], path) == "matched"


# -- the contract assertions ----------------------------------------------------------------------

def test_activation_bytes_limits(tiny: dict[str, Report]) -> None:
    report = tiny["llama"]
    big = _largest(report)
    assert_activation_bytes_at_most(report, report.activation_bytes)
    largest_first = rf"exceed the limit {report.activation_bytes - 1:,} by 1 B.*\n  {re.escape(big.module)}: {big.op}"
    with pytest.raises(AssertionError, match=largest_first):
        assert_activation_bytes_at_most(report, report.activation_bytes - 1)

    smaller = _without(report, big)
    growth = 100 * big.bytes / smaller.activation_bytes
    assert_activation_growth_at_most(report, smaller, percent=growth + 0.01)
    with pytest.raises(AssertionError, match=rf"grew more than .*\n.*\n  {re.escape(big.module)}: \+{big.bytes:,} B"):
        assert_activation_growth_at_most(report, Snapshot.from_report(smaller), percent=growth - 0.01)


def test_growth_baseline_from_files(tmp_path: Path, tiny: dict[str, Report]) -> None:
    (tmp_path / "base.json").write_text(tiny["gpt"].to_json())
    (tmp_path / "base.txt").write_text(Snapshot.from_report(tiny["gpt"]).render())
    for baseline in ("base.json", "base.txt"):
        assert_activation_growth_at_most(tiny["gpt"], tmp_path / baseline, percent=0)


def test_saved_in_one_dtype(tiny: dict[str, Report]) -> None:
    assert_saved_in_one_dtype(tiny["deepseek"])  # top-k values and int64 indices are two tensors
    twice = Report(rows=[
        _row("layers.0.mlp.up_proj", "aten.mm", (64, 512), "bfloat16"),
        _row("layers.0.mlp.up_proj", "aten.mm", (64, 512), "float8_e4m3fn", kind="fp8_data"),
        _row("layers.0.mlp.up_proj", "aten.mm", (1,), "float32", kind="fp8_scale"),
    ])
    with pytest.raises(AssertionError, match=r"1 tensor\(s\) saved in more than one dtype.*\n"
                                             r"  layers\.0\.mlp\.up_proj: aten\.mm bfloat16 64x512.*\n"
                                             r"  layers\.0\.mlp\.up_proj: aten\.mm float8_e4m3fn 64x512"):
        assert_saved_in_one_dtype(twice)
    copied = Report(rows=[
        _row("layers.0.post_attention_layernorm", "aten.mul", (64, 256), "bfloat16", name="mul_3"),
        _row("layers.0.mlp.up_proj", "graphpass.quantize", (64, 256), "float8_e4m3fn", kind="fp8_data",
             copy_of="mul_3"),
    ])
    with pytest.raises(AssertionError, match=r"FP8 copy next to its original.*\n  layers\.0\.post_attention"):
        assert_saved_in_one_dtype(copied)
    assert_saved_in_one_dtype(Report(rows=copied.rows[1:]))


def test_recomputed() -> None:
    report = Report(rows=[
        _row("layers.0.input_layernorm", "aten.rsqrt", (2, 32, 1), "float32"),
        _row("layers.0.input_layernorm.weight", "input", (256,), "float32", kind="parameter"),
        _row("layers.0.mlp.gate_proj", "aten.mm", (64, 512), "float32"),
        _row("norm", "aten.rsqrt", (2, 32, 1), "float32",
             decisions=(Decision(What.RECOMPUTED, "recompute layernorm", "layernorm"),)),
    ])
    with pytest.raises(AssertionError, match=r"1 saved row\(s\) come from modules that should be recomputed "
                                             r"\(\*norm\*\):\n  layers\.0\.input_layernorm: aten\.rsqrt float32 2x32x1"):
        assert_recomputed(report, "*norm*")
    model, _ = llama.build("tiny")
    with pytest.raises(AssertionError, match=r"\(RMSNorm\):\n  layers\.0\.input_layernorm: aten\.rsqrt"):
        assert_recomputed(report, nn.RMSNorm, model=model)
    with pytest.raises(ValueError, match="model="):
        assert_recomputed(report, nn.RMSNorm)
    assert_recomputed(report, "layers.*.self_attn", "norm")
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.gate_proj: aten\.mm"):
        assert_recomputed(report, "layers.0.mlp")  # submodules are part of a module


def test_no_parameter_offloaded(tiny: dict[str, Report]) -> None:
    assert_no_parameter_offloaded(tiny["gpt"])
    yes = Decision(What.OFFLOAD, "offload")
    rows = [_row("layers.0.mlp.fc1.weight", "input", (1024, 256), "float32", kind="parameter", decisions=d)
            for d in ((Decision(What.NOT_OFFLOADED, "offload", "parameter"),),
                      (Decision(What.OFFLOAD_ELIGIBLE, "offload"),),
                      (Decision(What.SAVED, "recompute", "saved"), yes))]
    rows.append(_row("layers.0.mlp", "aten.mm", (64, 1024), "float32", decisions=(yes,)))
    offloaded = (r"1 parameter\(s\) offloaded:\n  layers\.0\.mlp\.fc1\.weight: "
                 r"input float32 1024x256 parameter 1,048,576 B \(saved; offload: yes\)$")
    with pytest.raises(AssertionError, match=offloaded):
        assert_no_parameter_offloaded(Report(rows=rows))
    moved = _row("layers.0.mlp.fc2.weight", "input", (256, 1024), "float32", kind="parameter", offloaded=True)
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.fc2\.weight"):
        assert_no_parameter_offloaded(Report(rows=[moved]))


def test_fp8_lowered() -> None:
    decisions = [Decision(What.LOWERED, "fp8", "reference/tensorwise", "layers.0.mlp.up_proj"),
                 Decision(What.NOT_LOWERED, "fp8", "excluded by pattern 'output'", "output")]
    assert_fp8_lowered(_decided(decisions))
    odd = _decided([*decisions, Decision(What.NOT_LOWERED, "fp8", "GEMM below fp8_min_gemm_flops",
                                         "layers.0.mlp.down_proj")])
    with pytest.raises(AssertionError, match=r"\n  layers\.0\.mlp\.down_proj: GEMM below fp8_min_gemm_flops$"):
        assert_fp8_lowered(odd)
    assert_fp8_lowered(odd, allowed=("excluded by pattern *", "GEMM below *"))

    mlp = nn.ModuleDict({"up_proj": nn.Linear(2, 2), "gate_proj": nn.Linear(2, 2)})
    model = nn.ModuleDict({"output": nn.Linear(2, 2), "layers": nn.ModuleList([nn.ModuleDict({"mlp": mlp})])})
    with pytest.raises(AssertionError, match=r"layers\.0\.mlp\.gate_proj: no FP8 note"):
        assert_fp8_lowered(_decided(decisions), model=model)
    with pytest.raises(AssertionError, match="no FP8 lowering notes"):
        assert_fp8_lowered(Report())


def _decided(decisions: list[Decision]) -> Report:
    return Report(notes=[str(d) for d in decisions], decisions=decisions)


def _row(module: str, op: str, shape: tuple[int, ...], dtype: str, *, kind: str = "activation",
         nbytes: int | None = None, decisions: tuple[Decision, ...] = (), name: str = "", alias_of: str = "",
         copy_of: str = "", offloaded: bool = False) -> Row:
    size = {"float8_e4m3fn": 1, "bfloat16": 2, "float32": 4}[dtype]
    for n in shape:
        size *= n
    return Row(name=name or f"{module}.{op}.{dtype}", op=op, module=module, shape=shape, dtype=dtype,
               bytes=size if nbytes is None else nbytes, tensor_bytes=size, kind=kind,
               decisions=decisions, alias_of=alias_of, copy_of=copy_of, offloaded=offloaded)


def _largest(report: Report) -> Row:
    return max((r for r in report.rows if r.is_activation), key=lambda r: r.bytes)


def _without(report: Report, row: Row) -> Report:
    return Report(rows=[r for r in report.rows if r is not row], notes=report.notes)
