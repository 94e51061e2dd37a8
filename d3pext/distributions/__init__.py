"""Distributions for inference from private releases.

- :mod:`~d3pext.distributions.geometric`: two-sided geometric noise (``TwoSidedGeometric``) and
  privatized Poisson counts (``GeometricNoisedPoisson``), seed 002;
- :mod:`~d3pext.distributions.bessel`: ``log_bessel_ive``, ``Skellam`` and the ``Bessel`` law with
  its exact sampler, seed 002;
- :mod:`~d3pext.distributions.inverse_gaussian`: ``InverseGaussian``, the Laplace mixing
  precision of seed 004;
- :mod:`~d3pext.distributions.truncated_gamma`: truncated gamma and the truncated-gamma mixture
  (TGM) of seed 001;
- :mod:`~d3pext.distributions.expfam`: exponential-family descriptions (natural parameters,
  log-partition, conjugate priors) that privatize and the Gibbs backends read.
"""

from d3pext.distributions.bessel import Bessel, Skellam, bessel_mode, log_bessel_ive, sample_bessel
from d3pext.distributions.geometric import (
    GeometricNoisedPoisson,
    TwoSidedGeometric,
    exponential_fine_tail,
    integer,
)
from d3pext.distributions.inverse_gaussian import InverseGaussian
from d3pext.distributions.truncated_gamma import TGM, TruncatedGammaMixture, truncated_gamma

__all__ = [
    "Bessel",
    "GeometricNoisedPoisson",
    "InverseGaussian",
    "Skellam",
    "TGM",
    "TruncatedGammaMixture",
    "TwoSidedGeometric",
    "bessel_mode",
    "exponential_fine_tail",
    "integer",
    "log_bessel_ive",
    "sample_bessel",
    "truncated_gamma",
]
