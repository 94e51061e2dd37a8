"""Uniform-driven samplers shared by the data-augmentation Gibbs kernels.

On CPU a threefry pass costs about as much per chain as the rest of a sweep, so a sweep draws all
its first-attempt variates at once (:class:`SweepDraws`) as pairs ``w`` of uniforms on ``(-1, 1)``
(:func:`uniform_pairs`), and the samplers here come in two forms: a keyed one
(:func:`truncated_normal`, :func:`log_gamma_variate`, :func:`laplace_mixing_variance`,
:func:`sample_posterior`) and a ``*_from_uniforms`` one that maps given pairs ``w`` to a draw,
for kernels that hand out a sweep's uniforms themselves. Rejection steps run in a
``lax.while_loop`` after a first attempt made outside it, so under ``vmap`` the loop body runs only
in the sweeps where some chain needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
import math

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import erfinv, log_ndtr, ndtri

import numpyro.distributions as dist

from d3pext._backend import by_backend
from d3pext.dtypes import float_dtype

__all__ = [
    "SweepDraws",
    "laplace_mixing_variance",
    "log_gamma_from_uniforms",
    "log_gamma_variate",
    "log_uniform_from_uniforms",
    "mixing_variance_from_uniforms",
    "normal_from_uniforms",
    "posterior_from_draws",
    "sample_posterior",
    "truncated_normal",
    "truncated_normal_from_uniforms",
    "index_from_uniforms",
    "inverse_truncated_normal",
    "uniform_pairs",
]


def _lower_tail_quantile(log_p: jax.Array, a: jax.Array, b: jax.Array, u: jax.Array) -> jax.Array:
    """Standard normal restricted to ``[a, b]``, ``a < b``, from ``log_p = log Phi(x)``: the quantile
    ``ndtri(exp(log_p))``, exact to rounding while ``exp(log_p)`` is a normal float, down to ``b = -12.5``
    in single precision and ``-37`` in double.

    Beyond, the restricted normal is taken as the exponential with rate ``|b|`` below ``b``, which
    leaves out the factor ``exp(-t^2/2)`` of the density at a distance ``t`` below ``b``: about
    ``1/b^2`` for a typical draw (``t`` near ``1/|b|``; 0.6% at 12.5 sd), 2% three mean excesses out at
    15 sd. (The switch was at 10 sd in both precisions, which biased the draws' scale there by about
    2%; Newton steps on ``log Phi`` from the exponential's point made it exact at every depth, but
    slowed the Kazan & Reiter sweep by 30%.)
    """
    deep = b < (-37.0 if jnp.dtype(log_p.dtype) == jnp.float64 else -12.5)
    direct = ndtri(jnp.exp(jnp.where(deep, -1.0, log_p)))
    rate = jnp.where(deep, -b, 1.0)
    span = jnp.where(deep, b - a, 1.0)
    tail = b + jnp.log1p(-u * -jnp.expm1(-rate * span)) / rate
    return jnp.where(deep, tail, direct)


def inverse_truncated_normal(u, loc, scale, low, high):
    """``Normal(loc, scale)`` restricted to ``[low, high]`` by inversion of ``u`` in log space."""
    safe_scale = jnp.where(scale > 0, scale, 1.0)
    alpha, beta = (low - loc) / safe_scale, (high - loc) / safe_scale
    flip = alpha > -beta
    a, b = jnp.where(flip, -beta, alpha), jnp.where(flip, -alpha, beta)
    # log(Phi(a) + u (Phi(b) - Phi(a)))
    log_p = jnp.logaddexp(jnp.log1p(-u) + log_ndtr(a), jnp.log(u) + log_ndtr(b))
    x = jnp.clip(_lower_tail_quantile(log_p, a, b, u), a, b)
    x = jnp.where(flip, -x, x)
    return jnp.where(scale > 0, loc + safe_scale * x, jnp.clip(loc, low, high))


class SweepDraws:
    """The random numbers of one sweep, from one call of the bit generator.

    On CPU a threefry pass costs about as much per chain as the rest of a sweep, and compiling
    each call site costs time too, so a sweep draws all its first-attempt variates at once:
    ``pairs(shape)`` hands out the next ``(2, *shape)`` uniforms on ``(-1, 1)`` of one flat draw
    (``sqrt(2) erfinv(w)`` is a standard normal, ``(1 + w) / 2`` a uniform). ``retry_keys()``
    gives the keys of a retry loop, made inside the loop (so not at all when it does not run),
    and ``key()`` a key for samplers without a uniform-driven form.

    Built by :meth:`count` (abstract: how many pairs does a sweep take?), :meth:`bulk` (one draw
    of a known number of pairs) or :meth:`per_call` (one draw per request, for one-off use).
    """

    _STRIDE = 2**20  # the retry counters of the j-th loop are [j * stride, (j + 1) * stride)

    def __init__(self, dtype, source=None, retry_key=None, per_call_key=None) -> None:
        self.dtype = dtype
        self.num_pairs = 0
        self._source = source
        self._retry_key = retry_key
        self._per_call_key = per_call_key
        self._num_loops = 0

    @classmethod
    def count(cls, dtype) -> "SweepDraws":
        return cls(dtype)

    @classmethod
    def bulk(cls, key_draw: jax.Array, key_retry: jax.Array, num_pairs: int, dtype) -> "SweepDraws":
        return cls(dtype, uniform_pairs(key_draw, (num_pairs,), dtype), key_retry)

    @classmethod
    def per_call(cls, rng_key: jax.Array, dtype) -> "SweepDraws":
        key_retry, key_calls = random.split(rng_key)
        return cls(dtype, retry_key=key_retry, per_call_key=key_calls)

    def pairs(self, shape: tuple[int, ...]) -> jax.Array:
        size = math.prod(shape)
        start, self.num_pairs = self.num_pairs, self.num_pairs + size
        if self._per_call_key is not None:
            return uniform_pairs(random.fold_in(self._per_call_key, start), shape, self.dtype)
        if self._source is None:  # counting
            return jnp.zeros((2, *shape), self.dtype)
        return self._source[:, start : start + size].reshape(2, *shape)

    def retry_keys(self) -> Callable[[jax.Array], jax.Array]:
        """``i -> key`` for the ``i``-th retry (``1 <= i < 2**20``) of one retry loop."""
        self._num_loops += 1
        if self._num_loops >= 2**31 // self._STRIDE:
            raise ValueError("Too many retry loops in one sweep.")
        base, offset = self._retry_key, self._num_loops * self._STRIDE
        if base is None:  # counting
            return lambda i: random.key(0)
        return lambda i: random.fold_in(base, offset + i)

    def key(self) -> jax.Array:
        return self.retry_keys()(0)


def uniform_pairs(rng_key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """``(2, *shape)`` uniforms on ``(-1, 1)``, drawn flat (a multi-axis ``random.uniform`` is
    several times slower under ``vmap`` on CPU, JAX 0.10)."""
    low = jnp.nextafter(jnp.array(-1.0, dtype), jnp.array(0.0, dtype))
    size = 2 * math.prod(shape)
    return random.uniform(rng_key, (size,), dtype, minval=low).reshape(2, *shape)


def normal_from_uniforms(w: jax.Array) -> jax.Array:
    return math.sqrt(2.0) * erfinv(w)


def log_uniform_from_uniforms(w: jax.Array) -> jax.Array:
    return jnp.log1p(w) - math.log(2.0)


def index_from_uniforms(w: jax.Array, log_weights: jax.Array) -> jax.Array:
    """An index of the last axis of ``log_weights`` drawn with probability proportional to its weight, by
    inversion of the CDF (``w`` uniform on ``(-1, 1)``, shaped like ``log_weights`` less its last axis).

    >>> import jax.numpy as jnp
    >>> index_from_uniforms(jnp.array([-0.9, 0.9]), jnp.log(jnp.array([1.0, 1.0, 2.0])))
    Array([0, 2], dtype=int32)
    """
    cdf = jnp.cumsum(jnp.exp(log_weights - jnp.max(log_weights, -1, keepdims=True)), -1)
    u = 0.5 * (w + 1.0) * cdf[..., -1]
    index = jnp.sum(cdf < u[..., None], -1, dtype=jnp.int32)
    return jnp.minimum(index, log_weights.shape[-1] - 1)


def truncated_normal(
    rng_key: jax.Array, loc: jax.Array, scale: jax.Array, low: jax.Array, high: jax.Array
) -> jax.Array:
    """One draw of ``Normal(loc, scale)`` restricted to ``[low, high]``.

    A plain normal draw is kept when it falls inside ``[low, high]``; otherwise an independent
    draw by inversion in log space replaces it (a mixture of two exact draws of the same
    distribution, so exact). The inversion mirrors the interval to the lower tail, where the
    normal CDF is accurate, so bounds many standard deviations away from ``loc`` are fine. It
    runs in a ``lax.while_loop`` of at most one pass, which under ``vmap`` is skipped when every
    lane's plain draw is inside (a ``lax.cond`` would compute both branches); on a GPU it is
    computed for every lane instead, since a data-dependent loop waits for the host. ``scale = 0``
    returns ``loc`` clipped.

    >>> from jax import random
    >>> x = truncated_normal(random.key(0), 0.0, 1.0, 30.0, 31.0)
    >>> bool(30.0 <= x <= 31.0)
    True
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in (loc, scale, low, high)))
    return truncated_normal_from_uniforms(uniform_pairs(rng_key, shape, float_dtype()), loc, scale, low, high)


def truncated_normal_from_uniforms(w, loc, scale, low, high):
    # On a GPU a data-dependent loop waits for the host every sweep (about as long as the inversion
    # itself for thousands of lanes): there the inversion is computed for every lane and selected.
    return by_backend(
        partial(_truncated_normal_from_uniforms, loop=True), partial(_truncated_normal_from_uniforms, loop=False),
        w, loc, scale, low, high,
    )


def _truncated_normal_from_uniforms(w, loc, scale, low, high, *, loop: bool):
    loc, scale, low, high = jnp.broadcast_arrays(
        *(jnp.asarray(v, w.dtype) for v in (loc, scale, low, high))
    )
    x = loc + scale * normal_from_uniforms(w[0])
    inside = (x >= low) & (x <= high)

    def invert(carry):
        x, done = carry
        x_inv = inverse_truncated_normal((1 + w[1]) / 2, loc, scale, low, high)
        return jnp.where(done, x, x_inv), jnp.ones_like(done)

    if not loop:
        return invert((x, inside))[0]
    return lax.while_loop(lambda carry: ~jnp.all(carry[1]), invert, (x, inside))[0]


def log_gamma_variate(rng_key: jax.Array, concentration: jax.Array) -> jax.Array:
    """``log G`` for ``G ~ Gamma(concentration, 1)`` (Marsaglia & Tsang, boosted below 1).

    Exact in log space for small shapes. The first proposal is drawn for every component at
    once, outside any loop; a ``lax.while_loop`` redraws only the rejected components, and under
    ``vmap`` it runs only when some lane rejected (rarely: the rejection rate is 5% at shape 1 and
    below 0.3% from shape 10). The uniform of the boost below shape 1 is recycled from the
    accepted proposal (``U / acceptance ratio``, uniform and independent of the proposal), so a
    draw costs one normal and one uniform. A NaN concentration gives NaN (it never loops).

    >>> from jax import random
    >>> import jax.numpy as jnp
    >>> x = jnp.exp(log_gamma_variate(random.key(0), jnp.full(20000, 3.0)))
    >>> bool(abs(x.mean() - 3.0) < 0.05)
    True
    """
    a = jnp.asarray(concentration, float_dtype())
    draws = SweepDraws.per_call(rng_key, a.dtype)
    return log_gamma_from_uniforms(draws.pairs(a.shape), draws.retry_keys(), a)


def log_gamma_from_uniforms(w, retry_keys, a):
    boost = a < 1
    d = jnp.where(boost, a + 1, a) - 1.0 / 3.0
    c = 1.0 / jnp.sqrt(9.0 * d)

    def propose(w):
        x, log_u = normal_from_uniforms(w[0]), log_uniform_from_uniforms(w[1])
        v = (1 + c * x) ** 3
        log_ratio = 0.5 * x**2 + d - d * v + d * jnp.log(jnp.where(v > 0, v, 1.0))
        accept = (v > 0) & (log_u < log_ratio)
        return v, log_u - jnp.minimum(log_ratio, 0.0), accept

    v, log_w, done = propose(w)
    done = done | jnp.isnan(a)

    def retry(carry):
        i, v, log_w, done = carry
        v_new, log_w_new, accept = propose(uniform_pairs(retry_keys(i), a.shape, a.dtype))
        return (
            i + 1,
            jnp.where(done, v, v_new),
            jnp.where(done, log_w, log_w_new),
            done | accept,
        )

    _, v, log_w, _ = lax.while_loop(lambda carry: ~jnp.all(carry[3]), retry, (1, v, log_w, done))
    log_g = jnp.log(d * v)
    return jnp.where(boost, log_g + log_w / jnp.where(boost, a, 1.0), log_g)


def laplace_mixing_variance(rng_key: jax.Array, gap: jax.Array, scale: float) -> jax.Array:
    """Full conditional of the variance ``sigma^2`` in ``Laplace(0, b) = N(0, sigma^2)``,
    ``sigma^2 ~ Exponential(1 / (2 b^2))``, given a residual ``gap = |y - s|``.

    The precision ``1 / sigma^2`` is ``InverseGaussian(1 / (b gap), 1 / b^2)`` (Park & Casella;
    Bernstein & Sheldon Appendix B). Drawn by Michael, Schucany & Haas written in
    ``r = b gap = 1 / mean``: the candidate variance is ``r + a + sqrt(a^2 + 2 r a)`` with
    ``a = b^2 z^2 / 2``; it is kept with probability ``1 / (1 + r / candidate)`` and otherwise
    replaced by ``r^2 / candidate``. No division by zero: ``gap = 0`` is the Levy limit.
    One normal and one uniform per component.

    >>> from jax import random
    >>> import jax.numpy as jnp
    >>> v = laplace_mixing_variance(random.key(0), jnp.zeros(3), 2.0)
    >>> v.shape, bool((v >= 0).all())
    ((3,), True)
    """
    gap = jnp.asarray(gap, float_dtype())
    return mixing_variance_from_uniforms(uniform_pairs(rng_key, gap.shape, gap.dtype), gap, scale)


def mixing_variance_from_uniforms(w, gap, scale):
    z, log_u = normal_from_uniforms(w[0]), log_uniform_from_uniforms(w[1])
    r = scale * gap
    a = jnp.maximum(0.5 * (scale * z) ** 2, jnp.finfo(w.dtype).tiny)
    candidate = r + a + jnp.sqrt(a * a + 2 * r * a)
    keep = log_u <= -jnp.log1p(r / candidate)
    return jnp.where(keep, candidate, r * (r / candidate))


def sample_posterior(rng_key: jax.Array, posterior) -> jax.Array:
    """One draw of a conjugate posterior; Gamma, Beta and Dirichlet use :func:`log_gamma_variate`.

    >>> from jax import random
    >>> import numpyro.distributions as dist
    >>> bool(0.0 < sample_posterior(random.key(0), dist.Beta(3.0, 4.0)) < 1.0)
    True
    """
    return posterior_from_draws(SweepDraws.per_call(rng_key, float_dtype()), posterior)


def posterior_from_draws(draws: SweepDraws, posterior) -> jax.Array:
    if isinstance(posterior, dist.Gamma):
        a = jnp.asarray(posterior.concentration, draws.dtype)
        log_g = log_gamma_from_uniforms(draws.pairs(a.shape), draws.retry_keys(), a)
        return jnp.exp(log_g) / posterior.rate
    if isinstance(posterior, dist.Beta):
        c1, c0 = jnp.broadcast_arrays(posterior.concentration1, posterior.concentration0)
        a = jnp.stack([c1, c0]).astype(draws.dtype)
        log_g = log_gamma_from_uniforms(draws.pairs(a.shape), draws.retry_keys(), a)
        return jax.nn.sigmoid(log_g[0] - log_g[1])
    if isinstance(posterior, dist.Dirichlet):
        a = jnp.asarray(posterior.concentration, draws.dtype)
        return jax.nn.softmax(log_gamma_from_uniforms(draws.pairs(a.shape), draws.retry_keys(), a), -1)
    return posterior.sample(draws.key())
