"""Truncated gamma and truncated gamma mixture (TGM) distributions, in log space.

Kazan & Reiter (seed 001, Definition 1 and Appendix B): ``TGM(alpha, beta, lam, tau, upper)`` has
density proportional to ``x^(alpha-1) exp(-beta x - lam |x - tau|)`` on ``(0, upper)``; it is the
full conditional of a sample variance ``S^2 ~ Gamma((n-1)/2, (n-1)/(2 sigma^2))`` released with
Laplace noise of rate ``lam`` as ``tau`` (Theorem 7). It is the mixture of
``Gamma(alpha, beta - lam)`` on ``(0, tau]`` and ``Gamma(alpha, beta + lam)`` on ``[tau, upper]``
with weights

    w1 = exp(-lam tau) Gamma(alpha) / (beta - lam)^alpha P(alpha, (beta - lam) tau)
    w2 = exp(lam tau) Gamma(alpha) / (beta + lam)^alpha [Q(alpha, (beta + lam) tau) - Q(alpha, (beta + lam) upper)]

(``P``, ``Q`` the regularized incomplete gamma functions). ``beta`` runs from 10 to 1e8 in the
paper's Example 1, where ``Q`` underflows: every mass here is computed in log space
(:func:`log_gammainc`, :func:`log_gammaincc`: series and continued fraction where the direct
evaluation underflows) and draws are made by inversion of the log CDF (:func:`truncated_gamma`,
Newton steps on a concave function, so monotone and bounded). Use float64
(``jax.enable_x64``) for exact work; float32 runs but its quantiles are coarser.

NumPyro's ``TruncatedGamma`` (``LeftTruncatedGamma``, ...) takes its normalizer outside log space
and returns ``nan`` where it underflows, which happens in the TGM's components; the tests use it
as a reference where it is accurate.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import gammainc, gammaincc, gammaln
from jax.typing import ArrayLike
import numpy as np

from numpyro.distributions import constraints
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.util import promote_shapes, validate_sample
from numpyro.util import is_prng_key

__all__ = [
    "TGM",
    "TruncatedGammaMixture",
    "log_gamma_mass",
    "log_gammainc",
    "log_gammaincc",
    "tgm_log_weights",
    "truncated_gamma",
    "truncated_gamma_icdf",
]

Array = jax.Array

_SERIES_TERMS = 64
_CF_TERMS = 64
_NEWTON_STEPS = 50


def _dtype(*args: ArrayLike):
    dtype = jnp.result_type(*args)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.result_type(float)


def _switch(dtype) -> float:
    # below this the direct incomplete gamma loses relative accuracy or underflows; the series
    # and continued fraction used instead converge fast there (x << a, resp. x >> a)
    return float(np.sqrt(np.finfo(dtype).tiny))


def _log_p_series(a: Array, x: Array) -> Array:
    """``log P(a, x) = a log x - x - log Gamma(a + 1) + log sum_k x^k / prod_j (a + j)``."""

    def body(k, carry):
        term, total = carry
        term = term * x / (a + k)
        return term, total + term

    one = jnp.ones_like(x)
    _, total = lax.fori_loop(1, _SERIES_TERMS, body, (one, one))
    return a * jnp.log(x) - x - gammaln(a + 1) + jnp.log(total)


def _log_q_fraction(a: Array, x: Array) -> Array:
    """``log Q(a, x)`` by the continued fraction (modified Lentz), for ``x > a + 1``."""
    tiny = jnp.finfo(x.dtype).tiny * 1e10
    b = x + 1 - a
    b = jnp.where(jnp.abs(b) < tiny, tiny, b)
    c = jnp.full_like(x, 1 / tiny)
    d = 1 / b
    h = d

    def body(i, carry):
        b, c, d, h = carry
        an = -i * (i - a)
        b = b + 2
        d = an * d + b
        d = jnp.where(jnp.abs(d) < tiny, tiny, d)
        c = b + an / c
        c = jnp.where(jnp.abs(c) < tiny, tiny, c)
        d = 1 / d
        return b, c, d, h * d * c

    *_, h = lax.fori_loop(1, _CF_TERMS, body, (b, c, d, h))
    return a * jnp.log(x) - x - gammaln(a) + jnp.log(jnp.abs(h))


def _log_pq(a: Array, x: Array) -> tuple[Array, Array]:
    """``(log P(a, x), log Q(a, x))`` from one ``gammainc`` and one ``gammaincc`` evaluation."""
    dtype = x.dtype
    safe_x = jnp.where((x > 0) & jnp.isfinite(x), x, 1.0)
    p = gammainc(a, safe_x)
    q = gammaincc(a, safe_x)
    log_p = jnp.where(p > 0.5, jnp.log1p(-q), jnp.log(jnp.where(p > 0, p, 1.0)))
    log_q = jnp.where(q > 0.5, jnp.log1p(-p), jnp.log(jnp.where(q > 0, q, 1.0)))
    small_p, small_q = p < _switch(dtype), q < _switch(dtype)
    # the fallbacks run in a loop of at most one pass, skipped (also under vmap) unless needed
    log_p, log_q, _ = lax.while_loop(
        lambda c: ~c[2],
        lambda c: (
            jnp.where(small_p, _log_p_series(a, jnp.where(small_p, safe_x, jnp.minimum(safe_x, a))), c[0]),
            jnp.where(small_q, _log_q_fraction(a, jnp.where(small_q, safe_x, jnp.maximum(safe_x, a + 2))), c[1]),
            jnp.array(True),
        ),
        (log_p, log_q, ~jnp.any(small_p | small_q)),
    )
    log_p = jnp.where(x <= 0, -jnp.inf, jnp.where(jnp.isposinf(x), 0.0, log_p))
    log_q = jnp.where(x <= 0, 0.0, jnp.where(jnp.isposinf(x), -jnp.inf, log_q))
    return log_p, log_q


def log_gammainc(a: ArrayLike, x: ArrayLike) -> Array:
    """``log P(a, x)``, the log regularized lower incomplete gamma function, without underflow.

    >>> import jax.numpy as jnp
    >>> bool(jnp.isfinite(log_gammainc(20.0, 1e-30)))  # P itself underflows to 0
    True
    """
    dtype = _dtype(a, x)
    a, x = jnp.broadcast_arrays(jnp.asarray(a, dtype), jnp.asarray(x, dtype))
    return _log_pq(a, x)[0]


def log_gammaincc(a: ArrayLike, x: ArrayLike) -> Array:
    """``log Q(a, x)``, the log regularized upper incomplete gamma function, without underflow.

    >>> import jax.numpy as jnp
    >>> float(log_gammaincc(2.0, 1e4)) < -9990.0  # Q itself underflows to 0
    True
    """
    dtype = _dtype(a, x)
    a, x = jnp.broadcast_arrays(jnp.asarray(a, dtype), jnp.asarray(x, dtype))
    return _log_pq(a, x)[1]


def _log_diff(log_big: Array, log_small: Array) -> Array:
    """``log(exp(log_big) - exp(log_small))``, ``log_big >= log_small``."""
    gap = jnp.where(jnp.isfinite(log_big), log_small - log_big, -jnp.inf)
    return jnp.where(jnp.isneginf(log_big), -jnp.inf, log_big + jnp.log1p(-jnp.exp(gap)))


def log_gamma_mass(a: ArrayLike, low: ArrayLike, high: ArrayLike) -> Array:
    """``log(P(a, high) - P(a, low))``: log mass of ``Gamma(a, 1)`` on ``[low, high]``.

    The difference is taken in the tail it lies in (``Q`` above the mean, ``P`` below), so it
    keeps its relative accuracy however far out the interval is. Empty intervals give ``-inf``.

    >>> import jax.numpy as jnp
    >>> bool(jnp.isfinite(log_gamma_mass(21.0, 4.4e7, jnp.inf)))  # Q(21, 4.4e7) = exp(-4.4e7)
    True
    """
    dtype = _dtype(a, low, high)
    a, low, high = (jnp.asarray(v, dtype) for v in (a, low, high))
    a, low, high = jnp.broadcast_arrays(a, jnp.maximum(low, 0.0), high)
    log_p, log_q = _log_pq(jnp.stack([a, a]), jnp.stack([low, high]))
    return _log_mass(a, low, high, (log_p[0], log_q[0]), (log_p[1], log_q[1]))


def _log_mass(a, low, high, ends_low, ends_high):
    by_q = _log_diff(ends_low[1], ends_high[1])
    by_p = _log_diff(ends_high[0], ends_low[0])
    return jnp.where(high <= low, -jnp.inf, jnp.where(low >= a, by_q, by_p))


def truncated_gamma_icdf(
    u: ArrayLike, concentration: ArrayLike, rate: ArrayLike, low: ArrayLike, high: ArrayLike
) -> Array:
    """Quantile ``u`` of ``Gamma(concentration, rate)`` restricted to ``[low, high]``.

    Solves ``log F(x) = log((1 - u) F(low) + u F(high))`` with ``F = P`` below the median and
    ``F = Q`` above it, by Newton steps in ``log x``. Both ``log P(e^s)`` and ``log Q(e^s)`` are
    concave in ``s`` (the log of a gamma variate has a log-concave density), so the steps
    converge monotonically from a bracketing start without any safeguard; at most
    ``50`` steps, typically 4 to 8. ``high`` may be ``inf``, ``low`` may be 0.

    >>> import jax.numpy as jnp
    >>> x = truncated_gamma_icdf(jnp.array([0.1, 0.9]), 3.0, 2.0, 40.0, jnp.inf)
    >>> bool(jnp.all(x > 40.0))
    True
    """
    dtype = _dtype(u, concentration, rate, low, high)
    u, a, rate, low, high = jnp.broadcast_arrays(
        *(jnp.asarray(v, dtype) for v in (u, concentration, rate, low, high))
    )
    lo, hi = jnp.maximum(low, 0.0) * rate, high * rate
    # one stacked evaluation: each incomplete gamma call site costs seconds of compilation
    log_p, log_q = _log_pq(jnp.stack([a, a]), jnp.stack([lo, hi]))
    return _standard_icdf(u, a, lo, hi, (log_p[0], log_q[0]), (log_p[1], log_q[1])) / rate


def _standard_icdf(u, a, lo, hi, ends_lo, ends_hi):
    """Quantile ``u`` of ``Gamma(a, 1)`` on ``[lo, hi]`` given ``(log P, log Q)`` at both ends."""
    dtype = u.dtype
    (log_plo, log_qlo), (log_phi, log_qhi) = ends_lo, ends_hi
    use_q = lo >= a
    log_u, log_1mu = jnp.log(u), jnp.log1p(-u)
    target = jnp.where(
        use_q,
        jnp.logaddexp(log_qlo + log_1mu, log_qhi + log_u),
        jnp.logaddexp(log_plo + log_1mu, log_phi + log_u),
    )
    s_hi = jnp.log(hi)
    # P(x) <= x^a / Gamma(a + 1): a start left of the root when low = 0
    s_lo = jnp.where(lo > 0, jnp.log(jnp.where(lo > 0, lo, 1.0)), (target + gammaln(a + 1)) / a)
    s0 = jnp.minimum(s_lo, s_hi)
    lga = gammaln(a)
    # Newton converges quadratically: a step below tol leaves an error far below float precision,
    # and a tighter stop lets lanes that dither in the last bits run the loop for all lanes
    tol = max(1e-10, 64 * float(jnp.finfo(dtype).eps))

    def step(s):
        x = jnp.exp(s)
        log_p, log_q = _log_pq(a, x)
        log_f = jnp.where(use_q, log_q, log_p)
        # d log F / ds = +- x pdf(x) / F(x)
        slope = jnp.exp(a * s - x - lga - log_f)
        g = log_f - target
        new = jnp.where(use_q, s + g / slope, s - g / slope)
        new = jnp.where(jnp.isfinite(new), new, s)
        return jnp.clip(new, s_lo, s_hi)

    def cond(carry):
        i, s, prev = carry
        moving = jnp.abs(s - prev) > tol * jnp.maximum(1.0, jnp.abs(s))
        return (i < _NEWTON_STEPS) & jnp.any(moving)

    def body(carry):
        i, s, _ = carry
        return i + 1, step(s), s

    _, s, _ = lax.while_loop(cond, body, (0, step(s0), s0))
    return jnp.clip(jnp.exp(s), lo, hi)


def truncated_gamma(
    rng_key: Array,
    concentration: ArrayLike,
    rate: ArrayLike,
    low: ArrayLike = 0.0,
    high: ArrayLike = float("inf"),
    shape: tuple[int, ...] = (),
) -> Array:
    """Draws of ``Gamma(concentration, rate)`` restricted to ``[low, high]`` (exact inversion).

    >>> from jax import random
    >>> x = truncated_gamma(random.key(0), 20.0, 1.0, 0.0, 1.0, (100,))  # mass 2e-19
    >>> bool((x > 0).all() and (x <= 1).all())
    True
    """
    dtype = _dtype(concentration, rate, low, high)
    shape = jnp.broadcast_shapes(shape, *(jnp.shape(v) for v in (concentration, rate, low, high)))
    u = _open_uniform(rng_key, shape, dtype)
    return truncated_gamma_icdf(u, concentration, rate, low, high)


def _open_uniform(rng_key: Array, shape, dtype) -> Array:
    return random.uniform(rng_key, shape, dtype, minval=jnp.finfo(dtype).tiny)


def tgm_log_weights(
    alpha: ArrayLike, beta: ArrayLike, lam: ArrayLike, tau: ArrayLike, upper: ArrayLike = jnp.inf
) -> tuple[Array, Array]:
    """Unnormalized log mixture weights ``(log w1, log w2)`` of ``TGM(alpha, beta, lam, tau, upper)``.

    ``w1 + w2`` is the normalizer of ``x^(alpha-1) exp(-beta x - lam |x - tau|)`` on
    ``(0, upper)``; a component whose interval is empty has weight ``exp(-inf) = 0``.

    >>> import jax.numpy as jnp
    >>> lw1, lw2 = tgm_log_weights(21.0, 2e8, 10.75, 0.22)  # Q(21, 4.4e7) underflows
    >>> bool(jnp.isfinite(lw1) and jnp.isfinite(lw2) and lw1 > lw2)
    True
    """
    return _tgm_parts(alpha, beta, lam, tau, upper)[0]


def _tgm_parts(alpha, beta, lam, tau, upper):
    """Log weights and, per component, ``(rate, low, high, ends at low, ends at high)``."""
    dtype = _dtype(alpha, beta, lam, tau, upper)
    alpha, beta, lam, tau, upper = jnp.broadcast_arrays(
        *(jnp.asarray(v, dtype) for v in (alpha, beta, lam, tau, upper))
    )
    cut = jnp.clip(tau, 0.0, upper)
    r1, r2 = beta - lam, beta + lam
    zero = jnp.zeros_like(cut)
    ends_zero = (jnp.full_like(cut, -jnp.inf), zero)
    log_p, log_q = _log_pq(jnp.stack([alpha] * 3), jnp.stack([r1 * cut, r2 * cut, r2 * upper]))
    ends_1, ends_2lo, ends_2hi = ((log_p[i], log_q[i]) for i in range(3))
    lga = gammaln(alpha)
    log_w1 = -lam * tau + lga - alpha * jnp.log(r1) + _log_mass(alpha, zero, r1 * cut, ends_zero, ends_1)
    log_w2 = lam * tau + lga - alpha * jnp.log(r2) + _log_mass(
        alpha, r2 * cut, r2 * upper, ends_2lo, ends_2hi
    )
    first = (r1, zero, cut, ends_zero, ends_1)
    second = (r2, cut, upper, ends_2lo, ends_2hi)
    return (log_w1, log_w2), first, second


def _is_concrete(*args) -> bool:
    return not any(isinstance(v, jax.core.Tracer) for v in args)


class TruncatedGammaMixture(Distribution):
    r"""Truncated gamma mixture ``TGM(alpha, beta, lam, tau, upper)`` (Kazan & Reiter, Def. 1).

    .. math::
        p(x) \propto x^{\alpha - 1} e^{-\beta x - \lambda |x - \tau|}, \quad 0 < x < u,

    with ``beta > lam > 0`` (so that the density is a mixture of two truncated gammas). Sampling
    picks the component by its log weight (:func:`tgm_log_weights`) and inverts its truncated
    gamma CDF in log space (:func:`truncated_gamma_icdf`); no evaluation underflows, whatever
    ``beta``.

    :param alpha: shape ``> 0`` (``(n - 1) / 2`` for a sample variance).
    :param beta: rate ``> lam`` (``(n - 1) / (2 sigma^2)``).
    :param lam: Laplace rate ``> 0`` (``epsilon_2 n`` on the [0, 1] scale).
    :param tau: the released value (any real).
    :param upper: upper truncation ``> 0``, possibly ``inf``.

    >>> from jax import random
    >>> d = TruncatedGammaMixture(21.0, 700.0, 10.75, 0.22, upper=0.25)
    >>> x = d.sample(random.key(0), (1000,))
    >>> bool((x > 0).all() and (x <= 0.25).all())
    True
    """

    arg_constraints = {
        "alpha": constraints.positive,
        "beta": constraints.positive,
        "lam": constraints.positive,
        "tau": constraints.real,
        "upper": constraints.positive,
    }
    reparametrized_params = []
    pytree_data_fields = ("alpha", "beta", "lam", "tau", "upper")

    def __init__(
        self,
        alpha: ArrayLike,
        beta: ArrayLike,
        lam: ArrayLike,
        tau: ArrayLike,
        upper: ArrayLike = float("inf"),
        *,
        validate_args: Optional[bool] = None,
    ) -> None:
        if _is_concrete(beta, lam) and np.any(np.asarray(beta) <= np.asarray(lam)):
            raise ValueError(
                "TGM needs beta > lam (Kazan & Reiter, Definition 1): beta = (n-1)/(2 sigma^2) "
                f"must exceed the Laplace rate; got beta={beta}, lam={lam}."
            )
        if _is_concrete(upper) and np.any(np.asarray(upper) <= 0):
            raise ValueError(f"TGM needs upper > 0, got {upper}.")
        self.alpha, self.beta, self.lam, self.tau, self.upper = promote_shapes(
            alpha, beta, lam, tau, upper
        )
        batch_shape = lax.broadcast_shapes(
            *(jnp.shape(v) for v in (alpha, beta, lam, tau, upper))
        )
        super().__init__(batch_shape=batch_shape, validate_args=validate_args)

    @constraints.dependent_property(is_discrete=False, event_dim=0)
    def support(self):
        return constraints.interval(0.0, self.upper)

    @property
    def log_weights(self) -> tuple[Array, Array]:
        """Normalized log mixture weights ``(log pi1, log pi2)``."""
        lw1, lw2 = tgm_log_weights(self.alpha, self.beta, self.lam, self.tau, self.upper)
        log_z = jnp.logaddexp(lw1, lw2)
        return lw1 - log_z, lw2 - log_z

    def icdf_pair(self, u: Array) -> Array:
        """Draw from two uniforms ``u[0]`` (component) and ``u[1]`` (quantile in it)."""
        (lw1, lw2), first, second = _tgm_parts(self.alpha, self.beta, self.lam, self.tau, self.upper)
        choose = jnp.log(u[0]) < lw1 - jnp.logaddexp(lw1, lw2)
        rate, lo, hi, ends_lo, ends_hi = jax.tree.map(
            lambda x1, x2: jnp.where(choose, x1, x2), first, second
        )
        alpha = jnp.broadcast_to(self.alpha, rate.shape).astype(rate.dtype)
        x = _standard_icdf(u[1], alpha, rate * lo, rate * hi, ends_lo, ends_hi)
        return x / rate

    def sample(self, key: Array, sample_shape: tuple[int, ...] = ()) -> Array:
        assert is_prng_key(key)
        dtype = _dtype(self.alpha, self.beta, self.lam, self.tau, self.upper)
        u = _open_uniform(key, (2, *sample_shape, *self.batch_shape), dtype)
        return self.icdf_pair(u)

    @validate_sample
    def log_prob(self, value: ArrayLike) -> Array:
        lw1, lw2 = tgm_log_weights(self.alpha, self.beta, self.lam, self.tau, self.upper)
        safe = jnp.where(value > 0, value, 1.0)
        log_kernel = (
            (self.alpha - 1) * jnp.log(safe) - self.beta * value - self.lam * jnp.abs(value - self.tau)
        )
        return jnp.where(value > 0, log_kernel - jnp.logaddexp(lw1, lw2), -jnp.inf)

    def cdf(self, value: ArrayLike) -> Array:
        shape = jnp.broadcast_shapes(jnp.shape(value), self.batch_shape)
        params = (self.alpha, self.beta, self.lam, self.tau, self.upper)
        (lw1, lw2), first, second = _tgm_parts(*(jnp.broadcast_to(v, shape) for v in params))
        r1, _, cut, ends_zero, ends_1 = first
        r2, _, upper, ends_2lo, _ = second
        alpha, lam, tau = (jnp.broadcast_to(v, shape) for v in (self.alpha, self.lam, self.tau))
        x = jnp.clip(value, 0.0, upper)
        x1, x2 = r1 * jnp.minimum(x, cut), r2 * jnp.maximum(x, cut)
        log_p, log_q = _log_pq(jnp.stack([alpha, alpha]), jnp.stack([x1, x2]))
        lga = gammaln(alpha)
        part1 = -lam * tau + lga - alpha * jnp.log(r1) + _log_mass(
            alpha, jnp.zeros_like(x1), x1, ends_zero, (log_p[0], log_q[0])
        )
        part2 = lam * tau + lga - alpha * jnp.log(r2) + _log_mass(
            alpha, r2 * cut, x2, ends_2lo, (log_p[1], log_q[1])
        )
        return jnp.exp(jnp.logaddexp(part1, part2) - jnp.logaddexp(lw1, lw2))

    @property
    def mean(self) -> Array:
        # E[x] = normalizer at alpha + 1 over normalizer at alpha
        num = jnp.logaddexp(*tgm_log_weights(self.alpha + 1, self.beta, self.lam, self.tau, self.upper))
        den = jnp.logaddexp(*tgm_log_weights(self.alpha, self.beta, self.lam, self.tau, self.upper))
        return jnp.exp(num - den)


TGM = TruncatedGammaMixture
"""Short name of :class:`TruncatedGammaMixture`."""
