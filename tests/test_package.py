"""The package's front: top-level names, a cheap ``import d3pext``, moved module paths."""

import importlib
import subprocess
import sys
import warnings

import pytest

import d3pext

TOP_LEVEL = (
    "DPSVI", "privatize", "private_posterior", "make_release", "LaplaceMechanism",
    "GaussianMechanism", "GeometricMechanism", "PrivacyLedger", "approximate_sigma",
)


def test_everyday_names_import_from_the_top_level():
    namespace = {}
    exec(f"from d3pext import {', '.join(TOP_LEVEL)}", namespace)
    from d3pext.handlers.privatize import privatize
    from d3pext.training.svi import DPSVI

    assert namespace["privatize"] is privatize and namespace["DPSVI"] is DPSVI
    assert set(TOP_LEVEL) <= set(d3pext.__all__) <= set(dir(d3pext))
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        d3pext.nothing


def test_import_d3pext_is_cheap():
    # the top-level names are lazy: importing the package loads neither JAX nor NumPyro
    code = "import sys, d3pext; print(sorted(m for m in ('jax', 'numpyro') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("old, new", sorted(d3pext.MOVED_MODULES.items()))
def test_moved_modules_keep_working_with_a_deprecation_warning(old, new):
    if new.startswith("d3pext.simulation.flows") or new == "d3pext.simulation.sbi":
        pytest.importorskip("flowjax")
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module(new)  # the new path is silent


def test_pyproject_lists_every_subpackage():
    # a non-editable install ships only the listed packages
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    for package, folder in config["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            name = ".".join([package, *rel])
            if not any(name == p or name.startswith(p + ".") and p != "d3pext" for p in listed - {name}):
                assert name in listed, f"{name} ({init.parent}) is missing from pyproject's packages"
