"""Bayesian logistic regression (seed 003, sections 2.1 and 3.1, listings 1 and 2).

    y_i | x_i, w ~ Bernoulli(sigmoid(w^T x_i)),    w ~ N(w_0, S_0),  w_0 = 0,  S_0 = 4 I.

S_0 = 4 I is a *covariance*: the prior standard deviation is 2 (the paper's listings write
``Normal(0, 4)``, i.e. standard deviation 4, which contradicts its equation; we follow the equation
and expose the scale as ``prior_scale``).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from jax import random

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from d3pext.validation import check_batch_size, check_labels, check_positive_if_number, check_records

__all__ = ["logistic_regression", "logistic_guide", "simulate_logistic"]


def logistic_regression(
    x: jax.Array, y: Optional[jax.Array] = None, *, batch_size: Optional[int] = None, prior_scale: float = 2.0
) -> None:
    """Logistic regression without intercept: ``y ~ Bernoulli(sigmoid(x @ w))``, ``w ~ N(0, prior_scale^2 I)``.

    Give the full data; the data plate ``"data"`` subsamples ``batch_size`` records per step (under
    :class:`~d3pext.DPSVI` the batch is drawn by DPSVI's sampler). Append a column of ones to ``x``
    for an intercept.

    Args:
        x: features, shape ``(N, D)``.
        y: binary labels, shape ``(N,)``; ``None`` to sample them.
        batch_size: records per step (``None``: all).
        prior_scale: prior standard deviation of each weight (2: the paper's ``S_0 = 4 I``).

    Fits with :func:`logistic_guide` (the paper's mean-field Gaussian) or
    :class:`~numpyro.infer.autoguide.AutoDiagonalNormal`.

    >>> import jax, numpyro
    >>> from numpyro.infer import SVI, Trace_ELBO
    >>> from d3pext.models import logistic_regression, logistic_guide, simulate_logistic
    >>> x, y, w = simulate_logistic(jax.random.key(0), 1000, 3)
    >>> svi = SVI(logistic_regression, logistic_guide, numpyro.optim.Adam(0.05), Trace_ELBO())
    >>> result = svi.run(jax.random.key(1), 1000, x, y, batch_size=100, progress_bar=False)
    >>> result.params["w_loc"].shape
    (3,)
    """
    n, d = check_records("x", x, 2)
    check_labels("y", y, n)
    check_batch_size(batch_size, n)
    check_positive_if_number("prior_scale", prior_scale)
    w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([d]).to_event(1))
    with numpyro.plate("data", n, subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)


def logistic_guide(
    x: jax.Array, y: Optional[jax.Array] = None, *, batch_size: Optional[int] = None, prior_scale: float = 2.0
) -> None:
    """Mean-field Gaussian ``q(w) = N(w_loc, diag(w_scale^2))`` for :func:`logistic_regression` (paper's eq. 4).

    Parameters ``w_loc`` (initialised at 0) and ``w_scale`` (positive, initialised at 0.1).

    >>> import jax, jax.numpy as jnp
    >>> from numpyro.handlers import seed, trace
    >>> from d3pext.models import logistic_guide
    >>> trace(seed(logistic_guide, 0)).get_trace(jnp.ones((5, 2)))["w"]["value"].shape
    (2,)
    """
    d = jnp.shape(x)[-1]
    w_loc = numpyro.param("w_loc", jnp.zeros(d))
    w_scale = numpyro.param("w_scale", jnp.full(d, 0.1), constraint=constraints.positive)
    numpyro.sample("w", dist.Normal(w_loc, w_scale).to_event(1))


def simulate_logistic(
    rng_key: jax.Array, num_records: int, num_features: int, *, weights: Optional[jax.Array] = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw ``(x, y, w)`` from the model: ``x ~ N(0, I)``, ``w ~ N(0, 4 I)`` unless ``weights`` is given.

    >>> import jax
    >>> from d3pext.models import simulate_logistic
    >>> x, y, w = simulate_logistic(jax.random.key(0), 100, 4)
    >>> x.shape, y.shape, w.shape
    ((100, 4), (100,), (4,))
    """
    if num_records < 1 or num_features < 1:
        raise ValueError(f"num_records and num_features must be >= 1, got {num_records} and {num_features}")
    if weights is not None:
        weights = jnp.asarray(weights, dtype=jnp.float32)
        if weights.shape != (num_features,):
            raise ValueError(f"weights must have shape ({num_features},), got {weights.shape}")
    return _simulate_logistic(rng_key, num_records, num_features, weights)


@partial(jax.jit, static_argnums=(1, 2))
def _simulate_logistic(rng_key, num_records, num_features, weights):
    key_w, key_x, key_y = random.split(rng_key, 3)
    if weights is None:
        weights = 2.0 * random.normal(key_w, (num_features,))
    x = random.normal(key_x, (num_records, num_features))
    y = random.bernoulli(key_y, jax.nn.sigmoid(x @ weights)).astype(jnp.float32)
    return x, y, weights
