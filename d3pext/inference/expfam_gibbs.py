"""Bernstein & Sheldon Gibbs kernels for noisy sufficient statistics of exponential families.

:class:`ExpFamGibbs` is a NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel` over an *augmented*
model (built by :func:`d3pext.handlers.private_posterior`) in which each privatized record site is
replaced by latent statistic sites, the Laplace noise of the release by a scale mixture of normals
(latent variances with exponential prior, Park & Casella), and the parameters of the records keep
their priors. One sweep, for each release:

1. the statistic given the parameters and the noise variances. A Bernoulli or binomial count of
   at most :data:`EXACT_COUNT_MAX` trials is drawn exactly on its support (then the sweep samples the
   exact posterior, see :func:`_exact_count_update`); so is a categorical or multinomial count vector
   with at most :data:`EXACT_COMPOSITIONS_MAX` possible values (:func:`_exact_count_vector_update`), and
   the released and the full statistic of Poisson records truncated to a finite ``[a, b]`` with
   ``n floor(b) <=`` :data:`EXACT_TRUNCATED_MAX`
   (:func:`_exact_truncated_poisson_update`); exponential records truncated to ``[a, b]``, at most
   :data:`EXACT_RECORDS_MAX`, are latent records of the state, each drawn from its exact conditional
   (:func:`_exact_truncated_exponential_update`) after the rate and the records are rescaled together
   (:func:`_rescale_rate_and_records`, a Metropolis-Hastings move across the posterior's modes), the
   statistics their sums. Otherwise, as in the paper, the normal (CLT) approximation of
   ``p(s | theta)`` (moments by autodiff of the log-partition, :mod:`d3pext.distributions.expfam`) times the
   normal ``p(y | s, sigma^2)``, restricted to the statistics that are valid for the data model
   (``0 <= s <= n`` for a binomial, ...). The restriction is the paper's rejection step: in one
   dimension it is drawn exactly as a truncated normal, in several dimensions by rejection, which
   keeps the previous statistic after ``max_rejections`` invalid draws (still an exact update:
   the chance of that does not depend on the previous statistic); a chain that keeps it
   ``max_stalls`` sweeps in a row is stuck and fails the run
   (:func:`~d3pext.inference.gibbs_base.raise_if_stuck`);
2. the record parameters by conjugacy given the full statistic (exact model). After a CLT draw in
   step 1 the two conditionals belong to different joints (the paper's "two views"), so the chain
   samples neither the exact posterior nor the CLT model's: its error is that of the CLT, large only
   for a few records (Bernoulli, ``n = 3``, epsilon 1: posterior mean 0.404 against the exact 0.371;
   4 categorical records in 3 categories: up to 0.39 sd; hence the exact draws for counts), below the Monte-Carlo error from about 30 records on for an
   untruncated statistic. A truncated statistic (Algorithm 2) drawn by the CLT draws its part outside
   ``[a, b]`` by the CLT too, which is poor while few records fall outside, at any ``n``: Poisson records
   truncated to ``[0, 10]`` at epsilon 1 had posterior means 0.15-0.5 posterior sd off the exact ones at
   ``n = 2..5`` and 0.39 sd at ``n = 30`` (about one record above 10), hence the exact draw for them
   (now within 0.03 sd); exponential records truncated, 0.12-0.30 sd at ``n = 3..5`` with the paper's
   ``Gamma(20, 20)`` prior and 0.4-0.5 sd at ``n = 4..16`` with a ``Gamma(2, 2)`` one, 0.17 sd at ``n = 64``
   (hence their latent records, now within the Monte-Carlo error). A truncated sum rises and falls with the
   rate, so two rates can explain one release; where the sweep owns the rate of a truncated release, the rate
   first jumps towards both (:func:`_release_anchors`), with the statistics integrated out
   (:func:`_move_rate_given_release` under the CLT, :func:`_jump_rate_given_counts` for the exact Poisson draw)
   or the latent records rescaled with it (:func:`_rescale_rate_and_records`): the Gibbs steps alone stayed
   in one of the posterior's modes;
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
first-attempt variates (:class:`SweepDraws`; threefry passes were most of the cost of a sweep), and
each rejection or fallback step runs in a ``lax.while_loop`` after a first attempt made outside it,
so under ``vmap`` the loop body runs only in the sweeps where some chain needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
import functools
import itertools
import math
from typing import Literal, NamedTuple

import jax
from jax import lax, random
from jax.scipy.special import gammaln, log_ndtr
import jax.numpy as jnp
import numpy as np
from scipy import special

from numpyro.handlers import seed, substitute, trace
from numpyro.infer.gibbs import conditioned
from numpyro.infer.initialization import init_to_uniform

from d3pext.distributions.expfam import (
    ExpFamily,
    clt_moments,
    conjugate_posterior,
    family_of,
    random_sum_moments,
    record_distribution,
    truncated_moments,
)
from d3pext.dtypes import float_dtype
from d3pext.inference.draws import (
    SweepDraws,
    inverse_truncated_normal,
    index_from_uniforms,
    log_uniform_from_uniforms,
    mixing_variance_from_uniforms,
    normal_from_uniforms,
    posterior_from_draws,
    truncated_normal_from_uniforms,
    uniform_pairs,
)
from d3pext.inference.gibbs_base import DEFAULT_MAX_STALLS, ConstrainedGibbsKernel, raise_if_stuck

__all__ = ["ExpFamGibbs", "ExpFamGibbsState", "StatisticBlock"]


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
        the previous value is kept, an exact update still, and counted in ``num_rejections``).
    :param max_stalls: the run fails when the previous value is kept this many sweeps in a row (the
        chain is stuck: a release far outside the range of the statistic).
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
    max_stalls: int = DEFAULT_MAX_STALLS

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
    - **stalls** - per block, sweeps in a row in which its multivariate statistic kept its value
      after ``max_rejections`` invalid draws.
    - **records** - per release whose records are latent (truncated exponential records, at most
      :data:`EXACT_RECORDS_MAX`), by its statistic site: the records.
    - **anchors** - per truncated release whose rate the kernel owns, by its statistic site: where the
      rate's posterior modes can lie (:func:`_release_anchors`, fixed for the run).
    """

    z: dict[str, jax.Array]
    rng_key: jax.Array
    num_rejections: jax.Array
    stalls: jax.Array
    records: dict[str, jax.Array] = {}
    anchors: dict[str, jax.Array] = {}


def _stat_range(family: ExpFamily, n: int) -> tuple[float, float]:
    lo, hi = family.stat_range
    return n * lo, n * hi


def _norm_product(m1, v1, y, v2):
    """Mean and variance of ``N(m1, v1) N(y; ., v2)`` (NormProduct, univariate)."""
    v = v1 * v2 / (v1 + v2)
    return v * (m1 / v1 + y / v2), v


EXACT_COUNT_MAX = 256
"""A Bernoulli or binomial count statistic with at most this many trials is drawn exactly on its support
(:func:`_exact_count_update`); above, by its CLT (whose bias is below the Monte-Carlo error from about
30 trials on)."""


def _log_multinomial_coefficients(counts: np.ndarray) -> np.ndarray:
    """``log(total! / prod_j counts_j!)`` per row of ``counts`` (total = the row's sum), in float64 on the
    host, less their maximum (the values near the mode, which carry the mass, keep their precision in
    float32)."""
    logc = special.gammaln(counts.sum(-1) + 1) - special.gammaln(counts + 1).sum(-1)
    return logc - logc.max()


def _log_binomial_coefficients(total: int) -> np.ndarray:
    """``log C(total, k)`` for ``k = 0..total``, less their maximum."""
    k = np.arange(total + 1)
    return _log_multinomial_coefficients(np.stack([k, total - k], -1))


def _exact_count_update(draws, eta, total: int, y, noise_var):
    """``s | theta, sigma^2`` on ``{0, ..., total}``: ``Binomial(s; total, sigmoid(eta)) N(y; s, sigma^2)``,
    by inversion of its CDF.

    With this draw the conjugate update of the parameters (step 2) is a conditional of the same joint,
    the exact model, so the sweep targets the exact posterior. With the CLT draw the two conditionals
    belong to different joints (the paper's "two views"), which biases small counts: Bernoulli records,
    ``n = 3``, epsilon 1, posterior mean 0.404 against the exact 0.371."""
    k = jnp.arange(total + 1, dtype=jnp.result_type(y))
    eta, noise_var = (jnp.broadcast_to(v, jnp.shape(y))[..., None] for v in (eta, noise_var))
    logp = eta * k + jnp.asarray(_log_binomial_coefficients(total), k.dtype) - 0.5 * (y[..., None] - k) ** 2 / noise_var
    return index_from_uniforms(draws.pairs(jnp.shape(y))[0], logp).astype(k.dtype)


def _exact_count_trials(family: ExpFamily, n: int) -> int | None:
    """The number of trials of a count statistic drawn exactly (:data:`EXACT_COUNT_MAX`), else None."""
    if family.name not in ("Bernoulli", "Binomial"):
        return None
    _, hi = _stat_range(family, n)
    return int(hi) if hi == int(hi) and hi <= EXACT_COUNT_MAX else None


EXACT_COMPOSITIONS_MAX = 2048
"""A categorical or multinomial count vector with at most this many possible values (the compositions of its
total into its categories: 15 for 4 records in 3 categories, 2016 for 62, 1820 for 12 in 5) is drawn
exactly (:func:`_exact_count_vector_update`); above, by its CLT. The exact draw's cost grows with that
number: against the CLT's sweep, 100 chains took 0.18x the time at 15 values, 0.55x at 253, 0.80x at 861
and 2.5x at 3876 (15 records in 5 categories, where the CLT's posterior mean was 0.05 sd off)."""


@functools.lru_cache(maxsize=32)
def _compositions(total: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Every vector of ``k >= 2`` non-negative integers summing to ``total`` (stars and bars), shape
    ``(C, k)``, and its log multinomial coefficient less their maximum (host, float64)."""
    bars = np.array(list(itertools.combinations(range(total + k - 1), k - 1)), dtype=np.int64)
    edges = np.concatenate([np.full((len(bars), 1), -1), bars, np.full((len(bars), 1), total + k - 1)], 1)
    counts = np.diff(edges, axis=1) - 1
    return counts, _log_multinomial_coefficients(counts)


def _exact_count_vector_total(family: ExpFamily, n: int, y) -> int | None:
    """The total of a count vector drawn exactly (:data:`EXACT_COMPOSITIONS_MAX`), else None."""
    if family.name not in ("Categorical", "Multinomial") or jnp.ndim(y) != 1:
        return None
    _, hi = _stat_range(family, n)
    k = family.stat_shape[0]
    if hi != int(hi) or k < 2 or math.comb(int(hi) + k - 1, k - 1) > EXACT_COMPOSITIONS_MAX:
        return None
    return int(hi)


def _exact_count_vector_update(draws, eta, total: int, y, noise_var):
    """``s | theta, sigma^2`` over the count vectors summing to ``total``: ``Multinomial(s; total, softmax(eta))
    prod_j N(y_j; s_j, sigma_j^2)``, by inversion of its CDF. As for :func:`_exact_count_update`, the
    sweep then samples the exact posterior (4 categorical records in 3 categories, epsilon 1: the CLT draw
    put the posterior means up to 0.39 posterior sd off the exact ones, the sds 7% too small)."""
    counts, logc = _compositions(total, y.shape[-1])
    s = jnp.asarray(counts.T, y.dtype)  # (K, C): a row per category, contiguous over the count vectors
    # a probability that underflowed to 0 (a Dirichlet draw in float32) excludes its category, without
    # 0 * -inf = nan where its count is 0
    log_p = jnp.maximum(jax.nn.log_softmax(eta, -1), jnp.finfo(y.dtype).min / (2 * max(total, 1)))
    # the noise term as a difference first: expanded, a small variance (a large precision) would lose it to
    # rounding in float32
    noise = sum((y[j] - s[j]) ** 2 / noise_var[j] for j in range(s.shape[0]))
    logw = log_p @ s - 0.5 * noise + jnp.asarray(logc, y.dtype)
    return s[:, index_from_uniforms(draws.pairs(())[0], logw)]


def _bounded_scalar_update(draws, family, eta, n, y, noise_var):
    trials = _exact_count_trials(family, n)
    if trials is not None:
        return _exact_count_update(draws, eta, trials, y, noise_var)
    mu, sigma = clt_moments(family, eta)
    m, v = _norm_product(n * mu, n * sigma, y, noise_var)
    lo, hi = _stat_range(family, n)
    return truncated_normal_from_uniforms(draws.pairs(jnp.shape(y)), m, jnp.sqrt(v), lo, hi)


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
        e = normal_from_uniforms(w)
        s0 = m1 + factor @ e[0]
        s = s0 + gain @ (y - s0 - jnp.sqrt(noise_var) * e[1])
        return s, jnp.all((s >= lo) & (s <= hi))

    s, ok = draw(draws.pairs(y.shape))
    retry_keys = draws.retry_keys()

    def retry(carry):
        tries, s, _ = carry
        s, ok = draw(uniform_pairs(retry_keys(tries), y.shape, y.dtype))
        return tries + 1, s, ok

    tries, s, ok = lax.while_loop(
        lambda carry: (~carry[2]) & (carry[0] < max_tries), retry, (jnp.int32(1), s, ok)
    )
    # after max_tries invalid draws the previous (valid) statistic is kept: still a valid update,
    # as whether the draws succeed does not depend on the current statistic
    return jnp.where(ok, s, s_old), tries - ok.astype(jnp.int32), ok


EXACT_TRUNCATED_MAX = 1024
"""Poisson records released truncated to ``[a, b]`` with ``n * floor(b)`` at most this: the released and the full
statistic are drawn exactly (:func:`_exact_truncated_poisson_update`, ``n`` convolutions of ``n floor(b) + 1``
values per sweep); above, by the bivariate CLT."""
OUTSIDE_WIDTH = 256
"""Values above ``b`` are drawn on ``b + 1 .. b + OUTSIDE_WIDTH`` (the mass beyond is below 1e-30 unless the
rate exceeds ``b`` by about 100)."""


def _truncated_poisson_log_weights(eta, n: int, y, noise_var, bounds) -> jax.Array:
    """``log [C(n, k) q_out^(n - k) conv^k(p_in)(s_c) N(y; s_c, sigma^2)]`` over ``k = 0..n`` records inside
    ``[a, b]`` and their sum ``s_c = 0..n floor(b)`` (shape ``(n + 1, n floor(b) + 1)``, up to a constant free of
    the rate)."""
    a, b = bounds
    lo, hi = _lowest_count(a), math.floor(b)
    dtype = jnp.result_type(y)
    j = jnp.arange(hi + 1, dtype=dtype)
    logp = jnp.where(j >= lo, j * eta - jnp.exp(eta) - gammaln(j + 1), -jnp.inf)
    log_q_in = jax.nn.logsumexp(logp)
    log_q_out = jnp.log(-jnp.expm1(jnp.minimum(log_q_in, -1e-30)))
    L = n * hi + 1
    row0 = jnp.full((L,), -jnp.inf, dtype).at[0].set(0.0)

    def step(row, _):  # log conv^k(p_in), shifted by its max (kept in the carry's scale)
        new = jnp.log(jnp.convolve(jnp.exp(row - jnp.max(row)), jnp.exp(logp - jnp.max(logp)))[:L] + 1e-38)
        new = new + jnp.max(row) + jnp.max(logp)
        return new, new

    _, rows = lax.scan(step, row0, None, length=n)
    table = jnp.concatenate([row0[None], rows], 0)  # (n + 1, L): k records inside
    k = jnp.arange(n + 1, dtype=dtype)
    log_binom = jnp.asarray(_log_binomial_coefficients(n), dtype)
    s = jnp.arange(L, dtype=dtype)
    return log_binom[:, None] + (n - k)[:, None] * log_q_out + table - 0.5 * (y - s[None]) ** 2 / noise_var


def _exact_truncated_poisson_update(draws, eta, n, y, noise_var, bounds, log_weights=None):
    """(s_c, s) | rate, sigma^2 for Poisson records and the release of s_c = sum x_i 1[a <= x_i <= b]:
    the number k of records inside [a, b] and their sum s_c jointly from
    C(n, k) q_out^(n - k) conv^k(p_in)(s_c) N(y; s_c, sigma^2) on its support, then the n - k outside
    values from the Poisson restricted to the outside. All conditionals of the exact model.
    ``log_weights``: :func:`_truncated_poisson_log_weights` at ``eta`` when known."""
    a, b = bounds
    lo, hi = _lowest_count(a), math.floor(b)
    dtype = jnp.result_type(y)
    logw = _truncated_poisson_log_weights(eta, n, y, noise_var, bounds) if log_weights is None else log_weights
    L = n * hi + 1
    idx = index_from_uniforms(draws.pairs(())[0], logw.ravel())
    k_in, s_c = idx // L, (idx % L).astype(dtype)
    # outside values: inversion on [0, lo) U (hi, hi + OUTSIDE_WIDTH]
    x = jnp.concatenate([jnp.arange(lo), jnp.arange(hi + 1, hi + 1 + OUTSIDE_WIDTH)]).astype(dtype)
    w = draws.pairs(((n + 1) // 2,)).ravel()[:n]
    picks = index_from_uniforms(w, jnp.broadcast_to(x * eta - gammaln(x + 1), (n, x.size)))
    s_out = jnp.sum(jnp.where(jnp.arange(n) < n - k_in, x[picks], 0.0))
    return s_c, s_c + s_out


def _jump_rate_given_counts(draws, prior, rate, eta_of, n, y, noise_var, bounds, anchors):
    """One Metropolis-Hastings move of a Poisson rate with the statistics of
    :func:`_exact_truncated_poisson_update` summed out exactly: the independence proposal of
    :func:`_anchor_jump` (at the rates whose expected released sum is the release), accepted with the exact
    marginal ``p(rate) sum_{k, s_c} w(k, s_c)``. The Gibbs steps alone crossed between the posterior's modes
    slowly or never (100 records in ``[0, 10]``). Returns the rate, its natural parameter and its
    :func:`_truncated_poisson_log_weights` (for the draw that follows)."""
    w = draws.pairs(())
    jump, log_q = _anchor_jump(w[0], anchors)
    log_rates = jnp.stack([jnp.log(rate), jump])
    rates = jnp.exp(log_rates)
    etas = jax.vmap(eta_of)(rates)
    log_weights = jax.vmap(lambda e: _truncated_poisson_log_weights(e, n, y, noise_var, bounds))(etas)
    log_target = (
        jax.vmap(lambda r: jnp.sum(prior.log_prob(r)))(rates) + log_rates
        + jax.nn.logsumexp(log_weights.reshape(2, -1), axis=1)
    )
    log_ratio = log_target[1] - log_target[0] + log_q(log_rates[0]) - log_q(jump)
    chosen = (log_uniform_from_uniforms(w[1]) < log_ratio).astype(jnp.int32)
    return rates[chosen].astype(jnp.result_type(rate)), etas[chosen], log_weights[chosen]


def _lowest_count(a: float) -> int:
    """The smallest count inside a lower bound ``a`` (which may be ``-inf``)."""
    return 0 if not math.isfinite(a) else max(math.ceil(a), 0)


def _exact_truncated_poisson(family: ExpFamily, n: int, y, bounds) -> bool:
    """Whether a truncated release of Poisson records is drawn exactly (:data:`EXACT_TRUNCATED_MAX`)."""
    a, b = bounds
    return (
        family.name == "Poisson" and jnp.ndim(y) == 0 and math.isfinite(b) and math.floor(b) >= _lowest_count(a)
        and n * math.floor(b) <= EXACT_TRUNCATED_MAX
    )


EXACT_RECORDS_MAX = 256
"""Exponential records released truncated to ``[a, b]``, at most this many: the records themselves are latent
in the sampler's state, each drawn from its exact conditional in every sweep
(:func:`_exact_truncated_exponential_update`), after two joint rescalings of the rate and the records
(:func:`_rescale_rate_and_records`), and the statistics are their sums; above, the statistics are drawn by
the bivariate CLT (Algorithm 2). With a ``Gamma(2, 2)`` prior at epsilon 1 the CLT's draw put the posterior
mean of 4 records about 0.5 posterior sd below the exact one (sds 23-31% too small), 0.17 sd at 64 records,
and at 256 records its chains stayed in one of the posterior's two modes (sd 0.24-0.5x the exact one; the CLT
path has since gained moves of the rate across the modes, :func:`_move_rate_given_release`). A
sweep costs about 13 microseconds per record for 32 chains on a CPU core (at 256 records 72,000 sweeps took
15 s against the CLT's 0.5 s)."""


def _exact_truncated_exponential(family: ExpFamily, n: int, y) -> bool:
    """Whether a truncated release of exponential records is drawn with its records (:data:`EXACT_RECORDS_MAX`)."""
    return family.name == "Exponential" and jnp.ndim(y) == 0 and n <= EXACT_RECORDS_MAX


def _start_records(n: int, stat, bounds) -> jax.Array:
    """Records to start the chain from: ``n`` equal values inside ``[a, b]`` summing close to ``stat``."""
    a, b = max(bounds[0], 0.0), bounds[1]
    return jnp.full((n,), jnp.clip(stat / n, a, b if math.isfinite(b) else jnp.inf))


def _tilted_log_mass(m, sigma, a: float, b: float):
    """``m^2 / (2 sigma^2) + log P(a <= N(m, sigma^2) <= b)``, computed as ``e (2 m - e) / (2 sigma^2) +
    [log P(alpha <= Z <= beta) + c^2 / 2]``, ``e`` the point of ``[a, b]`` nearest ``m`` and ``c = (e - m) /
    sigma``: the bracket stays moderate where ``m`` is many sds outside ``[a, b]``, where the two terms of the
    plain form are large and of opposite signs."""
    e = jnp.clip(m, a, b)
    c = (e - m) / sigma
    return e * (2 * m - e) / (2 * sigma**2) + (_log_normal_interval(m, sigma, a, b) + 0.5 * c**2)


def _log_normal_interval(m, sigma, a, b):
    """``log P(a <= N(m, sigma^2) <= b)``, accurate far in either tail."""
    alpha, beta = (a - m) / sigma, (b - m) / sigma
    flip = alpha > -beta  # the interval's tail side: Phi's log is accurate there
    lo, hi = jnp.where(flip, -beta, alpha), jnp.where(flip, -alpha, beta)
    log_hi = log_ndtr(hi)
    return log_hi + jnp.log1p(-jnp.exp(jnp.minimum(log_ndtr(lo) - log_hi, 0.0)))


def _exact_truncated_exponential_update(draws, eta, records, y, noise_var, bounds):
    """One sweep over exponential records given the rate ``-eta`` and the release ``y ~ N(s_c, sigma^2)`` of
    ``s_c = sum x_i 1[a <= x_i <= b]`` (the Laplace noise as its normal mixture): each record in turn from its
    exact conditional given the others. With ``r = y - s_c`` of the others, the record falls inside with
    weight ``rate exp(-rate r + rate^2 sigma^2 / 2) P(a <= N(m, sigma^2) <= b)``, ``m = r - rate sigma^2``, and
    then follows that normal restricted to ``[a, b]``; outside with weight ``N(r; 0, sigma^2) P(x outside)``,
    and then follows the exponential restricted to ``[0, a) U (b, inf)``. Returns ``(records, s_c, s)``."""
    a, b = max(bounds[0], 0.0), bounds[1]
    dtype = records.dtype
    rate = -eta
    sigma = jnp.sqrt(noise_var)
    n = records.shape[0]
    w = draws.pairs((2, n))  # per record: the side and the value inside; the outer section and its value
    log_below = jnp.log(-jnp.expm1(-rate * a)) if a > 0 else jnp.array(-jnp.inf, dtype)
    log_above = -rate * b if math.isfinite(b) else jnp.array(-jnp.inf, dtype)
    log_outside = jnp.logaddexp(log_below, log_above)
    constant = jnp.log(rate) + jnp.log(sigma) + 0.5 * math.log(2 * math.pi) - log_outside

    def inside(x):
        return (x >= a) & (x <= b)

    def step(i, carry):
        records, s_c = carry
        x = records[i]
        others = s_c - jnp.where(inside(x), x, 0.0)
        r = y - others
        m = r - rate * noise_var
        log_odds = constant + _tilted_log_mass(m, sigma, a, b)
        take_inside = u[0, 0, i] < jax.nn.sigmoid(log_odds)
        x_in = inverse_truncated_normal(u[1, 0, i], m, sigma, a, b)
        x_new = jnp.where(take_inside, x_in, x_outside[i]).astype(dtype)
        return records.at[i].set(x_new), others + jnp.where(inside(x_new), x_new, 0.0)

    u = 0.5 * (w + 1)
    # the value each record takes if it falls outside does not depend on the others: drawn for all at once,
    # strictly outside (a rounded value on a bound would count as inside)
    x_below = jnp.minimum(-jnp.log1p(u[1, 1] * jnp.expm1(-rate * a)) / rate, jnp.nextafter(jnp.asarray(a, dtype), 0))
    x_above = jnp.maximum(b - jnp.log1p(-u[1, 1]) / rate, jnp.nextafter(jnp.asarray(b, dtype), jnp.inf))
    x_outside = jnp.where(u[0, 1] < jnp.exp(log_below - log_outside), x_below, x_above)
    s_c = jnp.sum(jnp.where(inside(records), records, 0.0))
    records, _ = lax.fori_loop(0, n, step, (records, s_c))
    s_c = jnp.sum(jnp.where(inside(records), records, 0.0))
    return records, s_c, jnp.sum(records)


def _rescale_rate_and_records(draws, prior, rate, records, y, noise_var, bounds, anchors=None):
    """Two Metropolis-Hastings moves of the rate and all exponential records together: ``rate e^-u``,
    ``records e^u``, ``u ~ N(0, tau^2)``. The records' density ``prod rate e^(-rate x_i) dx_i`` is unchanged
    in log coordinates (each ``rate x_i`` is), so a move is accepted with the prior's ratio (times the
    rate's: the log coordinate's Jacobian) and the release's, ``N(y; s_c, sigma^2)`` of the rescaled
    records' truncated sum. Record-by-record Gibbs crosses this ridge slowly: the rate given all records
    is far tighter than given the release, and the truncated sum is not monotone in the rate (two rates
    can explain one release). The first move's ``tau`` scales with ``u``'s spread under the release and
    the prior, ``(1 + y^2 / sigma^2 + concentration)^-1/2`` (what the move holds fixed), the second's is 1,
    a jump between modes. With ``anchors`` (:func:`_release_anchors`) a third move draws the new rate from
    Cauchy distributions at the rates whose expected released sum is the release (:func:`_anchor_jump`), a
    jump to a mode however far (an independence proposal of ``log rate``: the ratio of its densities joins the
    acceptance).
    Returns ``(rate, records)``."""
    a, b = max(bounds[0], 0.0), bounds[1]
    concentration = prior.mean**2 / prior.variance  # the gamma prior's, through plate expansions and masks

    def log_target(rate, records):
        s_c = jnp.sum(jnp.where((records >= a) & (records <= b), records, 0.0))
        return jnp.sum(prior.log_prob(rate) + jnp.log(rate)) - (y - s_c) ** 2 / (2 * noise_var)

    def rescale(rate, records, u, w, log_proposal_ratio=0.0):
        new_rate = (rate * jnp.exp(-u)).astype(jnp.result_type(rate))
        new_records = records * jnp.exp(u).astype(records.dtype)
        log_ratio = log_target(new_rate, new_records) - log_target(rate, records) + log_proposal_ratio
        accept = log_uniform_from_uniforms(w) < log_ratio
        return jnp.where(accept, new_rate, rate), jnp.where(accept, new_records, records)

    # multipliers measured at 16 and 64 records (ESS per sweep, against 2.4 or 9.6 and 0.5 or 2)
    for tau in (4.8 * lax.rsqrt(1.0 + y**2 / noise_var + concentration), 1.0):
        w = draws.pairs(())
        rate, records = rescale(rate, records, tau * normal_from_uniforms(w[0]), w[1])
    if anchors is not None:
        w = draws.pairs(())
        jump, log_q = _anchor_jump(w[0], anchors)
        log_rate = jnp.log(rate)
        rate, records = rescale(rate, records, log_rate - jump, w[1], log_q(log_rate) - log_q(jump))
    return rate, records


def _released_moments(family, eta, n, bounds):
    """The CLT of the released statistic ``s_c = sum_i 1_[a,b](x_i) t(x_i)``: ``(q, mu_c, sigma_c, m_c, v_c)``,
    the truncated family's mass, mean and variance and the sum's mean and variance."""
    q, mu_c, sigma_c = truncated_moments(family, eta, *bounds)
    v_c = n * q * sigma_c + n * q * (1 - q) * mu_c**2
    # at least the smallest normal float: where q underflows (a rate far above b) the sum is 0 with variance 0
    return q, mu_c, sigma_c, n * q * mu_c, jnp.maximum(v_c, jnp.finfo(jnp.result_type(v_c)).tiny)


def _released_range(family, n, bounds) -> tuple[float, float]:
    """The values the released statistic of ``n`` records can take."""
    lo, hi = family.stat_range
    return n * min(0.0, max(bounds[0], lo)), n * max(0.0, min(bounds[1], hi))


def _move_rate_given_release(draws, prior, rate, eta_of, family, n, y, noise_var, bounds, anchors):
    """Two Metropolis-Hastings moves of the rate with the statistics integrated out under the CLT (the draw of
    :func:`_truncated_update` follows): the target is ``p(rate) N(y; m_c, v_c + sigma^2) P(range | y) / P(range)``
    (``m_c, v_c`` the released statistic's CLT moments, restricted to its range). A truncated statistic is not
    monotone in the rate, so two rates can explain one release, and the Gibbs steps between the statistics and
    the rate cross the valley between them slowly or never. Both moves use the release's ``anchors``
    (:func:`_release_anchors`, computed once):

    1. a random walk ``rate e^-u``, ``u ~ N(0, tau^2)``;
    2. an independence proposal of the log rate (:func:`_anchor_jump`) from Cauchy distributions at the rates
       whose ``m_c`` is the release (on the rising and on the falling branch), the posterior sd there wide: a
       jump to the other mode however far it lies.

    Returns the rate, its natural parameter and its :func:`_released_moments`."""
    lo, hi = _released_range(family, n, bounds)

    def log_target(log_rate):
        rate = jnp.exp(log_rate)
        eta = eta_of(rate)
        moments = _released_moments(family, eta, n, bounds)
        m_c, v_c = moments[3:]
        total = v_c + noise_var
        m, v = _norm_product(m_c, v_c, y, noise_var)
        log_target = (
            jnp.sum(prior.log_prob(rate)) + log_rate - 0.5 * jnp.log(total) - (y - m_c) ** 2 / (2 * total)
            + _log_normal_interval(m, jnp.sqrt(v), lo, hi) - _log_normal_interval(m_c, jnp.sqrt(v_c), lo, hi)
        )
        return log_target, (eta, *moments)

    log_rate = jnp.log(rate)
    w_walk, w_jump = draws.pairs(()), draws.pairs(())
    step = anchors[4] * normal_from_uniforms(w_walk[0])
    jump, log_q = _anchor_jump(w_jump[0], anchors)
    # the three points do not depend on the moves' outcomes: one vectorised evaluation
    points = jnp.stack([log_rate, log_rate - step, jump])
    targets, moments = jax.vmap(log_target)(points)

    walked = log_uniform_from_uniforms(w_walk[1]) < targets[1] - targets[0]
    chosen = walked.astype(jnp.int32)
    log_ratio = targets[2] - targets[chosen] + log_q(points[chosen]) - log_q(jump)
    chosen = jnp.where(log_uniform_from_uniforms(w_jump[1]) < log_ratio, 2, chosen)
    rate = jnp.exp(points[chosen]).astype(jnp.result_type(rate))
    return rate, tuple(v[chosen] for v in moments)


def _release_anchors(family, eta_of, n: int, y, noise_var, bounds, concentration, num: int = 256) -> jax.Array:
    """Where the rate's posterior given a truncated release can have its modes, for the jumps of
    :func:`_anchor_jump`: ``(c_1, c_2, s_1, s_2, tau, low, high)``. ``c_1, c_2``: the log rates of the first
    up- and the last down-crossing of ``m_c = y`` on a grid of ``num`` log rates (linear interpolation; without
    a crossing on a side of ``m_c``'s peak, the grid point of that side whose ``m_c`` is nearest ``y``);
    ``s_1, s_2``: the posterior sds of the log rate there, ``(concentration + I)^-1/2`` with
    ``I = (d m_c / d log rate)^2 / (v_c + sigma^2)``, within ``[1e-4, 1]``; ``tau``: the random walk's scale,
    2.4 times the smaller sd; ``low, high``: the grid's ends. The grid spans record means (``rate`` for Poisson records,
    ``1 / rate`` for exponential ones) from ``|y| / (10 n max(b, 1)^2)`` to ``10 max(b, 1)^2 n / |y|`` either
    way round."""
    b = max(bounds[1], 1.0)
    small = jnp.log(jnp.maximum(jnp.abs(y), 1.0) / (10.0 * n * b**2))
    low, high = jnp.minimum(small, -math.log(10.0 * b)), jnp.maximum(math.log(10.0 * b), -small)
    grid = low + (high - low) * jnp.linspace(0.0, 1.0, num, dtype=jnp.result_type(y))
    _, _, _, m_c, v_c = jax.vmap(lambda x: _released_moments(family, eta_of(jnp.exp(x)), n, bounds))(grid)
    gap = jnp.nan_to_num(m_c - y, nan=-jnp.inf)
    up, down = (gap[:-1] <= 0) & (gap[1:] > 0), (gap[:-1] > 0) & (gap[1:] <= 0)
    found = jnp.stack([jnp.any(up), jnp.any(down)])
    # without a crossing on a side of the peak, the point of that side whose m_c is nearest the release
    side = jnp.arange(num) <= jnp.argmax(gap)
    nearest = jnp.stack([jnp.argmin(jnp.where(side, jnp.abs(gap), jnp.inf)),
                         jnp.argmin(jnp.where(side, jnp.inf, jnp.abs(gap)))])
    cells = jnp.stack([jnp.argmax(up), num - 2 - jnp.argmax(down[::-1])])
    k = jnp.where(found, cells, jnp.minimum(nearest, num - 2))
    h = grid[1] - grid[0]
    g0, g1 = gap[k], gap[k + 1]
    frac = jnp.where(found, jnp.clip(jnp.nan_to_num(g0 / (g0 - g1), nan=0.5), 0.0, 1.0), 0.0)  # g0 may be -inf
    centres = grid[k] + h * frac
    slope = jnp.where(found, (g1 - g0) / h, 0.0)
    total = v_c[k] + frac * (v_c[k + 1] - v_c[k]) + noise_var
    sds = jnp.clip(jnp.nan_to_num(lax.rsqrt(concentration + slope**2 / total), nan=1.0), 1e-4, 1.0)
    return jnp.concatenate([centres, sds, 2.4 * jnp.min(sds, keepdims=True), jnp.stack([low, high])])


def _natural_params_of(record) -> Callable[[jax.Array], jax.Array]:
    """``rate -> eta`` for records of ``record``'s family whose one parameter is ``rate``."""
    family = family_of(record)
    return lambda rate: family.natural_params(type(record)(rate))


def _anchor_jump(w: jax.Array, anchors: jax.Array) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """A log rate from the equal mixture of Cauchy distributions at the :func:`_release_anchors`, their posterior
    sds wide, each restricted to the anchors' grid (``w`` one uniform on ``(-1, 1)``: its sign picks the
    component), and the mixture's log density (up to a constant; ``-inf`` off the grid). Heavy tails let a
    chain far from both anchors (started where neither mode is) leave, and the grid keeps the rates where the
    moments are accurate."""
    centres, scales, low, high = anchors[:2], anchors[2:4], anchors[5], anchors[6]
    below, above = jnp.arctan((low - centres) / scales), jnp.arctan((high - centres) / scales)
    pick = (w > 0).astype(jnp.int32)
    angle = below[pick] + (above[pick] - below[pick]) * jnp.abs(w)
    jump = jnp.clip(centres[pick] + scales[pick] * jnp.tan(angle), low, high)

    def log_q(x):
        z = (x - centres) / scales
        log_q = jax.nn.logsumexp(-jnp.log1p(z**2) - jnp.log(scales) - jnp.log(above - below))
        return jnp.where((x >= low) & (x <= high), log_q, -jnp.inf)

    return jump, log_q


def _truncated_update(draws, family, eta, n, y, noise_var, bounds, sections, released=None):
    """Joint draw of the centre statistic ``s_c`` (released) and the full statistic ``s`` (``released``: the
    :func:`_released_moments` at ``eta`` when known)."""
    a, b = bounds
    mu, sigma = clt_moments(family, eta)
    q, mu_c, sigma_c, m_c, v_c = _released_moments(family, eta, n, bounds) if released is None else released
    if sections == "joint":
        # CLT of the per-record vector (t, 1_c t): Cov = E[t^2 1_c] - E[t] E[1_c t]
        v_s = n * sigma
        cov = n * q * (sigma_c + mu_c**2 - mu * mu_c)
    else:
        v_s = v_c + sum(random_sum_moments(family, eta, n, *sec)[1] for sec in _outer_sections(family, a, b))
        cov = v_c
    lo, hi = family.stat_range
    m, v = _norm_product(m_c, v_c, y, noise_var)
    s_c = truncated_normal_from_uniforms(draws.pairs(()), m, jnp.sqrt(v), *_released_range(family, n, bounds))
    cond_mean = n * mu + cov / v_c * (s_c - m_c)
    cond_var = jnp.clip(v_s - cov**2 / v_c, 0.0)
    # the records outside [a, b] contribute a statistic in [n min(0, lo), n max(0, hi)]
    low = jnp.maximum(n * lo, s_c + n * min(0.0, lo))
    high = jnp.minimum(n * hi, s_c + n * max(0.0, hi))
    s = truncated_normal_from_uniforms(draws.pairs(()), cond_mean, jnp.sqrt(cond_var), low, high)
    return s_c, s


def _outer_sections(family: ExpFamily, a: float, b: float) -> list[tuple[float, float]]:
    """The parts of the support below and above ``[a, b]`` (inclusive bounds for discrete families),
    those that hold any value: an empty one (``a`` at or below the support's minimum) has no mass
    and no moments."""
    if family.discrete:
        sections = ((-math.inf, math.ceil(a) - 1.0), (math.floor(b) + 1.0, math.inf))
    else:
        sections = ((-math.inf, a), (b, math.inf))
    lo, hi = family.stat_range
    clipped = [(max(v, lo), min(w, hi)) for v, w in sections]
    return [(v, w) for v, w in clipped if v < w or (family.discrete and v == w)]


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
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
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
        # the rate site of truncated Poisson or exponential records, moved before the statistics' draw (a site is
        # owned by one block): with the latent records (_rescale_rate_and_records) or with the statistics
        # integrated out (_move_rate_given_release under the CLT, _jump_rate_given_counts for exact counts)
        self._rate_sites = {
            blk.stat: blk.params[0][0]
            for blk in self._blocks
            if blk.bounds is not None and len(blk.params) == 1 and blk.params[0][1] == "rate"
        }

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
        records, anchors = {}, {}
        draws = SweepDraws.per_call(key_params, float_dtype())
        for blk in self._blocks:
            y = jnp.asarray(tr[blk.release]["value"], draws.dtype) / blk.release_scale
            record = record_distribution(tr[blk.source]["fn"])
            lo, hi = _stat_range(family_of(record), blk.num_records)
            stat = jnp.clip(y, lo, hi)
            if not blk.naive:
                z[blk.stat] = stat
                if blk.full_stat is not None:
                    z[blk.full_stat] = stat
                if blk.bounds is not None and _exact_truncated_exponential(family_of(record), blk.num_records, y):
                    records[blk.stat] = _start_records(blk.num_records, stat, blk.bounds).astype(draws.dtype)
                if blk.noise_var is not None:
                    z[blk.noise_var] = jnp.full(jnp.shape(y), 2 * blk.noise_scale**2)
                if (site := self._anchored_rate_site(blk)) is not None:
                    prior = tr[site]["fn"]
                    anchors[blk.stat] = _release_anchors(
                        family_of(record), _natural_params_of(record), blk.num_records, y,
                        (2 if blk.noise == "laplace" else 1) * blk.noise_scale**2, blk.bounds,
                        prior.mean**2 / prior.variance,
                    )
            # the parameters start from their conditional given the statistic at the release: a
            # start drawn over the prior's support can fall into a mode of negligible mass that
            # Gibbs does not leave (a truncated statistic is not monotone in the parameter)
            for site, param in blk.params:
                posterior = conjugate_posterior(tr[site]["fn"], stat, blk.num_records, record, param)
                z[site] = posterior_from_draws(draws, posterior).astype(z[site].dtype)
        if init_params:
            z.update({k: jnp.asarray(v) for k, v in init_params.items() if k in z})
        return ExpFamGibbsState(
            z, rng_key, jnp.zeros((), jnp.int32), jnp.zeros((len(self._blocks),), jnp.int32), records, anchors
        )

    def sample(self, state, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else model_kwargs
        next_key, key_draw, key_retry = random.split(state.rng_key, 3)
        # one call of the bit generator per sweep: an abstract pass counts its variates first
        counter = SweepDraws.count(float_dtype())
        jax.eval_shape(
            lambda z, records: self._sweep(z, records, state.anchors, counter, model_args, model_kwargs),
            *jax.tree.map(lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), (state.z, state.records)),
        )
        draws = SweepDraws.bulk(key_draw, key_retry, counter.num_pairs, counter.dtype)
        z, records, rejections, kept = self._sweep(
            state.z, state.records, state.anchors, draws, model_args, model_kwargs
        )
        if draws.num_pairs != counter.num_pairs:
            raise RuntimeError("ExpFamGibbs: the sweep used more or fewer variates than counted.")
        stalls = state.stalls
        capped = [blk.stat for blk, k in zip(self._blocks, kept) if k is not None]
        if capped:  # some statistic is drawn by capped rejection
            kept = jnp.stack([jnp.bool_(False) if k is None else k for k in kept])
            stalls = jnp.where(kept, stalls + 1, 0)
            # always False (it raises otherwise); fed into a draw so that JAX keeps the check
            stuck = self._raise_if_stuck(stalls)
            z[capped[0]] = jnp.where(stuck, state.z[capped[0]], z[capped[0]])
        return ExpFamGibbsState(z, next_key, rejections, stalls, records, state.anchors)

    def _anchored_rate_site(self, blk: StatisticBlock) -> str | None:
        """The rate site of a truncated release that jumps to the :func:`_release_anchors` before the statistics'
        draw (:func:`_move_rate_given_release` for the CLT's, :func:`_jump_rate_given_counts` for the exact
        Poisson one, :func:`_rescale_rate_and_records` for latent exponential records)."""
        return None if blk.naive else self._rate_sites.get(blk.stat)

    def _raise_if_stuck(self, stalls: jax.Array) -> jax.Array:
        updates = [f"statistic update of release {b.release!r}" for b in self._blocks]
        advice = (
            "Most likely the release is far outside the values a statistic of the model's number of "
            "records can take (e.g. a count well below 0 or above n with little noise): check the "
            "release, its noise scale and the number of records."
        )
        max_stalls = min(b.max_stalls for b in self._blocks)
        failed = "drew no statistic in its range in max_rejections draws"
        return raise_if_stuck(stalls, max_stalls, "ExpFamGibbs", updates, failed, advice)

    def _sweep(self, z, records, anchors, draws: SweepDraws, model_args, model_kwargs):
        z, records = dict(z), dict(records)
        tr = trace(substitute(seed(conditioned(self._model), draws.key()), data=z)).get_trace(
            *model_args, **model_kwargs
        )
        rejections = jnp.zeros((), jnp.int32)
        kept = [None] * len(self._blocks)  # per block: the previous statistic kept (capped rejection)
        for index, blk in enumerate(self._blocks):
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
                if blk.stat in records:
                    if (site := self._rate_sites.get(blk.stat)) is not None:
                        z[site], records[blk.stat] = _rescale_rate_and_records(
                            draws, tr[site]["fn"], z[site], records[blk.stat], y, noise_var, blk.bounds,
                            anchors.get(blk.stat),
                        )
                        eta = -z[site]
                    records[blk.stat], s_rel, s_full = _exact_truncated_exponential_update(
                        draws, eta, records[blk.stat], y, noise_var, blk.bounds
                    )
                    z[blk.full_stat] = s_full
                elif blk.bounds is not None and _exact_truncated_poisson(family, n, y, blk.bounds):
                    log_weights = None
                    if blk.stat in anchors:
                        site = self._rate_sites[blk.stat]
                        z[site], eta, log_weights = _jump_rate_given_counts(
                            draws, tr[site]["fn"], z[site], _natural_params_of(record), n, y, noise_var,
                            blk.bounds, anchors[blk.stat],
                        )
                    s_rel, s_full = _exact_truncated_poisson_update(
                        draws, eta, n, y, noise_var, blk.bounds, log_weights
                    )
                    z[blk.full_stat] = s_full
                elif blk.bounds is not None:
                    released = None
                    if blk.stat in anchors:
                        site = self._rate_sites[blk.stat]
                        z[site], (eta, *released) = _move_rate_given_release(
                            draws, tr[site]["fn"], z[site], _natural_params_of(record), family, n, y, noise_var,
                            blk.bounds, anchors[blk.stat],
                        )
                    s_rel, s_full = _truncated_update(
                        draws, family, eta, n, y, noise_var, blk.bounds, blk.sections, released
                    )
                    z[blk.full_stat] = s_full
                elif family.univariate:
                    s_rel = s_full = _bounded_scalar_update(draws, family, eta, n, y, noise_var)
                elif (total := _exact_count_vector_total(family, n, y)) is not None:
                    s_rel = s_full = _exact_count_vector_update(draws, eta, total, y, noise_var)
                else:
                    s_rel, rej, ok = _bounded_vector_update(
                        draws, family, eta, n, y, noise_var, z[blk.stat], blk.max_rejections
                    )
                    s_full = s_rel
                    rejections = rejections + rej
                    kept[index] = ~ok
                z[blk.stat] = s_rel
            for site, param in blk.params:
                posterior = conjugate_posterior(tr[site]["fn"], s_full, n, record, param)
                z[site] = posterior_from_draws(draws, posterior).astype(z[site].dtype)
            if blk.noise == "laplace" and not blk.naive:
                gap = jnp.abs(y - s_rel)
                z[blk.noise_var] = mixing_variance_from_uniforms(draws.pairs(gap.shape), gap, blk.noise_scale)
        return z, records, rejections, kept


