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
    register_fitter,
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
    "register_fitter",
    "release_sites",
    "sample_releases",
]

# backends of later methods register themselves on import
import d3pext.bounded  # noqa: E402,F401  (Kazan & Reiter bounded Gaussian)
import d3pext.counts  # noqa: E402,F401  (Schein et al. Bessel augmentation for counts)
import d3pext.sbi  # noqa: E402,F401  (Xiong, Ju & Zhang "sppe" and "sple"; flowjax imported on use)
import d3pext.regression  # noqa: E402,F401  (Bernstein & Sheldon regression with Kazan & Reiter constraints)
