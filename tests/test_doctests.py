"""Every module's docstring examples run and print what they say (``doctest``).

The modules whose examples compile samplers or fit models (minutes of CPU together) run with
``pytest -m slow``; the quick ones run by default.
"""

import doctest
import importlib
import pkgutil

import pytest

FAST = {
    "d3pext.accountants.fourier", "d3pext.accountants.ledger", "d3pext.cli", "d3pext.distributions.expfam",
    "d3pext.releases.mechanisms", "d3pext.models.sir", "d3pext.prng", "d3pext.validation", "d3pext.dtypes",
    "d3pext.inference.registry", "d3pext.training.clipping", "d3pext.releases.counts", "d3pext.releases.exact",
    "d3pext.training.dependence", "d3pext.audit", "d3pext.inference.gibbs_base", "d3pext.training.noise",
    "d3pext.releases.info", "d3pext.releases.files", "d3pext.releases.sums",
}


def _modules() -> list[str]:
    # the subpackages live in their own folders (handlers/, models/, accountants/): walk each
    names = set()
    for package in ("d3pext", "d3pext.handlers", "d3pext.models", "d3pext.accountants"):
        names.add(package)
        path = importlib.import_module(package).__path__
        names.update(i.name for i in pkgutil.walk_packages(path, package + ".") if not i.name.endswith("__main__"))
    return sorted(names)


MODULES = _modules()


def test_module_list_is_complete():
    assert FAST <= set(MODULES)
    assert {"d3pext.training.svi", "d3pext.handlers.posterior", "d3pext.models.vae"} <= set(MODULES)


@pytest.mark.parametrize(
    "name", [m if m in FAST else pytest.param(m, marks=pytest.mark.slow) for m in MODULES]
)
def test_docstring_examples(name):
    if name in ("d3pext.simulation.flows", "d3pext.simulation.sbi"):
        pytest.importorskip("flowjax")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples of {name} failed (output above)"
