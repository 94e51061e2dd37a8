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
evaluation underflows). Draws are exact rejection samplers that evaluate no incomplete gamma
function (:func:`truncated_gamma_from_uniforms`, :func:`tgm_from_uniforms`: a log-concave
three-tangent envelope for shape ``>= 1``, which covers the whole TGM without choosing a
component, and a power/exponential envelope below shape 1; derivations above
``_log_concave_envelope`` in the source); inversion of the log CDF (:func:`truncated_gamma_icdf`,
Newton steps on a concave function) remains for quantiles and as the exact fallback of a lane
that rejects 63 times in a row. Use float64 (``jax.enable_x64``) for exact work; float32 runs.

NumPyro's ``TruncatedGamma`` (``LeftTruncatedGamma``, ...) takes its normalizer outside log space
and returns ``nan`` where it underflows, which happens in the TGM's components; the tests use it
as a reference where it is accurate.
"""

from __future__ import annotations

from functools import partial
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

from d3pext._backend import by_backend

__all__ = [
    "TGM",
    "TruncatedGammaMixture",
    "log_gamma_mass",
    "log_gammainc",
    "log_gammaincc",
    "tgm_from_uniforms",
    "tgm_log_weights",
    "truncated_gamma",
    "truncated_gamma_from_uniforms",
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
    # the fallbacks run in a loop of at most one pass, skipped (also under vmap) unless needed;
    # the barrier keeps XLA from hoisting the (loop-invariant) series out of the loop
    def fallback(c):
        log_p, log_q, done, a_, x_ = lax.optimization_barrier((c[0], c[1], c[2], a, safe_x))
        return (
            jnp.where(small_p, _log_p_series(a_, jnp.where(small_p, x_, jnp.minimum(x_, a_))), log_p),
            jnp.where(small_q, _log_q_fraction(a_, jnp.where(small_q, x_, jnp.maximum(x_, a_ + 2))), log_q),
            jnp.ones_like(done),
        )

    log_p, log_q, _ = lax.while_loop(
        lambda c: ~c[2], fallback, (log_p, log_q, ~jnp.any(small_p | small_q))
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
    """Draws of ``Gamma(concentration, rate)`` restricted to ``[low, high]`` (exact, by rejection:
    :func:`truncated_gamma_from_uniforms`).

    >>> from jax import random
    >>> x = truncated_gamma(random.key(0), 20.0, 1.0, 0.0, 1.0, (100,))  # mass 2e-19
    >>> bool((x > 0).all() and (x <= 1).all())
    True
    """
    dtype = _dtype(concentration, rate, low, high)
    shape = jnp.broadcast_shapes(shape, *(jnp.shape(v) for v in (concentration, rate, low, high)))
    key_u, key_retry = random.split(rng_key)
    u = _open_uniform(key_u, (2, *shape), dtype)
    return truncated_gamma_from_uniforms(u, key_retry, concentration, rate, low, high)


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


# ---------------------------------------------------------------------------------------------
# Exact samplers by rejection (no incomplete gamma on the hot path)
#
# Kernel  k(x) = x^(a-1) exp(-beta x - lam |x - tau|)  on  [low, high]  (lam = 0: a truncated
# gamma; low = 0, high = upper: the TGM). With h = log k:
#
# * a >= 1: h is concave ((a-1) log x concave, -beta x linear, -lam |x - tau| concave), so every
#   tangent of h lies above h. The envelope is "adaptive rejection with three abscissae", built
#   once per draw: the mode m of h on [low, high] (closed form: (a-1)/(beta+lam) if that exceeds
#   tau, else (a-1)/(beta-lam) if that is below tau, else tau; clipped to [low, high]), and two
#   points x_l < m < x_r where h has dropped by about 1 (from the one-sided slopes g and curvature
#   c = (a-1)/m^2 at m: g d + c d^2 / 2 = 1). The envelope is
#       env(x) = min(h(m), h(x_l) + h'(x_l)(x - x_l), h(x_r) + h'(x_r)(x - x_r)) >= h(x),
#   i.e. flat at h(m) on [z_l, z_r] (z where a tangent meets the top) with exponential tails
#   truncated at low and high. Its pieces have closed-form masses and inverse CDFs: one uniform
#   picks the point by inverting the envelope's CDF, and x is kept with probability
#       exp(h(x) - env(x)) <= 1,
#   so a kept x has density exactly proportional to k (the standard rejection argument: the
#   proposal density is env / int env, the acceptance env -> k). The positions of x_l, x_r only
#   affect the efficiency, never the law. For a near-normal h the acceptance rate is about 0.88
#   (tangents at +- sqrt(2) sd); for a Laplace-like kink or a boundary mode with linear h it tends
#   to 1; for any log-concave h with x_l, x_r where h has dropped by exactly 1 it is at least
#   (1 - 1/e) / (1 + 1/e) = 0.46 (Devroye 1986, VII.2).
# * a < 1, lam = 0 (truncated gamma, log-convex): standardised y = rate x on [L, U], B = L + 1.
#   On [L, min(B, U)] the proposal y^(a-1) (power law, inverse CDF (L^a + f (B^a - L^a))^(1/a)),
#   kept with probability exp(-(y - L)) >= 1/e; on [B, U] the proposal B^(a-1) exp(-y)
#   (translated exponential), kept with probability (y / B)^(a-1) (y >= B, a < 1, so <= 1;
#   B >= 1 gives an average >= E[(1 + E)^(-1)] = 0.6). Both pieces bound y^(a-1) e^(-y) times
#   e^L, so the mixture of the two pieces by their masses is an exact envelope.
# * a < 1, lam > 0 (TGM with alpha < 1; never in Kazan & Reiter, where alpha = (n - 1)/2 >= 1):
#   the component is chosen by its log weight (tgm_log_weights) and drawn as above.
#
# Rejection loop: the first proposal uses the given uniforms; lanes that reject draw new ones in a
# lax.while_loop (under vmap only while some lane still rejects), for at most _MAX_ROUNDS rounds;
# a lane still rejecting then (probability < 0.55^63 for valid parameters; NaN parameters) gets
# the exact inversion draw (truncated_gamma_icdf / TGM.icdf_pair), which is therefore exact too.
# With fallback=False (the Kazan & Reiter sweep) the inversion is not compiled at all (it is
# about three quarters of the sampler's compile time: each incomplete gamma evaluation compiles
# to a large program): lanes with NaN parameters stop at once (NaN), the others keep rejecting
# for up to _LONG_ROUNDS rounds and only then give NaN, which happens with probability
# < 0.64^1023 < 1e-198 for valid parameters (acceptance >= 0.46 above, >= 1/e below shape 1):
# the draws are those of the exact rejection sampler.

_MAX_ROUNDS = 64
_LONG_ROUNDS = 1024
# proposals per lane and round on accelerators: a lane then rejects a round with probability
# < 0.54^16 < 1e-4, so among thousands of lanes the loop after the first round seldom runs
_GPU_CANDIDATES = 16


def _log_concave_envelope(a, beta, lam, tau, low, high):
    """Envelope of ``x^(a-1) exp(-beta x - lam |x - tau|)`` on ``[low, high]``, ``a >= 1``."""
    am1 = a - 1
    b1, b2 = beta - lam, beta + lam
    m2 = am1 / b2
    m1 = jnp.where(b1 > 0, am1 / jnp.where(b1 > 0, b1, 1.0), jnp.inf)
    m = jnp.where(m2 > tau, m2, jnp.where(m1 < tau, m1, tau))
    m = jnp.clip(m, low, high)
    safe_m = jnp.where(m > 0, m, 1.0)
    lin_m = am1 / safe_m - beta  # slope of the smooth part at m

    def rel(x):  # h(x) - h(m)
        log_ratio = jnp.log(jnp.where(x > 0, x, 0.0) / safe_m)
        smooth = jnp.where(am1 == 0, 0.0, am1 * log_ratio)
        return smooth - beta * (x - m) - lam * (jnp.abs(x - tau) - jnp.abs(m - tau))

    def slope(x):  # a supergradient of h at x > 0
        return am1 / jnp.where(x > 0, x, 1.0) - beta - lam * jnp.sign(x - tau)

    c = jnp.where(m > 0, am1 / safe_m**2, 0.0)
    g_r = jnp.maximum(-(lin_m - lam * jnp.where(m >= tau, 1.0, -1.0)), 0.0)
    g_l = jnp.maximum(lin_m - lam * jnp.where(m > tau, 1.0, -1.0), 0.0)
    d_r = 2 / (g_r + jnp.sqrt(g_r**2 + 2 * c))
    d_l = 2 / (g_l + jnp.sqrt(g_l**2 + 2 * c))

    # tangent points: where h dropped by about 1, or half way to an end closer than that
    have_r = m < high
    x_r = jnp.where(m + d_r < high, m + d_r, m + (high - m) / 2)
    x_r = jnp.where(have_r & jnp.isfinite(x_r), x_r, m + 1.0)
    k_r = jnp.where(have_r, -slope(x_r), 1.0)
    z_r = jnp.where(have_r, x_r + rel(x_r) / k_r, high)
    mass_r = jnp.where(have_r, -jnp.expm1(-k_r * (high - z_r)) / k_r, 0.0)

    have_l = m > low
    x_l = jnp.where(m - d_l > low, m - d_l, m - (m - low) / 2)
    x_l = jnp.where(have_l & jnp.isfinite(x_l), x_l, m + 1.0)
    k_l = jnp.where(have_l, slope(x_l), 1.0)
    z_l = jnp.where(have_l, x_l - rel(x_l) / k_l, low)
    mass_l = jnp.where(have_l, -jnp.expm1(-k_l * (z_l - low)) / k_l, 0.0)
    mass_f = z_r - z_l
    return rel, (low, high, z_l, z_r, k_l, k_r, mass_l, mass_f, mass_r)


def _log_concave_propose(rel, env, u):
    low, high, z_l, z_r, k_l, k_r, mass_l, mass_f, mass_r = env
    v = u[0] * (mass_l + mass_f + mass_r)
    in_l = v < mass_l
    in_r = v >= mass_l + mass_f
    v_l = jnp.where(in_l, v, 0.0)
    v_r = jnp.where(in_r, jnp.clip(v - mass_l - mass_f, 0.0, mass_r), 0.0)
    t_l = -jnp.log1p(-k_l * v_l) / k_l
    t_r = -jnp.log1p(-k_r * v_r) / k_r
    x = jnp.where(in_l, z_l - t_l, jnp.where(in_r, z_r + t_r, z_l + (v - mass_l)))
    log_env = jnp.where(in_l, -k_l * t_l, jnp.where(in_r, -k_r * t_r, 0.0))
    x = jnp.clip(x, low, high)
    return x, jnp.log(u[1]) <= rel(x) - log_env


def _small_shape_envelope(a, lo, hi):
    """Envelope of ``y^(a-1) e^(-y)`` on ``[lo, hi]``, ``a < 1`` (standardised, rate 1)."""
    b = jnp.minimum(lo + 1, hi)
    safe_lo = jnp.where(lo > 0, lo, 1.0)
    # B^a - L^a without cancellation: L^a expm1(a log1p((B - L) / L)), or B^a at L = 0
    em = jnp.expm1(a * jnp.log1p((b - lo) / safe_lo))
    mass_p = jnp.where(lo > 0, safe_lo**a * em, b**a) / a
    has_e = b < hi
    e_scale = b ** (a - 1) * jnp.exp(-(b - lo))
    mass_e = jnp.where(has_e, e_scale * -jnp.expm1(-(hi - b)), 0.0)
    return (a, lo, hi, b, safe_lo, em, mass_p, mass_e, e_scale)


def _small_shape_propose(env, u):
    a, lo, hi, b, safe_lo, em, mass_p, mass_e, e_scale = env
    v = u[0] * (mass_p + mass_e)
    in_p = v < mass_p
    f = jnp.where(in_p, v / mass_p, 0.5)
    y_p = jnp.where(lo > 0, safe_lo * jnp.exp(jnp.log1p(f * em) / a), b * f ** (1 / a))
    v_e = jnp.where(in_p, 0.0, (v - mass_p) / e_scale)
    y_e = b - jnp.log1p(-jnp.clip(v_e, 0.0, 1.0))
    y = jnp.clip(jnp.where(in_p, y_p, y_e), lo, hi)
    log_acc = jnp.where(in_p, -(y - lo), (a - 1) * jnp.log(y / b))
    return y, jnp.log(u[1]) <= log_acc


def _retry_keys(retry_key):
    """``i -> key``: a key, folded with ``i``, or already such a function."""
    if callable(retry_key):
        return retry_key
    return lambda i: random.fold_in(retry_key, i)


def _by_rejection(propose, u, retry_key, fallback, params):
    """Run ``propose(u) -> (x, accepted)`` until every component accepted (see above); a
    component still rejecting after ``_MAX_ROUNDS`` gets ``fallback(u, *params)``, or, with
    ``fallback=None``, after ``_LONG_ROUNDS`` gets NaN (NaN parameters: NaN at once)."""
    shape, dtype = u.shape[1:], u.dtype
    retry_key = _retry_keys(retry_key)
    x, ok = propose(u)
    rounds = _MAX_ROUNDS if fallback is not None else _LONG_ROUNDS
    if fallback is None:
        invalid = jnp.zeros(shape, bool)
        for p in params:
            invalid = invalid | jnp.isnan(p)
        ok = ok | invalid
        x = jnp.where(invalid, jnp.nan, x)

    def retry(carry, candidates):
        i, x, ok = carry
        if candidates == 1:
            x_new, accepted = propose(_open_uniform(retry_key(i), (2, *shape), dtype))
        else:  # the first accepted of ``candidates`` independent proposals: exact as well
            xs, accepted = propose(_open_uniform(retry_key(i), (2, candidates, *shape), dtype))
            first = jnp.argmax(accepted, axis=0)
            x_new, accepted = jnp.take_along_axis(xs, first[None], axis=0)[0], jnp.any(accepted, axis=0)
        return i + 1, jnp.where(ok, x, x_new), ok | accepted

    def rounds_until_accepted(x, ok, candidates):
        carry = (jnp.int32(1), x, ok)
        if candidates > 1:  # one round for every lane, outside the loop
            carry = retry(carry, candidates)
        cond = lambda c: (c[0] < rounds) & ~jnp.all(c[2])
        return lax.while_loop(cond, partial(retry, candidates=candidates), carry)[1:]

    # Each round of a data-dependent loop waits for the host on a GPU, and with thousands of lanes
    # some lane almost always rejects the first proposal (acceptance >= 0.46): there, every lane
    # gets _GPU_CANDIDATES more proposals at once before the loop, which then rarely runs.
    x, ok = by_backend(
        partial(rounds_until_accepted, candidates=1), partial(rounds_until_accepted, candidates=_GPU_CANDIDATES), x, ok
    )
    if fallback is None:
        return jnp.where(ok, x, jnp.nan)

    def invert(carry):
        x, done = carry
        # the barrier ties the fallback to the loop state: without it XLA hoists the whole
        # (loop-invariant) inversion out of the loop and computes it for every draw
        x, u_inv, args = lax.optimization_barrier(
            (x, _open_uniform(retry_key(_MAX_ROUNDS), (2, *shape), dtype), params)
        )
        return jnp.where(ok, x, fallback(u_inv, *args)), jnp.ones_like(done)

    return lax.while_loop(lambda c: ~c[1], invert, (x, jnp.all(ok)))[0]


def _shape_regimes(concentration) -> tuple[bool, bool]:
    """Whether shapes ``< 1`` and ``>= 1`` can occur (both when traced): only those get compiled."""
    if _is_concrete(concentration):
        a = np.asarray(concentration)
        return bool(np.any(a < 1)), bool(np.any(a >= 1))
    return True, True


def truncated_gamma_from_uniforms(
    u: Array,
    retry_key: Array,
    concentration: ArrayLike,
    rate: ArrayLike,
    low: ArrayLike = 0.0,
    high: ArrayLike = float("inf"),
    fallback: bool = True,
) -> Array:
    """Exact draws of ``Gamma(concentration, rate)`` restricted to ``[low, high]`` by rejection.

    ``u``: ``(2, *shape)`` uniforms on ``(0, 1)`` for the first proposal; ``retry_key`` (a key,
    or a function ``i -> key`` for ``1 <= i <= 65``, ``1 <= i <= 1025`` with ``fallback=False``,
    e.g. ``SweepDraws.retry_keys()``) gives the uniforms of later proposals (drawn only while
    some component rejects). Log-concave envelope for ``concentration >= 1``, power/exponential
    envelope below (see the notes above ``_log_concave_envelope`` in the source); no incomplete
    gamma function is evaluated except in the exact inversion fallback after ``_MAX_ROUNDS``
    rejections in a row. ``fallback=False`` compiles no inversion (about three quarters of the
    compile time): a component keeps rejecting for up to 1023 rounds (probability ``< 1e-198``
    for valid parameters) and then, as for NaN parameters, is NaN.

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> u = random.uniform(random.key(0), (2, 1000), minval=1e-12)
    >>> x = truncated_gamma_from_uniforms(u, random.key(1), 21.0, 1.0, 200.0)
    >>> bool((x >= 200.0).all() and (x < 230.0).all())
    True
    """
    dtype = _dtype(u, concentration, rate, low, high)
    shape = u.shape[1:]
    a, rate, low, high = (
        jnp.broadcast_to(jnp.asarray(v, dtype), shape) for v in (concentration, rate, low, high)
    )
    low = jnp.maximum(low, 0.0)
    lo, hi = low * rate, high * rate
    u = jnp.asarray(u, dtype)
    need_small, need_big = _shape_regimes(concentration)
    big = a >= 1
    proposals = []
    if need_small:
        small_env = _small_shape_envelope(jnp.where(big, 0.5, a), lo, hi)
        proposals.append(lambda u: _small_shape_propose(small_env, u))
    if need_big:
        zero = jnp.zeros_like(a)
        rel, env = _log_concave_envelope(jnp.where(big, a, 1.0), zero + 1, zero, zero, lo, hi)
        proposals.append(lambda u: _log_concave_propose(rel, env, u))

    def propose(u):
        if len(proposals) == 1:
            y, ok = proposals[0](u)
        else:
            (y_s, ok_s), (y_b, ok_b) = (p(u) for p in proposals)
            y, ok = jnp.where(big, y_b, y_s), jnp.where(big, ok_b, ok_s)
        return y / rate, ok

    def invert(u, a, rate, low, high):
        return truncated_gamma_icdf(u[0], a, rate, low, high)

    return _by_rejection(propose, u, retry_key, invert if fallback else None, (a, rate, low, high))


def tgm_from_uniforms(
    u: Array,
    retry_key: Array,
    alpha: ArrayLike,
    beta: ArrayLike,
    lam: ArrayLike,
    tau: ArrayLike,
    upper: ArrayLike = float("inf"),
    fallback: bool = True,
) -> Array:
    """Exact draws of ``TGM(alpha, beta, lam, tau, upper)`` by rejection (``u``, ``retry_key``,
    ``fallback`` as in :func:`truncated_gamma_from_uniforms`).

    ``alpha >= 1`` (always in Kazan & Reiter): the density is log-concave and is drawn directly,
    without choosing a component, so without any incomplete gamma function. ``alpha < 1``: the
    component is chosen once by its log weight, then drawn by :func:`truncated_gamma_from_uniforms`'s
    small-shape envelope.

    >>> from jax import random
    >>> u = random.uniform(random.key(0), (2, 1000), minval=1e-12)
    >>> x = tgm_from_uniforms(u, random.key(1), 21.0, 700.0, 10.75, 0.22, 0.25)
    >>> bool((x > 0).all() and (x <= 0.25).all())
    True
    """
    dtype = _dtype(u, alpha, beta, lam, tau, upper)
    shape = u.shape[1:]
    alpha, beta, lam, tau, upper = (
        jnp.broadcast_to(jnp.asarray(v, dtype), shape) for v in (alpha, beta, lam, tau, upper)
    )
    u = jnp.asarray(u, dtype)
    need_small, need_big = _shape_regimes(alpha)
    big = alpha >= 1
    proposals = []
    if need_small:
        # the component, once, outside the loop (a choice per proposal would favour the component
        # with the higher acceptance rate)
        (lw1, lw2), first, second = _tgm_parts(alpha, beta, lam, tau, upper)
        pick = (_MAX_ROUNDS if fallback else _LONG_ROUNDS) + 1  # a key no retry round uses
        u_pick = _open_uniform(_retry_keys(retry_key)(pick), shape, dtype)
        choose = jnp.log(u_pick) < lw1 - jnp.logaddexp(lw1, lw2)
        rate, lo, hi = (jnp.where(choose, c1, c2) for c1, c2 in zip(first[:3], second[:3]))
        small_env = _small_shape_envelope(jnp.where(big, 0.5, alpha), lo * rate, hi * rate)
        proposals.append(lambda u: (lambda y, ok: (y / rate, ok))(*_small_shape_propose(small_env, u)))
    if need_big:
        rel, env = _log_concave_envelope(
            jnp.where(big, alpha, 1.0), beta, lam, tau, jnp.zeros_like(upper), upper
        )
        proposals.append(lambda u: _log_concave_propose(rel, env, u))

    def propose(u):
        if len(proposals) == 1:
            return proposals[0](u)
        (x_s, ok_s), (x_b, ok_b) = (p(u) for p in proposals)
        return jnp.where(big, x_b, x_s), jnp.where(big, ok_b, ok_s)

    def invert(u, *params):
        return TruncatedGammaMixture(*params).icdf_pair(u)

    params = (alpha, beta, lam, tau, upper)
    return _by_rejection(propose, u, retry_key, invert if fallback else None, params)


class TruncatedGammaMixture(Distribution):
    r"""Truncated gamma mixture ``TGM(alpha, beta, lam, tau, upper)`` (Kazan & Reiter, Def. 1).

    .. math::
        p(x) \propto x^{\alpha - 1} e^{-\beta x - \lambda |x - \tau|}, \quad 0 < x < u,

    with ``beta > lam > 0`` (so that the density is a mixture of two truncated gammas). Sampling
    is exact rejection (:func:`tgm_from_uniforms`: for ``alpha >= 1`` the density is log-concave
    and drawn directly, without the weights); :meth:`icdf_pair` inverts the CDF in log space
    (component by its log weight, then :func:`truncated_gamma_icdf`); no evaluation underflows,
    whatever ``beta``.

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
        key_u, key_retry = random.split(key)
        u = _open_uniform(key_u, (2, *sample_shape, *self.batch_shape), dtype)
        return tgm_from_uniforms(u, key_retry, self.alpha, self.beta, self.lam, self.tau, self.upper)

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
