"""Every Python block of README.md and docs/ runs as a test, through Sybil's markdown parsers.

A ```` ```python ```` block runs as written, in one namespace per page (a page's blocks run in
order, each seeing what the ones before it defined); a block of ``>>>`` lines is a doctest whose
outputs are checked (``...`` matches any text, whitespace is normalised). A block that cannot run
here (a GPU, several processes, a source checkout's files) is skipped by the HTML comment before
it, with its reason: ``<!-- skip: next "needs CUDA: ..." -->``. The suite collects these pages
through ``testpaths`` in pyproject.toml; ``pytest README.md docs`` runs them alone.

Each block is marked ``one_version``: CI runs the pages on its first torch version only. They
show the API; the suite's own tests cover every mechanism they use on every version, and the
pages' compiles would otherwise cost CI their time three times.
"""
import pytest
from doctest import ELLIPSIS, NORMALIZE_WHITESPACE

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser


def _fresh(namespace):
    """Each page starts from a fresh torch.compile state, and compiles partition every graph:
    a page's blocks read ``graphpass.last_report()``, which a compile-cache hit leaves None
    (docs/troubleshooting.md#last_report-returns-none)."""
    import torch
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.reset()
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".md":
            item.add_marker(pytest.mark.one_version)


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(doctest_optionflags=ELLIPSIS | NORMALIZE_WHITESPACE),
             SkipParser()],
    patterns=["README.md", "docs/*.md", "docs/memory/*.md"],
    setup=_fresh,
    teardown=lambda namespace: _fresh(namespace),
).pytest()
