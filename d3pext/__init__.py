"""d3pext: Bayesian inference under differential privacy for NumPyro.

``DPSVI`` and its result types are imported lazily, so that ``import d3pext.accountants`` (or any other
submodule) does not pull in the whole engine.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "DPSVI": "d3pext.svi",
    "DPSVIRunResult": "d3pext.svi",
    "DPSVIState": "d3pext.svi",
    "PrivacyReport": "d3pext.svi",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'd3pext' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY])
