"""``python -m graphpass``: config flags generated from Config, report, diff, plot, bad input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphpass import Decision, Report, Row, What
from graphpass.cli import main
from graphpass.cli_flags import config_flags
from graphpass.config import CHOICES, SHORTHAND
from graphpass.report.plot import category

ROOT = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_every_config_field_is_a_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    report_help = " ".join(capsys.readouterr().out.split())  # unwrapped
    for name in SHORTHAND:  # every keyword of Config, its groups' fields included
        assert f"--{name.replace('_', '-')}" in report_help, name
    assert "--report, --no-report" in report_help
    assert "--fp8 {" + ",".join("none" if v is None else v for v in CHOICES["fp8"]) + "}" in report_help
    assert "(default: output,lm_head,*.gate,*.router)" in report_help


def test_flag_kinds_follow_field_types() -> None:
    @dataclasses.dataclass(frozen=True)
    class Later:
        mode: str | None = None
        """A choice field."""
        ratio: float = 0.5
        budget: int | None = 3
        name: str = "x"
        patterns: tuple[str, ...] = ()
        parts: tuple[str, ...] = ("a",)
        on: bool = False

    flags = {f.name: f for f in config_flags(Later, {"mode": (None, "a", "b")}, {"parts": ("a", "b")})}
    assert flags["mode"].convert("none") is None and flags["mode"].convert("b") == "b"
    assert flags["mode"].help == "A choice field. (default: none)"
    assert flags["ratio"].convert("0.25") == 0.25 and flags["ratio"].metavar == "FLOAT"
    assert flags["budget"].convert("none") is None and flags["budget"].convert("1_000") == 1000
    assert flags["name"].convert("y") == "y"
    assert flags["patterns"].convert("a, b,") == ("a", "b") and flags["patterns"].help == "(default: empty)"
    assert flags["parts"].convert("b,a") == ("b", "a")
    assert flags["on"].is_bool and flags["on"].convert("yes") is True
    for name, text, error in [("mode", "c", "'c' is not one of none, a, b"),
                              ("parts", "a,c", "'c' not among a, b"),
                              ("budget", "lots", "expected an integer, got 'lots'"),
                              ("on", "maybe", "expected true or false")]:
        with pytest.raises(ValueError, match=error):
            flags[name].convert(text)

    @dataclasses.dataclass(frozen=True)
    class Unknown:
        sizes: dict[str, int] = dataclasses.field(default_factory=dict)

    with pytest.raises(TypeError, match=r"Unknown\.sizes has type .* cannot express"):
        config_flags(Unknown, {}, {})


def test_report_json_with_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "llama", "--layers", "1", "--json", "--fp8-exclude", "output,*.gate",
                 "--report"]) == 0
    out, err = capsys.readouterr()
    report = Report.from_json(out)
    assert report.meta["config"]["fp8_exclude"] == ["output", "*.gate"]
    assert report.activation_bytes > 0
    assert "[1/1] planning llama tiny fp8_exclude=output,*.gate report=true ..." in err


def test_diff_exit_status(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--model", "gpt", "--layers", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    before = tmp_path / "before.json"
    before.write_text(json.dumps(data))
    grown = max((r for r in data["rows"] if r["kind"] == "activation"), key=lambda r: r["bytes"])
    data["rows"].remove(grown)
    after = tmp_path / "after.json"
    after.write_text(json.dumps(data))

    assert main(["diff", str(before), str(before)]) == 0
    assert "no rows changed" in capsys.readouterr().out
    assert main(["diff", str(after), str(before)]) == 1  # the row came back: grew
    out = capsys.readouterr().out
    assert f"  {grown['module']}: +{grown['bytes']:,} B ({grown['op']}" in out
    assert main(["diff", str(before), str(after)]) == 0  # shrank
    assert "no longer saved" in capsys.readouterr().out


def test_plot_compares_policies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "saved.png"
    assert main(["report", "--model", "llama", "--layers", "1", "--json", "--plot", str(png),
                 "--policy", "fp8=none", "--policy", "fp8=tensorwise kernels=reference"]) == 0
    out, err = capsys.readouterr()
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    reports = json.loads(out)["reports"]
    assert [r["policy"] for r in reports] == ["fp8=none", "fp8=tensorwise kernels=reference"]
    assert "[2/2] planning llama tiny fp8=tensorwise kernels=reference ..." in err


def test_plot_categories_come_from_kind_dtype_and_decision() -> None:
    def row(dtype: str, kind: str = "activation", decision: Decision | None = None,
            offloaded: bool = False) -> Row:
        return Row("n", "aten.mm", "layers.0.mlp", (2,), dtype, 4, 4, kind,
                   decisions=(decision,) if decision else (), offloaded=offloaded)

    assert [category(r) for r in (
        row("bfloat16"), row("float32"), row("int64"), row("float8_e4m3fn", "fp8_data"),
        row("float32", "fp8_scale"), row("bfloat16", offloaded=True),
        row("bfloat16", decision=Decision(What.OFFLOAD, "offload")),
        row("bfloat16", decision=Decision(What.NOT_OFFLOADED, "offload", "parameter")),
        row("bfloat16", decision=Decision(What.RECOMPUTED, "recompute layernorm", "layernorm")),
    )] == ["activation bfloat16", "activation float32", "activation other dtypes", "FP8 data and scales",
           "FP8 data and scales", "offloaded", "offloaded", "activation bfloat16", "recomputed"]


@pytest.mark.parametrize("argv, message", [
    (["report", "--policy", "fp8=delayed"], "policy 'fp8=delayed': fp8: 'delayed' is not one of none, "
                                            "tensorwise, blockwise, mxfp8, rowwise"),
    (["report", "--policy", "recipe=tensorwise"], "unknown option 'recipe'; valid options: codegen,"),
    (["report", "--policy", "fp8"], "expected space-separated key=value items"),
    (["report", "--fp8-min-gemm-flops", "lots"], "argument --fp8-min-gemm-flops: expected an integer, got 'lots'"),
    (["report", "--size", "huge"], "model 'llama': unknown size 'huge'; valid sizes: tiny, tiny_lm, real"),
    (["report", "--model", "graphpass.cli:main"], "factory 'graphpass.cli:main' must accept size="),
    (["report", "--model", "graphpass.models.llama:nothing"], "'graphpass.models.llama' has no function 'nothing'"),
    (["diff", "missing.json", "missing.json"], "cannot read 'missing.json' (No such file or directory)"),
    (["diff", __file__, __file__], "is not one graphpass report"),
])
def test_bad_input_in_process(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphpass: error: ") and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    (["report", "--model", "gpt2"], "unknown model 'gpt2': use one of llama, gpt, deepseek or a factory "
                                    "'package.module:function'"),
    (["report", "--model", "no_such_package.models:build"], "cannot import 'no_such_package.models' for "
                                                            "model 'no_such_package.models:build'"),
    (["report", "--plot", "out.png"], "--plot needs matplotlib, which is not installed: "
                                      "pip install 'graphpass[plot]'"),
])
def test_bad_model_or_missing_extra_in_process(argv: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # A matplotlib that fails to import, as when the plot extra is not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphpass: error: ") and message in err and err.count("\n") == 1


def test_bad_input_is_one_line_and_exit_2_from_the_command(tmp_path: Path) -> None:
    # The whole command, in its own process: an argparse error (argparse exits by itself) is one
    # line on stderr, nothing on stdout, exit status 2. The other bad inputs above run in-process.
    proc = subprocess.run([sys.executable, "-m", "graphpass", "report", "--fp8", "delayed"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("graphpass: error: argument --fp8: 'delayed' is not one of none, "
                                  "tensorwise, blockwise, mxfp8, rowwise (see 'graphpass report "
                                  "--help')")
