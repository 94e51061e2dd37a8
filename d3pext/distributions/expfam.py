"""Exponential-family machinery for inference from noisy sufficient statistics.

Bernstein & Sheldon (2018) work with the sufficient statistic ``s = sum_i t(x_i)`` of ``n`` iid
records instead of the records. This module reads the exponential family of one record off a
NumPyro distribution (:func:`family_of`), gives the mean and covariance of ``t(x)`` by autodiff of
the log-partition function (eq. 1), the truncated moments by autodiff of
``log(F(w) - F(v))`` (Lemma 1), the random-sum CLT (Proposition 1), the sensitivity bound of
section 3.3, and the conjugate updates for the priors NumPyro users write (:func:`conjugate_posterior`).

Truncation bounds are static Python floats, so infinite bounds are handled by Python branches and
never reach autodiff (no NaN gradients from ``where(isinf(w), ...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import math

import jax
from jax.nn import softplus
import jax.numpy as jnp
from jax.scipy.special import gammainc, gammaincc, gammaln, logsumexp

import numpyro.distributions as dist
from numpyro.distributions.distribution import (
    Distribution,
    ExpandedDistribution,
    Independent,
    MaskedDistribution,
)

__all__ = [
    "ExpFamily",
    "clt_moments",
    "conjugate_posterior",
    "family_of",
    "find_conjugate",
    "random_sum_moments",
    "record_distribution",
    "register_conjugate",
    "register_family",
    "truncated_moments",
]


@dataclass(frozen=True)
class ExpFamily:
    """The exponential family of one record, ``p(x | eta) = h(x) exp(eta . t(x) - A(eta))``.

    :param name: family name (for messages).
    :param natural_params: maps the record distribution to ``eta`` (shape ``stat_shape``).
    :param log_partition: ``A(eta)``, a scalar; moments of ``t(x)`` come from its derivatives.
    :param statistic: ``t(x)`` of one record (shape ``stat_shape``); broadcasts over records.
    :param stat_shape: shape of ``t(x)``.
    :param stat_range: componentwise ``(min, max)`` of ``t(x)`` over the support.
    :param log_interval_mass: ``(eta, v, w) -> log P(v <= x <= w)`` for univariate families
        (static float bounds, possibly infinite), or ``None``.
    :param discrete: whether ``x`` is integer valued (truncation intervals are inclusive).
    :param covariance_factor: for multivariate families, ``eta -> F`` with ``F F^T`` the
        covariance of ``t(x)`` (``hessian A``), possibly singular; without it samplers factor the
        Hessian by an eigendecomposition (a LAPACK call per chain and sweep).
    :param log_base_measure: ``log h(x)`` of a discrete univariate family (with ``t(x) = x``): with it,
        :func:`truncated_moments` over a finite interval are sums over its values, accurate where the
        interval's mass is far below the float's precision.
    """

    name: str
    natural_params: Callable[[Distribution], jax.Array]
    log_partition: Callable[[jax.Array], jax.Array]
    statistic: Callable[[jax.Array], jax.Array]
    stat_shape: tuple[int, ...]
    stat_range: tuple[float, float]
    log_interval_mass: Callable[[jax.Array, float, float], jax.Array] | None = None
    discrete: bool = False
    covariance_factor: Callable[[jax.Array], jax.Array] | None = None
    log_base_measure: Callable[[jax.Array], jax.Array] | None = None

    @property
    def univariate(self) -> bool:
        return self.stat_shape == ()

    def truncated_statistic(self, x: jax.Array, bounds: tuple[float, float] | None) -> jax.Array:
        """``1_[a, b](x) t(x)`` per record (``t(x)`` when ``bounds`` is None)."""
        t = self.statistic(x)
        if bounds is None:
            return t
        a, b = bounds
        return jnp.where((x >= a) & (x <= b), t, jnp.zeros_like(t))

    def sensitivity(self, bounds: tuple[float, float] | None, neighbouring: str = "substitute") -> float:
        """L1 sensitivity of ``sum_i 1_[a,b](x_i) t(x_i)`` between neighbouring data sets.

        ``neighbouring="substitute"`` (replace one record): without bounds ``sum_j (max t_j - min t_j)``
        (bounded statistics; for the categorical and multinomial families, whose ``t(x)`` sums to the
        number of trials, one record moves that mass between components: twice the range); with
        bounds the bound of Bernstein & Sheldon section 3.3, ``max(max |t(x)|, max |t(x) - t(y)|)``
        over ``[a, b]`` (univariate families, where ``t(x) = x`` here). ``"add_remove"`` (add or
        remove one record): the largest ``||t(x)||_1``, ``max(|min t|, |max t|)`` or ``max(|a|, |b|)``.
        Bounds are for univariate families only: the multivariate statistics are bounded already.

        >>> import numpyro.distributions as dist
        >>> fam = family_of(dist.Poisson(3.0))
        >>> fam.sensitivity((0.0, 10.0)), fam.sensitivity((0.0, 10.0), "add_remove")
        (10.0, 10.0)
        >>> fam = family_of(dist.Bernoulli(probs=0.3))
        >>> fam.sensitivity(None), fam.sensitivity(None, "add_remove")
        (1.0, 1.0)
        """
        if neighbouring not in ("substitute", "add_remove"):
            raise ValueError(f"neighbouring must be 'substitute' or 'add_remove', got {neighbouring!r}.")
        lo, hi = self.stat_range
        if bounds is None:
            if not (math.isfinite(lo) and math.isfinite(hi)):
                raise ValueError(
                    f"The sufficient statistic of the {self.name} family is unbounded "
                    f"(range [{lo}, {hi}]): declare truncation bounds=(a, b) or give an "
                    "explicit sensitivity."
                )
            if neighbouring == "add_remove":
                return float(max(abs(lo), abs(hi)))
            if self.stat_shape == ():
                return float(hi - lo)
            # one record moves one unit of mass between two components (replacement)
            return float(2 * (hi - lo))
        if not self.univariate:
            raise ValueError(
                f"Bounds apply to scalar records; the {self.name} family's statistic (shape "
                f"{self.stat_shape}) is bounded already: omit bounds."
            )
        a, b = bounds
        if neighbouring == "add_remove":
            return float(max(abs(a), abs(b)))
        return float(max(abs(a), abs(b), b - a))


_FAMILIES: dict[type, Callable[[Distribution], ExpFamily]] = {}


def register_family(*classes: type) -> Callable:
    """Register a factory ``fn(record_distribution) -> ExpFamily`` for distribution classes.

    >>> import numpyro.distributions as dist
    >>> family_of(dist.Bernoulli(probs=0.3)).name
    'Bernoulli'
    """

    def decorator(factory: Callable[[Distribution], ExpFamily]) -> Callable:
        for cls in classes:
            _FAMILIES[cls] = factory
        return factory

    return decorator


def record_distribution(fn: Distribution, num_records: int | None = None) -> Distribution:
    """The distribution of one record: ``fn`` with masks and plate expansions removed.

    Raises when the records are not identically distributed (parameters vary across the plate).
    """
    while isinstance(fn, (MaskedDistribution, ExpandedDistribution, Independent)):
        if isinstance(fn, Independent):
            base = fn.base_dist
            while isinstance(base, (MaskedDistribution, ExpandedDistribution, Independent)):
                base = base.base_dist
            if not any(cls in _FAMILIES for cls in type(base).__mro__):
                family_of(base)  # no family either: that is the error to report
            raise ValueError(
                f"The record distribution has event dimensions ({type(base).__name__}(...).to_event("
                f"{fn.reinterpreted_batch_ndims}), event shape {fn.event_shape}); the sufficient-statistic "
                "methods take one scalar family per cell. If the event dimension indexes the records, put them "
                "in a numpyro.plate instead. If it holds the cells of one record, write them as a plate inside "
                "the records' plate (with numpyro.plate('cells', D): dist.X(theta)) and name the records' plate "
                "when releasing (privatize(..., record_plate=...)), or fit the model with DPSVI."
            )
        fn = fn.base_dist
    if fn.batch_shape != ():
        raise ValueError(
            f"The records must be iid given the parameters, but the record distribution "
            f"{type(fn).__name__} has batch shape {fn.batch_shape}: write "
            "`dist.X(theta)` inside a plate rather than per-record parameters."
        )
    return fn


def family_of(fn: Distribution) -> ExpFamily:
    """The :class:`ExpFamily` of one record of ``fn`` (see :func:`record_distribution`).

    >>> import numpyro.distributions as dist
    >>> family_of(dist.Exponential(2.0).expand([10])).stat_range
    (0.0, inf)
    """
    base = record_distribution(fn)
    for cls in type(base).__mro__:
        if cls in _FAMILIES:
            return _FAMILIES[cls](base)
    raise ValueError(
        f"No exponential family is registered for {type(base).__name__}; registered: "
        f"{sorted(c.__name__ for c in _FAMILIES)}. Use d3pext.distributions.expfam.register_family."
    )


def _logit_params(fn: Distribution) -> jax.Array:
    return jnp.asarray(fn.logits)


@register_family(dist.BernoulliProbs, dist.BernoulliLogits)
def _bernoulli(fn: Distribution) -> ExpFamily:
    return ExpFamily(
        "Bernoulli", _logit_params, softplus, lambda x: jnp.asarray(x, jnp.result_type(float)),
        (), (0.0, 1.0), discrete=True,
    )


@register_family(dist.BinomialProbs, dist.BinomialLogits)
def _binomial(fn: Distribution) -> ExpFamily:
    total = fn.total_count
    if not isinstance(total, (int, float)):
        try:
            total = float(total)
        except Exception as e:
            raise ValueError("Binomial total_count must be a concrete number.") from e
    return ExpFamily(
        "Binomial", _logit_params, lambda eta: total * softplus(eta),
        lambda x: jnp.asarray(x, jnp.result_type(float)), (), (0.0, float(total)), discrete=True,
    )


def _categorical_params(fn: Distribution) -> jax.Array:
    return jax.nn.log_softmax(jnp.asarray(fn.logits), -1)


def _one_hot_factor(eta: jax.Array) -> jax.Array:
    """``F = (I - p 1^T) diag(sqrt p)``: ``F F^T = diag(p) - p p^T``, the one-hot covariance."""
    p = jax.nn.softmax(eta, -1)
    root = jnp.sqrt(p)
    return jnp.diag(root) - p[:, None] * root[None, :]


@register_family(dist.CategoricalProbs, dist.CategoricalLogits)
def _categorical(fn: Distribution) -> ExpFamily:
    k = int(fn.support.upper_bound) + 1
    return ExpFamily(
        "Categorical", _categorical_params, logsumexp,
        lambda x: jax.nn.one_hot(x, k), (k,), (0.0, 1.0), discrete=True,
        covariance_factor=_one_hot_factor,
    )


@register_family(dist.MultinomialProbs, dist.MultinomialLogits)
def _multinomial(fn: Distribution) -> ExpFamily:
    k = fn.event_shape[-1]
    total = float(fn.total_count)
    return ExpFamily(
        "Multinomial", _categorical_params, lambda eta: total * logsumexp(eta),
        lambda x: jnp.asarray(x, jnp.result_type(float)), (k,), (0.0, total), discrete=True,
        covariance_factor=lambda eta: math.sqrt(total) * _one_hot_factor(eta),
    )


def _exponential_log_mass(eta: jax.Array, v: float, w: float) -> jax.Array:
    rate = -eta
    v = max(v, 0.0)
    if math.isinf(w):
        return -rate * v
    # log(exp(-rate v) - exp(-rate w)), stable for small rate (w - v)
    return -rate * v + jnp.log(-jnp.expm1(-rate * (w - v)))


@register_family(dist.Exponential)
def _exponential(fn: Distribution) -> ExpFamily:
    return ExpFamily(
        "Exponential", lambda d: -jnp.asarray(d.rate), lambda eta: -jnp.log(-eta),
        lambda x: jnp.asarray(x, jnp.result_type(float)), (), (0.0, math.inf), _exponential_log_mass,
    )


def _poisson_log_mass(eta: jax.Array, v: float, w: float) -> jax.Array:
    rate = jnp.exp(eta)
    lo = 0 if math.isinf(v) else max(math.ceil(v), 0)
    # P(X <= k) = Q(k + 1, rate), P(X >= k) = P(k, rate) (regularized incomplete gammas)
    if math.isinf(w):
        return jnp.log(gammainc(float(lo), rate)) if lo > 0 else jnp.zeros_like(rate)
    below = gammaincc(float(lo), rate) if lo > 0 else 0.0
    return jnp.log(gammaincc(math.floor(w) + 1.0, rate) - below)


@register_family(dist.Poisson)
def _poisson(fn: Distribution) -> ExpFamily:
    return ExpFamily(
        "Poisson", lambda d: jnp.log(jnp.asarray(d.rate)), jnp.exp,
        lambda x: jnp.asarray(x, jnp.result_type(float)), (), (0.0, math.inf), _poisson_log_mass,
        discrete=True, log_base_measure=lambda x: -gammaln(x + 1.0),
    )


def clt_moments(family: ExpFamily, eta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and covariance of ``t(x)`` for one record: ``grad A`` and ``hessian A`` (eq. 1).

    >>> import jax.numpy as jnp, numpyro.distributions as dist
    >>> fam = family_of(dist.Bernoulli(probs=0.25))
    >>> mu, var = clt_moments(fam, jnp.log(0.25 / 0.75))
    >>> round(float(mu), 4), round(float(var), 4)
    (0.25, 0.1875)
    """
    return jax.grad(family.log_partition)(eta), jax.hessian(family.log_partition)(eta)


FINITE_SUM_MAX = 4096
"""A discrete family with a ``log_base_measure``, truncated to an interval of fewer values than this: its
:func:`truncated_moments` are sums over them."""


def truncated_moments(
    family: ExpFamily, eta: jax.Array, v: float, w: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q, mean, variance)`` of ``t(x)`` for a univariate family truncated to ``[v, w]`` (Lemma 1).

    ``q = F(w) - F(v)``; mean and variance add the first and second derivatives of ``log q`` in
    ``eta`` to those of the untruncated family. A discrete family with a ``log_base_measure`` over fewer than
    :data:`FINITE_SUM_MAX` values sums over them instead (accurate where ``q`` underflows).

    >>> import jax.numpy as jnp, numpyro.distributions as dist
    >>> fam = family_of(dist.Exponential(1.0))
    >>> q, m, v = truncated_moments(fam, jnp.array(-1.0), 0.0, jnp.inf)
    >>> float(q), float(m), float(v)
    (1.0, 1.0, 1.0)
    """
    low, high = max(v, family.stat_range[0]), min(w, family.stat_range[1])
    finite = math.isfinite(low) and math.isfinite(high) and 0 <= math.floor(high) - math.ceil(low) < FINITE_SUM_MAX
    if family.discrete and family.log_base_measure is not None and finite:
        first, last = math.ceil(low), math.floor(high)
        # the moments' autodiff form divides masses that underflow (Poisson values up to 10 at rate 80 in
        # single precision: an infinite variance); the sums normalise first
        x = jnp.arange(first, last + 1, dtype=jnp.result_type(eta, float))
        log_p = x * eta + family.log_base_measure(x) - family.log_partition(eta)
        log_q = logsumexp(log_p)
        weights = jnp.exp(log_p - log_q)
        mean = jnp.sum(weights * x)
        return jnp.exp(log_q), mean, jnp.sum(weights * (x - mean) ** 2)
    if family.log_interval_mass is None:
        raise ValueError(f"The {family.name} family has no CDF registered for truncation.")

    def log_mass(e):
        return family.log_interval_mass(e, v, w)

    def log_partition(e):
        return family.log_partition(e) + log_mass(e)

    return (
        jnp.exp(log_mass(eta)),
        jax.grad(log_partition)(eta),
        jax.grad(jax.grad(log_partition))(eta),
    )


def random_sum_moments(
    family: ExpFamily, eta: jax.Array, num_records: int, v: float, w: float
) -> tuple[jax.Array, jax.Array]:
    """Mean and variance of ``sum_i 1_[v,w](x_i) t(x_i)`` by the random-sum CLT (Proposition 1).

    >>> import jax.numpy as jnp, numpyro.distributions as dist
    >>> fam = family_of(dist.Exponential(1.0))
    >>> m, var = random_sum_moments(fam, jnp.array(-1.0), 100, 0.0, jnp.inf)
    >>> float(m), float(var)
    (100.0, 100.0)
    """
    q, mu, sigma = truncated_moments(family, eta, v, w)
    return num_records * q * mu, num_records * q * sigma + num_records * q * (1 - q) * mu**2


# ---------------------------------------------------------------------------------------------
# Conjugate priors. Keyed by (likelihood class, parameter name) and prior class; an update maps
# (prior distribution, statistic s, number of records n, likelihood) to the posterior.

ConjugateUpdate = Callable[[Distribution, jax.Array, int, Distribution], Distribution]
_CONJUGATES: dict[tuple[type, str], dict[type, ConjugateUpdate]] = {}


def register_conjugate(likelihood: type | tuple[type, ...], param: str, prior: type) -> Callable:
    """Register ``update(prior, s, n, record_distribution) -> posterior`` for a conjugate pair.

    >>> import numpyro.distributions as dist
    >>> post = conjugate_posterior(dist.Beta(1.0, 1.0), 3.0, 10, dist.Bernoulli(probs=0.5))
    >>> float(post.concentration1), float(post.concentration0)
    (4.0, 8.0)
    """
    likelihoods = likelihood if isinstance(likelihood, tuple) else (likelihood,)

    def decorator(update: ConjugateUpdate) -> ConjugateUpdate:
        for cls in likelihoods:
            _CONJUGATES.setdefault((cls, param), {})[prior] = update
        return update

    return decorator


def find_conjugate(record: Distribution, param: str, prior: Distribution) -> ConjugateUpdate | None:
    """The registered update for ``record``'s parameter ``param`` under ``prior``, or None (also
    for a masked ``prior``: its density is not the registered family's)."""
    while isinstance(prior, (MaskedDistribution, ExpandedDistribution)):
        if isinstance(prior, MaskedDistribution) and prior._mask is not True:
            return None
        prior = prior.base_dist
    for cls in type(record).__mro__:
        table = _CONJUGATES.get((cls, param))
        if table is not None:
            for prior_cls in type(prior).__mro__:
                if prior_cls in table:
                    return table[prior_cls]
    return None


def conjugate_parameters(record: Distribution) -> tuple[str, ...]:
    """Names of the parameters of ``record`` that have a registered conjugate prior."""
    return tuple(
        sorted({p for cls in type(record).__mro__ for (c, p) in _CONJUGATES if c is cls})
    )


def conjugate_posterior(
    prior: Distribution, s: jax.Array, n: int, record: Distribution, param: str | None = None
) -> Distribution:
    """Posterior of the parameter ``param`` of ``record`` under ``prior`` given ``s`` and ``n``."""
    params = (param,) if param is not None else conjugate_parameters(record)
    for p in params:
        update = find_conjugate(record, p, prior)
        if update is not None:
            while isinstance(prior, (MaskedDistribution, ExpandedDistribution)):
                prior = prior.base_dist
            return update(prior, s, n, record)
    raise ValueError(
        f"No conjugate update registered for {type(record).__name__} with a "
        f"{type(prior).__name__} prior."
    )


@register_conjugate((dist.BernoulliProbs, dist.BernoulliLogits), "probs", dist.Beta)
def _beta_bernoulli(prior, s, n, record):
    return dist.Beta(prior.concentration1 + s, prior.concentration0 + n - s)


@register_conjugate((dist.BinomialProbs, dist.BinomialLogits), "probs", dist.Beta)
def _beta_binomial(prior, s, n, record):
    return dist.Beta(prior.concentration1 + s, prior.concentration0 + n * record.total_count - s)


@register_conjugate(
    (dist.CategoricalProbs, dist.CategoricalLogits, dist.MultinomialProbs, dist.MultinomialLogits),
    "probs",
    dist.Dirichlet,
)
def _dirichlet_categorical(prior, s, n, record):
    return dist.Dirichlet(prior.concentration + s)


@register_conjugate(dist.Exponential, "rate", dist.Gamma)
def _gamma_exponential(prior, s, n, record):
    return dist.Gamma(prior.concentration + n, prior.rate + s)


@register_conjugate(dist.Poisson, "rate", dist.Gamma)
def _gamma_poisson(prior, s, n, record):
    return dist.Gamma(prior.concentration + s, prior.rate + n)
