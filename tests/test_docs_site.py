"""The docs site builds with no warning, and its API reference documents the whole public API.

The site is Sphinx's (docs/conf.py): MyST reads the markdown pages, autodoc the docstrings
(docs/api.md). The build runs in this process with the ``dummy`` builder, which reads and
resolves every page (cross-references, anchors, autodoc) without writing HTML: the warnings are
those of ``make docs``'s HTML build.
"""
import io
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

sphinx_application = pytest.importorskip(
    "sphinx.application",
    reason="Sphinx is not installed: `pip install -e .[docs]` (make setup installs it)")
pytest.importorskip("myst_parser", reason="myst-parser is not installed: `pip install -e .[docs]`")
from sphinx.util.console import nocolor  # noqa: E402

# myst-parser's use of Sphinx APIs that a later Sphinx removes: theirs to change, not the site's.
# one_version: the site (markdown pages and docstrings) is the same under every torch version;
# tests/test_entry_points.py and the rest of the suite import graphpass on every version.
pytestmark = [pytest.mark.filterwarnings("ignore:.*Check CHANGES for Sphinx API modifications"),
              pytest.mark.one_version]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    warnings = io.StringIO()
    nocolor()
    app = sphinx_application.Sphinx(
        srcdir=ROOT, confdir=ROOT / "docs", outdir=out / "out", doctreedir=out / "doctrees",
        buildername="dummy", status=None, warning=warnings, freshenv=True)
    app.build()
    return app, warnings.getvalue()


def test_site_builds_without_warnings(site):
    app, warnings = site
    assert warnings == "", f"the docs site's build warned:\n{warnings}"
    assert app.statuscode == 0


def documented(app):
    return set(app.env.get_domain("py").objects)


def test_api_reference_documents_the_public_api(site):
    import graphpass
    import graphpass.testing

    app, _ = site
    have = documented(app)
    missing = [f"graphpass.{n}" for n in graphpass.__all__
               if n != "__version__" and f"graphpass.{n}" not in have]
    missing += [f"graphpass.testing.{n}" for n in graphpass.testing.__all__
                if f"graphpass.testing.{n}" not in have]
    assert not missing, f"docs/api.md leaves out: {missing}"


def test_every_page_is_in_the_navigation(site):
    """Every page of docs/ is reachable from the site's navigation (Sphinx warns about one that
    is not; this names them)."""
    app, _ = site
    pages = {p.relative_to(ROOT).with_suffix("").as_posix() for p in (ROOT / "docs").rglob("*.md")
             if "_build" not in p.parts}
    assert pages <= set(app.env.toctree_includes) | {d for ds in app.env.toctree_includes.values()
                                                      for d in ds}
