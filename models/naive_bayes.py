"""The naive-Bayes log-linear model from Laplace-noised cell proportions (seed 000, S3.3;
Karwa et al. 2015).

A record is ``(y, x_1, ..., x_K)``: a class ``y`` in ``{0, ..., I-1}`` and ``K`` features,
``x_k`` in ``{0, ..., J_k - 1}`` (the paper counts from 1). Given the class, the features are
independent: ``p(x | y = i) = prod_k p^k_{i, x_k}``. Priors: ``(p_1..p_I) ~ Dirichlet(alpha)``
(site ``"class_probs"``) and, for each feature ``k = 1..K``, each row ``p^k_{i,.} ~
Dirichlet(alpha)`` (site ``f"feature_probs_{k}"``, shape ``(I, J_k)``). The records form one
sample site ``"records"`` (integer matrix ``(n, K + 1)``, the class in column 0).

**Release.** The proportions ``r^k_{i,j} = n^k_{i,j} / n`` with ``n^k_{i,j} = #(y = i, x_k = j)``,
flattened in the order ``(i, k, j)`` (the order in which S3.3 lists them), each plus independent
``Laplace(0, 2K / (n epsilon))`` noise (release site ``"records_dp"``).

**Sensitivity** (a privacy claim). Under *substitution* of one record (``n`` fixed and public,
the neighbouring relation ``"substitute"`` of :class:`~d3pext.releases.mechanisms.LaplaceMechanism`),
replacing ``(y, x)`` by ``(y', x')`` moves, for each feature ``k``, one count ``n^k_{y, x_k}``
down by one and one count ``n^k_{y', x'_k}`` up by one (or none, if the cells agree): an L1
change of at most ``2 / n`` per feature, ``Delta_1 = 2K / n`` in all, reached whenever the two
records differ in every feature. So ``b = 2K / (n epsilon)`` (as in S3.3) gives epsilon-DP for
substitution. Under add/remove the proportions' denominator ``n`` is itself private and
changes; that relation is not what the paper's scale covers, and the model does not claim it.
A larger sensitivity may be passed; a smaller one is refused.

**The paper's numbers.** :data:`PAPER_CLASS_PROBS`, :data:`PAPER_FEATURE_PROBS` are the true
parameters of S3.3; :data:`PAPER_M` is its observed *private* statistic (the paper prints it as
``r^k_{i,j}`` but it is ``m^k_{i,j} = r^k_{i,j} + e^k_{i,j}``: the proportions of each feature add
to 0.9946 and 0.9931, not 1, and are not multiples of ``1/n``).

**Exact likelihood** (``I = 2``, ``J_k = 2``). With ``n_1 ~ Binomial(n, p_1)``, ``n_2 = n - n_1``
and, given ``n_i``, independent ``n^k_{i,1} ~ Binomial(n_i, p^k_{i,1})``,
``n^k_{i,2} = n_i - n^k_{i,1}``::

    p(m | p) = sum_{n_1=0}^{n} Bin(n_1; n, p_1)
               prod_k [ sum_{a=0}^{n_1} Bin(a; n_1, p^k_{1,1}) Lap(m^k_{1,1} - a/n) Lap(m^k_{1,2} - (n_1-a)/n) ]
               prod_k [ sum_{c=0}^{n_2} Bin(c; n_2, p^k_{2,1}) Lap(m^k_{2,1} - c/n) Lap(m^k_{2,2} - (n_2-c)/n) ]

``O(n^2 K)`` terms, computed in log space (:func:`naive_bayes_log_likelihood`); the tables that
depend only on the release are built once per release.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
import math

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.scipy.special import gammaln, logsumexp, xlogy

import numpyro
from numpyro.distributions import biject_to, constraints
import numpyro.distributions as dist

from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import LaplaceMechanism

__all__ = [
    "PAPER_ALPHA",
    "PAPER_CLASS_PROBS",
    "PAPER_EPSILON",
    "PAPER_FEATURE_PROBS",
    "PAPER_M",
    "PAPER_N",
    "NaiveBayesRecords",
    "naive_bayes_log_likelihood",
    "naive_bayes_model",
    "naive_bayes_naive_posterior",
    "naive_bayes_reference",
    "naive_bayes_sensitivity",
    "naive_bayes_statistic",
    "private_naive_bayes",
    "simulate_naive_bayes",
]

PAPER_N = 100
PAPER_EPSILON = 10.0
PAPER_ALPHA = 2.0
PAPER_CLASS_PROBS = (0.8489, 0.1511)
"""True ``(p_1, p_2)`` of S3.3."""
PAPER_FEATURE_PROBS = (
    ((0.3887, 0.6113), (0.6534, 0.3466)),
    ((0.7537, 0.2463), (0.5834, 0.4166)),
)
"""True ``p^k_{i,j}`` of S3.3, indexed ``[k][i][j]`` (feature, class, level)."""
PAPER_M = (0.3275, 0.4520, 0.5862, 0.1827, 0.1293, 0.0858, 0.1288, 0.0954)
"""The observed private proportions ``m^k_{i,j}`` of S3.3 in the order ``(i, k, j)`` (printed
there as ``r``): ``m^1_{1,1}, m^1_{1,2}, m^2_{1,1}, m^2_{1,2}, m^1_{2,1}, ...``."""


def _check_levels(num_classes: int, levels: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}.")
    levels = tuple(levels)
    if not levels or any(isinstance(j, bool) or int(j) != j or j < 2 for j in levels):
        raise ValueError(f"levels must be a non-empty sequence of integers >= 2, got {levels!r}.")
    return int(num_classes), tuple(int(j) for j in levels)


def _check_n(n: int) -> int:
    if isinstance(n, bool) or int(n) != n or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}.")
    return int(n)


class NaiveBayesRecords(dist.Distribution):
    """One record ``(y, x_1..x_K)`` of the naive-Bayes model (event shape ``(K + 1,)``).

    :param class_probs: ``(I,)``.
    :param feature_probs: a sequence of ``K`` arrays ``(I, J_k)``.

    Parameters carry no batch dimensions (use a plate for the records).

    >>> from jax import random
    >>> d = NaiveBayesRecords(jnp.array([0.5, 0.5]), [jnp.array([[0.9, 0.1], [0.2, 0.8]])])
    >>> x = d.sample(random.key(0), (4,))
    >>> x.shape, d.log_prob(jnp.array([0, 1])).round(4)
    ((4, 2), Array(-2.9957, dtype=float32))
    """

    pytree_data_fields = ("class_probs", "feature_probs")

    def __init__(self, class_probs, feature_probs, validate_args=None):
        self.class_probs = jnp.asarray(class_probs)
        self.feature_probs = tuple(jnp.asarray(p) for p in feature_probs)
        if self.class_probs.ndim != 1 or any(
            p.ndim != 2 or p.shape[0] != self.class_probs.shape[0] for p in self.feature_probs
        ):
            raise ValueError("class_probs must be (I,) and each feature_probs[k] (I, J_k).")
        super().__init__((), (1 + len(self.feature_probs),), validate_args=validate_args)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self):
        top = max(self.class_probs.shape[0], *(p.shape[1] for p in self.feature_probs)) - 1
        return constraints.independent(constraints.integer_interval(0, top), 1)

    def sample(self, key, sample_shape=()):
        shape = tuple(sample_shape) + self.batch_shape
        ky, kx = random.split(key)
        y = random.categorical(ky, jnp.log(self.class_probs), shape=shape)
        cols = [y]
        for k, p in enumerate(self.feature_probs):
            cols.append(random.categorical(random.fold_in(kx, k), jnp.log(p)[y]))
        return jnp.stack(cols, -1)

    def log_prob(self, value):
        value = jnp.asarray(value)
        y = value[..., 0]
        lp = jnp.log(self.class_probs)[y]
        for k, p in enumerate(self.feature_probs):
            lp = lp + jnp.log(p)[y, value[..., k + 1]]
        return lp


def _check_records(records, n, num_classes, levels):
    if records is None or isinstance(records, jax.core.Tracer):
        return records
    x = np.asarray(records)
    if x.shape != (n, len(levels) + 1):
        raise ValueError(
            f"records must have shape (n, K + 1) = {(n, len(levels) + 1)} (class in column 0), "
            f"got {x.shape}."
        )
    if not np.all(np.mod(x, 1) == 0):
        raise ValueError("records must be integer category codes.")
    top = np.array((num_classes, *levels))
    bad = (x < 0) | (x >= top)
    if bad.any():
        col = int(np.nonzero(bad.any(0))[0][0])
        raise ValueError(
            f"records column {col} has values outside {{0, ..., {top[col] - 1}}} "
            f"({int(bad.sum())} entries)."
        )
    return jnp.asarray(x, jnp.int32)


def naive_bayes_model(
    n: int = PAPER_N,
    num_classes: int = 2,
    levels: Sequence[int] = (2, 2),
    alpha: float = PAPER_ALPHA,
    records: jax.Array | None = None,
) -> None:
    """Dirichlet priors and ``n`` records (site ``"records"``, ``(n, K + 1)``, class first)."""
    n = _check_n(n)
    num_classes, levels = _check_levels(num_classes, levels)
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}.")
    records = _check_records(records, n, num_classes, levels)
    class_probs = numpyro.sample("class_probs", dist.Dirichlet(jnp.full(num_classes, float(alpha))))
    feature_probs = [
        numpyro.sample(
            f"feature_probs_{k + 1}", dist.Dirichlet(jnp.full((num_classes, j), float(alpha))).to_event(1)
        )
        for k, j in enumerate(levels)
    ]
    with numpyro.plate("data", n):
        numpyro.sample("records", NaiveBayesRecords(class_probs, feature_probs), obs=records)


def naive_bayes_statistic(
    records: jax.Array, num_classes: int = 2, levels: Sequence[int] = (2, 2)
) -> jax.Array:
    """The proportions ``n^k_{i,j} / n`` in the order ``(i, k, j)``: shape ``(I * sum_k J_k,)``.

    >>> naive_bayes_statistic(jnp.array([[0, 1, 0], [1, 1, 1]])).tolist()
    [0.0, 0.5, 0.5, 0.0, 0.0, 0.5, 0.0, 0.5]
    """
    num_classes, levels = _check_levels(num_classes, levels)
    if not isinstance(records, jax.core.Tracer):
        return _exact_proportions(np.asarray(records), num_classes, levels)
    records = jnp.asarray(records)
    n = records.shape[-2]
    y = jax.nn.one_hot(records[..., 0], num_classes)
    counts = [
        jnp.einsum("...ri,...rj->...ij", y, jax.nn.one_hot(records[..., k + 1], j))
        for k, j in enumerate(levels)
    ]
    return (jnp.concatenate(counts, -1) / n).reshape(*records.shape[:-2], -1)


def _exact_proportions(records: np.ndarray, num_classes: int, levels: tuple[int, ...]) -> np.ndarray:
    """The curator's statistic: integer counts divided by ``n`` in float64 (float32 proportions had moved
    between neighbours by up to 1.19x the sensitivity 2K / n at n = 1e7, beyond the release's one grid
    unit of slack)."""
    *batch, n, _ = records.shape
    rows = records.reshape(-1, n, records.shape[-1]).astype(np.int64)
    offsets = np.arange(rows.shape[0])[:, None]
    parts = []
    for k, j in enumerate(levels):
        cell = offsets * (num_classes * j) + rows[..., 0] * j + rows[..., k + 1]
        counts = np.bincount(cell.ravel(), minlength=rows.shape[0] * num_classes * j)
        parts.append(counts.reshape(rows.shape[0], num_classes, j))
    return (np.concatenate(parts, -1) / np.float64(n)).reshape(*batch, -1)


def naive_bayes_sensitivity(n: int, num_features: int) -> float:
    """L1 sensitivity ``2K / n`` of the released proportions under substitution (module doc).

    >>> naive_bayes_sensitivity(100, 2)
    0.04
    """
    n = _check_n(n)
    if isinstance(num_features, bool) or int(num_features) != num_features or num_features < 1:
        raise ValueError(f"num_features must be a positive integer, got {num_features!r}.")
    return 2 * int(num_features) / n


def private_naive_bayes(
    n: int = PAPER_N,
    epsilon: float = PAPER_EPSILON,
    num_classes: int = 2,
    levels: Sequence[int] = (2, 2),
    alpha: float = PAPER_ALPHA,
    sensitivity: float | None = None,
):
    """The privatized model, with ``n``, the levels and the prior bound in: call it with no
    arguments (``records=`` on the curator's side). Release ``"records_dp"``. The sensitivity
    holds for these ``n``, ``num_classes`` and ``levels`` only: passing other values to the model
    is refused; build another model instead.

    >>> from numpyro.handlers import seed, trace
    >>> model = private_naive_bayes()
    >>> tr = trace(seed(model, 0)).get_trace()
    >>> tr["records_dp"]["value"].shape, tr["records_dp"]["infer"]["privatize"].mechanism.scale
    ((8,), 0.004)
    """
    n = _check_n(n)
    num_classes, levels = _check_levels(num_classes, levels)
    proven = naive_bayes_sensitivity(n, len(levels))
    if sensitivity is None:
        sensitivity = proven
    elif not sensitivity >= proven * (1 - 1e-12):
        raise ValueError(
            f"sensitivity {sensitivity} is below 2K/n = {proven} (substitution of one record): "
            "the release would not be epsilon-DP."
        )
    mechanism = LaplaceMechanism(epsilon, sensitivity=float(sensitivity), neighbouring="substitute")
    built = {"n": n, "num_classes": num_classes, "levels": levels}

    def mismatch(what: str) -> ValueError:
        return ValueError(
            f"private_naive_bayes was built for n={n}, num_classes={num_classes}, "
            f"levels={levels} (sensitivity {sensitivity:g}), but {what}: the release would not "
            "be epsilon-DP. Build the model for the data: private_naive_bayes(n, epsilon, "
            "num_classes, levels)."
        )

    def model(
        n: int = n,
        num_classes: int = num_classes,
        levels: Sequence[int] = levels,
        alpha: float = alpha,
        records: jax.Array | None = None,
    ) -> None:
        given = {"n": n, "num_classes": num_classes, "levels": tuple(levels)}
        for name, value in given.items():
            if value != built[name]:
                raise mismatch(f"the model was called with {name}={value!r}")
        naive_bayes_model(n, num_classes, levels, alpha, records)

    return privatize(
        model,
        site="records",
        mechanism=mechanism,
        statistic=lambda r: naive_bayes_statistic(r, num_classes, levels),
    )


def simulate_naive_bayes(
    rng_key: jax.Array,
    n: int = PAPER_N,
    class_probs: Sequence[float] = PAPER_CLASS_PROBS,
    feature_probs: Sequence = PAPER_FEATURE_PROBS,
) -> jax.Array:
    """``n`` confidential records at the given parameters (default: the paper's truth);
    ``feature_probs[k]`` is ``(I, J_k)``.

    >>> simulate_naive_bayes(random.key(0)).shape
    (100, 3)
    """
    n = _check_n(n)
    d = NaiveBayesRecords(jnp.asarray(class_probs), [jnp.asarray(p) for p in feature_probs])
    return d.sample(rng_key, (n,))


# ---------------------------------------------------------------------------------------------
# Exact likelihood (I = 2, J_k = 2) and reference posterior.


@partial(jax.jit, static_argnums=(1, 2))
def _release_tables(release: jax.Array, n: int, scale: float):
    """``log C(t, a) + log Lap(m_{i,1} - a/n) + log Lap(m_{i,2} - (t-a)/n)``, ``(2, K, n+1, n+1)``,
    ``-inf`` where ``a > t``."""
    m = jnp.asarray(release).reshape(2, -1, 2)  # (i, k, j)
    t = jnp.arange(n + 1.0)[:, None]
    a = jnp.arange(n + 1.0)[None, :]
    valid = a <= t
    log_choose = jnp.where(valid, gammaln(t + 1) - gammaln(a + 1) - gammaln(jnp.abs(t - a) + 1), -jnp.inf)
    log_b = math.log(2 * scale)
    lap1 = -jnp.abs(m[..., 0, None, None] - a / n) / scale
    lap2 = -jnp.abs(m[..., 1, None, None] - (t - a) / n) / scale
    return log_choose + lap1 + lap2 - 2 * log_b, t[:, 0], a[0]


def _log_likelihood_from_tables(tables, class_probs, feature_probs, n):
    base, t, a = tables
    p = jnp.asarray(class_probs)
    q = jnp.asarray(feature_probs)  # (K, 2, 2): [k, i, j]
    q1 = jnp.swapaxes(q[..., 0], 0, 1)[..., None, None]  # (2, K, 1, 1)
    q2 = jnp.swapaxes(q[..., 1], 0, 1)[..., None, None]
    terms = base + xlogy(a, q1) + xlogy(t[:, None] - a, q2)
    terms = jnp.where(jnp.isnan(terms), -jnp.inf, terms)
    inner = jnp.sum(logsumexp(terms, -1), 1)  # (2, n+1): sum over features at n_i = t
    log_n1 = gammaln(n + 1.0) - gammaln(t + 1) - gammaln(n - t + 1) + xlogy(t, p[0]) + xlogy(n - t, p[1])
    return logsumexp(log_n1 + inner[0] + inner[1][::-1])


@partial(jax.jit, static_argnums=(3, 4))
def _exact_log_likelihood(release, class_probs, feature_probs, n, scale):
    return _log_likelihood_from_tables(_release_tables(release, n, scale), class_probs, feature_probs, n)


def _stack_features(feature_probs) -> jax.Array:
    if isinstance(feature_probs, (list, tuple)):
        return jnp.stack([jnp.asarray(p) for p in feature_probs])
    return jnp.asarray(feature_probs)


def naive_bayes_log_likelihood(
    release: jax.Array,
    class_probs: jax.Array,
    feature_probs: jax.Array | Sequence[jax.Array],
    n: int,
    scale: float,
) -> jax.Array:
    """Exact ``log p(release | parameters)`` for ``I = 2`` classes and binary features.

    :param release: ``(4K,)`` in the order ``(i, k, j)``.
    :param class_probs: ``(2,)``; :param feature_probs: ``(K, 2, 2)`` indexed ``[k, i, j]`` (or
        the model's ``K`` arrays ``(2, 2)``).
    :param int n: number of records; :param float scale: Laplace scale ``b`` (``2K/(n eps)``).

    >>> ll = naive_bayes_log_likelihood(jnp.array(PAPER_M), jnp.array(PAPER_CLASS_PROBS),
    ...                                 jnp.array(PAPER_FEATURE_PROBS), 100, 0.004)
    >>> bool(jnp.isfinite(ll))
    True
    """
    q = _stack_features(feature_probs)
    release = jnp.asarray(release, jnp.result_type(float))
    K = q.shape[0]
    if q.shape != (K, 2, 2) or release.shape != (4 * K,) or jnp.shape(class_probs) != (2,):
        raise ValueError(
            "The exact likelihood covers I = 2 classes and binary features: release (4K,), "
            f"class_probs (2,), feature_probs (K, 2, 2); got {release.shape}, "
            f"{jnp.shape(class_probs)}, {q.shape}."
        )
    n = _check_n(n)
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}.")
    return _exact_log_likelihood(release, jnp.asarray(class_probs), q, n, float(scale))


_SIMPLEX = biject_to(constraints.simplex)


def _constrain(u: jax.Array, K: int):
    """Unconstrained ``(1 + 2K,)`` -> ``class_probs (2,)``, ``feature_probs (K, 2, 2)`` and
    ``log |det J|``."""
    x = _SIMPLEX(u[..., None])  # (1 + 2K, 2)
    ladj = jnp.sum(_SIMPLEX.log_abs_det_jacobian(u[..., None], x))
    return x[0], x[1:].reshape(K, 2, 2), ladj


def naive_bayes_reference(
    release: jax.Array,
    rng_key: jax.Array,
    n: int = PAPER_N,
    epsilon: float = PAPER_EPSILON,
    sensitivity: float | None = None,
    alpha: float = PAPER_ALPHA,
    num_draws: int = 20000,
    stages: int = 3,
    chunk: int = 256,
) -> dict:
    """Reference posterior by importance sampling with the exact likelihood (``I = 2``, binary
    features).

    All draws live in the unconstrained (stick-breaking) space. Stage 1 draws from a broad
    multivariate Student-t (4 degrees of freedom, scale 2, centred at 0, covering the prior);
    each later stage from a t fitted to the previous stage's weighted draws (scale inflated by
    1.5); the last stage's weighted draws are returned.

    :returns: ``{"samples": {site: (num_draws, ...)}, "weights", "mean", "sd" (per site),
        "ess"}`` with the model's site names (``class_probs``, ``feature_probs_k``).

    >>> ref = naive_bayes_reference(jnp.array(PAPER_M), random.key(0), num_draws=2000)
    >>> ref["samples"]["feature_probs_1"].shape, ref["ess"] > 200
    ((2000, 2, 2), True)
    """
    release = jnp.asarray(release, jnp.result_type(float))
    if release.ndim != 1 or release.shape[0] % 4:
        raise ValueError(f"release must be (4K,) for binary features and 2 classes, got {release.shape}.")
    K = release.shape[0] // 4
    n = _check_n(n)
    if sensitivity is None:
        sensitivity = naive_bayes_sensitivity(n, K)
    scale = LaplaceMechanism(epsilon, sensitivity=sensitivity).scale
    tables = _release_tables(release, n, scale)
    d = 1 + 2 * K
    prior = dist.Dirichlet(jnp.full(2, float(alpha)))

    def log_prior(u):
        p, q, ladj = _constrain(u, K)
        return prior.log_prob(p) + jnp.sum(prior.log_prob(q)) + ladj

    def log_target(u):
        p, q, _ = _constrain(u, K)
        return log_prior(u) + _log_likelihood_from_tables(tables, p, q, n)

    @jax.jit
    def weigh(key, loc, scale_tril):
        # multivariate Student-t with 4 degrees of freedom: chi2_4 = -2 log(u1 u2), no gamma sampler
        kz, ku = random.split(key)
        z = random.normal(kz, (num_draws, d))
        u = random.uniform(ku, (2, num_draws), minval=jnp.finfo(z.dtype).tiny)
        chi2 = -2.0 * jnp.log(u[0] * u[1])
        us = loc + (z / jnp.sqrt(chi2 / 4.0)[:, None]) @ scale_tril.T
        log_prop = dist.MultivariateStudentT(4.0, loc, scale_tril).log_prob(us)
        logw = lax.map(log_target, us, batch_size=chunk) - log_prop
        logw = jnp.where(jnp.isnan(logw), -jnp.inf, logw)
        w = jnp.exp(logw - logsumexp(logw))
        mean = w @ us
        cov = (us - mean).T @ ((us - mean) * w[:, None])
        return us, w, mean, cov

    # stage 1: a broad t around 0 (the Dirichlet(2, 2) prior has sd ~1.2 in these coordinates);
    # later stages: a t fitted to the previous weighted draws, scale inflated by 1.5
    loc, tril = jnp.zeros(d), 2.0 * jnp.eye(d)
    for key in random.split(rng_key, stages):
        us, w, mean, cov = weigh(key, loc, tril)
        loc, tril = mean, 1.5 * jnp.linalg.cholesky(cov + 1e-6 * jnp.eye(d))
    p, q, _ = jax.vmap(lambda u: _constrain(u, K))(us)
    samples = {"class_probs": p, **{f"feature_probs_{k + 1}": q[:, k] for k in range(K)}}
    mean = {k: jnp.tensordot(w, v, 1) for k, v in samples.items()}
    sd = {k: jnp.sqrt(jnp.tensordot(w, (v - mean[k]) ** 2, 1)) for k, v in samples.items()}
    return {"samples": samples, "weights": w, "mean": mean, "sd": sd, "ess": float(1.0 / jnp.sum(w**2))}


def naive_bayes_naive_posterior(
    release: jax.Array,
    n: int = PAPER_N,
    num_classes: int = 2,
    levels: Sequence[int] = (2, 2),
    alpha: float = PAPER_ALPHA,
) -> dict:
    """The naive posterior: the release treated as exact proportions. Returns the Dirichlet
    concentrations ``{site: alpha + n * max(m, 0)}``; the class pseudo-counts are ``n`` times
    the clipped proportions of each class averaged over the features (each feature gives
    its own, noisy, version of the class counts).

    >>> conc = naive_bayes_naive_posterior(jnp.array(PAPER_M))
    >>> np.round(np.asarray(conc["feature_probs_1"], np.float64), 2).tolist()
    [[34.75, 47.2], [14.93, 10.58]]
    """
    num_classes, levels = _check_levels(num_classes, levels)
    n = _check_n(n)
    m = jnp.clip(jnp.asarray(release), 0.0, None)
    if m.shape != (num_classes * sum(levels),):
        raise ValueError(f"release must have shape ({num_classes * sum(levels)},), got {m.shape}.")
    m = m.reshape(num_classes, sum(levels))
    bounds = np.cumsum((0, *levels))
    per_feature = [m[:, bounds[k] : bounds[k + 1]] for k in range(len(levels))]
    class_counts = n * jnp.mean(jnp.stack([f.sum(1) for f in per_feature]), 0)
    out = {"class_probs": alpha + class_counts}
    for k, f in enumerate(per_feature):
        out[f"feature_probs_{k + 1}"] = alpha + n * f
    return out
