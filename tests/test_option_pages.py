"""The option pages: docs/options.md (the common options) and docs/options-advanced.md (every
other keyword, by group) are what scripts/option_pages.py writes from graphpass/config.py, each
keyword is on exactly one of them, and no option's docstring (which ``graphpass report --help``
prints) quotes a measurement: numbers live in docs/numbers.md with their commands."""
import importlib.util
import re
from pathlib import Path

import pytest

from graphpass.cli_flags import config_flags
from graphpass.config import SHORTHAND

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("option_pages", ROOT / "scripts" / "option_pages.py")
pages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pages)

# A measured quantity: bytes in MiB/GiB/MB/GB, times, percentages, speedups, or a number with
# thousands separators (as a measured byte count is written).
MEASUREMENT = re.compile(r"\d(?:[\d,.]*\d)?\s*(?:[KMG]i?B|ms|us|µs|%|x faster|x slower)\b|"
                         r"[+-]\d+(?:\.\d+)?%|\d{1,3}(?:,\d{3})+")


@pytest.mark.parametrize("path", sorted(pages.PAGES))
def test_page_is_what_the_script_writes(path):
    text = (ROOT / path).read_text()
    assert pages.rendered(path, text) == text, (
        f"{path} differs from graphpass/config.py: run `python scripts/option_pages.py`")


def test_every_option_is_on_one_page():
    assert pages.COMMON == ("fp8", "memory_budget", "recompute", "offload", "fp8_exclude",
                            "codegen")
    advanced = [name for _, names in pages.ADVANCED for name in names]
    on_pages = list(pages.COMMON) + advanced
    assert sorted(on_pages) == sorted(SHORTHAND), (
        "each keyword of Config on exactly one option page (scripts/option_pages.py): "
        f"missing {sorted(set(SHORTHAND) - set(on_pages))}, "
        f"twice {sorted({n for n in on_pages if on_pages.count(n) > 1})}, "
        f"unknown {sorted(set(on_pages) - set(SHORTHAND))}")


def test_no_option_docstring_quotes_a_measurement():
    quoted = {flag.name: MEASUREMENT.findall(flag.help) for flag in config_flags()}
    assert not {name: found for name, found in quoted.items() if found}


def test_the_measurement_pattern_finds_measurements():
    for text in ("holds 913 MiB instead of 1,201", "+4.3% step time", "1.1 us", "2.3x faster"):
        assert MEASUREMENT.search(text), text
    for text in ("1 byte per element", "1x128 block", "(0, 1]", "2*M*N*K", "fp8_max / amax"):
        assert not MEASUREMENT.search(text), text
