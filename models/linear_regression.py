"""Bayesian linear regression from Laplace-noised, clamped sufficient statistics (seed 000,
section 4.2 and S3.2; the setting of Ju et al. 2022).

Each record is ``(x_0, y)`` with ``x_0 ~ N_p(m, I)`` and ``y | x_0 ~ N(beta_0 + x_0' beta_1,
sigma^2)``, i.e. jointly a ``(p+1)``-variate normal (one sample site, ``"records"``). The curator
clamps every value to ``[-B, B]`` (``B = 10``) and divides by ``B``; with ``x = (1, x_0 / B)``,
``y~ = y / B`` it releases, with independent Laplace noise on each entry, the ``(p+1)(p+2)/2 + p + 1``
entries of ``s = (x'y~ / n, y~'y~ / n, upper triangle of x'x / n without the constant (0, 0))``
(9 numbers for ``p = 2``, in the order of the paper's ``s_vec``).

**Sensitivity** (substitute one record, all values in ``[-1, 1]``, intercept 1). Entry by entry
the change is at most 2 for ``y``, each ``x_j y``, each ``x_j`` and each ``x_j x_k`` (``j < k``),
and 1 for ``y^2`` and each ``x_j^2``: ``p^2 + 4p + 3`` (15 for ``p = 2``, the "independent
count"). Pairing each linear term with its square is tighter: ``|a - b| + |a^2 - b^2| =
|a - b| (1 + |a + b|) <= 9/4`` on ``[-1, 1]`` (maximum at ``a = 1, b = -1/2``), against 3 for the
two bounds separately. That saves ``3/4`` for ``y`` and for each ``x_j``:
``Delta_1 <= (p^2 + 4p + 3 - 3(p + 1)/4) / n = (p + 1)(p + 9/4) / n`` (12.75 / n for ``p = 2``).
The paper's ``(p^2 + 3p + 3) / n`` (13 / n) is therefore a valid bound for ``p <= 3`` (and is
what generated its ``s_dp``); a brute-force search over pairs of records (``tests/test_sbi.py``)
finds the largest change near 9.4 / n for ``p = 2``. The default here is the proven
``(p + 1)(p + 9/4) / n``; a larger value (e.g. the paper's 13 / n) may be passed, a smaller one is
refused.
"""

from __future__ import annotations

import math

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import logsumexp

import numpyro
import numpyro.distributions as dist

from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import LaplaceMechanism
from d3pext.releases.sums import array_module, record_sums

__all__ = [
    "PAPER_BETA",
    "PAPER_S_DP",
    "linear_regression_model",
    "linear_regression_naive_posterior",
    "linear_regression_reference",
    "linear_regression_sensitivity",
    "linear_regression_statistic",
    "private_linear_regression",
]

PAPER_BETA = (-1.79, -2.89, -0.66)
"""Data-generating coefficients of seed 000, S3.2."""
PAPER_S_DP = (-0.3824, -0.0667, 0.0320, 0.2720, 0.0988, -0.1385, 0.0219, -0.0229, 0.0341)
"""The observed release of seed 000, S3.2 (epsilon = 10, n = 100, released with 13 / n)."""
PAPER_MEANS = (0.9, -1.17)
CLAMP = 10.0


def linear_regression_sensitivity(p: int, n: int) -> float:
    """Proven L1 sensitivity ``(p + 1)(p + 9/4) / n`` of the released statistic (module doc).

    >>> linear_regression_sensitivity(2, 100)
    0.1275
    """
    if int(p) != p or p < 1 or int(n) != n or n < 1:
        raise ValueError(f"p and n must be positive integers, got p={p!r}, n={n!r}.")
    return (p + 1) * (p + 2.25) / n


def linear_regression_statistic(records: jax.Array, bound: float = CLAMP) -> jax.Array:
    """The released statistic of ``records`` (shape ``(n, p + 1)``, columns ``x_0``, then ``y``).

    >>> import jax.numpy as jnp
    >>> linear_regression_statistic(jnp.array([[10.0, 0.0, -5.0]])).tolist()
    [-0.5, -0.5, 0.0, 0.25, 1.0, 0.0, 1.0, 0.0, 0.0]
    """
    xp, records = array_module(records)  # the curator's in float64, sums correctly rounded
    n, q = records.shape[-2], records.shape[-1]
    z = xp.clip(records, -bound, bound) / bound
    x = xp.concatenate([xp.ones_like(z[..., :1]), z[..., : q - 1]], -1)
    y = z[..., q - 1:]
    rows, cols = np.triu_indices(q)
    keep = ~((rows == 0) & (cols == 0))
    # products per record, then sums over the records (elementwise: no TF32 rounding on a GPU)
    terms = xp.concatenate([x * y, y * y, x[..., rows[keep]] * x[..., cols[keep]]], -1)
    return record_sums(terms) / n


def linear_regression_model(
    n: int,
    means: tuple[float, ...] = PAPER_MEANS,
    noise_variance: float = 2.0,
    prior_scale: float = 1.0,
    records: jax.Array | None = None,
) -> None:
    """``beta ~ N(0, prior_scale^2 I)``; records ``(x_0, y)`` jointly normal (``"records"``)."""
    m = jnp.asarray(means, dtype=jnp.result_type(float))
    p = m.shape[0]
    beta = numpyro.sample("beta", dist.Normal(0.0, prior_scale).expand([p + 1]).to_event(1))
    loc = jnp.concatenate([m, (beta[0] + m @ beta[1:])[None]])
    cov = jnp.eye(p + 1).at[:p, p].set(beta[1:]).at[p, :p].set(beta[1:])
    cov = cov.at[p, p].set(beta[1:] @ beta[1:] + noise_variance)
    with numpyro.plate("data", n):
        numpyro.sample("records", dist.MultivariateNormal(loc, cov), obs=records)


def private_linear_regression(
    n: int,
    epsilon: float,
    sensitivity: float | None = None,
    bound: float = CLAMP,
    p: int = 2,
):
    """The privatized model: release ``"records_dp"`` (9 numbers for ``p = 2``).

    ``sensitivity`` defaults to :func:`linear_regression_sensitivity`; smaller values are refused.
    Call the result with the model's arguments (``n``, ``means``, ...; ``records=`` on the
    curator's side). The sensitivity holds for ``n`` records of ``p`` covariates only: ``n``
    defaults to the built one, and another ``n``, ``means`` of another length than ``p`` or
    records of another shape than ``(n, p + 1)`` are refused.

    >>> import jax.numpy as jnp
    >>> from numpyro.handlers import seed, trace
    >>> model = private_linear_regression(100, 10.0)
    >>> tr = trace(seed(model, 0)).get_trace(100)
    >>> tr["records_dp"]["value"].shape, tr["records_dp"]["infer"]["privatize"].sensitivity
    ((9,), 0.1275)
    """
    proven = linear_regression_sensitivity(p, n)
    built_n, p = int(n), int(p)
    if sensitivity is None:
        sensitivity = proven
    elif sensitivity < proven * (1 - 1e-12):
        raise ValueError(
            f"sensitivity {sensitivity} is below the proven bound {proven} = (p+1)(p+9/4)/n: the "
            "release would not be epsilon-DP."
        )
    mechanism = LaplaceMechanism(epsilon, sensitivity=sensitivity)

    def mismatch(what: str) -> ValueError:
        return ValueError(
            f"private_linear_regression was built for n={built_n} records of p={p} covariates "
            f"(sensitivity {sensitivity:g}), but {what}: the release would not be epsilon-DP. "
            "Build the model for the data: private_linear_regression(n, epsilon, p=p)."
        )

    def statistic(records: jax.Array) -> jax.Array:
        # the records (also when set through a handler) fix the statistic's divisor and length
        shape = tuple(jnp.shape(records))
        if shape[-2:] != (built_n, p + 1):
            raise mismatch(f"the records have shape {shape} (expected (n, p + 1) = "
                           f"{(built_n, p + 1)}: the covariates, then y)")
        return linear_regression_statistic(records, bound)

    def model(
        n: int = built_n,
        means: tuple[float, ...] = PAPER_MEANS,
        noise_variance: float = 2.0,
        prior_scale: float = 1.0,
        records: jax.Array | None = None,
    ) -> None:
        if n != built_n:
            raise mismatch(f"the model was called with n={n}")
        if np.shape(means) != (p,):
            raise mismatch(f"the model was called with means of shape {np.shape(means)} (p={p} "
                           "entries expected)")
        linear_regression_model(n, means, noise_variance, prior_scale, records)

    return privatize(model, site="records", mechanism=mechanism, statistic=statistic)


def _unpack(s: jax.Array, p: int):
    q = p + 1
    xy, yy, rest = s[..., :q], s[..., q], s[..., q + 1 :]
    rows, cols = np.triu_indices(q)
    keep = ~((rows == 0) & (cols == 0))
    xx = jnp.zeros((*s.shape[:-1], q, q)).at[..., 0, 0].set(1.0)
    xx = xx.at[..., rows[keep], cols[keep]].set(rest).at[..., cols[keep], rows[keep]].set(rest)
    return xy, yy, xx


def linear_regression_naive_posterior(
    s_dp, n: int, noise_variance: float = 2.0, prior_scale: float = 1.0, bound: float = CLAMP
) -> tuple[jax.Array, jax.Array]:
    """The naive posterior: the release plugged into the conjugate posterior as if it were the
    exact, unclamped statistic. Returns ``(mean, covariance)``."""
    s_dp = jnp.asarray(s_dp)
    q = next(q for q in range(2, 20) if q + 1 + q * (q + 1) // 2 - 1 == s_dp.shape[-1])
    xy, _, xx = _unpack(s_dp, q - 1)
    scale = jnp.concatenate([jnp.ones(1), jnp.full(q - 1, bound)])
    xtx = n * scale[:, None] * xx * scale[None, :]
    xty = n * bound * scale * xy
    precision = jnp.eye(q) / prior_scale**2 + xtx / noise_variance
    cov = jnp.linalg.inv(precision)
    return cov @ xty / noise_variance, cov


def linear_regression_reference(
    s_dp,
    rng_key: jax.Array,
    n: int,
    epsilon: float,
    sensitivity: float | None = None,
    means: tuple[float, ...] = PAPER_MEANS,
    noise_variance: float = 2.0,
    prior_scale: float = 1.0,
    bound: float = CLAMP,
    num_draws: int = 4000,
    num_datasets: int = 1000,
    chunk: int = 50,
) -> dict:
    """Exact reference posterior by importance sampling over the exact Laplace likelihood.

    ``f(s_dp | beta) = E_{records | beta}[prod_k Laplace(s_dp,k; s_k(records), b)]`` is estimated
    without bias by ``num_datasets`` independent simulated data sets for each draw (a
    pseudo-marginal weight); draws come from a normal proposal fitted in a first pass with prior
    draws, inflated by 1.5 in scale. Returns ``{"samples", "weights", "mean", "cov", "ess"}``.
    """
    s_dp = jnp.asarray(s_dp)
    m = jnp.asarray(means)
    p = m.shape[0]
    if sensitivity is None:
        sensitivity = linear_regression_sensitivity(p, n)
    b = sensitivity / epsilon

    def loglik_one(key, beta):
        kx, ke = random.split(key)
        x0 = m + random.normal(kx, (num_datasets, n, p))
        y = beta[0] + x0 @ beta[1:] + math.sqrt(noise_variance) * random.normal(ke, (num_datasets, n))
        stat = linear_regression_statistic(jnp.concatenate([x0, y[..., None]], -1), bound)
        ll = jnp.sum(-jnp.abs(s_dp - stat) / b - jnp.log(2 * b), -1)
        return logsumexp(ll) - math.log(num_datasets)

    def logliks(key, betas):
        keys = random.split(key, betas.shape[0])
        return lax.map(lambda a: loglik_one(*a), (keys, betas), batch_size=chunk)

    @jax.jit  # one program for both passes (op by op, the proposal's algebra compiled 40 programs)
    def weigh(key, loc, scale_tril):
        kd, kl = random.split(key)
        z = random.normal(kd, (num_draws, p + 1))
        betas = loc + z @ scale_tril.T
        prop = dist.MultivariateNormal(loc, scale_tril=scale_tril).log_prob(betas)
        prior = dist.Normal(0.0, prior_scale).log_prob(betas).sum(-1)
        logw = prior + logliks(kl, betas) - prop
        w = jnp.exp(logw - logsumexp(logw))
        mean = w @ betas
        cov = (betas - mean).T @ ((betas - mean) * w[:, None])
        return betas, w, mean, cov

    k1, k2 = random.split(rng_key)
    _, _, mean, cov = weigh(k1, jnp.zeros(p + 1), prior_scale * jnp.eye(p + 1))
    betas, w, mean, cov = weigh(k2, mean, 1.5 * jnp.linalg.cholesky(cov + 1e-6 * jnp.eye(p + 1)))
    return {"samples": betas, "weights": w, "mean": mean, "cov": cov, "ess": float(1.0 / jnp.sum(w**2))}
