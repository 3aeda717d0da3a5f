"""``--first-params`` (tests/conftest.py): CI's later torch versions run each parametrized test
with its first parameter set, after ``-m``'s deselection, and every set of a test marked
``every_param``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
# pytest's collection, not torch's: the same on every version
pytestmark = pytest.mark.one_version

CONFTEST = Path(__file__).with_name("conftest.py")

INNER = '''
import pytest

@pytest.mark.parametrize("x", [1, 2, 3])
def test_sweep(x):
    pass

@pytest.mark.parametrize("x", [pytest.param(1, marks=pytest.mark.one_version), 2, 3])
def test_first_left_out(x):
    pass

@pytest.mark.every_param
@pytest.mark.parametrize("x", ["a", "b"])
def test_kept(x):
    pass

@pytest.mark.parametrize("y", [1, 2])
@pytest.mark.parametrize("x", [1, 2])
def test_stacked(x, y):
    pass

def test_plain():
    pass
'''


def _ids(pytester: pytest.Pytester, *args: str) -> list[str]:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    one_version: x\n    every_param: x\n")
    pytester.makepyfile(test_inner=INNER)
    # in-process: a subprocess per run imported torch again (25 s each on 2 busy cores)
    result = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:xdist", *args)
    return [line for line in result.outlines if "::" in line]


def test_each_function_keeps_its_first_set_that_is_left(pytester: pytest.Pytester) -> None:
    ids = _ids(pytester, "-m", "not one_version", "--first-params")
    assert [i.split("::")[1] for i in ids] == [
        "test_sweep[1]", "test_first_left_out[2]", "test_kept[a]", "test_kept[b]",
        "test_stacked[1-1]", "test_plain"]


def test_without_the_option_every_set_runs(pytester: pytest.Pytester) -> None:
    assert len(_ids(pytester)) == 3 + 3 + 2 + 4 + 1
