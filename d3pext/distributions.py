"""Distributions for inference from private releases.

* :class:`InverseGaussian` (Wald): the full conditional of the precision in the normal
  scale-mixture representation of Laplace noise (Bernstein & Sheldon, seed 004, section 3),
  including the Levy limit ``loc = inf`` reached when a noisy statistic equals its release.
* :class:`TwoSidedGeometric`: the noise of the geometric mechanism (Schein et al., seed 002, eq. 6).
* :class:`Skellam`: the difference of two Poisson counts (seed 002, Theorem 2), with
  :func:`log_bessel_ive`, a stable log modified Bessel function for all orders and arguments.
* :class:`Bessel`: the minimum of two Poisson counts given their difference (seed 002,
  Theorem 3; Yuan & Kalbfleisch 2000), with an exact vectorised rejection sampler.
* :class:`GeometricNoisedPoisson`: a Poisson count plus two-sided geometric noise, i.e. the
  exponentially randomized Skellam of seed 002, eq. 11 (the law of a privatized count).
"""

from fractions import Fraction
import math
from typing import Optional

import jax
from jax import lax, random
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
from jax.scipy.special import erfcx, gammainc, gammaincc, gammaln, ndtr, xlogy
from jax.typing import ArrayLike, DTypeLike
import numpy as np

from numpyro.distributions import constraints
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.util import promote_shapes, validate_sample
from numpyro.util import is_prng_key

__all__ = [
    "Bessel",
    "GeometricNoisedPoisson",
    "InverseGaussian",
    "Skellam",
    "TwoSidedGeometric",
    "exponential_fine_tail",
    "integer",
    "log_bessel_ive",
]

Array = jax.Array


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


def _int_dtype() -> np.dtype:
    return jax.dtypes.canonicalize_dtype(jnp.int64)


def _float_dtype(*args: ArrayLike) -> np.dtype:
    """The floating dtype of ``args`` (Python scalars follow the x64 setting)."""
    dtype = jnp.result_type(*args)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.result_type(float)


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

_UAE_TERMS = 8  # terms u_1..u_8 of the Debye expansion
# The expansion is used at orders >= 32 in float64 (>= 12 in lower precision): relative error
# below about 1e-13 (1e-9); lower orders recur down from there.  A lower start order in float32
# limits the rounding of the large log I_start that the recurrence cancels.
_UAE_MIN_ORDER_F64, _UAE_MIN_ORDER_F32 = 32, 12
_SERIES_TERMS = 8  # power series for x <= 1: the first omitted term is below 1e-14 relative


def _debye_polynomials(num_terms: int) -> list[list[float]]:
    """Coefficients (in powers of t) of the Debye polynomials u_k(t), k = 0..num_terms.

    Generated exactly from the recurrence (DLMF 10.41.9)
    u_{k+1}(t) = t^2 (1 - t^2) u_k'(t) / 2 + (1/8) int_0^t (1 - 5 s^2) u_k(s) ds.
    """
    polys = [[Fraction(1)]]
    for _ in range(num_terms):
        u = polys[-1]
        nxt = [Fraction(0)] * (len(u) + 3)
        for p, c in enumerate(u):
            if p > 0:  # t^2 (1 - t^2) / 2 * p c t^(p-1)
                nxt[p + 1] += c * p / 2
                nxt[p + 3] -= c * p / 2
            nxt[p + 1] += c / (8 * (p + 1))  # (1/8) int_0^t c s^p ds
            nxt[p + 3] -= 5 * c / (8 * (p + 3))  # -(5/8) int_0^t c s^(p+2) ds
        polys.append(nxt)
    return [[float(c) for c in u] for u in polys]


_DEBYE = _debye_polynomials(_UAE_TERMS)


def _horner(coeffs: list[float], t: Array) -> Array:
    out = jnp.zeros_like(t)
    for c in reversed(coeffs):
        out = out * t + c
    return out


def _log_ive_debye(v: Array, x: Array) -> Array:
    """log(I_v(x) e^{-x}) by the uniform asymptotic (Debye) expansion, for v >= 32, x > 0.

    I_v(v z) ~ exp(v eta) / sqrt(2 pi v) / (1 + z^2)^(1/4) * sum_k u_k(t) / v^k with
    t = 1 / sqrt(1 + z^2) and eta - z = 1 / (sqrt(1 + z^2) + z) - asinh(1 / z) (DLMF 10.41.3).
    """
    z = x / v
    sq = jnp.hypot(1.0, z)
    t = 1.0 / sq
    series = jnp.zeros_like(x)
    for k in range(_UAE_TERMS, 0, -1):
        series = (series + _horner(_DEBYE[k], t)) / v
    return (
        v * (1.0 / (sq + z) - jnp.arcsinh(v / x))
        - 0.5 * jnp.log(2 * jnp.pi * v)
        - 0.5 * jnp.log(sq)
        + jnp.log1p(series)
    )


def _log_ive_series(v: Array, x: Array) -> Array:
    # I_v(x) = (x/2)^v / Gamma(v + 1) sum_k (x^2/4)^k / (k! (v + 1)_k), for x <= 1.
    y = x * x / 4
    series = jnp.ones_like(x)
    for k in range(_SERIES_TERMS - 1, 0, -1):
        series = 1 + series * y / (k * (v + k))
    return xlogy(v, x / 2) - gammaln(v + 1) + jnp.log(series) - x


def _log_ive_and_ratio(v: Array, x: Array) -> tuple[Array, Array]:
    """log(I_v(x) e^{-x}) and I_{v+1}(x) / I_v(x), for v >= 0, x >= 0 (same shape and dtype)."""
    double = jnp.finfo(x.dtype).bits >= 64
    min_order = _UAE_MIN_ORDER_F64 if double else _UAE_MIN_ORDER_F32
    small = x <= 1
    # Double-where: each branch only sees arguments it handles, so no NaN leaks into gradients.
    xm = jnp.where(small, x, 1.0)
    log_small = _log_ive_series(v, xm)
    ratio_small = jnp.exp(_log_ive_series(v + 1, xm) - log_small)
    xs = jnp.where(small, 2.0, x)
    steps = jnp.maximum(jnp.ceil(min_order - v), 0.0)
    top = v + steps
    log_top = _log_ive_debye(top, xs)
    ratio_top = jnp.exp(_log_ive_debye(top + 1, xs) - log_top)  # I_{top+1} / I_top

    def body(i, carry):
        acc, r = carry
        n = top - i
        r_new = 1.0 / (r + 2.0 * n / xs)  # I_n / I_{n-1}
        active = i < steps
        return jnp.where(active, acc - jnp.log(r_new), acc), jnp.where(active, r_new, r)

    log_large, ratio_large = lax.fori_loop(0, min_order, body, (log_top, ratio_top))
    return jnp.where(small, log_small, log_large), jnp.where(small, ratio_small, ratio_large)


@jax.custom_jvp
def _log_ive(v: Array, x: Array) -> Array:
    return _log_ive_and_ratio(v, x)[0]


def _log_ive_jvp(primals, tangents):
    # d/dx log(I_v(x) e^{-x}) = I_{v+1}(x) / I_v(x) + v / x - 1 (DLMF 10.29.2).
    v, x = primals
    v_dot, x_dot = tangents
    out, ratio = _log_ive_and_ratio(v, x)
    out_dot = jnp.zeros_like(out)
    if not isinstance(x_dot, SymbolicZero):
        v_over_x = jnp.where(v == 0, 0.0, v / jnp.where(v == 0, 1.0, x))
        out_dot = out_dot + (ratio + v_over_x - 1) * x_dot
    if not isinstance(v_dot, SymbolicZero):  # the derivative in the order is not implemented
        out_dot = out_dot + jnp.nan * v_dot
    return out, out_dot


_log_ive.defjvp(_log_ive_jvp, symbolic_zeros=True)


@jax.jit
def log_bessel_ive(v: ArrayLike, x: ArrayLike) -> Array:
    r"""Log of the exponentially scaled modified Bessel function, :math:`\log(I_v(x) e^{-x})`.

    Accurate to about 1e-13 (relative to ``max(1, |result|)``, float64) for every real order
    ``v >= 0`` and argument ``x >= 0``, also where :func:`scipy.special.ive` under- or overflows:
    orders ``v >= 32`` use the uniform asymptotic (Debye) expansion, lower orders run the stable
    backward recurrence :math:`I_{n-1} = I_{n+1} + (2n/x) I_n` on ratios down from order
    ``v + ceil(32 - v)``, and ``x <= 1`` uses the power series. In float32 the relative error is
    below about 2e-6. Differentiable in ``x`` (exactly, through
    :math:`I_v' = I_{v+1} + (v/x) I_v`), not in ``v``; broadcasts.

    :param v: order(s), ``v >= 0``.
    :param x: argument(s), ``x >= 0``.

    >>> import jax.numpy as jnp
    >>> from d3pext.distributions import log_bessel_ive
    >>> float(jnp.exp(log_bessel_ive(0.0, 1.0)))  # scipy.special.ive(0, 1) = 0.4657596...
    0.46575...
    >>> float(log_bessel_ive(1000, 10.0))  # I_1000(10) ~ 1e-1869: no underflow
    -4312.66...
    """
    dtype = _float_dtype(x)
    v, x = jnp.broadcast_arrays(jnp.asarray(v, dtype), jnp.asarray(x, dtype))
    return _log_ive(v, x)


# ---------------------------------------------------------------------------------------------
# Inverse Gaussian (Wald)
# ---------------------------------------------------------------------------------------------


class InverseGaussian(Distribution):
    r"""Inverse Gaussian (Wald) distribution with mean ``loc`` and shape ``concentration``:

    .. math::
        p(x \mid \mu, \lambda) = \sqrt{\frac{\lambda}{2 \pi x^3}}
            \exp\left(-\frac{\lambda (x - \mu)^2}{2 \mu^2 x}\right), \quad x > 0.

    ``loc = inf`` is allowed and gives the Levy limit
    :math:`\sqrt{\lambda / (2\pi x^3)} \exp(-\lambda / (2x))` in :meth:`sample`, :meth:`log_prob`
    and :meth:`cdf`, with finite gradients (the formulas use :math:`x/\mu` and a double-where at
    :math:`\mu = \infty`). This is the full conditional of the precision :math:`1/\sigma^2` in the scale-mixture representation of
    Laplace noise (seed 004, Appendix B), whose mean :math:`\epsilon / (\Delta |y - s|)` is
    infinite when the statistic ``s`` equals its release ``y``.

    Sampling uses Michael, Schucany & Haas (1976), rearranged so that it has no cancellation
    for large means. The sampler is not reparametrized (its accept step jumps).

    :param loc: the mean :math:`\mu > 0`, possibly ``inf``.
    :param concentration: the shape :math:`\lambda > 0`.

    >>> import jax
    >>> from d3pext.distributions import InverseGaussian
    >>> d = InverseGaussian(2.0, 3.0)
    >>> d.sample(jax.random.PRNGKey(0), (4,)).shape
    (4,)
    >>> float(InverseGaussian(float("inf"), 1.0).log_prob(1.0))  # Levy(1) at 1
    -1.418...
    """

    arg_constraints = {"loc": constraints.positive, "concentration": constraints.positive}
    support = constraints.positive
    reparametrized_params = []

    def __init__(
        self,
        loc: ArrayLike = 1.0,
        concentration: ArrayLike = 1.0,
        *,
        validate_args: Optional[bool] = None,
    ) -> None:
        self.loc, self.concentration = promote_shapes(loc, concentration)
        batch_shape = lax.broadcast_shapes(jnp.shape(loc), jnp.shape(concentration))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        shape = sample_shape + self.batch_shape
        key_normal, key_uniform = random.split(key)
        dtype = _float_dtype(self.loc, self.concentration)
        inv_mean = 1.0 / jnp.asarray(self.loc, dtype)
        z = random.normal(key_normal, shape, dtype)
        # a = chi2_1 / (2 lambda); the smaller root of the MSH quadratic is
        # mu / (1 + w + sqrt(w^2 + 2w)) with w = mu a, i.e. 1 / (r + a + sqrt(a^2 + 2 r a))
        # with r = 1/mu.
        a = jnp.maximum(z * z / (2 * self.concentration), jnp.finfo(dtype).tiny)
        x = 1.0 / (inv_mean + a + jnp.sqrt(a * a + 2 * inv_mean * a))
        u = random.uniform(key_uniform, shape, dtype)
        # Keep x with probability mu / (mu + x) = 1 / (1 + x r), else take mu^2 / x.
        return jnp.where(u * (1 + x * inv_mean) <= 1, x, self.loc * (self.loc / x))

    def _relative_deviation(self, value: ArrayLike) -> Array:
        # (x - mu) / mu, exact for x near mu; -1 at mu = inf.  Double-where keeps the gradient
        # with respect to mu finite (zero) at mu = inf.
        finite = jnp.isfinite(self.loc)
        loc = jnp.where(finite, self.loc, 1.0)
        return jnp.where(finite, (value - loc) / loc, -1.0)

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        lam = self.concentration
        dev = self._relative_deviation(value)
        log_normalizer = 0.5 * (jnp.log(lam) - jnp.log(2 * jnp.pi) - 3 * jnp.log(value))
        return log_normalizer - lam * dev * dev / (2 * value)

    def cdf(self, value: ArrayLike) -> Array:
        """Cumulative distribution function (for ``loc = inf``: ``erfc(sqrt(lam / (2 x)))``).

        Uses ``exp(2 lam / mu) Phi(-w) = erfcx(w / sqrt 2) exp(-lam (x - mu)^2 / (2 mu^2 x)) / 2``
        with ``w = sqrt(lam / x) (x / mu + 1)``, which cannot overflow.
        """
        lam = self.concentration
        dev = self._relative_deviation(value)
        root = jnp.sqrt(lam / value)
        w = root * (value / self.loc + 1)
        return ndtr(root * dev) + 0.5 * erfcx(w / jnp.sqrt(2.0)) * jnp.exp(
            -lam * dev * dev / (2 * value)
        )

    @property
    def mean(self) -> Array:
        return jnp.broadcast_to(self.loc, self.batch_shape)

    @property
    def variance(self) -> Array:
        return jnp.broadcast_to(self.loc**3 / self.concentration, self.batch_shape)


# ---------------------------------------------------------------------------------------------
# Two-sided geometric
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
        int_dtype = _int_dtype()
        limit = float(jnp.iinfo(int_dtype).max // 2)
        e = exponential_fine_tail(key, (2,) + shape, _float_dtype(self.log_alpha))
        g = jnp.minimum(jnp.floor(e / -self.log_alpha), limit).astype(int_dtype)
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
        q = jnp.asarray(q, _float_dtype(q))
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


class Skellam(Distribution):
    r"""Skellam distribution: the difference ``N1 - N2`` of independent Poisson counts,

    .. math::
        P(k \mid \mu_1, \mu_2) = e^{-(\mu_1 + \mu_2)} (\mu_1 / \mu_2)^{k/2}
            I_{|k|}(2 \sqrt{\mu_1 \mu_2}), \quad k \in \mathbb{Z},

    evaluated in log space with :func:`log_bessel_ive`, so it is finite for all counts and rates.
    Samples are differences of Poisson draws (integers of the default integer dtype).

    :param rate1: rate :math:`\mu_1 > 0` of the positive part.
    :param rate2: rate :math:`\mu_2 > 0` of the negative part.

    >>> import jax
    >>> from d3pext.distributions import Skellam
    >>> d = Skellam(3.0, 1.0)
    >>> round(float(d.log_prob(2)), 5)  # scipy.stats.skellam(3, 1).logpmf(2)
    -1.59567
    >>> d.sample(jax.random.PRNGKey(0), (5,)).shape
    (5,)
    """

    arg_constraints = {"rate1": constraints.positive, "rate2": constraints.positive}
    support = integer

    def __init__(
        self,
        rate1: ArrayLike,
        rate2: ArrayLike,
        *,
        validate_args: Optional[bool] = None,
    ) -> None:
        self.rate1, self.rate2 = promote_shapes(rate1, rate2)
        batch_shape = lax.broadcast_shapes(jnp.shape(rate1), jnp.shape(rate2))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        shape = sample_shape + self.batch_shape
        key1, key2 = random.split(key)
        int_dtype = _int_dtype()
        n1 = random.poisson(key1, self.rate1, shape, dtype=int_dtype)
        n2 = random.poisson(key2, self.rate2, shape, dtype=int_dtype)
        return n1 - n2

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        dtype = _float_dtype(self.rate1, self.rate2)
        rate1 = jnp.asarray(self.rate1, dtype)
        rate2 = jnp.asarray(self.rate2, dtype)
        k = jnp.asarray(value, dtype)
        x = 2 * jnp.sqrt(rate1 * rate2)
        return (
            -((jnp.sqrt(rate1) - jnp.sqrt(rate2)) ** 2)
            + 0.5 * k * (jnp.log(rate1) - jnp.log(rate2))
            + log_bessel_ive(jnp.abs(k), x)
        )

    @property
    def mean(self) -> Array:
        return jnp.broadcast_to(self.rate1 - self.rate2, self.batch_shape)

    @property
    def variance(self) -> Array:
        return jnp.broadcast_to(self.rate1 + self.rate2, self.batch_shape)



# ---------------------------------------------------------------------------------------------
# Bessel
# ---------------------------------------------------------------------------------------------


def _bessel_log_weight(n: Array, nu: Array, log_half_a: Array) -> Array:
    # log of the unnormalised pmf (a/2)^(2n) / (n! Gamma(n + nu + 1)); -inf below the support.
    # One gammaln call on stacked arguments: each call site expands to a large XLA kernel.
    safe = jnp.maximum(n, 0.0)
    lg = gammaln(jnp.stack(jnp.broadcast_arrays(safe + 1, safe + nu + 1)))
    out = 2 * safe * log_half_a - lg[0] - lg[1]
    return jnp.where(n >= 0, out, -jnp.inf)


def bessel_mode(nu: ArrayLike, a: ArrayLike) -> Array:
    r"""Mode :math:`\lfloor (\sqrt{a^2 + \nu^2} - \nu) / 2 \rfloor` of ``Bessel(nu, a)``.

    The pmf ratio :math:`p(n+1)/p(n) = (a/2)^2 / ((n+1)(n+\nu+1))` decreases in ``n`` (the pmf
    is log-concave), so the pmf increases up to the first ``n`` where the ratio drops below 1
    (at a tie, ratio exactly 1, the mode minus one is a mode too). Written as
    ``a^2 / (2 (sqrt(a^2 + nu^2) + nu))`` to avoid cancellation for small ``a``.

    >>> int(bessel_mode(0.0, 10.0)), int(bessel_mode(50.0, 10.0))
    (5, 0)
    """
    dtype = _float_dtype(nu, a)
    nu, a = jnp.asarray(nu, dtype), jnp.asarray(a, dtype)
    return jnp.floor(a * a / (2 * (jnp.hypot(a, nu) + nu)))


def _bessel_envelope(nu: Array, a: Array):
    """Dominating function of the log-concave Bessel pmf: a flat piece on ``[L, R]`` around the
    mode and geometric tails beyond, along the chords at ``L`` and ``R``."""
    lh = jnp.log(a / 2)
    mode = bessel_mode(nu, a)
    # curvature of log p at the mode: 1/(M+1) + 1/(M+nu+1); about one standard deviation
    var = 1.0 / (1.0 / (mode + 1) + 1.0 / (mode + nu + 1))
    sd = jnp.floor(jnp.sqrt(var))
    left = jnp.maximum(mode - jnp.maximum(sd, 1.0), 0.0)
    right = mode + sd
    points = jnp.stack([mode - 1, mode, mode + 1, mode + 2, right, right + 1, left, left - 1])
    # the barrier keeps XLA from duplicating the (large) lgamma kernel into every consumer,
    # which multiplied the compile time
    f = lax.optimization_barrier(_bessel_log_weight(points, nu, lh))
    # max over mode - 1..mode + 1 guards against rounding of the mode formula
    height = jnp.max(f[:3], axis=0)
    # The right tail needs a slope s_R clearly below 0. For sd >= 1 the chord at mode + sd has
    # s_R ~ -1/sd. For sd = 0 the chord at the mode is flat near a tie (p(M) ~ p(M+1), which
    # rounding of the mode formula can also produce); there the tail starts past mode + 1, where
    # s_R <= log(x*(x* + nu) / ((x* + 1)(x* + 1 + nu))) < 0 with x* the real mode.
    step = (sd == 0) & (f[2] - f[1] > -1.0)
    right = jnp.where(step, mode + 1, right)
    f_right = jnp.where(step, f[2], f[4])
    s_right = jnp.where(step, f[3] - f[2], f[5] - f[4])
    # log-concavity: f(k) <= f(L) - (L - k) s_L for k < L and f(k) <= f(R) + (k - R) s_R for
    # k > R, with the chord slopes s_L = f(L) - f(L - 1) > 0 and s_R = f(R + 1) - f(R) < 0
    has_left = left >= 1
    f_left = f[6]
    s_left = jnp.where(has_left, f[6] - jnp.where(has_left, f[7], 0.0), 1.0)
    log_w_mid = jnp.log(right - left + 1) + height
    log_w_right = f_right + s_right - jnp.log(-jnp.expm1(s_right))
    log_w_left = jnp.where(has_left, f_left - s_left - jnp.log(-jnp.expm1(-s_left)), -jnp.inf)
    return lh, left, right, height, f_left, f_right, s_left, s_right, (log_w_left, log_w_mid, log_w_right)


def sample_bessel(
    key: Array, nu: ArrayLike, a: ArrayLike, shape: tuple[int, ...] = (), max_iter: int = 100
) -> tuple[Array, Array]:
    """Exact draws from ``Bessel(nu, a)`` by rejection from a log-concave envelope.

    The envelope is flat on ``[mode - sd, mode + sd]`` (``sd`` from the curvature of the log pmf
    at the mode) and geometric beyond, with the chord slopes at its ends (valid because the pmf
    is log-concave), so the acceptance rate is above 0.66 for every ``nu >= 0`` and ``a > 0``
    (about 0.78 for large ``a``). Each element retries in a bounded
    ``lax.while_loop``; the second output is ``False`` where ``max_iter`` proposals were all
    rejected (probability below 1e-25 at the default), and those draws are ``-1``.

    The log pmf is evaluated in the dtype of ``nu`` and ``a``: in float32 its rounding (about
    1e-7 of ``a log a``) is negligible for ``a`` up to about 1e4; pass float64 (under
    ``jax.enable_x64``) beyond.

    >>> import jax
    >>> x, ok = sample_bessel(jax.random.PRNGKey(0), 2.5, 30.0, (1000,))
    >>> bool(ok.all()), x.shape
    (True, (1000,))
    """
    dtype = _float_dtype(nu, a)
    shape = tuple(shape)
    nu = jnp.broadcast_to(jnp.asarray(nu, dtype), shape)
    a = jnp.broadcast_to(jnp.asarray(a, dtype), shape)
    lh, left, right, height, f_left, f_right, s_left, s_right, log_w = _bessel_envelope(nu, a)
    log_w = jnp.stack(log_w)
    log_total = jax.nn.logsumexp(log_w, axis=0)
    cum_left = jnp.exp(log_w[0] - log_total)
    cum_mid = cum_left + jnp.exp(log_w[1] - log_total)

    def propose(key):
        # one call of the bit generator per round (each call site compiles to a large kernel)
        tiny = jnp.finfo(dtype).tiny
        u_piece, u_mid, u_exp, u_acc = random.uniform(key, (4, *shape), dtype, minval=tiny)
        e = -jnp.log(u_exp)
        width = right - left + 1
        k_mid = left + jnp.minimum(jnp.floor(u_mid * width), width - 1)
        j_left = 1 + jnp.floor(e / s_left)
        j_right = 1 + jnp.floor(e / -s_right)
        in_left, in_mid = u_piece < cum_left, u_piece < cum_mid
        k = jnp.where(in_left, left - j_left, jnp.where(in_mid, k_mid, right + j_right))
        env = jnp.where(
            in_left, f_left - j_left * s_left, jnp.where(in_mid, height, f_right + j_right * s_right)
        )
        accept = (k >= 0) & (jnp.log(u_acc) <= _bessel_log_weight(k, nu, lh) - env)
        return k, accept

    def cond(carry):
        i, _, _, done, _ = carry
        return (i < max_iter) & ~jnp.all(done)

    def body(carry):
        i, key, x, done, _ = carry
        key, sub = random.split(key)
        k, accept = propose(sub)
        take = accept & ~done
        return i + 1, key, jnp.where(take, k, x), done | accept, None

    init = (0, key, jnp.full(shape, -1.0, dtype), jnp.zeros(shape, bool), None)
    _, _, x, done, _ = lax.while_loop(cond, body, init)
    return x.astype(_int_dtype()), done


class Bessel(Distribution):
    r"""Bessel distribution (Yuan & Kalbfleisch 2000) on the non-negative integers:

    .. math::
        P(n \mid \nu, a) = \frac{(a/2)^{2n + \nu}}{I_\nu(a)\, n!\, \Gamma(n + \nu + 1)},
        \quad n = 0, 1, \ldots, \quad \nu \ge 0,\ a > 0.

    The minimum of two independent Poisson counts with rates :math:`\lambda_1, \lambda_2` given
    their difference :math:`\tau` is ``Bessel(|tau|, 2 sqrt(lambda_1 lambda_2))`` (seed 002,
    Theorem 3). ``log_prob`` uses :func:`log_bessel_ive` (finite for all orders and arguments);
    :meth:`sample` is the exact rejection sampler :func:`sample_bessel`, vectorised over the
    batch (draws that exhaust ``max_iter`` proposals are ``-1``, outside the support).

    :param nu: order :math:`\nu \ge 0` (real).
    :param a: argument :math:`a > 0`.

    >>> import jax
    >>> from d3pext.distributions import Bessel
    >>> d = Bessel(1.0, 4.0)
    >>> round(float(d.log_prob(1)), 4)  # log(2^3 / (I_1(4) 1! 2!))
    -0.8919
    >>> d.sample(jax.random.PRNGKey(0), (3,)).shape
    (3,)
    """

    arg_constraints = {"nu": constraints.nonnegative, "a": constraints.positive}
    support = constraints.nonnegative_integer

    def __init__(
        self,
        nu: ArrayLike,
        a: ArrayLike,
        *,
        max_iter: int = 100,
        validate_args: Optional[bool] = None,
    ) -> None:
        self.nu, self.a = promote_shapes(nu, a)
        self.max_iter = max_iter
        batch_shape = lax.broadcast_shapes(jnp.shape(nu), jnp.shape(a))
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        x, _ = sample_bessel(key, self.nu, self.a, sample_shape + self.batch_shape, self.max_iter)
        return x

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        dtype = _float_dtype(self.nu, self.a)
        nu, a = jnp.asarray(self.nu, dtype), jnp.asarray(self.a, dtype)
        n = jnp.asarray(value, dtype)
        return (
            xlogy(2 * n + nu, a / 2)
            - gammaln(n + 1)
            - gammaln(n + nu + 1)
            - log_bessel_ive(nu, a)
            - a
        )

    @property
    def mean(self) -> Array:
        dtype = _float_dtype(self.nu, self.a)
        nu, a = jnp.asarray(self.nu, dtype), jnp.asarray(self.a, dtype)
        ratio = jnp.exp(log_bessel_ive(nu + 1, a) - log_bessel_ive(nu, a))
        return jnp.broadcast_to(a * ratio / 2, self.batch_shape)

    @property
    def variance(self) -> Array:
        # E[m (m + nu)] = a^2 / 4 (Yuan & Kalbfleisch 2000)
        m = self.mean
        return jnp.maximum(self.a**2 / 4 - self.nu * m - m * m, 0.0)


# ---------------------------------------------------------------------------------------------
# Poisson count plus two-sided geometric noise (exponentially randomized Skellam)
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
        y = random.poisson(key_y, self.rate, shape, dtype=_int_dtype())
        log_alpha = jnp.broadcast_to(self.log_alpha, self.batch_shape)
        return y + TwoSidedGeometric(log_alpha=log_alpha).sample(key_tau, sample_shape)

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        dtype = _float_dtype(self.rate, self.log_alpha)
        mu, la = jnp.asarray(self.rate, dtype), jnp.asarray(self.log_alpha, dtype)
        k = jnp.asarray(value, dtype)
        alpha = jnp.exp(la)
        kp = jnp.maximum(k, 0.0)
        # y <= k (only for k >= 0): alpha^k e^{mu/alpha - mu} P(Pois(mu/alpha) <= k)
        x = mu / alpha
        cdf = gammaincc(kp + 1, x)
        low = k * la + mu * (1 / alpha - 1) + jnp.log(jnp.where(cdf > 0, cdf, 1.0))
        # where that CDF underflows, sum the lower tail down from its last term:
        # P(Pois(x) <= k) = Pois(k; x) sum_j prod_{i<j} (k - i) / x
        low = jnp.where(cdf > 0, low, k * la + mu * (1 / alpha - 1) + _log_poisson_lower_tail(kp, x))
        low = jnp.where(k >= 0, low, -jnp.inf)
        # y > k, y >= 0: alpha^{-k} e^{-mu (1 - alpha)} P(Pois(alpha mu) > max(k, -1))
        z = alpha * mu
        survival = jnp.where(k >= 0, gammainc(kp + 1, z), 1.0)
        log_survival = jnp.where(
            survival > 0, jnp.log(jnp.where(survival > 0, survival, 1.0)), _log_poisson_upper_tail(kp, z)
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
