"""Exponential-family models of Bernstein & Sheldon (2018) with their release annotations.

Each ``*_model`` is an ordinary NumPyro model of ``n`` confidential records; each ``private_*``
wraps it with :class:`~d3pext.handlers.privatize` so that the Laplace mechanism releases the
sufficient statistic (sensitivity derived from the family, or from the truncation bounds).

>>> import jax.numpy as jnp
>>> from jax import random
>>> from d3pext.handlers import make_release, private_posterior
>>> model = private_beta_binomial(epsilon=1.0)
>>> release = make_release(model, 100, jnp.ones(100, jnp.int32), rng_key=0)
>>> mcmc = private_posterior(model, release, num_warmup=100, num_samples=100, progress_bar=False)
>>> mcmc.run(random.key(1), 100)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist

from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import LaplaceMechanism

__all__ = [
    "beta_binomial_model",
    "dirichlet_multinomial_model",
    "exponential_gamma_model",
    "private_beta_binomial",
    "private_dirichlet_multinomial",
    "private_exponential_gamma",
]


def beta_binomial_model(
    n: int, x: jax.Array | None = None, concentration1: float = 10.0, concentration0: float = 10.0
) -> None:
    """``theta ~ Beta(concentration1, concentration0)``, ``x_i ~ Bernoulli(theta)`` for ``n`` records.

    The sufficient statistic ``sum x_i`` is binomial (the paper's binomial model).
    """
    theta = numpyro.sample("theta", dist.Beta(concentration1, concentration0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Bernoulli(theta), obs=x)


def dirichlet_multinomial_model(
    n: int, x: jax.Array | None = None, concentration: jax.Array | None = None
) -> None:
    """``theta ~ Dirichlet(concentration)``, ``x_i ~ Categorical(theta)`` (default 4 categories).

    The sufficient statistic (category counts) is multinomial.
    """
    concentration = jnp.ones(4) if concentration is None else jnp.asarray(concentration)
    theta = numpyro.sample("theta", dist.Dirichlet(concentration))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Categorical(theta), obs=x)


def exponential_gamma_model(
    n: int, x: jax.Array | None = None, concentration: float = 20.0, rate: float = 20.0
) -> None:
    """``lam ~ Gamma(concentration, rate)``, ``x_i ~ Exponential(lam)`` for ``n`` records."""
    lam = numpyro.sample("lam", dist.Gamma(concentration, rate))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Exponential(lam), obs=x)


def private_beta_binomial(epsilon: float, **model_kwargs) -> privatize:
    """:func:`beta_binomial_model` releasing ``sum x_i + Laplace(1 / epsilon)`` as ``"x_dp"``."""
    return privatize(
        _bind(beta_binomial_model, model_kwargs), site="x", mechanism=LaplaceMechanism(epsilon)
    )


def private_dirichlet_multinomial(epsilon: float, **model_kwargs) -> privatize:
    """:func:`dirichlet_multinomial_model` releasing the counts plus ``Laplace(2 / epsilon)`` noise.

    The L1 sensitivity of the count vector under replacement of one record is 2.
    """
    return privatize(
        _bind(dirichlet_multinomial_model, model_kwargs),
        site="x",
        mechanism=LaplaceMechanism(epsilon),
    )


def private_exponential_gamma(
    epsilon: float, bounds: tuple[float, float] = (0.0253, 3.689), **model_kwargs
) -> privatize:
    """:func:`exponential_gamma_model` releasing the sum of the records inside ``bounds``.

    Records outside ``[a, b]`` are dropped; the sensitivity is ``max(|a|, |b|, b - a)``
    (Bernstein & Sheldon section 3.3). The default bounds keep the middle 95% of records at
    ``lam = 1``, as in the paper's experiments.
    """
    return privatize(
        _bind(exponential_gamma_model, model_kwargs),
        site="x",
        mechanism=LaplaceMechanism(epsilon),
        bounds=bounds,
    )


def _bind(model, model_kwargs: dict):
    if not model_kwargs:
        return model

    def bound(*args, **kwargs):
        return model(*args, **{**model_kwargs, **kwargs})

    bound.__name__ = model.__name__
    return bound
