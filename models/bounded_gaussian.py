"""Gaussian model of bounded data released as a noisy sample mean and variance (seed 001).

``y_i ~ N(mu, sigma^2)``, ``i = 1..n``, with public bounds ``[a, b]`` on the records; the curator
releases the sample mean and the sample variance through Laplace mechanisms (``epsilon1``,
``epsilon2``; sensitivities ``(b - a) / n`` and ``(b - a)^2 / n``). The analyst's prior is a
normal-inverse-gamma or the flat prior, with or without the constraints implied by the bounds.
``private_posterior(..., method="gibbs")`` runs Kazan & Reiter's exact Gibbs sampler
(:class:`d3pext.inference.bounded.KazanReiterGibbs`).

>>> import jax.numpy as jnp
>>> from jax import random
>>> from d3pext.inference.bounded import FlatPrior
>>> from d3pext.handlers import make_release, private_posterior
>>> model = private_bounded_gaussian(0.25, 0.25, (0.0, 100.0), FlatPrior(), constrained=True)
>>> release = make_release(model, 43, jnp.linspace(10.0, 60.0, 43), rng_key=0)
>>> sorted(release)
['y_mean_dp', 'y_var_dp']
>>> mcmc = private_posterior(model, release, num_warmup=100, num_samples=100, progress_bar=False)
>>> mcmc.run(random.key(1), 43)
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

from d3pext.inference.bounded import FlatPrior, NormalInverseGamma, Prior, bounded_gaussian_prior
from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import LaplaceMechanism

__all__ = ["BLOOD_LEAD", "bounded_gaussian_model", "private_bounded_gaussian"]

BLOOD_LEAD = {
    "bounds": (0.0, 100.0),
    "n": 43,
    "sample_mean": 32.08,
    "sample_sd": 16.98,
    "epsilon1": 0.25,
    "epsilon2": 0.25,
    "prior": NormalInverseGamma(mu0=12.5, kappa0=1.0, nu0=1.0, sigma0_sq=3.8**2),
    # drawn by the paper's R code with set.seed(6) (Appendix L.2), original scale
    "release": {"y_mean_dp": 34.3027, "y_var_dp": 2224.80},
}
"""Seed 001, Example 1 (blood lead levels of Egyptian traffic policemen, Mortada et al. 2001)."""


def bounded_gaussian_model(
    n: int,
    y: jax.Array | None = None,
    *,
    bounds: tuple[float, float] = (0.0, 1.0),
    prior: Prior = FlatPrior(),
    constrained: bool = False,
) -> None:
    """``(mu, sigma^2) ~ prior`` (restricted to the feasible region if ``constrained``),
    ``y_i ~ N(mu, sigma^2)`` for ``n`` records in ``bounds``."""
    if n < 3:
        raise ValueError(f"The bounded Gaussian model needs n >= 3 records, got n={n}.")
    mu, sigma2 = bounded_gaussian_prior(prior, bounds, constrained)
    with numpyro.plate("records", n):
        numpyro.sample("y", dist.Normal(mu, jnp.sqrt(sigma2)), obs=y)


def private_bounded_gaussian(
    epsilon1: float,
    epsilon2: float,
    bounds: tuple[float, float],
    prior: Prior = FlatPrior(),
    constrained: bool = False,
) -> privatize:
    """:func:`bounded_gaussian_model` releasing ``"y_mean_dp"`` (sample mean, Laplace
    ``epsilon1``) and ``"y_var_dp"`` (sample variance, Laplace ``epsilon2``); the total cost is
    ``epsilon1 + epsilon2``."""
    model = partial(bounded_gaussian_model, bounds=bounds, prior=prior, constrained=constrained)
    model = privatize(
        model, site="y", mechanism=LaplaceMechanism(epsilon1), statistic="sample_mean",
        bounds=bounds, name="y_mean_dp",
    )
    return privatize(
        model, site="y", mechanism=LaplaceMechanism(epsilon2), statistic="sample_variance",
        bounds=bounds, name="y_var_dp",
    )
