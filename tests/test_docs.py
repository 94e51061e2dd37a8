"""The documentation builds with warnings as errors, and documents every public name.

Runs the documented command ``sphinx-build -W --keep-going -b html docs docs/_build/html`` into a
temporary folder, without the highlighted module sources (``D3PEXT_DOCS_SOURCE_PAGES=0``, see
docs/conf.py: sphinx.ext.viewcode never warns); about half a minute on two cores (the notebooks are
rendered from their stored outputs, not executed). Needs the docs packages (sphinx, myst-nb, furo),
which the ``[test]`` and ``[docs]`` extras install.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SUBPACKAGES = ["distributions", "releases", "training", "inference", "simulation", "handlers", "models", "accountants"]


def _public_names() -> list[str]:
    """Fully qualified names that the API reference must describe: each module's ``__all__``."""
    import d3pext

    modules = [
        f"d3pext.{m.name}"
        for m in pkgutil.iter_modules(d3pext.__path__)
        if not m.ispkg and not m.name.startswith("_")
    ]
    for sub in SUBPACKAGES:
        package = importlib.import_module(f"d3pext.{sub}")
        modules += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]
    names = []
    for module in modules:
        mod = importlib.import_module(module)
        for name in getattr(mod, "__all__", []):
            home = getattr(getattr(mod, name), "__module__", None)
            if isinstance(home, str) and home != module and home.startswith("d3pext"):
                continue  # a re-export: described where it is defined
            names.append(f"{module}.{name}")
    # the top-level names are described where they are defined
    names += [f"{module}.{name}" for name, module in d3pext._LAZY.items()]
    return names


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory):
    for module in ("sphinx", "myst_nb", "furo"):
        try:
            importlib.import_module(module)
        except ImportError:
            pytest.fail(f"building the docs needs {module}: pip install -e '.[test]' (or '.[docs]')")
    out = tmp_path_factory.mktemp("docs")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q",
           "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    # without the highlighted module sources (docs/conf.py): they never warn, and took a fifth of the build
    env = {**os.environ, "D3PEXT_DOCS_SOURCE_PAGES": "0"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (
        "sphinx-build -W failed (every warning is an error):\n" + proc.stderr[-6000:] + proc.stdout[-2000:]
    )
    return out / "html"


def test_docs_build_without_warnings(built_docs):
    for page in ("index.html", "guides/getting_started.html", "api/index.html", "notebooks.html"):
        assert (built_docs / page).is_file(), page
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    for name in notebooks:
        html = (built_docs / "notebooks" / f"{name}.html").read_text(encoding="utf-8")
        assert "<img" in html, f"notebook {name} rendered without its figures"


def test_api_reference_documents_every_public_name(built_docs):
    from sphinx.util.inventory import InventoryFile

    with open(built_docs / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    data = inventory.data if hasattr(inventory, "data") else inventory
    described = {name for entries in data.values() for name in entries}
    missing = [name for name in _public_names() if name not in described]
    assert not missing, f"public names missing from the API reference: {missing}"
