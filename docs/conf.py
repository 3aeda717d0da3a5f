"""Sphinx configuration of graphpass's docs site: ``python -m sphinx -W -c docs . docs/_build``
builds its HTML from the repository's root; tests/test_docs_site.py builds it with warnings as
errors.

The site's source is the repository itself, so every markdown link between README.md, the other
top-level pages and docs/ resolves as it does on GitHub: ``sphinx-build -c docs . <out>``.
MyST parses the markdown pages; autodoc writes the API reference (docs/api.md) from the public
API's docstrings.
"""

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "graphpass"
author = "graphpass developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]

root_doc = "docs/index"
source_suffix = {".md": "markdown"}
include_patterns = ["README.md", "DEVELOPERS.md", "CHANGELOG.md", "docs/**"]
# Every other top-level folder is left out, so Sphinx does not walk the virtualenvs' files.
exclude_patterns = sorted(name for name in os.listdir(ROOT)
                          if os.path.isdir(os.path.join(ROOT, name)) and name != "docs")
exclude_patterns.append("docs/_build")

# GitHub's heading slugs, so `page.md#heading` links resolve on the site as on GitHub.
myst_heading_anchors = 6
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}

html_theme = "alabaster"
html_title = "graphpass"
