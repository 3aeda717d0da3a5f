"""graphpass as a user installs it: the package alone, run from a directory outside the
repository, where the checkout's other folders (examples/, tests/, benchmarks/) are not
importable. The reference models the CLI plans ship inside the package (graphpass.models)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _outside(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` in an empty directory with the graphpass package, and nothing else of the
    checkout, on the path."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "graphpass").symlink_to(ROOT / "graphpass", target_is_directory=True)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)


# a fresh interpreter importing torch and graphpass (about 12 s of CPU); what it checks is the
# package's contents, the same under every torch: test_cli.py's `report --model llama` cases
# resolve the model in graphpass.models on every version
@pytest.mark.one_version
def test_the_cli_builds_a_reference_model_outside_the_checkout(tmp_path):
    """``graphpass report --model llama`` resolves its model in the package, from any directory
    (planning it is test_cli.py's)."""
    out = _outside(tmp_path, "-c", "import importlib.util, graphpass; from graphpass import cli; "
                   "print(importlib.util.find_spec('examples')); print(graphpass.__file__); "
                   "model, inputs = cli.build_model('llama', 'tiny', 1); "
                   "print(type(model).__module__, len(model.layers), tuple(inputs[0].shape))")
    assert out.returncode == 0, out.stderr
    found, package, built = out.stdout.splitlines()
    assert found == "None", "the checkout's examples/ is importable here: the test checks nothing"
    assert package.startswith(str(tmp_path / "site" / "graphpass"))
    assert built == "graphpass.models.llama 1 (2, 32, 256)"


def test_the_package_build_includes_the_reference_models():
    """The packages pyproject.toml's find settings give a wheel include graphpass.models."""
    tomllib = pytest.importorskip("tomllib")
    setuptools = pytest.importorskip("setuptools")
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(str(ROOT), include=find["include"])
    assert "graphpass.models" in packages
    from graphpass.models import MODELS

    assert all((ROOT / "graphpass" / "models" / f"{name}.py").is_file() for name in MODELS)


def test_graphpass_calls_no_option_by_a_deprecated_name():
    """A keyword of ``Config.DEPRECATED`` passed by graphpass's own code would print its
    FutureWarning to every user of that code (the CLI's report, once)."""
    import ast

    from graphpass.config import DEPRECATED

    found = [f"{path.relative_to(ROOT)}:{node.lineno}: {keyword.arg}="
             for path in sorted((ROOT / "graphpass").rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
             if isinstance(node, ast.Call) for keyword in node.keywords
             if keyword.arg in DEPRECATED]
    assert not found, "deprecated option names: " + ", ".join(found)
