"""Every Python block of README.md and docs/ is one that tests/test_doc_pages.py runs: a
fence whose language is exactly ``python`` (another spelling, ``py`` or ``python3``, would be
rendered as Python and never run), and each skip says why."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "docs").glob("memory/*.md")])


def test_python_blocks_are_spelled_python():
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
           for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.match(r"\s*(```|~~~)\s*(py|python3|pycon|ipython)\b", line)]
    assert not bad, "Python blocks the docs' tests would not run:\n" + "\n".join(bad)


def test_every_skip_gives_its_reason():
    bad = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
           for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
           if re.match(r"\s*<!--\s*skip:", line)
           and not re.match(r"""\s*<!--\s*skip:\s*(next|start|end)(\s+"[^"]{10,}"|\s+if\(.*reason=.*\))?\s*-->""", line)]
    bad += [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in PAGES for n, line in enumerate(p.read_text().splitlines(), 1)
            if re.match(r"\s*<!--\s*skip:\s*(next|start)\s*-->", line)]
    assert not bad, "skips without a reason:\n" + "\n".join(bad)
