"""Every Python block of README.md and docs/ runs, through Sybil's markdown parsers: one test
per page, its blocks in order in one namespace (each sees what the ones before it defined), so
pytest-xdist never splits a page between two workers.

A ```` ```python ```` block runs as written; a block of ``>>>`` lines is a doctest whose outputs
are checked (``...`` matches any text, whitespace is normalised). A block that cannot run here (a
GPU, several processes, a trainer's data set) is skipped by the HTML comment before it, with its
reason: ``<!-- skip: next "needs CUDA: ..." -->``; setup a reader need not see goes in an
``<!-- invisible-code-block: python ... -->`` comment. ``pytest tests/test_doc_pages.py -k fp8``
runs the pages whose name has ``fp8``.

one_version: the pages show the API; the suite's own tests cover every mechanism they use on
every torch version, and the pages' compiles would otherwise cost CI their time three times.
"""
from doctest import ELLIPSIS, NORMALIZE_WHITESPACE
from pathlib import Path
from unittest import SkipTest

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"),
                *(ROOT / "docs").glob("memory/*.md")])

SYBIL = Sybil(parsers=[PythonCodeBlockParser(doctest_optionflags=ELLIPSIS | NORMALIZE_WHITESPACE),
                       SkipParser()], path="..")


def _fresh():
    """A fresh torch.compile state, and compiles that partition every graph: the pages read
    ``graphpass.last_report()``, which a compile-cache hit leaves None
    (docs/troubleshooting.md#last_report-returns-none)."""
    torch._dynamo.reset()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


@pytest.mark.one_version
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_of_the_page_run(page):
    document = SYBIL.parse(page)
    _fresh()
    ran = 0
    try:
        for example in document:
            try:
                example.evaluate()
                ran += 1
            except SkipTest:  # a skip comment's block; its reason is in the page
                pass
    finally:
        document.namespace.clear()
        _fresh()
    assert ran or "```python" not in page.read_text(), f"{page.name}: no block ran"
