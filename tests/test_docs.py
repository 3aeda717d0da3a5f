"""The docs say what is true now, and keep saying it.

- every link between the docs resolves: a markdown link in README.md, DEVELOPERS.md or docs/ to a
  file of the repository and, with ``#anchor``, to one of its headings (GitHub's slugs); every
  ``docs/<page>.md#anchor`` named in those docs or in the Python sources (graphpass/, tests/,
  benchmarks/, examples/, scripts/) too;
- the docs (README.md, DEVELOPERS.md, docs/) and graphpass/'s sources narrate no history and cite
  no file outside the repository: fixed bugs, earlier runs and old numbers go to CHANGELOG.md;
- a module of graphpass/ over 500 lines says why it is one module: a line of its docstring
  starting ``One module because``.
"""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
REASON = "One module because"

# History a doc must not narrate (CHANGELOG.md holds it), case-insensitive.
HISTORY = ("fixed:", "predate", "before this fix", "before the fix", "an export of",
           "as measured before")
# Files outside the repository a doc or a source must not cite.
OUTSIDE = ("/work/", "../shared", "shared/reference", "shared/notes", "reference notes", "§")



def doc_files():
    return sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", *(ROOT / "docs").rglob("*.md")])


def source_files():
    return sorted((ROOT / "graphpass").rglob("*.py"))


def python_files():
    """Every Python source that may name a doc (this test's own examples aside)."""
    found = [p for d in ("graphpass", "tests", "benchmarks", "examples", "scripts")
             for p in (ROOT / d).rglob("*.py")]
    return sorted(p for p in found if p != Path(__file__).resolve())


def rel(path):
    return path.relative_to(ROOT).as_posix()


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but '-' and '_'
    dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def without_code(text, spans=True):
    """The markdown outside fenced code blocks and, with ``spans``, inline code spans (neither
    holds links or headings)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", "", line) if spans else line)
    return "\n".join(out)


def anchors(path, _cache={}):
    """The anchors of ``path``'s headings (a repeated heading's get ``-1``, ``-2``, ...) and of
    its ``<a name=...>`` tags."""
    if path not in _cache:
        seen, found = {}, set()
        for line in without_code(path.read_text(), spans=False).split("\n"):
            m = re.match(r" {0,3}#{1,6} +(.*?) *#* *$", line)
            if m:
                base = slug(m.group(1))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        found |= set(re.findall(r"""<a (?:name|id)=["']([^"']+)["']""", path.read_text()))
        _cache[path] = found
    return _cache[path]


def broken(target, base):
    """Why ``target`` (a path relative to ``base``, with an optional ``#anchor``) does not
    resolve, or None."""
    path, _, anchor = target.partition("#")
    file = (base / path).resolve() if path else None
    if file is not None and not file.exists():
        return f"no file {path}"
    if anchor and (file is None or file.suffix == ".md"):
        if anchor not in anchors(file):
            return f"no heading #{anchor} in {path}"
    return None


MD_LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w./-]+?\.md(?:#[\w-]+)?")


def links(path):
    """(target, base directory) of every reference ``path`` makes to a doc or file."""
    text = path.read_text()
    found = []
    if path.suffix == ".md":
        for target in MD_LINK.findall(without_code(text)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            found.append((path.name + target if target.startswith("#") else target, path.parent))
    found += [(t, ROOT) for t in DOCS_PATH.findall(text)]
    return found


def test_every_link_resolves():
    bad = []
    for path in doc_files() + python_files():
        for target, base in links(path):
            why = broken(target, base)
            if why:
                bad.append(f"{rel(path)}: {target}: {why}")
    assert not bad, "\n".join(bad)


def test_the_link_checker_finds_each_kind_of_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text("# A `thing` (option)\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    assert anchors(doc) == {"a-thing-option", "same", "same-1"}
    assert broken("a.md#a-thing-option", tmp_path) is None
    assert broken("a.md#same-1", tmp_path) is None
    assert broken("a.md#not-a-heading", tmp_path) == "no heading #not-a-heading in a.md"
    assert broken("b.md", tmp_path) == "no file b.md"
    other = tmp_path / "b.md"
    other.write_text("See [a](a.md#gone), [here](#b), `[code](x.md)`, [web](https://x.org/y.md)"
                     " and docs/c.md#d.\n\n# B\n")
    assert links(other) == [("a.md#gone", tmp_path), ("b.md#b", tmp_path), ("docs/c.md#d", ROOT)]
    assert slug("`recompute_method` and `recompute_num_layers`") == \
        "recompute_method-and-recompute_num_layers"
    assert slug("FP8 activation cache (lossy, opt-in)") == "fp8-activation-cache-lossy-opt-in"
    assert slug("Llama-3-8B on an H100, 2026-11-23") == "llama-3-8b-on-an-h100-2026-11-23"


def history(text, phrases=HISTORY + OUTSIDE):
    low = text.lower()
    return [p for p in phrases if p.lower() in low]


def test_no_history_and_no_outside_files():
    """No history in the docs and graphpass/; no file outside the repository cited by any of
    them, nor by the tests, benchmarks, examples and scripts."""
    bad = []
    for path in sorted(set(doc_files() + source_files() + python_files())):
        phrases = HISTORY + OUTSIDE if path in doc_files() + source_files() else OUTSIDE
        for i, line in enumerate(path.read_text().split("\n"), 1):
            for phrase in history(line, phrases):
                bad.append(f"{rel(path)}:{i}: {phrase!r}: {line.strip()}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("line", [
    "Fixed: the cache is undone for such a tensor.",
    "The 5-seed row above predates this fix.",
    "The layer_input row predates the layer_input fix.",
    "Mean gap 0.585% (before this fix 0.267%).",
    "+0.547% +- 0.185% (before the fix +0.216%).",
    "`all` before it, run from an export of f535560^, 2.6285.",
    "**Loss, as measured before** (earlier runs).",
    "see /work/shared/reference/transformer-engine.md",
    "the notes in ../shared/notes/fp8.md",
    "computes ``B @ A.T`` (§1 of the TE reference notes)",
])
def test_the_history_check_finds(line):
    assert history(line)


def test_the_history_check_passes_the_present_tense():
    assert not history("The cache is undone for such a tensor, and a note says so.")


def long_without_reason(path):
    lines = path.read_text().split("\n")
    if len(lines) <= MAX_LINES:
        return False
    doc = ast.get_docstring(ast.parse("\n".join(lines))) or ""
    return not any(line.strip().startswith(REASON) for line in doc.split("\n"))


def test_every_long_module_says_why_it_is_one():
    bad = [f"{rel(p)}: {len(p.read_text().splitlines())} lines, no '{REASON} ...' in its docstring"
           for p in source_files() if long_without_reason(p)]
    assert not bad, "\n".join(bad)


def test_the_length_check_reads_the_docstring(tmp_path):
    body = "x = 1\n" * MAX_LINES
    short = tmp_path / "short.py"
    short.write_text('"""Short."""\n')
    bare = tmp_path / "bare.py"
    bare.write_text('"""A module."""\n' + body)
    said = tmp_path / "said.py"
    said.write_text(f'"""A module.\n\n{REASON} its parts share one table.\n"""\n' + body)
    in_code = tmp_path / "code.py"
    in_code.write_text(f'"""A module."""\n# {REASON} it is\n' + body)
    assert [long_without_reason(p) for p in (short, bare, said, in_code)] == \
        [False, True, False, True]
