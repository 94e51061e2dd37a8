"""Effect handlers that put privacy into NumPyro models.

- :mod:`~d3pext.handlers.privatize`: ``privatize`` (insert a release into a model, as a wrapper or
  a ``with`` block), ``privatize_counts`` (locally private counts) and the curator's
  ``make_release``;
- :mod:`~d3pext.handlers.posterior`: ``private_posterior`` (inference from releases by the
  registered backends, :mod:`d3pext.inference`) and ``sample_releases`` (many releases in one
  compiled call).
"""

from d3pext.handlers.posterior import PrivatePosterior, private_posterior, sample_releases
from d3pext.handlers.privatize import curator_key, make_release, privatize, privatize_counts
from d3pext.inference.registry import available_methods, register_backend
from d3pext.inference.structure import NotApplicable, PrivateModel, inspect_model
from d3pext.releases.info import ReleaseInfo, release_sites

__all__ = [
    "NotApplicable",
    "PrivateModel",
    "PrivatePosterior",
    "ReleaseInfo",
    "available_methods",
    "curator_key",
    "inspect_model",
    "make_release",
    "private_posterior",
    "privatize",
    "privatize_counts",
    "register_backend",
    "release_sites",
    "sample_releases",
]
