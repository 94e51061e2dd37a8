"""Simple linear regression from noisy sufficient statistics, with and without the constraints
implied by bounded data (Bernstein & Sheldon 2019, "Gibbs-SS-Noisy"; Kazan & Reiter, seed 001
section 5 and Appendix J).

**Data and scale.** Records ``(x_i, y_i)``, ``i = 1..n`` (``n`` public), with public bounds
``[a_x, b_x]``, ``[a_y, b_y]``. The curator clips and rescales them to ``u = (x - a_x) / w_x``,
``v = (y - a_y) / w_y`` in ``[0, 1]`` (``w = b - a``; seed 001 Theorem 1) and releases, through
``privatize``:

1. ``S = (sum u, sum u^2, sum v, sum u v, sum v^2)`` with Laplace noise (L1 sensitivity 5 under
   substitution: each entry moves by at most 1, and ``(u, v) = (1, 1) -> (0, 0)`` moves all
   five), epsilon share ``1 - x_moment_share``;
2. the power sums ``(sum u^k)_{k=1..4}`` (sensitivity 4), share ``x_moment_share``, from which
   the moments of the covariate are estimated (Bernstein & Sheldon's ``eta = E[x x']`` and
   ``xi = Cov(vec x x')`` for ``x = (1, u)``).

The model on the unit scale is ``v = theta_0 + theta_1 u + e``, ``e ~ N(0, sigma_u^2)``, with
the conjugate prior ``sigma_u^2 ~ IG(a_0, b_0)``, ``theta | sigma_u^2 ~ N(mu_0, sigma_u^2
Lambda_0^{-1})`` (:class:`RegressionNIG`, on the unit scale as in the paper). The reported sites
are on the original scale: ``beta1 = theta_1 w_y / w_x``, ``beta0 = a_y + w_y theta_0 - beta1
a_x`` and ``sigma2 = w_y^2 sigma_u^2`` (substitute ``u``, ``v`` in the unit-scale model); the
imputed statistics ``f"{release}_stat"`` stay on the unit scale of the release.

**One sweep** (:class:`BernsteinSheldonRegression`), on the unit scale:

1. ``S | theta, sigma_u^2, omega^2``: the CLT normal ``N(n mu_t, n Sigma_t)`` of the per-record
   statistic times the Laplace scale-mixture normals ``N(z_j; S_j, omega_j^2)``, drawn by
   Matheron's rule (no inverse of ``Sigma_t`` is needed). ``mu_t`` and ``Sigma_t`` are the exact
   first two moments of ``t = (u, u^2, v, u v, v^2)`` given the first four moments of ``u``
   (:func:`statistic_moments`). Noisy moments can make ``Sigma_t`` indefinite; as in R's
   ``nearPD`` eigenvalues are clipped at 0, but only where it can happen: ``Sigma_t = L C L'``
   with ``L`` invertible and ``C`` block diagonal, whose only block that can be indefinite is
   ``Cov(u, u^2)`` (2 x 2, clipped in closed form, :func:`statistic_factor`; no 5 x 5
   eigendecomposition per sweep). Unconstrained: a proposal, accepted by a Metropolis-Hastings
   test (below). Constrained: restricted to the feasible statistics by rejection (as the paper).
2. ``(theta, sigma_u^2) | S``: the normal-inverse-gamma posterior with ``S`` as the sufficient
   statistics, ``Lambda_n = X'X + Lambda_0``, ``mu_n = Lambda_n^{-1}(X'y + Lambda_0 mu_0)``,
   ``a_n = a_0 + n / 2``, ``b_n = b_0 + (y'y + mu_0' Lambda_0 mu_0 - mu_n' Lambda_n mu_n) / 2``.
   Unconstrained: ``S`` is first mapped into the PSD cone (:func:`project_statistics`).
   Constrained: the posterior restricted to ``sigma_u^2 <= 1/4`` and the feasible parallelogram
   of ``theta``, by joint rejection of ``(sigma_u^2, theta)`` (as the paper, which draws
   ``sigma_u^2`` from its truncated law and rejects on ``theta``). The precision is proposed by
   Marsaglia-Tsang where the truncation point ``4`` lies below the gamma's mode, and by an
   exponential tail proposal above it (:func:`_precision_proposal`), so that a severe truncation
   does not exhaust the loop; each proposal is accepted with its own probability times
   ``1[theta feasible]``, so the accepted draw is exact.
3. ``1 / omega_j^2 | S``: inverse Gaussian (:func:`d3pext.inference.expfam_gibbs.laplace_mixing_variance`).

**One model for both steps (unconstrained).** As printed, steps 1 and 2 are conditionals of two
different joints (the CLT model of ``S``, and the exact model given ``S``), so the paper's chain samples
neither posterior: at 5 records (epsilon 20, unit bounds) ``sigma2``'s posterior mean came out 0.18
posterior sd too high and its sd 23% too wide, at 10 records (epsilon 100) 0.05 sd. Nor is the CLT model
itself a good target: given exact statistics (large epsilon) its posterior is 0.3 sd (10 records) to
2.5 sd (46 records) off the exact one, which step 2 reproduces. So the unconstrained sweep samples the
model of :func:`_exact_over_clt`: the CLT for the covariate's sums ``(sum u, sum u^2)``, whose law is free
of the parameters, and the response's sums exactly given them, as for normal errors. Its conditional of
``(theta, sigma_u^2)`` is step 2's, and in step 1 the CLT draw becomes an independence
Metropolis-Hastings proposal whose ratio is closed-form (the noise terms cancel). The chain matches an
importance-sampling reference of that model within 0.02 sd at 3, 5 and 10 records, and the model
itself is within 0.02 sd of the records' exact model at 3 records (epsilon 20); given exact statistics
it is the exact posterior. About 16% (3 records), 44% (5) and 80% (30) of the proposals are
accepted; below 10 records a sweep makes three proposals (:func:`_mh_steps`). In the constrained
variant step 1 is restricted to the feasible statistics, whose probability depends on the parameters
and has no closed form, so the paper's sweep is kept there.

**Constraints on the statistics** (``u, v`` in ``[0, 1]``; each is a sum over records of a
product that is non-negative on ``[0, 1]^2``, or the Gram matrix of ``(1, u, v)``):
``0 <= sum u <= n`` (``u``, ``1 - u``); ``0 <= sum u^2 <= sum u`` (``u^2``, ``u (1 - u)``);
the same for ``v``; ``sum u v >= 0`` (``u v``), ``sum u v <= sum u`` (``u (1 - v)``),
``sum u v <= sum v`` (``(1 - u) v``), ``sum u v >= sum u + sum v - n`` (``(1 - u)(1 - v)``,
not in the paper's list); and ``G = [[n, sum u, sum v], [., sum u^2, sum u v], [., ., sum v^2]]``
is PSD. The remaining products of two of ``u, 1 - u, v, 1 - v`` are squares, whose sums are
implied by the PSD condition (e.g. ``sum u^2 >= (sum u)^2 / n >= 2 sum u - n``).
:func:`feasible_statistics` checks all of them.

**Constraints on the parameters** (Appendix J): ``E[v | u] = theta_0 + theta_1 u`` must lie in
``[0, 1]`` for every ``u`` in ``[0, 1]``; as the mean is linear in ``u`` it suffices at ``u = 0``
and ``u = 1``: ``0 <= theta_0 <= 1``, ``0 <= theta_0 + theta_1 <= 1`` (a parallelogram). And
``sigma_u^2 = Var(v | u) <= m (1 - m) <= 1/4`` (eq. 110), i.e. precision ``>= 4``. The pointwise
bound ``sigma_u^2 <= min(theta_0 (1 - theta_0), (theta_0 + theta_1)(1 - theta_0 - theta_1))`` also
follows when the linear model holds at the end points; like the paper, it is not imposed.

**Deviations from the R code of Appendix L.5** (checked by hand and in the tests):

- its acceptance test for ``theta`` (``flag``) accepts any slope when ``0 <= theta_0 <= 1`` and
  its shaded region is the parallelogram's mirror image; the region above is used;
- it draws ``1 / rtrunc(gamma, b = 1/4)``, i.e. ``sigma^2 >= 4``; here ``sigma_u^2 <= 1/4``;
- its ``Sigma_22 = Cov(x y)`` block subtracts ``eta (theta' eta theta)`` where the covariance of
  ``x x' theta`` needs ``(eta theta)(eta theta)'`` (its other blocks agree with
  :func:`statistic_moments`, which is exact: ``tests/test_regression.py`` checks both against
  simulation);
- it releases the public ``n`` with noise in the unconstrained variant and the power sum of
  order 0; here ``n`` is public and never noised (same release for both variants);
- it noises ``S`` at ``epsilon / p`` per entry but tells the sampler ``epsilon 6 / 11``; here the
  sampler reads the Laplace scale from the release metadata, so they agree, and both releases are
  in the model (and in a ledger used with ``make_release``).

As in Bernstein & Sheldon, the noise of the covariate-moment release is not propagated: the
moments are plug-in estimates (projected onto ``1 >= m_1 >= m_2 >= m_3 >= m_4 >= 0`` with
``m_1^2 <= m_2``, ``m_2^2 <= m_1 m_3``, ``m_3^2 <= m_2 m_4``, then mixed with one uniform
pseudo-record, ``(n m + (1/2, 1/3, 1/4, 1/5)) / (n + 1)``, so that a noisy release cannot make
the covariate a point mass at 0 or 1: then the CLT of ``S`` lives where the constraints hold
only with equality and the constrained sampler could never accept), seed 001 footnote 6.

**Rejection limits.** Each rejection loop (``lax.while_loop``) stops after ``max_tries`` proposals
(default :data:`DEFAULT_MAX_TRIES`, set by the model's :func:`regression_prior`) and then keeps
the previous value of its block. That is still an exact update of the block's conditional ``pi``:
the chance ``r`` that all ``max_tries`` proposals are infeasible depends only on the other blocks,
not on the previous value ``x``, so the step is ``K(x, .) = (1 - r) pi + r delta_x``, which leaves
``pi`` invariant (a lazy Gibbs step, as a rejected Metropolis move). It only slows mixing where
feasible proposals are rare, which happens for a small share of the releases of real records
(about one in 160 of the README example's, with 10000 proposals). A chain whose update keeps its
value ``max_stalls`` sweeps in a row (default
:data:`~d3pext.inference.gibbs_base.DEFAULT_MAX_STALLS`) is stuck, most likely
on a release far from every feasible statistic, and makes the run fail with an error that names
the update and the chain and says what to do: a host callback (``jax.pure_callback`` in a
``lax.while_loop`` whose body runs only in sweeps where some chain is stuck, so it costs nothing
otherwise) raises it, and JAX re-raises it from ``MCMC.run`` as a ``jax.errors.JaxRuntimeError``
(a ``RuntimeError``; some dispatch paths surface it as a ``ValueError``). The paper's sampler loops
forever there. Feasibility of the inputs is checked up front (bounds, ``n >= 3``, epsilon, prior).
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import NamedTuple

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.linalg import cho_solve

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_uniform

from d3pext.inference.draws import (
    log_gamma_from_uniforms,
    log_uniform_from_uniforms,
    mixing_variance_from_uniforms,
    normal_from_uniforms,
    uniform_pairs,
)
from d3pext.inference.gibbs_base import DEFAULT_MAX_STALLS, ConstrainedGibbsKernel, raise_if_stuck
from d3pext.inference.structure import NotApplicable, PrivateModel
from d3pext.releases.mechanisms import LaplaceMechanism
from d3pext.releases.sums import array_module, record_sums
from d3pext.validation import check_bounds

__all__ = [
    "check_num_records",
    "DEFAULT_MAX_STALLS",
    "DEFAULT_MAX_TRIES",
    "STAT_NAMES",
    "BernsteinSheldonRegression",
    "RegressionNIG",
    "RegressionRecords",
    "RegressionSpec",
    "RegressionState",
    "feasible_coefficients",
    "feasible_statistics",
    "nig_posterior",
    "power_sums",
    "project_moments",
    "project_statistics",
    "regression_prior",
    "regression_statistics",
    "statistic_factor",
    "statistic_moments",
    "to_original_scale",
    "to_unit_scale",
]

SPEC_KEY = "bernstein_sheldon_regression"
"""Key of the :class:`RegressionSpec` in the ``infer`` dict of the variance site."""
STAT_NAMES = ("sum_x", "sum_x2", "sum_y", "sum_xy", "sum_y2")
"""Entries of the released statistic ``S`` (unit scale)."""
DEFAULT_MAX_TRIES = 10_000
_NUM_PAIRS = 13  # uniform pairs per sweep: S 5, (precision, theta) 3, omega 5


# ---------------------------------------------------------------------------------------------
# Prior, spec and input checks


def check_num_records(n) -> int:
    if int(n) != n or n < 3:
        raise ValueError(
            f"The regression sampler needs an integer number of records n >= 3, got {n!r} (with "
            "fewer than 3 records the intercept, slope and variance are not identified)."
        )
    return int(n)


@dataclass(frozen=True)
class RegressionNIG:
    """Normal-inverse-gamma prior on the unit scale: ``sigma_u^2 ~ IG(a0, b0)``,
    ``theta | sigma_u^2 ~ N(mu0, sigma_u^2 Lambda0^{-1})`` (``Lambda0`` a precision matrix).

    The default is the prior of seed 001, Appendix L.5.

    >>> RegressionNIG().a0
    20.0
    """

    mu0: tuple[float, float] = (1.0, 0.0)
    Lambda0: tuple[tuple[float, float], tuple[float, float]] = ((0.25, 0.0), (0.0, 0.25))
    a0: float = 20.0
    b0: float = 0.5

    def __post_init__(self) -> None:
        mu0 = tuple(float(v) for v in self.mu0)
        lam = np.asarray(self.Lambda0, dtype=float)
        if len(mu0) != 2 or not all(math.isfinite(v) for v in mu0):
            raise ValueError(f"RegressionNIG: mu0 must be 2 finite numbers, got {self.mu0!r}.")
        if lam.shape != (2, 2) or not np.all(np.isfinite(lam)) or not np.allclose(lam, lam.T):
            raise ValueError(
                f"RegressionNIG: Lambda0 must be a symmetric 2x2 matrix, got {self.Lambda0!r}."
            )
        if not np.all(np.linalg.eigvalsh(lam) > 0):
            raise ValueError(
                f"RegressionNIG: Lambda0 must be positive definite (a prior precision), got "
                f"eigenvalues {np.linalg.eigvalsh(lam).tolist()}."
            )
        for name in ("a0", "b0"):
            value = float(getattr(self, name))
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"RegressionNIG: {name} must be positive and finite, got {value} (a "
                    "non-positive shape or scale is not a proper inverse-gamma prior)."
                )
        object.__setattr__(self, "mu0", mu0)
        object.__setattr__(self, "Lambda0", tuple(tuple(float(v) for v in row) for row in lam))
        object.__setattr__(self, "a0", float(self.a0))
        object.__setattr__(self, "b0", float(self.b0))


@dataclass(frozen=True)
class RegressionSpec:
    """What the backend needs to know about a regression model (read from the trace)."""

    prior: RegressionNIG
    bounds_x: tuple[float, float]
    bounds_y: tuple[float, float]
    constrained: bool
    stats_release: str = "records_dp"
    moments_release: str = "records_moments_dp"
    sites: tuple[str, str, str] = ("beta0", "beta1", "sigma2")
    max_tries: int = DEFAULT_MAX_TRIES
    max_stalls: int = DEFAULT_MAX_STALLS


def _affine(bounds_x, bounds_y):
    """``beta = A theta + c`` and ``sigma2 = w_y^2 sigma_u^2``."""
    (ax, bx), (ay, by) = bounds_x, bounds_y
    wx, wy = bx - ax, by - ay
    A = np.array([[wy, -wy * ax / wx], [0.0, wy / wx]])
    c = np.array([ay, 0.0])
    return A, c, wy


def to_original_scale(bounds_x, bounds_y, theta0, theta1, sigma2_unit):
    """Unit-scale ``(theta_0, theta_1, sigma_u^2)`` to ``(beta0, beta1, sigma2)``.

    >>> to_original_scale((0.0, 10.0), (5.0, 7.0), 0.5, 1.0, 0.25)
    (6.0, 0.2, 1.0)
    """
    (ax, bx), (ay, by) = check_bounds("bounds_x", bounds_x), check_bounds("bounds_y", bounds_y)
    wx, wy = bx - ax, by - ay
    beta1 = theta1 * wy / wx
    return ay + wy * theta0 - beta1 * ax, beta1, sigma2_unit * wy**2


def to_unit_scale(bounds_x, bounds_y, beta0, beta1, sigma2):
    """Inverse of :func:`to_original_scale`.

    >>> to_unit_scale((0.0, 10.0), (5.0, 7.0), 6.0, 0.2, 1.0)
    (0.5, 1.0, 0.25)
    """
    (ax, bx), (ay, by) = check_bounds("bounds_x", bounds_x), check_bounds("bounds_y", bounds_y)
    wx, wy = bx - ax, by - ay
    return (beta0 - ay + beta1 * ax) / wy, beta1 * wx / wy, sigma2 / wy**2


def regression_prior(
    prior: RegressionNIG,
    bounds_x: tuple[float, float],
    bounds_y: tuple[float, float],
    constrained: bool = False,
    *,
    stats_release: str = "records_dp",
    moments_release: str = "records_moments_dp",
    max_tries: int = DEFAULT_MAX_TRIES,
    max_stalls: int = DEFAULT_MAX_STALLS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sample ``beta0``, ``beta1``, ``sigma2`` (original scale) under ``prior`` (call in a model).

    The unit-scale prior mapped to the original scale: ``sigma2 ~ IG(a0, b0 w_y^2)``, then
    ``beta1`` and ``beta0 | beta1`` from the normal ``beta = A theta + c``; with ``constrained``,
    a factor ``"feasible"`` restricts them to the feasible region (module docstring). The
    variance site's ``infer`` carries the :class:`RegressionSpec` that the ``"gibbs"`` backend
    ``"bernstein-sheldon-regression"`` reads.

    >>> from numpyro.handlers import seed, trace
    >>> def model():
    ...     regression_prior(RegressionNIG(), (0.0, 1.0), (0.0, 1.0), constrained=True)
    >>> sorted(trace(seed(model, 0)).get_trace())
    ['beta0', 'beta1', 'feasible', 'sigma2']
    """
    if not isinstance(prior, RegressionNIG):
        raise TypeError(f"prior must be a RegressionNIG, got {type(prior).__name__}.")
    bounds_x = check_bounds("bounds_x", bounds_x)
    bounds_y = check_bounds("bounds_y", bounds_y)
    for name, value in (("max_tries", max_tries), ("max_stalls", max_stalls)):
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    spec = RegressionSpec(
        prior, bounds_x, bounds_y, bool(constrained), stats_release, moments_release,
        max_tries=int(max_tries), max_stalls=int(max_stalls),
    )
    A, c, wy = _affine(bounds_x, bounds_y)
    sigma2 = numpyro.sample(
        spec.sites[2], dist.InverseGamma(prior.a0, prior.b0 * wy**2), infer={SPEC_KEY: spec}
    )
    mean = A @ np.asarray(prior.mu0) + c
    cov = A @ np.linalg.inv(np.asarray(prior.Lambda0)) @ A.T  # times sigma_u^2
    s2u = sigma2 / wy**2
    beta1 = numpyro.sample(spec.sites[1], dist.Normal(mean[1], jnp.sqrt(s2u * cov[1, 1])))
    loc0 = mean[0] + cov[0, 1] / cov[1, 1] * (beta1 - mean[1])
    var0 = cov[0, 0] - cov[0, 1] ** 2 / cov[1, 1]
    beta0 = numpyro.sample(spec.sites[0], dist.Normal(loc0, jnp.sqrt(s2u * var0)))
    if constrained:
        t0, t1, s2 = to_unit_scale(bounds_x, bounds_y, beta0, beta1, sigma2)
        ok = feasible_coefficients(t0, t1) & (s2 <= 0.25)
        numpyro.factor("feasible", jnp.where(ok, 0.0, -jnp.inf))
    return beta0, beta1, sigma2


# ---------------------------------------------------------------------------------------------
# Records and released statistics


class RegressionRecords(dist.Distribution):
    """Records ``(x, y)``: ``x ~ Uniform(a_x, b_x)``, ``y | x ~ N(beta0 + beta1 x, sigma^2)``.

    The covariate's law enters the sampler only through its moments (estimated from the
    power-sum release), so the uniform is a placeholder for forward simulation.

    >>> import jax
    >>> RegressionRecords(0.0, 1.0, 0.1, (0.0, 1.0)).sample(jax.random.key(0), (3,)).shape
    (3, 2)
    """

    arg_constraints = {"beta0": constraints.real, "beta1": constraints.real, "sigma": constraints.positive}
    support = constraints.real_vector

    def __init__(self, beta0, beta1, sigma, bounds_x, *, validate_args=None) -> None:
        self.beta0, self.beta1, self.sigma = jnp.broadcast_arrays(
            *(jnp.asarray(v, jnp.result_type(float)) for v in (beta0, beta1, sigma))
        )
        self.bounds_x = check_bounds("bounds_x", bounds_x)
        super().__init__(jnp.shape(self.beta0), (2,), validate_args=validate_args)

    def sample(self, key, sample_shape=()):
        shape = sample_shape + self.batch_shape
        kx, ky = random.split(key)
        a, b = self.bounds_x
        x = random.uniform(kx, shape, minval=a, maxval=b)
        y = self.beta0 + self.beta1 * x + self.sigma * random.normal(ky, shape)
        return jnp.stack([x, y], -1)

    def log_prob(self, value):
        x, y = value[..., 0], value[..., 1]
        a, b = self.bounds_x
        log_px = jnp.where((x >= a) & (x <= b), -math.log(b - a), -jnp.inf)
        return log_px + dist.Normal(self.beta0 + self.beta1 * x, self.sigma).log_prob(y)


def regression_statistics(records, bounds_x, bounds_y) -> jax.Array:
    """``S = (sum u, sum u^2, sum v, sum u v, sum v^2)`` of records clipped into the bounds and
    rescaled to ``[0, 1]`` (L1 sensitivity 5 under substitution); concrete records in float64.

    >>> import jax.numpy as jnp
    >>> regression_statistics(jnp.array([[5.0, 2.0], [20.0, 0.0]]), (0, 10), (0, 2)).tolist()
    [1.5, 1.25, 1.0, 0.5, 1.0]
    """
    xp, records = array_module(records)
    (ax, bx), (ay, by) = bounds_x, bounds_y
    u = (xp.clip(records[..., 0], ax, bx) - ax) / (bx - ax)
    v = (xp.clip(records[..., 1], ay, by) - ay) / (by - ay)
    return record_sums(xp.stack([u, u * u, v, u * v, v * v], -1))


def power_sums(records, bounds_x) -> jax.Array:
    """``(sum u^k)_{k=1..4}`` of the clipped, rescaled covariate (L1 sensitivity 4); concrete records
    in float64.

    >>> import jax.numpy as jnp
    >>> power_sums(jnp.array([[5.0, 2.0], [10.0, 0.0]]), (0, 10)).tolist()
    [1.5, 1.25, 1.125, 1.0625]
    """
    xp, records = array_module(records)
    (ax, bx) = bounds_x
    u = (xp.clip(records[..., 0], ax, bx) - ax) / (bx - ax)
    return record_sums(xp.stack([u**k for k in range(1, 5)], -1))


# ---------------------------------------------------------------------------------------------
# Moments, projections and feasibility (unit scale)


def project_moments(m) -> jax.Array:
    """Map noisy moments ``(m_1, .., m_4)`` of a variable in ``[0, 1]`` to values that satisfy
    ``1 >= m_1 >= m_2 >= m_3 >= m_4 >= 0``, ``m_1^2 <= m_2``, ``m_2^2 <= m_1 m_3``,
    ``m_3^2 <= m_2 m_4`` (clipping in order).

    >>> project_moments([0.5, 0.6, -0.1, 0.2]).tolist()
    [0.5, 0.5, 0.5, 0.5]
    """
    m = jnp.asarray(m, jnp.result_type(float))
    tiny = jnp.finfo(m.dtype).tiny
    m1 = jnp.clip(m[..., 0], 0.0, 1.0)
    m2 = jnp.clip(m[..., 1], m1**2, m1)
    m3 = jnp.clip(m[..., 2], m2**2 / jnp.maximum(m1, tiny), m2)
    m4 = jnp.clip(m[..., 3], m3**2 / jnp.maximum(m2, tiny), m3)
    return jnp.stack([m1, m2, m3, m4], -1)


def _coefficients(theta):
    """The per-record statistic ``t = (u, u^2, v, u v, v^2)`` as polynomials in ``(u, e)``:
    ``C[j, a, b]`` is the coefficient of ``u^a e^b`` in ``t_j``, ``v = theta_0 + theta_1 u + e``."""
    t0, t1 = theta[..., 0], theta[..., 1]
    zero, one = jnp.zeros_like(t0), jnp.ones_like(t0)

    def poly(rows):
        return jnp.stack([jnp.stack(r, -1) for r in rows], -2)

    return jnp.stack(
        [
            poly([[zero, zero, zero], [one, zero, zero], [zero, zero, zero]]),
            poly([[zero, zero, zero], [zero, zero, zero], [one, zero, zero]]),
            poly([[t0, one, zero], [t1, zero, zero], [zero, zero, zero]]),
            poly([[zero, zero, zero], [t0, one, zero], [t1, zero, zero]]),
            poly([[t0**2, 2 * t0, one], [2 * t0 * t1, 2 * t1, zero], [t1**2, zero, zero]]),
        ],
        -3,
    )


def statistic_moments(theta, sigma2, m) -> tuple[jax.Array, jax.Array]:
    """Mean ``mu_t`` and covariance ``Sigma_t`` of ``t = (u, u^2, v, u v, v^2)`` for one record,
    ``v = theta_0 + theta_1 u + e``, ``e ~ N(0, sigma2)`` independent of ``u``, given the raw
    moments ``m = (E u, E u^2, E u^3, E u^4)`` (unit scale). Exact: ``E[u^a e^b]`` products of
    the polynomial coefficients of ``t`` (degrees at most 4 in ``u`` and in ``e``).

    >>> import jax.numpy as jnp
    >>> mu, cov = statistic_moments(jnp.array([0.0, 1.0]), 0.0, jnp.array([0.5, 1/3, 1/4, 1/5]))
    >>> [round(float(x), 4) for x in mu]  # v = u ~ Uniform(0, 1)
    [0.5, 0.3333, 0.5, 0.3333, 0.3333]
    """
    theta = jnp.asarray(theta)
    dtype = jnp.result_type(theta.dtype, float)
    m = jnp.asarray(m, dtype)
    s2 = jnp.asarray(sigma2, dtype)
    C = _coefficients(theta.astype(dtype))
    mu_u = jnp.concatenate([jnp.ones_like(m[..., :1]), m], -1)  # E u^k, k = 0..4
    one, zero = jnp.ones_like(s2), jnp.zeros_like(s2)
    mu_e = jnp.stack([one, zero, s2, zero, 3 * s2**2], -1)  # E e^k, k = 0..4
    idx = np.add.outer(np.arange(3), np.arange(3))
    hank_u, hank_e = mu_u[..., idx], mu_e[..., idx]
    mean = jnp.einsum("...jab,...a,...b->...j", C, mu_u[..., :3], mu_e[..., :3])
    second = jnp.einsum("...iab,...jcd,...ac,...bd->...ij", C, C, hank_u, hank_e)
    return mean, second - mean[..., :, None] * mean[..., None, :]


def _gram_parts(s, n):
    sx, sxx, sy, sxy, syy = (s[..., j] for j in range(5))
    cxx, cyy, cxy = sxx - sx * sx / n, syy - sy * sy / n, sxy - sx * sy / n
    return sx, sxx, sy, sxy, syy, cxx, cyy, cxy


def feasible_statistics(s, n) -> jax.Array:
    """Whether ``S`` (unit scale) is feasible for ``n`` records in ``[0, 1]^2`` (module doc).

    >>> import jax.numpy as jnp
    >>> bool(feasible_statistics(jnp.array([1.5, 1.25, 1.0, 0.5, 1.0]), 2))
    True
    >>> bool(feasible_statistics(jnp.array([1.5, 1.25, 1.0, 1.2, 1.0]), 2))  # sum xy > sum y
    False
    """
    s = jnp.asarray(s)
    sx, sxx, sy, sxy, syy, cxx, cyy, cxy = _gram_parts(s, n)
    # rounding slack, so that points on the boundary (projections) count as feasible
    eps = 16 * float(jnp.finfo(jnp.result_type(s.dtype, float)).eps)
    tol = eps * n
    return (
        (sx >= -tol) & (sx <= n + tol) & (sxx >= -tol) & (sxx <= sx + tol)
        & (sy >= -tol) & (sy <= n + tol) & (syy >= -tol) & (syy <= sy + tol)
        & (sxy >= -tol) & (sxy <= sx + tol) & (sxy <= sy + tol) & (sxy >= sx + sy - n - tol)
        & (cxx >= -tol) & (cyy >= -tol) & (cxy * cxy <= cxx * cyy * (1 + eps) + tol * tol)
    )


def project_statistics(s, n, constrained: bool) -> jax.Array:
    """Map ``S`` into the PSD cone of the Gram matrix with ``n`` fixed (``constrained=False``) or
    into the feasible set (``True``: first clip the linear constraints in order).

    The PSD step raises ``sum u^2`` to ``(sum u)^2 / n`` and ``sum v^2`` to ``(sum v)^2 / n`` if
    needed, then shrinks the centred cross term to ``|c_uv| <= sqrt(c_uu c_vv)``; it moves
    ``sum u v`` towards ``sum u sum v / n``, which satisfies the linear bounds, so the result
    stays feasible. Not the Euclidean projection, but it keeps the public ``n`` exact (R's
    ``nearPD`` of the noisy Gram matrix changes it).

    >>> import jax.numpy as jnp
    >>> s = project_statistics(jnp.array([3.0, -1.0, 2.5, 4.0, 3.0]), 4, True)
    >>> bool(feasible_statistics(s, 4))
    True
    """
    s = jnp.asarray(s, jnp.result_type(float))
    sx, sxx, sy, sxy, syy = (s[..., j] for j in range(5))
    if constrained:
        sx, sy = jnp.clip(sx, 0.0, n), jnp.clip(sy, 0.0, n)
        sxx, syy = jnp.clip(sxx, 0.0, sx), jnp.clip(syy, 0.0, sy)
        sxy = jnp.clip(sxy, jnp.maximum(0.0, sx + sy - n), jnp.minimum(sx, sy))
    sxx, syy = jnp.maximum(sxx, sx * sx / n), jnp.maximum(syy, sy * sy / n)
    bound = jnp.sqrt((sxx - sx * sx / n) * (syy - sy * sy / n))
    sxy = sx * sy / n + jnp.clip(sxy - sx * sy / n, -bound, bound)
    return jnp.stack([sx, sxx, sy, sxy, syy], -1)


def feasible_coefficients(theta0, theta1) -> jax.Array:
    """``0 <= theta_0 <= 1`` and ``0 <= theta_0 + theta_1 <= 1`` (unit scale): the mean of
    ``v`` is in ``[0, 1]`` at ``u = 0`` and ``u = 1``, hence everywhere in between.

    >>> bool(feasible_coefficients(0.8, -0.5)), bool(feasible_coefficients(0.8, 0.5))
    (True, False)
    """
    end = theta0 + theta1
    return (theta0 >= 0) & (theta0 <= 1) & (end >= 0) & (end <= 1)


def nig_posterior(s, n, prior: RegressionNIG):
    """``(mu_n, Lambda_n, a_n, b_n)`` of the normal-inverse-gamma posterior given statistics
    ``S`` (unit scale; ``S`` should have a PSD Gram matrix, see :func:`project_statistics`).

    >>> import jax.numpy as jnp
    >>> mu, lam, a, b = nig_posterior(jnp.array([1.5, 1.25, 1.0, 0.5, 1.0]), 2, RegressionNIG())
    >>> float(a)
    21.0
    """
    s = jnp.asarray(s)
    dtype = jnp.result_type(s.dtype, float)
    sx, sxx, sy, sxy, syy = (s[..., j].astype(dtype) for j in range(5))
    mu0 = jnp.asarray(prior.mu0, dtype)
    lam0 = jnp.asarray(prior.Lambda0, dtype)
    l00, l01, l11 = n + lam0[0, 0], sx + lam0[0, 1], sxx + lam0[1, 1]
    r = jnp.stack([sy, sxy], -1) + lam0 @ mu0
    det = l00 * l11 - l01 * l01
    mu_n = jnp.stack(
        [(l11 * r[..., 0] - l01 * r[..., 1]) / det, (l00 * r[..., 1] - l01 * r[..., 0]) / det], -1
    )
    lam_n = jnp.stack([jnp.stack([l00, l01], -1), jnp.stack([l01, l11], -1)], -2)
    quad = jnp.sum(mu_n * r, -1)  # mu_n' Lambda_n mu_n = mu_n' r
    a_n = jnp.asarray(prior.a0 + n / 2, dtype)
    b_n = prior.b0 + (syy + mu0 @ lam0 @ mu0 - quad) / 2
    return mu_n, lam_n, a_n, jnp.maximum(b_n, prior.b0 * 1e-12)


# ---------------------------------------------------------------------------------------------
# Conditional updates (one chain; vmapped by the caller)


_UPDATES = ("statistic update S | theta, sigma^2, omega^2", "parameter update (theta, sigma^2) | S")


def _fail_if_stalled(stalls: jax.Array, max_stalls: int, max_tries: int) -> jax.Array:
    """:func:`~d3pext.inference.gibbs_base.raise_if_stuck` for the two rejection steps."""
    advice = (
        "Most likely the release is far from every feasible statistic (seed 001, footnote 6): check "
        "the bounds and the release, or use constrained=False. Otherwise raise max_tries or max_stalls "
        "(private_constrained_regression(..., max_tries=..., max_stalls=...))."
    )
    failed = f"found no feasible draw in {max_tries} proposals"
    return raise_if_stuck(stalls, max_stalls, "Constrained regression", _UPDATES, failed, advice)


def _psd_2x2(a, b, c):
    """``[[a, b], [b, c]]`` with its eigenvalues clipped at 0, and a square-root factor of it."""
    mean, half = (a + c) / 2, jnp.sqrt(((a - c) / 2) ** 2 + b * b)
    l1, l2 = mean + half, jnp.maximum(mean - half, 0.0)  # l1 >= |l2|
    angle = 0.5 * jnp.arctan2(2 * b, a - c)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    r1, r2 = jnp.sqrt(jnp.maximum(l1, 0.0)), jnp.sqrt(l2)
    return jnp.stack([jnp.stack([cos * r1, -sin * r2]), jnp.stack([sin * r1, cos * r2])])


def statistic_factor(theta, sigma2, m) -> tuple[jax.Array, jax.Array]:
    """``(mu_t, F)`` with ``F F' = Sigma_t^+``: the covariance of :func:`statistic_moments` made
    PSD by clipping eigenvalues, in closed form.

    ``t = c(theta) + L(theta) phi`` with ``phi = (u, u^2, e, u e, e^2)`` and ``L`` unit lower
    triangular; ``Cov(phi)`` is block diagonal: ``Cov(u, u^2)`` (from the moments of ``u``; the
    only block that noisy moments can make indefinite, so its eigenvalues are clipped),
    ``sigma^2 [[1, m_1], [m_1, m_2]]`` and ``2 sigma^4``. Hence ``F = L blockdiag(factors)``.

    >>> import jax.numpy as jnp
    >>> th, m = jnp.array([0.2, 0.5]), jnp.array([0.4, 0.2, 0.12, 0.08])
    >>> mu, F = statistic_factor(th, 0.03, m)
    >>> bool(jnp.allclose(F @ F.T, statistic_moments(th, 0.03, m)[1], atol=1e-6))
    True
    """
    theta = jnp.asarray(theta)
    dtype = jnp.result_type(theta.dtype, float)
    t0, t1 = theta[0].astype(dtype), theta[1].astype(dtype)
    m1, m2, m3, m4 = (jnp.asarray(m, dtype)[j] for j in range(4))
    s2 = jnp.asarray(sigma2, dtype)
    one, zero = jnp.ones((), dtype), jnp.zeros((), dtype)
    L = jnp.stack([
        jnp.stack([one, zero, zero, zero, zero]),
        jnp.stack([zero, one, zero, zero, zero]),
        jnp.stack([t1, zero, one, zero, zero]),
        jnp.stack([t0, t1, zero, one, zero]),
        jnp.stack([2 * t0 * t1, t1 * t1, 2 * t0, 2 * t1, one]),
    ])
    c = jnp.stack([zero, zero, t0, zero, t0 * t0])
    mu = c + L @ jnp.stack([m1, m2, zero, zero, s2])
    fu = _psd_2x2(m2 - m1 * m1, m3 - m1 * m2, m4 - m2 * m2)
    sd = jnp.sqrt(s2)
    fe = sd * jnp.stack([jnp.stack([one, zero]), jnp.stack([m1, jnp.sqrt(jnp.maximum(m2 - m1 * m1, 0.0))])])
    block = jnp.zeros((5, 5), dtype).at[:2, :2].set(fu).at[2:4, 2:4].set(fe).at[4, 4].set(math.sqrt(2.0) * s2)
    return mu, L @ block


def _exact_over_clt(s, theta, sigma2, m, n):
    """``log p(S) - log N(S; n mu_t, n Sigma_t)`` given ``(theta, sigma_u^2)``, up to terms free of ``S``:
    the density of the unconstrained sweep's model over the CLT's; ``-inf`` outside its support.

    The model keeps the CLT for the covariate's sums ``(sum u, sum u^2)`` (a law free of the
    parameters) and takes the response's sums exactly given them, as for normal errors: with
    ``G = X'X`` (``X = (1, u)``), ``X'y ~ N(G theta, sigma^2 G)`` and the residual sum of squares of
    the least-squares fit, ``y'y - y'X G^{-1} X'y ~ sigma^2 chi^2_{n - 2}``, independent of ``X'y``.
    Given ``S`` its conditional of ``(theta, sigma_u^2)`` is the conjugate one (:func:`nig_posterior`).
    The CLT factors too (:func:`statistic_factor`, ``L`` unit lower triangular): the same law of the
    covariate's sums (which cancels) times ``E = X'y - G theta = (sum e, sum u e) ~ N(0, n sigma^2
    [[1, m_1], [m_1, m_2]])`` times ``sum e^2 ~ N(n sigma^2, 2 n sigma^4)`` (``e = v - theta_0 -
    theta_1 u``)."""
    m1, m2 = m[0], m[1]
    t0, t1 = theta[0], theta[1]
    sx, sxx, sy, sxy, syy, cxx, cyy, cxy = _gram_parts(s, n)
    e1, e2 = sy - n * t0 - t1 * sx, sxy - t0 * sx - t1 * sxx
    rss = syy - 2 * t0 * sy - 2 * t1 * sxy + n * t0**2 + 2 * t0 * t1 * sx + t1**2 * sxx  # sum e^2
    rss_fit = cyy - cxy**2 / cxx
    valid = (cxx > 0) & (rss_fit > 0)
    log_exact = -0.5 * jnp.log(jnp.where(valid, cxx, 1.0)) - rss / (2 * sigma2) + (n / 2 - 2) * jnp.log(
        jnp.where(valid, rss_fit, 1.0))
    log_clt = -(m2 * e1**2 - 2 * m1 * e1 * e2 + e2**2) / ((m2 - m1**2) * 2 * n * sigma2) - (
        rss - n * sigma2) ** 2 / (4 * n * sigma2**2)
    return jnp.where(valid, log_exact - log_clt, -jnp.inf)


def _mh_steps(n: int) -> int:
    """Metropolis-Hastings steps per sweep of the unconstrained statistic update: below 10 records,
    where about a sixth (``n = 3``) to a half (``n = 5``) of the proposals are accepted, three steps give
    1.7x the effective samples per second of one (``n = 3``); from 10 records one is best."""
    return 3 if n < 10 else 1


def _statistic_update(w, retry_key, s_old, z, noise_var, theta, sigma2, m, n, constrained, max_tries, w_accept=None):
    """``S | theta, sigma2, omega^2``: ``N(n mu_t, n Sigma_t^+) prod_j N(z_j; S_j, omega_j^2)``
    by Matheron's rule, restricted to the feasible set when ``constrained`` (rejection).
    Unconstrained, that draw is a Metropolis-Hastings proposal for the model of :func:`_exact_over_clt`
    (accepted when ``w_accept``, uniform on ``(-1, 1)``, passes the test)."""
    mu, F = statistic_factor(theta, sigma2, m)
    factor = math.sqrt(n) * F
    prior_cov = factor @ factor.T
    low = jnp.linalg.cholesky(prior_cov + jnp.diag(noise_var))
    sd = jnp.sqrt(noise_var)

    def draw(w):
        s0 = n * mu + factor @ normal_from_uniforms(w[0])
        return s0 + prior_cov @ cho_solve((low, True), z - s0 - sd * normal_from_uniforms(w[1]))

    if not constrained:
        # independence proposals: the noise terms cancel from the ratio, and a previous statistic
        # outside the support (none at init) gives way to any proposal
        s, log_w = s_old, _exact_over_clt(s_old, theta, sigma2, m, n)
        for i in range(_mh_steps(n)):
            if i:
                extra = uniform_pairs(random.fold_in(retry_key, i), (6,), w.dtype)
                w, w_accept = extra[:, :5], extra[0, 5]
            proposal = draw(w)
            log_w_new = _exact_over_clt(proposal, theta, sigma2, m, n)
            log_ratio = log_w_new - log_w
            accept = log_uniform_from_uniforms(w_accept) < jnp.where(jnp.isnan(log_ratio), jnp.inf, log_ratio)
            s, log_w = jnp.where(accept, proposal, s), jnp.where(accept, log_w_new, log_w)
        return s, jnp.bool_(True)
    s = draw(w)
    ok = feasible_statistics(s, n)

    def retry(carry):
        i, s, _ = carry
        s = draw(uniform_pairs(random.fold_in(retry_key, i), (5,), w.dtype))
        return i + 1, s, feasible_statistics(s, n)

    _, s, ok = lax.while_loop(
        lambda c: (~c[2]) & (c[0] < max_tries), retry, (jnp.int32(1), s, ok)
    )
    # after max_tries infeasible proposals the previous statistic is kept: an exact update still,
    # as the chance of that does not depend on the previous statistic (module doc)
    return jnp.where(ok, s, s_old), ok


_MIN_PRECISION = 4.0  # sigma_u^2 <= 1/4


def _precision_proposal(w, a, b):
    """A proposal of ``precision ~ Gamma(a, b)`` restricted to ``[4, inf)`` and its acceptance
    (``a > 1``). Standardised ``x = b precision`` above ``c = 4 b``: where ``c <= a - 1`` (the mode
    is inside) a Marsaglia-Tsang proposal of the whole gamma, accepted when it is ``>= c``; else
    an exponential proposal ``c + Exp(lam)``, ``lam = 1 - (a - 1) / c``, accepted with
    probability ``(x / c)^(a - 1) exp(-(1 - lam)(x - c))`` (at most 1, efficient in the tail)."""
    c = _MIN_PRECISION * b
    d = a - 1.0 / 3.0
    k = 1.0 / jnp.sqrt(9.0 * d)
    x = normal_from_uniforms(w[0, 0])
    v = (1 + k * x) ** 3
    log_ratio = 0.5 * x**2 + d - d * v + d * jnp.log(jnp.where(v > 0, v, 1.0))
    body = d * v
    ok_body = (v > 0) & (log_uniform_from_uniforms(w[1, 0]) < log_ratio) & (body >= c)
    tail = c > a - 1.0
    lam = jnp.where(tail, 1.0 - (a - 1.0) / c, 1.0)
    y = c - log_uniform_from_uniforms(w[0, 1]) / lam
    log_acc = (a - 1.0) * jnp.log(y / c) - (1.0 - lam) * (y - c)
    ok_tail = log_uniform_from_uniforms(w[1, 1]) < log_acc
    return jnp.where(tail, y, body) / b, jnp.where(tail, ok_tail, ok_body)


def _parameter_update(w, retry_key, s, n, prior, constrained, max_tries, old=None):
    """``(theta, sigma_u^2) | S`` from the normal-inverse-gamma posterior; constrained: restricted
    to ``sigma_u^2 <= 1/4`` and the feasible parallelogram by joint rejection. ``w``: ``(2, 3)``
    uniform pairs."""
    if not constrained:
        s = project_statistics(s, n, False)
    mu_n, lam_n, a_n, b_n = nig_posterior(s, n, prior)
    # Cholesky factor of Lambda_n^{-1} (2 x 2, closed form)
    det = lam_n[0, 0] * lam_n[1, 1] - lam_n[0, 1] ** 2
    c00, c01, c11 = lam_n[1, 1] / det, -lam_n[0, 1] / det, lam_n[0, 0] / det
    l00 = jnp.sqrt(c00)
    l10, l11 = c01 / l00, jnp.sqrt(jnp.clip(c11 - c01**2 / c00, 0.0))

    def theta_of(precision, e):
        scale = jnp.sqrt(1.0 / precision)
        return mu_n + scale * jnp.stack([l00 * e[0], l10 * e[0] + l11 * e[1]])

    if not constrained:
        log_g = log_gamma_from_uniforms(w[:, 0], lambda i: random.fold_in(retry_key, i), a_n)
        precision = jnp.exp(log_g) / b_n
        return theta_of(precision, normal_from_uniforms(w[:, 1])), 1.0 / precision, jnp.bool_(True)

    def propose(w):
        precision, ok = _precision_proposal(w[:, :2], a_n, b_n)
        theta = theta_of(precision, normal_from_uniforms(w[:, 2]))
        return theta, precision, ok & feasible_coefficients(theta[0], theta[1])

    theta, precision, ok = propose(w)

    def retry(carry):
        i, *_ = carry
        return (i + 1, *propose(uniform_pairs(random.fold_in(retry_key, i), (3,), w.dtype)))

    _, theta, precision, ok = lax.while_loop(
        lambda c: (~c[3]) & (c[0] < max_tries), retry, (jnp.int32(1), theta, precision, ok)
    )
    # as in the statistic update, the previous values are kept after max_tries proposals; without
    # any (at init) a feasible point near the posterior mean stands in
    if old is None:
        t0 = jnp.clip(mu_n[0], 0.0, 1.0)
        old = (jnp.stack([t0, jnp.clip(mu_n[1], -t0, 1.0 - t0)]), jnp.minimum(b_n / a_n, 0.25))
    theta = jnp.where(ok, theta, old[0])
    precision = jnp.where(ok, precision, 1.0 / old[1])
    return theta, 1.0 / precision, ok


# ---------------------------------------------------------------------------------------------
# The kernel


class RegressionState(NamedTuple):
    """
    - **z** - current values: ``beta0``, ``beta1``, ``sigma2`` hold the unit-scale ``theta_0``,
      ``theta_1``, ``sigma_u^2`` (reported on the original scale), plus ``S`` and ``omega^2``.
    - **released** - the release of ``S`` (5 numbers, unit scale).
    - **moments** - the projected plug-in moments ``(m_1, .., m_4)`` of the covariate.
    - **rng_key** - random key for the next sweep.
    - **stalls** - sweeps in a row in which the statistic and the parameter update (constrained)
      found no feasible proposal and kept the previous value.
    """

    z: dict[str, jax.Array]
    released: jax.Array
    moments: jax.Array
    rng_key: jax.Array
    stalls: jax.Array


class BernsteinSheldonRegression(ConstrainedGibbsKernel):
    """Gibbs-SS-Noisy for simple linear regression, unconstrained or constrained (module doc).

    Built by :func:`~d3pext.handlers.private_posterior` (``method="gibbs"``, backend
    ``"bernstein-sheldon-regression"``; ``method="naive"`` takes the release, mapped into the
    feasible set, as the exact statistics). Per chain; ``chain_method="vectorized"`` and
    :func:`~d3pext.handlers.sample_releases` ``vmap`` it. Reported sites: ``beta0``, ``beta1``,
    ``sigma2`` (original scale), ``f"{release}_stat"`` (``S``, unit scale) and
    ``f"{release}_noise_var"`` (``omega^2``).

    :param model: the conditioned privatized model.
    :param spec: the model's :class:`RegressionSpec`.
    :param num_records: ``n``.
    :param noise_scale: Laplace scale of each entry of the release of ``S`` (unit scale).
    :param naive: treat the release as the exact statistics.

    **Example**

    >>> import jax, jax.numpy as jnp
    >>> import d3pext.inference.regression
    >>> from d3pext.handlers import make_release, private_posterior
    >>> from d3pext.models.constrained_regression import (
    ...     BROWNLEE_LIKE, private_constrained_regression, simulate_drinking_cirrhosis)
    >>> records = simulate_drinking_cirrhosis(jax.random.key(0))
    >>> model = private_constrained_regression(46, 1.1, BROWNLEE_LIKE["bounds_x"],
    ...                                        BROWNLEE_LIKE["bounds_y"])
    >>> release = make_release(model, records=records, rng_key=1)
    >>> mcmc = private_posterior(model, release, num_warmup=100, num_samples=100, num_chains=2,
    ...                          progress_bar=False)
    >>> mcmc.run(jax.random.key(2))
    >>> type(mcmc.sampler.inner).__name__
    'BernsteinSheldonRegression'
    """

    def __init__(
        self, model, spec: RegressionSpec, num_records: int, noise_scale: float, naive: bool = False
    ) -> None:
        self._model = model
        self.spec = spec
        self.n = check_num_records(num_records)
        scale = float(noise_scale)
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"The Laplace scale of the release must be positive, got {scale}.")
        self.noise_scale = scale
        self.naive = bool(naive)
        release = spec.stats_release
        self._names = {"stat": f"{release}_stat", "noise_var": f"{release}_noise_var"}

    @property
    def sites(self) -> tuple[str, ...]:
        return self.spec.sites if self.naive else (*self.spec.sites, *self._names.values())

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        rng_key, key_trace, key_params = random.split(rng_key, 3)
        tr = trace(substitute(seed(self._model, key_trace), substitute_fn=init_to_uniform)).get_trace(
            *model_args, **model_kwargs
        )
        dtype = jnp.result_type(float)
        spec, n = self.spec, self.n
        released = jnp.asarray(tr[spec.stats_release]["value"], dtype)
        sums = jnp.asarray(tr[spec.moments_release]["value"], dtype)
        if released.shape != (5,) or sums.shape != (4,):
            raise ValueError(
                f"The releases {spec.stats_release!r} and {spec.moments_release!r} must have "
                f"shapes (5,) and (4,), got {released.shape} and {sums.shape}."
            )
        # one uniform pseudo-record keeps the covariate's law non-degenerate: projected moments
        # of a point mass at 0 or 1 put the CLT of S on a set where the constraints hold only
        # with equality (e.g. sum u v = sum v when u = 1), which rejection never hits
        moments = (n * project_moments(sums / n) + 1.0 / jnp.arange(2.0, 6.0)) / (n + 1)
        s = project_statistics(released, n, spec.constrained)
        w = uniform_pairs(key_params, (3,), dtype)
        theta, sigma2, _ = _parameter_update(w, key_params, s, n, spec.prior, spec.constrained, spec.max_tries)
        b0, b1, b2 = spec.sites
        z = {b0: theta[0], b1: theta[1], b2: sigma2}
        if not self.naive:
            noise_var = jnp.full((5,), 2 * self.noise_scale**2, dtype)
            if not spec.constrained:
                # the projected release lies on the boundary of the support, where the density of the
                # residual sum of squares can be unbounded (n = 3): start from an accepted proposal instead
                w_s = uniform_pairs(random.fold_in(key_params, 1), (6,), dtype)
                s, _ = _statistic_update(
                    w_s[:, :5], random.fold_in(key_params, 2), jnp.full((5,), jnp.nan, dtype), released,
                    noise_var, theta, sigma2, moments, n, False, spec.max_tries, w_s[0, 5],
                )
            z[self._names["stat"]] = s
            z[self._names["noise_var"]] = noise_var
        if init_params:
            given = [init_params.get(k) for k in spec.sites]
            if all(v is not None for v in given):
                values = (jnp.asarray(v, dtype) for v in given)
                t0, t1, s2 = to_unit_scale(spec.bounds_x, spec.bounds_y, *values)
                z.update({b0: t0, b1: t1, b2: s2})
        return RegressionState(z, released, moments, rng_key, jnp.zeros((2,), jnp.int32))

    def sample(self, state, model_args, model_kwargs):
        next_key, key_draw, key_s, key_p = random.split(state.rng_key, 4)
        w = uniform_pairs(key_draw, (_NUM_PAIRS,), state.released.dtype)
        spec, n = self.spec, self.n
        b0, b1, b2 = spec.sites
        z = dict(state.z)
        theta = jnp.stack([z[b0], z[b1]])
        if self.naive:
            s, s_ok = project_statistics(state.released, n, spec.constrained), jnp.bool_(True)
        else:
            s, s_ok = _statistic_update(
                w[:, :5], key_s, z[self._names["stat"]], state.released, z[self._names["noise_var"]],
                theta, z[b2], state.moments, n, spec.constrained, spec.max_tries,
                w[0, 7],  # unused by the unconstrained parameter update
            )
        theta, sigma2, p_ok = _parameter_update(
            w[:, 5:8], key_p, s, n, spec.prior, spec.constrained, spec.max_tries, (theta, z[b2])
        )
        stalls = jnp.where(jnp.stack([s_ok, p_ok]), 0, state.stalls + 1)
        if spec.constrained:
            # the check must feed the draws (always False: it raises otherwise), or JAX removes it
            # with the unused counts when a caller drops the final state
            stalled = _fail_if_stalled(stalls, spec.max_stalls, spec.max_tries)
            sigma2 = jnp.where(stalled, z[b2], sigma2)
        z[b0], z[b1], z[b2] = theta[0], theta[1], sigma2
        if not self.naive:
            gap = jnp.abs(state.released - s)
            z[self._names["stat"]] = s
            z[self._names["noise_var"]] = mixing_variance_from_uniforms(w[:, 8:], gap, self.noise_scale)
        return RegressionState(z, state.released, state.moments, next_key, stalls)

    def postprocess_fn(self, model_args, model_kwargs):
        spec = self.spec
        b0, b1, b2 = spec.sites

        def to_original(z):
            z = dict(z)
            z[b0], z[b1], z[b2] = to_original_scale(spec.bounds_x, spec.bounds_y, z[b0], z[b1], z[b2])
            return z

        return to_original


# ---------------------------------------------------------------------------------------------
# The backends


def _build(pm: PrivateModel, naive: bool) -> BernsteinSheldonRegression:
    spec = pm.declaration(
        SPEC_KEY, "declare the coefficients and variance with d3pext.inference.regression.regression_prior(...)")
    infos = {}
    for name, shape in ((spec.stats_release, (5,)), (spec.moments_release, (4,))):
        if name not in pm.releases:
            raise NotApplicable(
                f"the regression needs the release {name!r}; the model releases {sorted(pm.releases)}."
            )
        info = pm.releases[name]
        if not isinstance(info.mechanism, LaplaceMechanism):
            raise NotApplicable(
                f"release {name!r}: the regression sampler covers the Laplace mechanism, not "
                f"{type(info.mechanism).__name__}."
            )
        if tuple(info.stat_shape) != shape:
            raise ValueError(f"The release {name!r} must have shape {shape}, got {info.stat_shape}.")
        value_shape = np.shape(pm.sites[name].value)
        if value_shape != shape:
            raise ValueError(f"The release {name!r} must have shape {shape}, got {value_shape}.")
        infos[name] = info
    sources = {info.source for info in infos.values()}
    if len(sources) != 1:
        raise ValueError(f"The two regression releases come from different sites {sorted(sources)}.")
    if len(pm.releases) != 2:
        raise NotApplicable(f"the regression model has exactly two releases, got {sorted(pm.releases)}.")
    other = set(pm.latent) - set(spec.sites) - sources
    if other:
        raise NotApplicable(f"latent sites {sorted(other)} have no regression update.")
    n = {info.num_records for info in infos.values()}
    if len(n) != 1:
        raise ValueError(f"The two releases are of different numbers of records {sorted(n)}.")
    return BernsteinSheldonRegression(
        pm.model, spec, check_num_records(n.pop()), infos[spec.stats_release].mechanism.scale, naive=naive
    )


def regression_kernel(pm: PrivateModel, options: dict) -> BernsteinSheldonRegression:
    """The ``"gibbs"`` backend: Gibbs-SS-Noisy, with Kazan & Reiter's constraints if declared."""
    return _build(pm, naive=False)


def naive_regression_kernel(pm: PrivateModel, options: dict) -> BernsteinSheldonRegression:
    """The ``"naive"`` backend: the released statistics taken as exact."""
    return _build(pm, naive=True)
