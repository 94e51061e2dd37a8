"""Bernstein & Sheldon Gibbs kernels for noisy sufficient statistics of exponential families.

:class:`ExpFamGibbs` is a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel` over an *augmented*
model (built by :func:`d3pext.handlers.private_posterior`) in which each privatized record site is
replaced by latent statistic sites, the Laplace noise of the release by a scale mixture of normals
(latent variances with exponential prior, Park & Casella), and the parameters of the records keep
their priors. One sweep, for each release:

1. the statistic given the parameters and the noise variances: the normal (CLT) approximation of
   ``p(s | theta)`` (moments by autodiff of the log-partition, :mod:`d3pext.expfam`) times the
   normal ``p(y | s, sigma^2)``, restricted to the statistics that are valid for the data model
   (``0 <= s <= n`` for a binomial, ...). The restriction is the paper's rejection step: in one
   dimension it is drawn exactly as a truncated normal, in several dimensions by rejection;
2. the record parameters by conjugacy given the full statistic (exact model);
3. the precisions ``1 / sigma_j^2 ~ InverseGaussian(1 / (b |y_j - s_j|), 1 / b^2)`` (Laplace
   scale ``b``, :func:`laplace_mixing_variance`).

Truncated statistics (Algorithm 2, univariate families, truncation to ``[a, b]``): the released
statistic ``s_c`` (records inside ``[a, b]``) and the full statistic ``s`` are drawn jointly from
their bivariate normal conditional. By default (``sections="joint"``) the normal is the CLT of the
per-record vector ``(t(x), 1_[a,b](x) t(x))``, which carries the multinomial covariance of the
counts in the three truncation sections; ``sections="independent"`` treats the sections as
independent as printed in the paper (its posterior sd is 3-16% too small on the truncated
exponential model). In both cases the release enters the draw of ``s_c`` (as printed, line 10 of
Algorithm 2 ignores it).

Gaussian release noise needs no augmentation (its variance is known).

Speed (CPU, many chains under ``vmap``): a sweep makes one call of the bit generator for all its
first-attempt variates (:class:`_Draws`; threefry passes were most of the cost of a sweep), and
each rejection or fallback step runs in a ``lax.while_loop`` after a first attempt made outside it,
so under ``vmap`` the loop body runs only in the sweeps where some chain needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import copy
from dataclasses import dataclass
import math
from typing import Literal, NamedTuple

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import erfinv, log_ndtr, ndtri

import numpyro.distributions as dist
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.gibbs import conditioned
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity

from d3pext.expfam import (
    ExpFamily,
    clt_moments,
    conjugate_posterior,
    family_of,
    random_sum_moments,
    record_distribution,
    truncated_moments,
)

__all__ = [
    "ExpFamGibbs",
    "ExpFamGibbsState",
    "StatisticBlock",
    "laplace_mixing_variance",
    "log_gamma_variate",
    "sample_posterior",
    "truncated_normal",
]


def _lower_tail_quantile(log_p: jax.Array, a: jax.Array, b: jax.Array, u: jax.Array) -> jax.Array:
    """Standard normal restricted to ``[a, b]``, ``a < b``, from ``log_p = log Phi(x)``.

    Where ``b < -10`` the normal CDF underflows in single precision; there the restricted normal
    is an exponential with rate ``|b|`` below ``b`` (relative error of the density ``< 1%``).
    """
    deep = b < -10.0
    direct = ndtri(jnp.exp(jnp.where(deep, -1.0, log_p)))
    rate = jnp.where(deep, -b, 1.0)
    span = jnp.where(deep, b - a, 1.0)
    tail = b + jnp.log1p(-u * -jnp.expm1(-rate * span)) / rate
    return jnp.where(deep, tail, direct)


def _inverse_truncated_normal(u, loc, scale, low, high):
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


class _Draws:
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
    def count(cls, dtype) -> "_Draws":
        return cls(dtype)

    @classmethod
    def bulk(cls, key_draw: jax.Array, key_retry: jax.Array, num_pairs: int, dtype) -> "_Draws":
        return cls(dtype, _uniform_pairs(key_draw, (num_pairs,), dtype), key_retry)

    @classmethod
    def per_call(cls, rng_key: jax.Array, dtype) -> "_Draws":
        key_retry, key_calls = random.split(rng_key)
        return cls(dtype, retry_key=key_retry, per_call_key=key_calls)

    def pairs(self, shape: tuple[int, ...]) -> jax.Array:
        size = math.prod(shape)
        start, self.num_pairs = self.num_pairs, self.num_pairs + size
        if self._per_call_key is not None:
            return _uniform_pairs(random.fold_in(self._per_call_key, start), shape, self.dtype)
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


def _uniform_pairs(rng_key: jax.Array, shape: tuple[int, ...], dtype) -> jax.Array:
    """``(2, *shape)`` uniforms on ``(-1, 1)``, drawn flat (a multi-axis ``random.uniform`` is
    several times slower under ``vmap`` on CPU, JAX 0.10)."""
    low = jnp.nextafter(jnp.array(-1.0, dtype), jnp.array(0.0, dtype))
    size = 2 * math.prod(shape)
    return random.uniform(rng_key, (size,), dtype, minval=low).reshape(2, *shape)


def _normal(w: jax.Array) -> jax.Array:
    return math.sqrt(2.0) * erfinv(w)


def _log_uniform(w: jax.Array) -> jax.Array:
    return jnp.log1p(w) - math.log(2.0)


def _float_dtype():
    return jnp.result_type(float)


def truncated_normal(
    rng_key: jax.Array, loc: jax.Array, scale: jax.Array, low: jax.Array, high: jax.Array
) -> jax.Array:
    """One draw of ``Normal(loc, scale)`` restricted to ``[low, high]``.

    A plain normal draw is kept when it falls inside ``[low, high]``; otherwise an independent
    draw by inversion in log space replaces it (a mixture of two exact draws of the same
    distribution, so exact). The inversion mirrors the interval to the lower tail, where the
    normal CDF is accurate, so bounds many standard deviations away from ``loc`` are fine. It
    runs in a ``lax.while_loop`` of at most one pass, which under ``vmap`` is skipped when every
    lane's plain draw is inside (a ``lax.cond`` would compute both branches). ``scale = 0``
    returns ``loc`` clipped.

    >>> from jax import random
    >>> x = truncated_normal(random.key(0), 0.0, 1.0, 30.0, 31.0)
    >>> bool(30.0 <= x <= 31.0)
    True
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(v) for v in (loc, scale, low, high)))
    return _truncated_normal(_uniform_pairs(rng_key, shape, _float_dtype()), loc, scale, low, high)


def _truncated_normal(w, loc, scale, low, high):
    loc, scale, low, high = jnp.broadcast_arrays(
        *(jnp.asarray(v, w.dtype) for v in (loc, scale, low, high))
    )
    x = loc + scale * _normal(w[0])
    inside = (x >= low) & (x <= high)

    def invert(carry):
        x, done = carry
        x_inv = _inverse_truncated_normal((1 + w[1]) / 2, loc, scale, low, high)
        return jnp.where(done, x, x_inv), jnp.ones_like(done)

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
    a = jnp.asarray(concentration, _float_dtype())
    draws = _Draws.per_call(rng_key, a.dtype)
    return _log_gamma(draws.pairs(a.shape), draws.retry_keys(), a)


def _log_gamma(w, retry_keys, a):
    boost = a < 1
    d = jnp.where(boost, a + 1, a) - 1.0 / 3.0
    c = 1.0 / jnp.sqrt(9.0 * d)

    def propose(w):
        x, log_u = _normal(w[0]), _log_uniform(w[1])
        v = (1 + c * x) ** 3
        log_ratio = 0.5 * x**2 + d - d * v + d * jnp.log(jnp.where(v > 0, v, 1.0))
        accept = (v > 0) & (log_u < log_ratio)
        return v, log_u - jnp.minimum(log_ratio, 0.0), accept

    v, log_w, done = propose(w)
    done = done | jnp.isnan(a)

    def retry(carry):
        i, v, log_w, done = carry
        v_new, log_w_new, accept = propose(_uniform_pairs(retry_keys(i), a.shape, a.dtype))
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
    gap = jnp.asarray(gap, _float_dtype())
    return _mixing_variance(_uniform_pairs(rng_key, gap.shape, gap.dtype), gap, scale)


def _mixing_variance(w, gap, scale):
    z, log_u = _normal(w[0]), _log_uniform(w[1])
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
    return _sample_posterior(_Draws.per_call(rng_key, _float_dtype()), posterior)


def _sample_posterior(draws: _Draws, posterior) -> jax.Array:
    if isinstance(posterior, dist.Gamma):
        a = jnp.asarray(posterior.concentration, draws.dtype)
        log_g = _log_gamma(draws.pairs(a.shape), draws.retry_keys(), a)
        return jnp.exp(log_g) / posterior.rate
    if isinstance(posterior, dist.Beta):
        c1, c0 = jnp.broadcast_arrays(posterior.concentration1, posterior.concentration0)
        a = jnp.stack([c1, c0]).astype(draws.dtype)
        log_g = _log_gamma(draws.pairs(a.shape), draws.retry_keys(), a)
        return jax.nn.sigmoid(log_g[0] - log_g[1])
    if isinstance(posterior, dist.Dirichlet):
        a = jnp.asarray(posterior.concentration, draws.dtype)
        return jax.nn.softmax(_log_gamma(draws.pairs(a.shape), draws.retry_keys(), a), -1)
    return posterior.sample(draws.key())


@dataclass(frozen=True)
class StatisticBlock:
    """Static description of one release for :class:`ExpFamGibbs`.

    :param source: name of the (masked) record site in the augmented model.
    :param release: name of the observed release site.
    :param stat: latent site of the released statistic (``None`` in naive mode).
    :param num_records: number of records ``n``.
    :param noise: ``"laplace"`` (scale ``noise_scale``) or ``"gaussian"`` (standard deviation
        ``noise_scale``).
    :param noise_scale: Laplace scale ``Delta / epsilon`` or Gaussian standard deviation.
    :param noise_var: latent site of the Laplace mixing variances.
    :param params: ``(site, record parameter)`` pairs updated by conjugacy.
    :param bounds: truncation bounds ``(a, b)`` of the released statistic, or ``None``.
    :param full_stat: latent site of the full statistic (truncated case).
    :param sections: ``"joint"`` or ``"independent"`` covariance of the truncation sections.
    :param naive: treat the release as the exact full statistic (no statistic update).
    :param release_scale: the release is of ``release_scale * statistic`` (``1 / n`` for a mean);
        ``noise_scale`` is on the scale of the statistic.
    :param max_rejections: cap on rejected draws of a multivariate statistic in one sweep (then
        the previous value is kept and counted in ``num_rejections``).
    """

    source: str
    release: str
    stat: str | None
    num_records: int
    noise: Literal["laplace", "gaussian"]
    noise_scale: float
    noise_var: str | None = None
    params: tuple[tuple[str, str], ...] = ()
    bounds: tuple[float, float] | None = None
    full_stat: str | None = None
    sections: Literal["joint", "independent"] = "joint"
    naive: bool = False
    release_scale: float = 1.0
    max_rejections: int = 1000

    @property
    def latent_sites(self) -> tuple[str, ...]:
        """Augmented sites owned by the block (statistics and mixing variances)."""
        names = () if self.naive else (self.stat, self.full_stat, self.noise_var)
        return tuple(n for n in names if n is not None)


class ExpFamGibbsState(NamedTuple):
    """
    - **z** - current values of the sites owned by the kernel.
    - **rng_key** - random key for the next sweep.
    - **num_rejections** - invalid statistics rejected during the last sweep (multivariate
      statistics only; the univariate draws are exact truncated normals).
    """

    z: dict[str, jax.Array]
    rng_key: jax.Array
    num_rejections: jax.Array


def _stat_range(family: ExpFamily, n: int) -> tuple[float, float]:
    lo, hi = family.stat_range
    return n * lo, n * hi


def _norm_product(m1, v1, y, v2):
    """Mean and variance of ``N(m1, v1) N(y; ., v2)`` (NormProduct, univariate)."""
    v = v1 * v2 / (v1 + v2)
    return v * (m1 / v1 + y / v2), v


def _bounded_scalar_update(draws, family, eta, n, y, noise_var):
    mu, sigma = clt_moments(family, eta)
    m, v = _norm_product(n * mu, n * sigma, y, noise_var)
    lo, hi = _stat_range(family, n)
    return _truncated_normal(draws.pairs(jnp.shape(y)), m, jnp.sqrt(v), lo, hi)


def _bounded_vector_update(draws, family, eta, n, y, noise_var, s_old, max_tries):
    """Matheron's rule for ``N(n mu, n Sigma) N(y; s, diag(noise_var))``, rejection into the box.

    ``Sigma`` may be singular (one-hot statistics sum to one), so only a factor of it is needed:
    the family's ``covariance_factor`` or else an eigendecomposition. The first draw is made
    outside the loop; the ``lax.while_loop`` redraws only when it fell outside the box (under
    ``vmap``: only while some lane is outside).
    """
    mu, sigma = clt_moments(family, eta)
    m1, v1 = n * mu, n * sigma
    if family.covariance_factor is not None:
        factor = math.sqrt(n) * family.covariance_factor(eta)
    else:
        evals, evecs = jnp.linalg.eigh(v1)
        factor = evecs * jnp.sqrt(jnp.clip(evals, 0.0))
    gain = jnp.linalg.solve(v1 + jnp.diag(noise_var), v1).T
    lo, hi = _stat_range(family, n)

    def draw(w):
        e = _normal(w)
        s0 = m1 + factor @ e[0]
        s = s0 + gain @ (y - s0 - jnp.sqrt(noise_var) * e[1])
        return s, jnp.all((s >= lo) & (s <= hi))

    s, ok = draw(draws.pairs(y.shape))
    retry_keys = draws.retry_keys()

    def retry(carry):
        tries, s, _ = carry
        s, ok = draw(_uniform_pairs(retry_keys(tries), y.shape, y.dtype))
        return tries + 1, s, ok

    tries, s, ok = lax.while_loop(
        lambda carry: (~carry[2]) & (carry[0] < max_tries), retry, (jnp.int32(1), s, ok)
    )
    # after max_tries invalid draws the previous (valid) statistic is kept: still a valid update,
    # as whether the draws succeed does not depend on the current statistic
    return jnp.where(ok, s, s_old), tries - ok.astype(jnp.int32)


def _truncated_update(draws, family, eta, n, y, noise_var, bounds, sections):
    """Joint draw of the centre statistic ``s_c`` (released) and the full statistic ``s``."""
    a, b = bounds
    mu, sigma = clt_moments(family, eta)
    q, mu_c, sigma_c = truncated_moments(family, eta, a, b)
    m_c = n * q * mu_c
    v_c = n * q * sigma_c + n * q * (1 - q) * mu_c**2
    if sections == "joint":
        # CLT of the per-record vector (t, 1_c t): Cov = E[t^2 1_c] - E[t] E[1_c t]
        v_s = n * sigma
        cov = n * q * (sigma_c + mu_c**2 - mu * mu_c)
    else:
        lower, upper = _outer_sections(family, a, b)
        v_s = v_c + sum(random_sum_moments(family, eta, n, *sec)[1] for sec in (lower, upper))
        cov = v_c
    lo, hi = family.stat_range
    t_lo, t_hi = max(a, lo), min(b, hi)
    m, v = _norm_product(m_c, v_c, y, noise_var)
    s_c = _truncated_normal(draws.pairs(()), m, jnp.sqrt(v), n * min(0.0, t_lo), n * max(0.0, t_hi))
    cond_mean = n * mu + cov / v_c * (s_c - m_c)
    cond_var = jnp.clip(v_s - cov**2 / v_c, 0.0)
    # the records outside [a, b] contribute a statistic in [n min(0, lo), n max(0, hi)]
    low = jnp.maximum(n * lo, s_c + n * min(0.0, lo))
    high = jnp.minimum(n * hi, s_c + n * max(0.0, hi))
    s = _truncated_normal(draws.pairs(()), cond_mean, jnp.sqrt(cond_var), low, high)
    return s_c, s


def _outer_sections(family: ExpFamily, a: float, b: float):
    if family.discrete:
        return (-math.inf, math.ceil(a) - 1.0), (math.floor(b) + 1.0, math.inf)
    return (-math.inf, a), (b, math.inf)


class ConstrainedGibbsKernel(MCMCKernel):
    """Base of the data-augmentation Gibbs kernels: state ``z`` in the constrained space.

    Subclasses set ``self._model`` and implement ``init``/``sample``/``sites``; this class supplies
    what NumPyro's ``MCMC`` and composite ``Gibbs`` ask of every such kernel (identity transforms,
    no cached state, and ``wrap_model`` to run inside ``numpyro.infer.Gibbs``).
    """

    sample_field = "z"
    _standalone = True  # False once wrapped as a block of numpyro.infer.Gibbs

    @property
    def model(self):
        return self._model

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z",)

    def refresh(self, state, model_args, model_kwargs):
        """Identity: nothing is cached between sweeps."""
        return state

    def wrap_model(self, wrapper):
        kernel = copy.copy(self)
        kernel._model = wrapper(self._model)
        kernel._standalone = False
        return kernel

    def get_constrain_fn(self, model_args, model_kwargs):
        """Identity: the kernel works with constrained values."""
        return identity

    def postprocess_fn(self, model_args, model_kwargs):
        return identity

    def get_diagnostics_str(self, state) -> str:
        return ""


class ExpFamGibbs(ConstrainedGibbsKernel):
    """Bernstein & Sheldon Gibbs sampler for noisy sufficient statistics (Algorithms 1 and 2).

    Works on an augmented model (see :func:`d3pext.handlers.private_posterior`, which builds it
    and this kernel): it owns the statistic sites and mixing variances of each
    :class:`StatisticBlock` and the record parameters listed in ``block.params``. Standalone it must
    own every latent site; as a block of :class:`numpyro.infer.Gibbs` (next to ``NUTS`` for
    non-conjugate parameters) it reads the other sites from the conditioning.

    :param model: the augmented model.
    :param blocks: one :class:`StatisticBlock` per release.

    **Example**

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import privatize, private_posterior
    >>> from d3pext.mechanisms import LaplaceMechanism
    >>> def model(n, x=None):
    ...     theta = numpyro.sample("theta", dist.Beta(2.0, 2.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0))
    >>> mcmc = private_posterior(private, data={"x_dp": jnp.array(31.7)}, num_warmup=200,
    ...                          num_samples=500, progress_bar=False)
    >>> mcmc.run(random.key(0), 100)
    >>> type(mcmc.sampler.inner).__name__
    'ExpFamGibbs'
    """

    def __init__(self, model, blocks: Sequence[StatisticBlock]) -> None:
        if not blocks:
            raise ValueError("ExpFamGibbs needs at least one StatisticBlock.")
        self._model = model
        self._blocks = tuple(blocks)

    @property
    def blocks(self) -> tuple[StatisticBlock, ...]:
        return self._blocks

    @property
    def sites(self) -> tuple[str, ...]:
        """Latent sites updated by one sweep."""
        return tuple(
            name for blk in self._blocks for name in (*blk.latent_sites, *(p for p, _ in blk.params))
        )

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        rng_key, key_trace, key_params = random.split(rng_key, 3)
        tr = trace(
            substitute(seed(conditioned(self._model), key_trace), substitute_fn=init_to_uniform)
        ).get_trace(*model_args, **model_kwargs)
        latent = [
            name for name, site in tr.items() if site["type"] == "sample" and not site["is_observed"]
        ]
        unknown = [name for name in self.sites if name not in latent]
        if unknown:
            raise ValueError(f"Sites {unknown} are not latent sites of the augmented model.")
        if self._standalone:
            left = [name for name in latent if name not in self.sites]
            if left:
                raise ValueError(
                    f"ExpFamGibbs cannot update the latent sites {left} (no conjugate update); "
                    "use it as a block of numpyro.infer.Gibbs with NUTS for them."
                )
        z = {name: jnp.asarray(tr[name]["value"]) for name in self.sites}
        draws = _Draws.per_call(key_params, _float_dtype())
        for blk in self._blocks:
            y = jnp.asarray(tr[blk.release]["value"], draws.dtype) / blk.release_scale
            record = record_distribution(tr[blk.source]["fn"])
            lo, hi = _stat_range(family_of(record), blk.num_records)
            stat = jnp.clip(y, lo, hi)
            if not blk.naive:
                z[blk.stat] = stat
                if blk.full_stat is not None:
                    z[blk.full_stat] = stat
                if blk.noise_var is not None:
                    z[blk.noise_var] = jnp.full(jnp.shape(y), 2 * blk.noise_scale**2)
            # the parameters start from their conditional given the statistic at the release: a
            # start drawn over the prior's support can fall into a mode of negligible mass that
            # Gibbs does not leave (a truncated statistic is not monotone in the parameter)
            for site, param in blk.params:
                posterior = conjugate_posterior(tr[site]["fn"], stat, blk.num_records, record, param)
                z[site] = _sample_posterior(draws, posterior).astype(z[site].dtype)
        if init_params:
            z.update({k: jnp.asarray(v) for k, v in init_params.items() if k in z})
        return ExpFamGibbsState(z, rng_key, jnp.zeros((), jnp.int32))

    def sample(self, state, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else model_kwargs
        next_key, key_draw, key_retry = random.split(state.rng_key, 3)
        # one call of the bit generator per sweep: an abstract pass counts its variates first
        counter = _Draws.count(_float_dtype())
        jax.eval_shape(
            lambda z: self._sweep(z, counter, model_args, model_kwargs),
            jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), state.z),
        )
        draws = _Draws.bulk(key_draw, key_retry, counter.num_pairs, counter.dtype)
        z, rejections = self._sweep(state.z, draws, model_args, model_kwargs)
        if draws.num_pairs != counter.num_pairs:
            raise RuntimeError("ExpFamGibbs: the sweep used more or fewer variates than counted.")
        return ExpFamGibbsState(z, next_key, rejections)

    def _sweep(self, z, draws: _Draws, model_args, model_kwargs):
        z = dict(z)
        tr = trace(substitute(seed(conditioned(self._model), draws.key()), data=z)).get_trace(
            *model_args, **model_kwargs
        )
        rejections = jnp.zeros((), jnp.int32)
        for blk in self._blocks:
            record = record_distribution(tr[blk.source]["fn"])
            family = family_of(record)
            eta = family.natural_params(record)
            y = jnp.asarray(tr[blk.release]["value"], draws.dtype) / blk.release_scale
            n = blk.num_records
            if blk.naive:
                lo, hi = _stat_range(family, n)
                s_full = s_rel = jnp.clip(y, lo, hi)
            else:
                noise_var = (
                    z[blk.noise_var] if blk.noise == "laplace" else jnp.full_like(y, blk.noise_scale**2)
                )
                if blk.bounds is not None:
                    s_rel, s_full = _truncated_update(
                        draws, family, eta, n, y, noise_var, blk.bounds, blk.sections
                    )
                    z[blk.full_stat] = s_full
                elif family.univariate:
                    s_rel = s_full = _bounded_scalar_update(draws, family, eta, n, y, noise_var)
                else:
                    s_rel, rej = _bounded_vector_update(
                        draws, family, eta, n, y, noise_var, z[blk.stat], blk.max_rejections
                    )
                    s_full = s_rel
                    rejections = rejections + rej
                z[blk.stat] = s_rel
            for site, param in blk.params:
                posterior = conjugate_posterior(tr[site]["fn"], s_full, n, record, param)
                z[site] = _sample_posterior(draws, posterior).astype(z[site].dtype)
            if blk.noise == "laplace" and not blk.naive:
                gap = jnp.abs(y - s_rel)
                z[blk.noise_var] = _mixing_variance(draws.pairs(gap.shape), gap, blk.noise_scale)
        return z, rejections


