"""d3pext: Bayesian inference under differential privacy for NumPyro.

The package is layered; imports point one way, from the bottom up:

- :mod:`d3pext.accountants`: privacy accounting (Fourier accountant, ``approximate_sigma``,
  the privacy ledger);
- the engine:

  - :mod:`d3pext.distributions`: the laws of noise, counts and latent variables;
  - :mod:`d3pext.releases`: release mechanisms and what a release carries;
  - :mod:`d3pext.training`: private training, ``DPSVI`` with its clipping strategies and
    minibatch samplers;
  - :mod:`d3pext.inference`: inference from releases, the backend registry and one module per
    backend (exponential families, bounded Gaussian, counts, regression);
  - :mod:`d3pext.simulation`: simulation-based inference (SPPE/SPLE, flows, RQMC, ABC);
  - :mod:`d3pext.audit`: empirical privacy audits;
  - shared leaves: :mod:`d3pext.prng` (ChaCha20), :mod:`d3pext.validation`, :mod:`d3pext.dtypes`;

- :mod:`d3pext.handlers`: the effect handlers ``privatize`` and ``private_posterior``;
- :mod:`d3pext.models`: the models of the seed papers;
- :mod:`d3pext.cli`: the ``d3pext`` command.

The everyday names are importable from the top level, lazily (``import d3pext`` loads nothing
heavy)::

    from d3pext import DPSVI, privatize, private_posterior, make_release, LaplaceMechanism
    from d3pext import save_releases, load_releases  # curator and analyst in different processes

Modules moved by the restructuring of version 0.2 keep working under their old paths
(``d3pext.svi``, ``d3pext.mechanisms``, ``d3pext.bounded``, ...) with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from d3pext._lazy import lazy_attributes

__version__ = "0.2.0"

_LAZY = {
    "DPSVI": "d3pext.training.svi",
    "DPSVIRunResult": "d3pext.training.svi",
    "DPSVIState": "d3pext.training.svi",
    "PrivacyReport": "d3pext.training.svi",
    "privatize": "d3pext.handlers.privatize",
    "privatize_counts": "d3pext.handlers.privatize",
    "make_release": "d3pext.handlers.privatize",
    "save_releases": "d3pext.releases.files",
    "load_releases": "d3pext.releases.files",
    "private_posterior": "d3pext.handlers.posterior",
    "sample_releases": "d3pext.handlers.posterior",
    "register_backend": "d3pext.inference.registry",
    "LaplaceMechanism": "d3pext.releases.mechanisms",
    "GaussianMechanism": "d3pext.releases.mechanisms",
    "GeometricMechanism": "d3pext.releases.mechanisms",
    "BinomialMechanism": "d3pext.releases.mechanisms",
    "PrivacyLedger": "d3pext.accountants.ledger",
    "PrivacyBudgetExceeded": "d3pext.accountants.ledger",
    "approximate_sigma": "d3pext.accountants.fourier",
    "epsilon": "d3pext.accountants.fourier",
    "secure_key": "d3pext.prng",
    "enable_compile_cache": "d3pext.compile_cache",
}

MOVED_MODULES = {
    "d3pext.svi": "d3pext.training.svi",
    "d3pext.ghost": "d3pext.training.ghost",
    "d3pext.minibatch": "d3pext.training.minibatch",
    "d3pext.mechanisms": "d3pext.releases.mechanisms",
    "d3pext.bounded": "d3pext.inference.bounded",
    "d3pext.counts": "d3pext.inference.counts",
    "d3pext.regression": "d3pext.inference.regression",
    "d3pext.gibbs": "d3pext.inference.expfam_gibbs",
    "d3pext.expfam": "d3pext.distributions.expfam",
    "d3pext.tgm": "d3pext.distributions.truncated_gamma",
    "d3pext.sbi": "d3pext.simulation.sbi",
    "d3pext.flows": "d3pext.simulation.flows",
    "d3pext.rqmc": "d3pext.simulation.rqmc",
    "d3pext.abc": "d3pext.simulation.abc",
}
"""Old module paths (before 0.2) and where their contents live now."""

__all__ = [*_LAZY, "MOVED_MODULES", "__version__"]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path as its new module, with a ``DeprecationWarning``."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; import it from there (the old path will be removed).",
            DeprecationWarning,
            stacklevel=4,
        )
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())
