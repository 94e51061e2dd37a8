"""Two-sided geometric noise and privatized counts (Schein et al., seed 002).

* :class:`TwoSidedGeometric`: the noise of the geometric mechanism (seed 002, eq. 6).
* :class:`GeometricNoisedPoisson`: a Poisson count plus two-sided geometric noise, i.e. the
  exponentially randomized Skellam of seed 002, eq. 11 (the law of a privatized count).
* :func:`exponential_fine_tail`: exponential variates with an exact far tail.
"""

import math
from typing import Optional

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import gammainc, gammaincc, gammaln, xlogy
from jax.typing import ArrayLike, DTypeLike
import numpy as np

from numpyro.distributions import constraints
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.util import promote_shapes, validate_sample
from numpyro.util import is_prng_key

from d3pext.dtypes import float_dtype, int_dtype

Array = jax.Array

__all__ = ["GeometricNoisedPoisson", "TwoSidedGeometric", "exponential_fine_tail", "integer"]


class _Integer(constraints.ParameterFreeConstraint):
    """All integers (stored as integer or integer-valued floating point numbers)."""

    is_discrete = True

    def __call__(self, x: ArrayLike) -> ArrayLike:
        xp = jnp if isinstance(x, jax.Array) else np
        return xp.isfinite(x) & (xp.mod(x, 1) == 0)

    def feasible_like(self, prototype: ArrayLike) -> Array:
        return jnp.zeros_like(prototype)


integer = _Integer()
"""Constraint: the set of all integers."""


def exponential_fine_tail(
    key: Array, shape: tuple[int, ...] = (), dtype: Optional[DTypeLike] = None
) -> Array:
    """Standard exponential draws ``-log(U)`` whose tail is exact far beyond the usual one.

    :func:`jax.random.exponential` maps a uniform with 2^-23 resolution (float32), so it never
    exceeds about 16.6: a noise tail cut where its probability is 6e-8, which breaks pure DP
    for releases. Here ``U = (H + V) 2^-24`` with ``H`` a uniform integer below ``2^24`` and
    ``V`` a uniform float, so ``U`` reaches down to about 2^-47 (float32; 2^-77 in float64).

    >>> import jax
    >>> from d3pext.distributions import exponential_fine_tail
    >>> exponential_fine_tail(jax.random.PRNGKey(0), (3,)).shape
    (3,)
    """
    dtype = jnp.result_type(float) if dtype is None else dtype
    key_high, key_low = random.split(key)
    high = random.randint(key_high, shape, 0, 2**24).astype(dtype)
    low = random.uniform(key_low, shape, dtype)
    return 24 * math.log(2) - jnp.log(high + low)


# ---------------------------------------------------------------------------------------------
# Modified Bessel function of the first kind, in log space.
# ---------------------------------------------------------------------------------------------


class TwoSidedGeometric(Distribution):
    r"""Two-sided geometric (discrete Laplace) distribution on the integers:

    .. math::
        P(k \mid \alpha, \ell) = \frac{1 - \alpha}{1 + \alpha} \alpha^{|k - \ell|},
        \quad k \in \mathbb{Z}, \ 0 < \alpha < 1,

    the noise of the geometric mechanism (seed 002, eq. 6), here with an integer location
    :math:`\ell`. Give ``alpha`` or ``log_alpha`` (exact for ``alpha`` near 1, e.g.
    ``log_alpha = -epsilon / sensitivity``). Samples are the difference of two i.i.d.
    geometric counts ``floor(E / -log(alpha))``, ``E`` from :func:`exponential_fine_tail`;
    they are integers of the default integer dtype, shifted by ``loc``.

    :param alpha: the decay, ``0 < alpha < 1``.
    :param loc: integer location (default 0).
    :param log_alpha: ``log(alpha) < 0``, instead of ``alpha``.

    >>> import jax
    >>> from d3pext.distributions import TwoSidedGeometric
    >>> d = TwoSidedGeometric(0.5)
    >>> float(d.log_prob(0))  # log(1/3)
    -1.098...
    >>> float(d.cdf(0)), float(d.icdf(0.7))
    (0.666..., 1.0)
    >>> d.sample(jax.random.PRNGKey(0), (3,)).dtype
    dtype('int32')
    """

    arg_constraints = {
        "log_alpha": constraints.open_interval(-jnp.inf, 0.0),
        "loc": integer,
    }
    support = integer

    def __init__(
        self,
        alpha: Optional[ArrayLike] = None,
        loc: ArrayLike = 0,
        *,
        log_alpha: Optional[ArrayLike] = None,
        validate_args: Optional[bool] = None,
    ) -> None:
        if (alpha is None) == (log_alpha is None):
            raise ValueError("TwoSidedGeometric: give exactly one of `alpha` and `log_alpha`.")
        if log_alpha is None:
            log_alpha = jnp.log(alpha)
        self.log_alpha, self.loc = promote_shapes(log_alpha, loc)
        batch_shape = lax.broadcast_shapes(jnp.shape(log_alpha), jnp.shape(loc))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    @property
    def alpha(self) -> Array:
        return jnp.exp(self.log_alpha)

    def _log_normalizer(self) -> Array:
        # log((1 + alpha) / (1 - alpha)), stable for alpha near 0 and near 1.
        return jnp.logaddexp(0.0, self.log_alpha) - jnp.log(-jnp.expm1(self.log_alpha))

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        shape = sample_shape + self.batch_shape
        dtype = int_dtype()
        limit = float(jnp.iinfo(dtype).max // 2)
        e = exponential_fine_tail(key, (2,) + shape, float_dtype(self.log_alpha))
        g = jnp.minimum(jnp.floor(e / -self.log_alpha), limit).astype(dtype)
        return self.loc + (g[0] - g[1])

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        return jnp.abs(value - self.loc) * self.log_alpha - self._log_normalizer()

    def cdf(self, value: ArrayLike) -> Array:
        """``P(X <= value)``."""
        k = jnp.floor(value - self.loc)
        log_1p_alpha = jnp.logaddexp(0.0, self.log_alpha)
        negative = k < 0
        k_neg = jnp.where(negative, k, -1.0)
        k_pos = jnp.where(negative, 0.0, k)
        lower = jnp.exp(-k_neg * self.log_alpha - log_1p_alpha)  # alpha^{-k} / (1 + alpha)
        upper = -jnp.expm1((k_pos + 1) * self.log_alpha - log_1p_alpha)
        return jnp.where(negative, lower, upper)

    def icdf(self, q: ArrayLike) -> Array:
        """Smallest integer ``k`` with ``cdf(k) >= q`` (floating point; -inf at 0, inf at 1).

        Computed in the dtype of ``q``: pass float64 quantiles (under ``jax.enable_x64``) for
        randomized quasi-Monte Carlo near the tails.
        """
        q = jnp.asarray(q, float_dtype(q))
        la = self.log_alpha
        log_1p_alpha = jnp.logaddexp(0.0, la)
        negative = q <= jnp.exp(la - log_1p_alpha)  # q <= cdf(-1) = alpha / (1 + alpha)
        q_neg = jnp.where(negative, q, 0.25 * jnp.exp(la - log_1p_alpha))
        q_pos = jnp.where(negative, 0.5, q)
        k = jnp.where(
            negative,
            -jnp.floor((jnp.log(q_neg) + log_1p_alpha) / la),
            jnp.maximum(jnp.ceil((jnp.log1p(-q_pos) + log_1p_alpha) / la) - 1, 0.0),
        )
        # One step of correction against rounding at the jumps of the cdf.
        k = jnp.where(self.cdf(self.loc + k - 1) >= q, k - 1, k)
        k = jnp.where(self.cdf(self.loc + k) < q, k + 1, k)
        k = jnp.where(q <= 0, -jnp.inf, jnp.where(q >= 1, jnp.inf, k))
        return self.loc + k

    @property
    def mean(self) -> Array:
        return jnp.broadcast_to(self.loc, self.batch_shape).astype(jnp.result_type(float))

    @property
    def variance(self) -> Array:
        # 2 alpha / (1 - alpha)^2
        return jnp.broadcast_to(
            2 * jnp.exp(self.log_alpha) / jnp.expm1(self.log_alpha) ** 2, self.batch_shape
        )


# ---------------------------------------------------------------------------------------------
# Skellam
# ---------------------------------------------------------------------------------------------


_TAIL_TERMS = 2048


def _log_poisson_lower_tail(k: Array, x: Array) -> Array:
    """log P(Pois(x) <= k) for k < x deep in the lower tail (where gammaincc underflows)."""
    safe_x = jnp.where(x > 0, x, 1.0)
    log_last = xlogy(k, safe_x) - safe_x - gammaln(k + 1)

    def body(j, carry):
        term, total = carry
        term = term * jnp.maximum(k - j, 0.0) / safe_x
        return term, total + term

    _, total = lax.fori_loop(0, _TAIL_TERMS, body, (jnp.ones_like(log_last), jnp.ones_like(log_last)))
    return log_last + jnp.log(total)


def _log_poisson_upper_tail(k: Array, x: Array) -> Array:
    """log P(Pois(x) > k) for k > x deep in the upper tail (where gammainc underflows):
    Pois(k + 1; x) sum_j prod_{i=2}^{j+1} x / (k + i)."""
    log_first = xlogy(k + 1, x) - x - gammaln(k + 2)

    def body(j, carry):
        term, total = carry
        term = term * x / (k + 2 + j)
        return term, total + term

    _, total = lax.fori_loop(0, _TAIL_TERMS, body, (jnp.ones_like(log_first), jnp.ones_like(log_first)))
    return log_first + jnp.log(total)


class GeometricNoisedPoisson(Distribution):
    r"""Law of a privatized count :math:`\tilde y = y + \tau`, :math:`y \sim \mathrm{Pois}(\mu)`,
    :math:`\tau \sim 2\mathrm{Geo}(\alpha)`: the exponentially randomized Skellam
    :math:`\mathrm{Skel}(\lambda^+ + \mu, \lambda^-)`, :math:`\lambda^\pm \sim` exponential with
    mean :math:`\alpha / (1 - \alpha)`, of seed 002, eq. 11. Summing the convolution in closed form,

    .. math::
        P(k) = \tfrac{1 - \alpha}{1 + \alpha} \Big[ \alpha^{k} e^{\mu (1/\alpha - 1)}
            F_{\mu/\alpha}(k) + \alpha^{-k} e^{-\mu (1 - \alpha)} \bar F_{\alpha\mu}(k) \Big],

    with :math:`F_\lambda` and :math:`\bar F_\lambda` the Poisson CDF and survival function
    (regularized incomplete gamma functions; where they underflow, the tails are summed from
    their largest term).

    :param rate: Poisson rate :math:`\mu \ge 0`.
    :param alpha: noise decay in (0, 1) (or ``log_alpha``).

    >>> from d3pext.distributions import GeometricNoisedPoisson
    >>> round(float(GeometricNoisedPoisson(2.0, 0.5).log_prob(-1)), 4)
    -2.7918
    """

    arg_constraints = {"rate": constraints.nonnegative, "log_alpha": constraints.less_than(0.0)}
    support = integer

    def __init__(
        self,
        rate: ArrayLike,
        alpha: Optional[ArrayLike] = None,
        *,
        log_alpha: Optional[ArrayLike] = None,
        validate_args: Optional[bool] = None,
    ) -> None:
        if (alpha is None) == (log_alpha is None):
            raise ValueError("GeometricNoisedPoisson: give exactly one of `alpha` and `log_alpha`.")
        if log_alpha is None:
            log_alpha = jnp.log(alpha)
        self.rate, self.log_alpha = promote_shapes(rate, log_alpha)
        batch_shape = lax.broadcast_shapes(jnp.shape(rate), jnp.shape(log_alpha))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        shape = sample_shape + self.batch_shape
        key_y, key_tau = random.split(key)
        y = random.poisson(key_y, self.rate, shape, dtype=int_dtype())
        log_alpha = jnp.broadcast_to(self.log_alpha, self.batch_shape)
        return y + TwoSidedGeometric(log_alpha=log_alpha).sample(key_tau, sample_shape)

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        dtype = float_dtype(self.rate, self.log_alpha)
        mu, la = jnp.asarray(self.rate, dtype), jnp.asarray(self.log_alpha, dtype)
        k = jnp.asarray(value, dtype)
        alpha = jnp.exp(la)
        kp = jnp.maximum(k, 0.0)
        # y <= k (only for k >= 0): alpha^k e^{mu/alpha - mu} P(Pois(mu/alpha) <= k)
        x = mu / alpha
        # Probabilities below the smallest normal number count as underflowed: subnormal results
        # keep few digits, and a GPU flushes parts of their computation to zero (a float64 log pmf
        # 2e-3 off on an H100 where the survival below was about 1e-315).
        tiny = jnp.finfo(dtype).tiny
        cdf = gammaincc(kp + 1, x)
        low = k * la + mu * (1 / alpha - 1) + jnp.log(jnp.where(cdf >= tiny, cdf, 1.0))
        # where that CDF underflows, sum the lower tail down from its last term:
        # P(Pois(x) <= k) = Pois(k; x) sum_j prod_{i<j} (k - i) / x
        low = jnp.where(cdf >= tiny, low, k * la + mu * (1 / alpha - 1) + _log_poisson_lower_tail(kp, x))
        low = jnp.where(k >= 0, low, -jnp.inf)
        # y > k, y >= 0: alpha^{-k} e^{-mu (1 - alpha)} P(Pois(alpha mu) > max(k, -1))
        z = alpha * mu
        survival = jnp.where(k >= 0, gammainc(kp + 1, z), 1.0)
        log_survival = jnp.where(
            survival >= tiny, jnp.log(jnp.where(survival >= tiny, survival, 1.0)), _log_poisson_upper_tail(kp, z)
        )
        high = -k * la - mu * (1 - alpha) + log_survival
        log_norm = jnp.log(-jnp.expm1(la)) - jnp.logaddexp(0.0, la)
        return log_norm + jnp.logaddexp(low, high)

    @property
    def mean(self) -> Array:
        return jnp.broadcast_to(self.rate, self.batch_shape)

    @property
    def variance(self) -> Array:
        alpha = jnp.exp(self.log_alpha)
        return jnp.broadcast_to(self.rate + 2 * alpha / (1 - alpha) ** 2, self.batch_shape)
