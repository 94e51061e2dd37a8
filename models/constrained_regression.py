"""Simple linear regression of bounded data from private sufficient statistics (seed 001 section 5,
Bernstein & Sheldon 2019), with or without the constraints implied by the bounds.

Records ``(x_i, y_i)`` (one sample site ``"records"`` of shape ``(n, 2)``): ``x_i`` in public
bounds ``[a_x, b_x]`` (uniform placeholder: the sampler uses only the covariate's moments),
``y_i | x_i ~ N(beta0 + beta1 x_i, sigma^2)``. The curator **clips** both into their bounds
(so the sensitivities hold for any data), rescales to ``[0, 1]`` and releases two vectors with
the Laplace mechanism (:mod:`d3pext.inference.regression`):

- ``"records_dp"``: ``S = (sum u, sum u^2, sum v, sum u v, sum v^2)``, sensitivity 5,
  epsilon ``(1 - x_moment_share) epsilon``;
- ``"records_moments_dp"``: ``(sum u^k)_{k=1..4}``, sensitivity 4, epsilon
  ``x_moment_share epsilon``.

The total cost is ``epsilon`` (both releases are in the model, so ``make_release`` with a
ledger records both). The analysis treats ``y`` as unclipped normal (the CLT of Bernstein &
Sheldon, as in the paper); the constrained analysis restricts the parameters to where the mean
of ``y`` stays within its bounds and ``Var(y | x) <= (b_y - a_y)^2 / 4``.

The paper's default ``x_moment_share = 5/11`` is its 11 queries at ``epsilon / 11`` each, of
which 5 are power sums; here the public ``n`` (the power sum of order 0 and the ``(0, 0)`` entry
of ``X'X``) is not released, so the 9 numbers released share the budget by that ratio.

>>> import jax
>>> from d3pext.handlers import make_release, private_posterior
>>> model = private_constrained_regression(46, 1.1, (0.0, 100.0), (0.0, 150.0))
>>> records = simulate_drinking_cirrhosis(jax.random.key(0))
>>> release = make_release(model, records=records, rng_key=1)
>>> sorted(release)
['records_dp', 'records_moments_dp']
>>> mcmc = private_posterior(model, release, num_warmup=100, num_samples=100, progress_bar=False)
>>> mcmc.run(jax.random.key(2))
>>> sorted(mcmc.get_samples())
['beta0', 'beta1', 'records_dp_noise_var', 'records_dp_stat', 'sigma2']
"""

from __future__ import annotations

from functools import partial
import math

import jax
from jax import random
import jax.numpy as jnp

import numpyro

from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import LaplaceMechanism
from d3pext.validation import check_bounds
from d3pext.inference.regression import (
    DEFAULT_MAX_STALLS,
    DEFAULT_MAX_TRIES,
    RegressionNIG,
    RegressionRecords,
    check_num_records,
    power_sums,
    regression_prior,
    regression_statistics,
)

__all__ = [
    "BROWNLEE_LIKE",
    "constrained_regression_model",
    "private_constrained_regression",
    "simulate_drinking_cirrhosis",
]

BROWNLEE_LIKE = {
    "n": 46,
    "bounds_x": (0.0, 100.0),
    "bounds_y": (0.0, 150.0),
    "epsilon": 1.1,
    "x_moment_share": 5 / 11,
    "prior": RegressionNIG(mu0=(1.0, 0.0), Lambda0=((0.25, 0.0), (0.0, 0.25)), a0=20.0, b0=0.5),
}
"""Settings of seed 001's Example in Appendix L.5 (``eps <- 0.1*11``; ``mu_0 <- c(1,0)``,
``Lambda_0 <- diag(c(.25, .25))``, ``a_0 <- 20``, ``b_0 <- 0.5``; 46 states). The bounds are
public guesses for the synthetic stand-in (the paper rescales by the data's own minimum and
maximum, which is not private)."""


def constrained_regression_model(
    n: int,
    records: jax.Array | None = None,
    *,
    bounds_x: tuple[float, float] = (0.0, 1.0),
    bounds_y: tuple[float, float] = (0.0, 1.0),
    prior: RegressionNIG = RegressionNIG(),
    constrained: bool = True,
    max_tries: int = DEFAULT_MAX_TRIES,
    max_stalls: int = DEFAULT_MAX_STALLS,
) -> None:
    """``(beta0, beta1, sigma2) ~ prior`` (mapped from the unit scale; restricted to the feasible
    region if ``constrained``), ``records = (x, y)`` for ``n`` records."""
    n = check_num_records(n)
    beta0, beta1, sigma2 = regression_prior(
        prior, bounds_x, bounds_y, constrained, max_tries=max_tries, max_stalls=max_stalls
    )
    with numpyro.plate("data", n):
        numpyro.sample(
            "records", RegressionRecords(beta0, beta1, jnp.sqrt(sigma2), bounds_x), obs=records
        )


def private_constrained_regression(
    n: int,
    epsilon: float,
    bounds_x: tuple[float, float],
    bounds_y: tuple[float, float],
    prior: RegressionNIG = BROWNLEE_LIKE["prior"],
    constrained: bool = True,
    x_moment_share: float = 5 / 11,
    max_tries: int = DEFAULT_MAX_TRIES,
    max_stalls: int = DEFAULT_MAX_STALLS,
):
    """The privatized regression model; call it as ``model(records=None)``.

    :param n: number of records (public), at least 3.
    :param epsilon: total privacy budget of the two releases.
    :param bounds_x: public bounds of the covariate.
    :param bounds_y: public bounds of the response.
    :param prior: :class:`~d3pext.inference.regression.RegressionNIG` on the unit scale.
    :param constrained: restrict statistics and parameters to the feasible region.
    :param x_moment_share: share of ``epsilon`` spent on the covariate's power sums.
    :param max_tries: cap on the proposals of each rejection step; a step that finds no
        feasible draw keeps the previous value (still an exact update).
    :param max_stalls: the run fails when a chain's step keeps its value this many sweeps in a
        row (the chain is stuck: most likely a release far from every feasible statistic).

    >>> model = private_constrained_regression(46, 1.1, (0, 100), (0, 150))
    >>> private_constrained_regression(2, 1.1, (0, 100), (0, 150))
    Traceback (most recent call last):
    ...
    ValueError: The regression sampler needs an integer number of records n >= 3, got 2 ...
    """
    n = check_num_records(n)
    epsilon = float(epsilon)
    if not (epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be positive and finite, got {epsilon}.")
    share = float(x_moment_share)
    if not 0 < share < 1:
        raise ValueError(
            f"x_moment_share must be in (0, 1) (both releases need some budget), got {share}."
        )
    bounds_x = check_bounds("bounds_x", bounds_x)
    bounds_y = check_bounds("bounds_y", bounds_y)
    if not isinstance(prior, RegressionNIG):
        raise TypeError(f"prior must be a RegressionNIG, got {type(prior).__name__}.")
    model = partial(
        constrained_regression_model, n, bounds_x=bounds_x, bounds_y=bounds_y, prior=prior,
        constrained=constrained, max_tries=max_tries, max_stalls=max_stalls,
    )
    model = privatize(
        model, site="records",
        mechanism=LaplaceMechanism((1 - share) * epsilon, sensitivity=5.0),
        statistic=partial(regression_statistics, bounds_x=bounds_x, bounds_y=bounds_y),
        name="records_dp",
    )
    return privatize(
        model, site="records",
        mechanism=LaplaceMechanism(share * epsilon, sensitivity=4.0),
        statistic=partial(power_sums, bounds_x=bounds_x),
        name="records_moments_dp",
    )


def simulate_drinking_cirrhosis(rng_key: jax.Array, n: int = 46) -> jax.Array:
    """SYNTHETIC stand-in for Brownlee's (1965) drinking and cirrhosis data (not available
    offline): ``n`` records ``(drinking, cirrhosis death rate)`` with plausible ranges, drinking
    in about ``[10, 80]`` and cirrhosis about ``15 + 1.1 drinking + N(0, 12^2)``, clipped into
    :data:`BROWNLEE_LIKE`'s bounds. Not the real data: do not read findings into it.

    >>> import jax
    >>> simulate_drinking_cirrhosis(jax.random.key(0)).shape
    (46, 2)
    """
    kx, ky = random.split(rng_key)
    x = 10.0 + 70.0 * random.beta(kx, 2.0, 2.5, (n,))
    y = 15.0 + 1.1 * x + 12.0 * random.normal(ky, (n,))
    (ax, bx), (ay, by) = BROWNLEE_LIKE["bounds_x"], BROWNLEE_LIKE["bounds_y"]
    return jnp.stack([jnp.clip(x, ax, bx), jnp.clip(y, ay, by)], -1)
