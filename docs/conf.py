"""Sphinx configuration of the d3pext documentation.

Build (warnings are errors)::

    pip install -e ".[docs]"
    sphinx-build -W --keep-going -b html docs docs/_build/html

Guide pages are Markdown (MyST); the API reference is generated from the reST docstrings by autodoc
and autosummary; the notebooks in ``notebooks/`` are rendered by myst-nb with their stored outputs
and figures (they are not executed during the build: ``nb_execution_mode = "off"``).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the package (editable installs find it anyway)

# The notebooks live in the repository's notebooks/ folder, outside the Sphinx source folder:
# copy them in (only when changed, so that an incremental build re-reads nothing).
_NB_SRC, _NB_DST = ROOT / "notebooks", DOCS / "notebooks"
_NB_DST.mkdir(exist_ok=True)
for _nb in sorted(_NB_SRC.glob("*.ipynb")):
    _target = _NB_DST / _nb.name
    if not _target.exists() or not filecmp.cmp(_nb, _target, shallow=False):
        shutil.copyfile(_nb, _target)
for _stale in _NB_DST.glob("*.ipynb"):
    if not (_NB_SRC / _stale.name).exists():
        _stale.unlink()

import d3pext  # noqa: E402

sys.path.insert(0, str(DOCS))
import _api  # noqa: E402

_api.generate(DOCS)  # docs/api/*.rst, from the package's modules and their __all__

project = "d3pext"
author = "the d3pext authors"
copyright = "the d3pext authors, Apache-2.0"
release = d3pext.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_nb",  # Markdown pages (MyST) and notebooks
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # a few docstrings use Google-style "Args:" sections
    "sphinx.ext.doctest",  # the ``.. doctest::`` directive in docstrings
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]
# D3PEXT_DOCS_SOURCE_PAGES=0 leaves out the highlighted module sources (sphinx.ext.viewcode: the
# "[source]" links and the _modules/ pages), about a fifth of the build. tests/test_docs.py builds so:
# viewcode never warns (it logs only at debug and verbose level), so the build's warnings are the same.
if os.environ.get("D3PEXT_DOCS_SOURCE_PAGES", "1") == "0":
    extensions.remove("sphinx.ext.viewcode")

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints", "README.md"]
root_doc = "index"

# -- MyST / myst-nb ----------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"  # render the stored outputs; the tests execute the notebooks
nb_merge_streams = True
# Notebook outputs carry progress-bar widgets and other MIME types HTML cannot show; prefer the
# images and text that are always there.
nb_mime_priority_overrides = [("html", "application/vnd.jupyter.widget-view+json", None)]
suppress_warnings = ["mystnb.unknown_mime_type"]

# -- autodoc / autosummary ---------------------------------------------------------------------
autosummary_generate = False  # the API pages are written by hand (docs/api/*.rst)
autodoc_default_options = {"members": True, "member-order": "bysource", "show-inheritance": True}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
add_module_names = False
python_use_unqualified_type_names = True

# -- HTML --------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"d3pext {release}"
html_static_path = ["_static"]
html_theme_options = {
    "source_repository": os.environ.get("D3PEXT_DOCS_REPO", ""),
    "navigation_with_keys": True,
}
if not html_theme_options["source_repository"]:
    del html_theme_options["source_repository"]
