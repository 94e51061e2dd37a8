"""Effect handlers that put privacy into NumPyro models: ``privatize`` and ``private_posterior``."""

from .posterior import (
    NotApplicable,
    PrivateModel,
    PrivatePosterior,
    augment,
    available_methods,
    inspect_model,
    private_posterior,
    register_backend,
    sample_releases,
)
from .privatize import ReleaseInfo, curator_key, make_release, privatize, release_sites

__all__ = [
    "NotApplicable",
    "PrivateModel",
    "PrivatePosterior",
    "ReleaseInfo",
    "augment",
    "available_methods",
    "curator_key",
    "inspect_model",
    "make_release",
    "private_posterior",
    "privatize",
    "register_backend",
    "release_sites",
    "sample_releases",
]
