"""Kazan & Reiter's exact Gibbs sampler for a Gaussian model of bounded data (seed 001).

Records ``y_i ~ N(mu, sigma^2)`` lie in public bounds ``[a, b]``; the curator releases the sample
mean and the sample variance (denominator ``n - 1``) through Laplace mechanisms with
sensitivities ``(b - a) / n`` and ``(b - a)^2 / n`` (``privatize(..., statistic="sample_mean")``
and ``"sample_variance"``). Everything is computed on the ``[0, 1]`` scale (Theorem 1: the
releases rescale exactly, ``(y - a) / (b - a)`` and ``v / (b - a)^2``) and reported on the
original scale. One sweep (Appendix D and the R code of Appendix L), on the ``[0, 1]`` scale:

1. ``mu | sigma^2, Ybar``: normal; under constraints truncated to
   ``1/2 +- sqrt(1/4 - sigma^2)`` (Theorem 2);
2. ``1 / sigma^2 | mu, Ybar, S^2``: gamma truncated below at ``2 lam2 / (n - 1)`` and, under
   constraints, at ``1 / (mu (1 - mu))``. Normal-inverse-gamma prior: shape
   ``(n + nu0 + 1) / 2``, rate ``(nu0 sigma0^2 + kappa0 (mu - mu0)^2 + n (Ybar - mu)^2 +
   (n - 1) S^2) / 2`` (the exact full conditional); ``sigma2_update="paper"`` reproduces the
   paper's code (shape ``(n + nu0) / 2``, no ``kappa0`` term), which is not the full conditional
   of any joint posterior. Flat prior: shape ``(n - 2) / 2``, rate ``(n (Ybar - mu)^2 +
   (n - 1) S^2) / 2``;
3. ``Ybar | mu, sigma^2, omega^2``: normal, under constraints truncated to
   ``1/2 +- sqrt(1/4 - (n - 1) S^2 / n)`` (Theorem 3);
4. ``1 / omega^2``: inverse Gaussian (the Laplace noise of the mean as a scale mixture);
5. ``S^2``: ``TGM((n - 1) / 2, (n - 1) / (2 sigma^2), lam2, S^2 released, upper)`` with
   ``upper = n Ybar (1 - Ybar) / (n - 1)`` under constraints (:mod:`d3pext.distributions.truncated_gamma`).

``lam1 = epsilon1 n`` and ``lam2 = epsilon2 n`` are the Laplace rates on the ``[0, 1]`` scale.

**The sigma^2 cap.** The TGM needs ``beta > lam2``, i.e. ``sigma^2 < (n - 1) / (2 n epsilon2)`` on
the ``[0, 1]`` scale (``(b - a)^2`` times that on the original scale). Like the paper's sampler,
this one targets the posterior restricted to that region (:func:`sigma2_cap`). It is harmless
when the cap exceeds ``1/4`` (the constrained bound on ``sigma^2``), e.g. in Example 1 (cap 1.95),
but it binds for small ``n epsilon2``: at ``n = 10``, ``epsilon2 = 1`` it halves the flat-prior
posterior mean of ``sigma^2`` in the unconstrained analysis.

**Priors.** :class:`NormalInverseGamma` (hyperparameters on the original scale) and
:class:`FlatPrior` (``p(mu, sigma^2) propto 1``, proper posterior by Theorem 5, ``n >= 3``);
:class:`JeffreysPrior` (``1 / sigma^2``) gives an improper posterior (Theorem 4) and is refused
(:func:`check_prior`). With ``constrained=True`` the prior is restricted to the feasible region
``a <= mu <= b``, ``sigma^2 <= (mu - a)(b - mu)``.

The model declares its parameters with :func:`bounded_gaussian_prior` (which records the prior
for the backend); see :mod:`d3pext.models.bounded_gaussian`.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Any, Literal, NamedTuple, Union

import numpy as np

import jax
from jax import random
import jax.numpy as jnp

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.handlers import seed, substitute, trace
from numpyro.infer.initialization import init_to_uniform

from d3pext.inference.draws import (
    mixing_variance_from_uniforms,
    truncated_normal_from_uniforms,
    uniform_pairs,
)
from d3pext.distributions.expfam import record_distribution
from d3pext.inference.gibbs_base import ConstrainedGibbsKernel
from d3pext.inference.structure import NotApplicable, PrivateModel
from d3pext.releases.mechanisms import LaplaceMechanism
from d3pext.distributions.truncated_gamma import tgm_from_uniforms, truncated_gamma_from_uniforms
from d3pext.validation import check_bounds

__all__ = [
    "BoundedGaussianSpec",
    "FlatPrior",
    "JeffreysPrior",
    "KazanReiterGibbs",
    "KazanReiterState",
    "NormalInverseGamma",
    "bounded_gaussian_prior",
    "check_prior",
    "fraction_infeasible",
    "from_unit_scale",
    "hpd_interval",
    "posterior_predictive",
    "sigma2_cap",
    "to_unit_scale",
]

PRIOR_KEY = "bounded_gaussian"
"""Key of the :class:`BoundedGaussianSpec` in the ``infer`` dict of the variance site."""


# ---------------------------------------------------------------------------------------------
# Priors


class _Flat(dist.ImproperUniform):
    """``ImproperUniform`` whose forward draw is a fixed feasible placeholder.

    The flat prior has no sampler; forward runs of the model (the curator's ``make_release``,
    where the records are observed and the parameters do not enter the release) get the
    placeholder instead of an error. Inference never draws from it.
    """

    def __init__(self, support, placeholder: float) -> None:
        super().__init__(support, (), ())
        self._placeholder = placeholder

    def sample(self, key, sample_shape=()):
        return jnp.full(sample_shape, self._placeholder, jnp.result_type(float))


@dataclass(frozen=True)
class NormalInverseGamma:
    """``mu | sigma^2 ~ N(mu0, sigma^2 / kappa0)``, ``sigma^2 ~ IG(nu0 / 2, nu0 sigma0_sq / 2)``.

    Hyperparameters on the original scale of the data.

    :param sigma2_update: ``"conditional"`` (default: the exact full conditional of
        ``sigma^2``) or ``"paper"`` (the R code of seed 001, Appendix L, to reproduce its figures;
        it drops the ``kappa0 (mu - mu0)^2`` term and half a degree of freedom).

    >>> NormalInverseGamma(12.5, 1.0, 1.0, 3.8**2).sigma2_update
    'conditional'
    """

    mu0: float
    kappa0: float
    nu0: float
    sigma0_sq: float
    sigma2_update: Literal["conditional", "paper"] = "conditional"

    def __post_init__(self) -> None:
        for name in ("kappa0", "nu0", "sigma0_sq"):
            value = float(getattr(self, name))
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"NormalInverseGamma: {name} must be positive and finite, got {value} (the "
                    "limit kappa0, nu0 -> 0 is the Jeffreys prior, whose posterior is improper)."
                )
        if not math.isfinite(float(self.mu0)):
            raise ValueError(f"NormalInverseGamma: mu0 must be finite, got {self.mu0}.")
        if self.sigma2_update not in ("conditional", "paper"):
            raise ValueError(
                f"sigma2_update must be 'conditional' or 'paper', got {self.sigma2_update!r}."
            )


@dataclass(frozen=True)
class FlatPrior:
    """``p(mu, sigma^2) propto 1``: proper posterior for ``n >= 3`` (seed 001, Theorem 5).

    >>> check_prior(FlatPrior(), n=43)
    'flat prior p(mu, sigma^2) = 1: proper posterior (Kazan & Reiter Theorem 5, n >= 3)'
    """


@dataclass(frozen=True)
class JeffreysPrior:
    """The independent Jeffreys prior ``p(mu, sigma^2) propto 1 / sigma^2``: refused.

    Proper and frequentist-matching without privacy, but given a Laplace-noised mean and
    variance its posterior is improper (seed 001, Theorem 4; empirically also under constraints).
    """


Prior = Union[NormalInverseGamma, FlatPrior, JeffreysPrior]


def check_prior(prior: Prior, n: int | None = None, constrained: bool = False) -> str:
    """Check that ``prior`` gives a proper posterior; return why, or raise ``ValueError``.

    >>> check_prior(JeffreysPrior())
    Traceback (most recent call last):
    ...
    ValueError: The independent Jeffreys prior p(mu, sigma^2) = 1/sigma^2 gives an improper ...
    """
    if isinstance(prior, JeffreysPrior):
        raise ValueError(
            "The independent Jeffreys prior p(mu, sigma^2) = 1/sigma^2 gives an improper "
            "posterior from a Laplace-noised mean and variance (Kazan & Reiter, Theorem 4: the "
            "integral over sigma^2 diverges near 0, as the noisy variance cannot rule out "
            "sigma^2 -> 0; under constraints it is improper too). Use FlatPrior() "
            "(p = 1, proper by Theorem 5) or a proper NormalInverseGamma."
        )
    if n is not None and n < 3:
        raise ValueError(f"The bounded Gaussian sampler needs n >= 3 records, got n={n}.")
    if isinstance(prior, FlatPrior):
        return "flat prior p(mu, sigma^2) = 1: proper posterior (Kazan & Reiter Theorem 5, n >= 3)"
    if isinstance(prior, NormalInverseGamma):
        return "normal-inverse-gamma prior: proper prior, proper posterior"
    raise TypeError(
        f"prior must be NormalInverseGamma, FlatPrior or JeffreysPrior, got {type(prior).__name__}."
    )


@dataclass(frozen=True)
class BoundedGaussianSpec:
    """What the backend needs to know about the parameters of a bounded Gaussian model."""

    prior: Prior
    bounds: tuple[float, float]
    constrained: bool
    mean_site: str = "mu"
    var_site: str = "sigma2"


def bounded_gaussian_prior(
    prior: Prior,
    bounds: tuple[float, float],
    constrained: bool = False,
    *,
    mean_site: str = "mu",
    var_site: str = "sigma2",
) -> tuple[jax.Array, jax.Array]:
    """Sample the mean and variance of a bounded Gaussian model under ``prior`` (call in a model).

    Ordinary NumPyro sites (``InverseGamma`` and ``Normal``, or ``ImproperUniform``, whose
    forward draw is a feasible placeholder so that the curator can run the model), plus a
    factor ``"feasible"`` restricting them to ``a <= mu <= b``, ``sigma^2 <= (mu - a)(b - mu)``
    when ``constrained``. The variance site's ``infer`` carries a :class:`BoundedGaussianSpec`,
    which the ``"gibbs"`` backend ``"kazan-reiter"`` reads.

    >>> import jax.numpy as jnp, numpyro.distributions as dist
    >>> from numpyro.handlers import seed, trace
    >>> def model():
    ...     mu, sigma2 = bounded_gaussian_prior(FlatPrior(), (0.0, 100.0), constrained=True)
    >>> sorted(trace(seed(model, 0)).get_trace())
    ['feasible', 'mu', 'sigma2']
    """
    check_prior(prior, constrained=constrained)
    a, b = check_bounds("bounds", bounds)
    spec = BoundedGaussianSpec(prior, (a, b), bool(constrained), mean_site, var_site)
    infer = {PRIOR_KEY: spec}
    if isinstance(prior, NormalInverseGamma):
        sigma2 = numpyro.sample(
            var_site,
            dist.InverseGamma(prior.nu0 / 2, prior.nu0 * prior.sigma0_sq / 2),
            infer=infer,
        )
        mu = numpyro.sample(mean_site, dist.Normal(prior.mu0, jnp.sqrt(sigma2 / prior.kappa0)))
    else:
        sigma2 = numpyro.sample(
            var_site,
            _Flat(
                constraints.interval(0.0, (b - a) ** 2 / 4) if constrained else constraints.positive,
                (b - a) ** 2 / 16,
            ),
            infer=infer,
        )
        support = constraints.interval(a, b) if constrained else constraints.real
        mu = numpyro.sample(mean_site, _Flat(support, (a + b) / 2))
    if constrained:
        feasible = (mu >= a) & (mu <= b) & (sigma2 <= (mu - a) * (b - mu))
        numpyro.factor("feasible", jnp.where(feasible, 0.0, -jnp.inf))
    return mu, sigma2


# ---------------------------------------------------------------------------------------------
# Rescaling (Theorem 1) and analyst utilities


def to_unit_scale(bounds, mean: Any, variance: Any) -> tuple[Any, Any]:
    """Map a mean and a variance (released or parameters) from ``[a, b]`` to ``[0, 1]``.

    >>> to_unit_scale((0.0, 100.0), 34.3027, 2224.80)
    (0.343027, 0.22248)
    """
    a, b = check_bounds("bounds", bounds)
    return (mean - a) / (b - a), variance / (b - a) ** 2


def from_unit_scale(bounds, mean: Any, variance: Any) -> tuple[Any, Any]:
    """Inverse of :func:`to_unit_scale`.

    >>> from_unit_scale((0.0, 100.0), 0.5, 0.25)
    (50.0, 2500.0)
    """
    a, b = check_bounds("bounds", bounds)
    return a + (b - a) * mean, variance * (b - a) ** 2


def sigma2_cap(n: int, epsilon2: float, bounds=(0.0, 1.0)) -> float:
    """The bound ``sigma^2 < (b - a)^2 (n - 1) / (2 n epsilon2)`` that every variant imposes.

    >>> round(sigma2_cap(43, 0.25, (0.0, 100.0)), 1)
    19534.9
    """
    a, b = check_bounds("bounds", bounds)
    return (b - a) ** 2 * (n - 1) / (2 * n * epsilon2)


def hpd_interval(samples: Any, prob: float = 0.95, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """Highest posterior density interval: the shortest interval holding ``prob`` of the draws.

    Vectorised over the other axes (e.g. many data sets at once). Same rule as R's
    ``HDInterval::hdi``: with ``N`` sorted draws, the window holds ``ceil(prob N)`` draws.

    >>> import jax.numpy as jnp
    >>> lo, hi = hpd_interval(jnp.arange(100.0), 0.9)
    >>> float(hi - lo)
    89.0
    """
    if not 0 < prob < 1:
        raise ValueError(f"prob must be in (0, 1), got {prob}.")
    x = jnp.sort(jnp.moveaxis(jnp.asarray(samples), axis, -1), axis=-1)
    num = x.shape[-1]
    k = max(int(math.ceil(prob * num)) - 1, 0)
    widths = x[..., k:] - x[..., : num - k]
    i = jnp.argmin(widths, axis=-1)[..., None]
    return (
        jnp.take_along_axis(x, i, -1)[..., 0],
        jnp.take_along_axis(x, i + k, -1)[..., 0],
    )


def posterior_predictive(
    rng_key: jax.Array, mu: Any, sigma2: Any, bounds: tuple[float, float] | None = None
) -> jax.Array:
    """One new record per posterior draw: ``N(mu, sigma^2)``, truncated to ``bounds`` if given
    (the constrained analysis, seed 001 footnote 5).

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> y = posterior_predictive(random.key(0), jnp.full(1000, 30.0), jnp.full(1000, 900.0), (0, 100))
    >>> bool((y >= 0).all() and (y <= 100).all())
    True
    """
    mu, sigma2 = jnp.broadcast_arrays(jnp.asarray(mu), jnp.asarray(sigma2))
    w = uniform_pairs(rng_key, mu.shape, jnp.result_type(mu.dtype, float))
    if bounds is None:
        low, high = -jnp.inf, jnp.inf
    else:
        low, high = check_bounds("bounds", bounds)
    return truncated_normal_from_uniforms(w, mu, jnp.sqrt(sigma2), low, high)


def fraction_infeasible(mu: Any, sigma2: Any, bounds: tuple[float, float]) -> jax.Array:
    """Fraction of draws outside the feasible region ``a <= mu <= b``,
    ``sigma^2 <= (mu - a)(b - mu)`` (Theorem 2).

    >>> float(fraction_infeasible([10.0, 50.0, -1.0], [50.0, 3000.0, 1.0], (0.0, 100.0)))
    0.666...
    """
    a, b = check_bounds("bounds", bounds)
    mu, sigma2 = jnp.asarray(mu), jnp.asarray(sigma2)
    ok = (mu >= a) & (mu <= b) & (sigma2 <= (mu - a) * (b - mu))
    return 1.0 - jnp.mean(ok, axis=-1)


# ---------------------------------------------------------------------------------------------
# The kernel


class KazanReiterState(NamedTuple):
    """
    - **z** - current values on the ``[0, 1]`` scale (reported on the original scale).
    - **released** - the released mean and variance on the ``[0, 1]`` scale.
    - **rng_key** - random key for the next sweep.
    """

    z: dict[str, jax.Array]
    released: jax.Array
    rng_key: jax.Array


class KazanReiterGibbs(ConstrainedGibbsKernel):
    """Kazan & Reiter Gibbs sampler (seed 001, Appendix D and L) as a NumPyro ``MCMCKernel``.

    Built by :func:`~d3pext.handlers.private_posterior` (``method="gibbs"``, backend
    ``"kazan-reiter"``; ``method="naive"`` takes the releases as the exact statistics). It works
    per chain on scalars: ``chain_method="vectorized"`` and
    :func:`~d3pext.handlers.sample_releases` ``vmap`` it over chains and releases. Sites reported
    (original scale): the mean and variance sites, ``f"{mean release}_stat"`` (``Ybar``),
    ``f"{variance release}_stat"`` (``S^2``) and ``f"{mean release}_noise_var"`` (``omega^2``).
    Run it with ``jax.enable_x64`` for exact draws (float32 runs, with coarser quantiles).

    **Example**

    >>> import jax, jax.numpy as jnp
    >>> from jax import random
    >>> from d3pext.handlers import private_posterior
    >>> from d3pext.models.bounded_gaussian import private_bounded_gaussian
    >>> model = private_bounded_gaussian(0.25, 0.25, (0.0, 100.0), FlatPrior(), constrained=True)
    >>> mcmc = private_posterior(model, {"y_mean_dp": 34.3027, "y_var_dp": 2224.80},
    ...                          num_warmup=200, num_samples=500, num_chains=4, progress_bar=False)
    >>> mcmc.run(random.key(0), 43)
    >>> type(mcmc.sampler.inner).__name__
    'KazanReiterGibbs'
    >>> bool((mcmc.get_samples()["mu"] >= 0).all())
    True
    """

    def __init__(
        self,
        model,
        spec: BoundedGaussianSpec,
        mean_release: str,
        var_release: str,
        num_records: int,
        rates: tuple[float, float],
        naive: bool = False,
    ) -> None:
        check_prior(spec.prior, num_records, spec.constrained)
        lam1, lam2 = (float(r) for r in rates)
        if not (lam1 > 0 and lam2 > 0):
            raise ValueError(f"Laplace rates must be positive, got {rates}.")
        self._model = model
        self.spec = spec
        self.mean_release = mean_release
        self.var_release = var_release
        self.n = int(num_records)
        self.lam1, self.lam2 = lam1, lam2
        self.naive = bool(naive)
        a, b = spec.bounds
        self._a, self._w = a, b - a
        nig = spec.prior if isinstance(spec.prior, NormalInverseGamma) else None
        if nig is not None:
            self._mu0 = (nig.mu0 - a) / (b - a)
            self._s0 = nig.sigma0_sq / (b - a) ** 2
        self._names = {
            "ybar": f"{mean_release}_stat",
            "s2": f"{var_release}_stat",
            "omega2": f"{mean_release}_noise_var",
        }

    @property
    def sites(self) -> tuple[str, ...]:
        base = (self.spec.mean_site, self.spec.var_site)
        return base if self.naive else (*base, *self._names.values())

    def _feasible_stats(self, ym, yv):
        """Starting (or, naive, fixed) statistics: the releases moved into the feasible region."""
        n = self.n
        cap = (n - 1) / (2 * self.lam2)
        ybar = jnp.clip(ym, 1e-6, 1 - 1e-6) if self.spec.constrained else ym
        top = n / (n - 1) * ybar * (1 - ybar) if self.spec.constrained else jnp.inf
        s2 = jnp.clip(yv, 1e-4, jnp.minimum(0.25, top) * (1 - 1e-6))
        sigma2 = jnp.minimum(jnp.clip(yv, 1e-4, 0.25 * (1 - 1e-6)), 0.999 * cap)
        return ybar, s2, sigma2

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        rng_key, key_trace = random.split(rng_key)
        tr = trace(substitute(seed(self._model, key_trace), substitute_fn=init_to_uniform)).get_trace(
            *model_args, **model_kwargs
        )
        dtype = jnp.result_type(float)
        ym, yv = to_unit_scale(
            self.spec.bounds,
            jnp.asarray(tr[self.mean_release]["value"], dtype),
            jnp.asarray(tr[self.var_release]["value"], dtype),
        )
        ybar, s2, sigma2 = self._feasible_stats(ym, yv)
        mu = jnp.clip(ybar, 0.5 - jnp.sqrt(0.25 - sigma2), 0.5 + jnp.sqrt(0.25 - sigma2))
        mu = mu if self.spec.constrained else ybar
        z = {self.spec.mean_site: mu, self.spec.var_site: sigma2}
        if not self.naive:
            z[self._names["ybar"]] = ybar
            z[self._names["s2"]] = s2
            z[self._names["omega2"]] = jnp.asarray(2.0 / self.lam1**2, dtype)
        if init_params:
            m, v = init_params.get(self.spec.mean_site), init_params.get(self.spec.var_site)
            if m is not None:
                z[self.spec.mean_site] = to_unit_scale(self.spec.bounds, jnp.asarray(m, dtype), 0.0)[0]
            if v is not None:
                z[self.spec.var_site] = to_unit_scale(self.spec.bounds, 0.0, jnp.asarray(v, dtype))[1]
        return KazanReiterState(z, jnp.stack([ym, yv]), rng_key)

    def sample(self, state, model_args, model_kwargs):
        next_key, key_draw, key_retry = random.split(state.rng_key, 3)
        w = uniform_pairs(key_draw, (5,), state.released.dtype)
        z = self._sweep(state.z, state.released, w, key_retry)
        return KazanReiterState(z, state.released, next_key)

    def _sweep(self, z, released, w, key_retry):
        spec, n = self.spec, self.n
        ym, yv = released[0], released[1]
        mu_site, var_site = spec.mean_site, spec.var_site
        z = dict(z)
        if self.naive:
            ybar, s2, _ = self._feasible_stats(ym, yv)
            omega2 = None
        else:
            ybar, s2 = z[self._names["ybar"]], z[self._names["s2"]]
            omega2 = z[self._names["omega2"]]
        sigma2 = z[var_site]
        nig = isinstance(spec.prior, NormalInverseGamma)
        unbounded = jnp.asarray(jnp.inf, w.dtype)

        # 1. mu | sigma^2, Ybar
        if nig:
            k0 = spec.prior.kappa0
            loc, prec = (n * ybar + k0 * self._mu0) / (n + k0), (n + k0) / sigma2
        else:
            loc, prec = ybar, n / sigma2
        if spec.constrained:
            half = jnp.sqrt(jnp.clip(0.25 - sigma2, 0.0))
            low, high = 0.5 - half, 0.5 + half
        else:
            low, high = -unbounded, unbounded
        mu = truncated_normal_from_uniforms(w[:, 0], loc, jnp.sqrt(1 / prec), low, high)

        # 2. 1 / sigma^2 | mu, Ybar, S^2: truncated gamma
        rate = ((n - 1) * s2 + n * (ybar - mu) ** 2) / 2
        if nig:
            p = spec.prior
            if p.sigma2_update == "paper":
                shape = (n + p.nu0) / 2
                rate = rate + p.nu0 * self._s0 / 2
            else:
                shape = (n + p.nu0 + 1) / 2
                rate = rate + (p.nu0 * self._s0 + p.kappa0 * (mu - self._mu0) ** 2) / 2
        else:
            shape = (n - 2) / 2
        floor = 2 * self.lam2 / (n - 1)
        if spec.constrained:
            floor = jnp.maximum(floor, 1 / (mu * (1 - mu)))
        # exact rejection samplers (no incomplete gamma, no inversion fallback compiled: see
        # truncated_gamma_from_uniforms); retry keys i and 2**20 + i: disjoint
        precision = truncated_gamma_from_uniforms(
            (1 + w[:, 1]) / 2, lambda i: random.fold_in(key_retry, i), shape, rate, floor, unbounded,
            fallback=False,
        )
        sigma2 = 1 / precision
        z[mu_site], z[var_site] = mu, sigma2
        if self.naive:
            return z

        # 3. Ybar | mu, sigma^2, omega^2
        prec = 1 / omega2 + n / sigma2
        loc = (ym / omega2 + n * mu / sigma2) / prec
        if spec.constrained:
            half = jnp.sqrt(jnp.clip(0.25 - (n - 1) / n * s2, 0.0))
            low, high = 0.5 - half, 0.5 + half
        ybar = truncated_normal_from_uniforms(w[:, 2], loc, jnp.sqrt(1 / prec), low, high)

        # 4. omega^2 | Ybar: Laplace scale mixture (precision inverse Gaussian)
        omega2 = mixing_variance_from_uniforms(w[:, 3], jnp.abs(ym - ybar), 1 / self.lam1)

        # 5. S^2 | sigma^2, Ybar: truncated gamma mixture
        upper = n / (n - 1) * ybar * (1 - ybar) if spec.constrained else unbounded
        s2 = tgm_from_uniforms(
            (1 + w[:, 4]) / 2, lambda i: random.fold_in(key_retry, 2**20 + i),
            (n - 1) / 2, (n - 1) / (2 * sigma2), self.lam2, yv, upper, fallback=False,
        )
        z[self._names["ybar"]], z[self._names["omega2"]], z[self._names["s2"]] = ybar, omega2, s2
        return z

    def postprocess_fn(self, model_args, model_kwargs):
        a, w = self._a, self._w
        means = {self.spec.mean_site, self._names["ybar"]}

        def to_original(z):
            return {k: a + w * v if k in means else v * w**2 for k, v in z.items()}

        return to_original



# ---------------------------------------------------------------------------------------------
# The backends


def _build(pm: PrivateModel, naive: bool) -> KazanReiterGibbs:
    bounded = {k: i for k, i in pm.releases.items() if i.statistic in ("sample_mean", "sample_variance")}
    if not bounded:
        raise NotApplicable(
            "Kazan & Reiter needs a 'sample_mean' and a 'sample_variance' release of bounded records."
        )
    kinds = sorted(i.statistic for i in bounded.values())
    if kinds != ["sample_mean", "sample_variance"] or len(pm.releases) != 2:
        raise NotApplicable(
            "Kazan & Reiter needs exactly one 'sample_mean' and one 'sample_variance' release "
            f"(of the same site) and no other; got {sorted((k, i.statistic) for k, i in pm.releases.items())}."
        )
    mean_name = next(k for k, i in bounded.items() if i.statistic == "sample_mean")
    var_name = next(k for k, i in bounded.items() if i.statistic == "sample_variance")
    mean_info, var_info = bounded[mean_name], bounded[var_name]
    if mean_info.source != var_info.source:
        raise NotApplicable(
            f"the mean and variance are released from different sites "
            f"({mean_info.source!r}, {var_info.source!r})."
        )
    if mean_info.bounds != var_info.bounds:
        raise ValueError(
            f"The mean and the variance were released with different bounds "
            f"({mean_info.bounds}, {var_info.bounds})."
        )
    for info in (mean_info, var_info):
        if not isinstance(info.mechanism, LaplaceMechanism):
            raise NotApplicable(
                f"release {info.name!r}: Kazan & Reiter covers the Laplace mechanism, not "
                f"{type(info.mechanism).__name__}."
            )
    try:
        record = record_distribution(pm.sites[mean_info.source].fn)
    except ValueError as e:
        raise NotApplicable(f"records of {mean_info.source!r}: {e}") from e
    if not isinstance(record, dist.Normal):
        raise NotApplicable(
            f"Kazan & Reiter needs normal records, {mean_info.source!r} is {type(record).__name__}."
        )
    spec = pm.declaration(
        PRIOR_KEY, "declare the mean and variance with d3pext.inference.bounded.bounded_gaussian_prior(...)")
    other = set(pm.latent) - {spec.mean_site, spec.var_site, mean_info.source}
    if other:
        raise NotApplicable(f"latent sites {sorted(other)} have no Kazan & Reiter update.")
    if tuple(spec.bounds) != tuple(mean_info.bounds):
        raise ValueError(
            f"The prior's bounds {spec.bounds} differ from the release bounds {mean_info.bounds}."
        )
    for name in (mean_name, var_name):
        shape = np.shape(pm.sites[name].value)
        if shape != ():
            raise ValueError(f"The release {name!r} must be a scalar, got shape {shape}.")
    n = mean_info.num_records
    if var_info.num_records != n:
        raise ValueError("The mean and the variance were released for different numbers of records.")
    check_prior(spec.prior, n, spec.constrained)
    a, b = spec.bounds
    # Laplace rates on the [0, 1] scale (epsilon n for the sensitivities (b - a)/n, (b - a)^2/n)
    rates = ((b - a) / mean_info.mechanism.scale, (b - a) ** 2 / var_info.mechanism.scale)
    return KazanReiterGibbs(pm.model, spec, mean_name, var_name, n, rates, naive=naive)


def kazan_reiter_kernel(pm: PrivateModel, options: dict) -> KazanReiterGibbs:
    """The ``"gibbs"`` backend: exact TGM Gibbs given the released mean and variance."""
    return _build(pm, naive=False)


def naive_bounded_kernel(pm: PrivateModel, options: dict) -> KazanReiterGibbs:
    """The ``"naive"`` backend: the released mean and variance taken as exact."""
    return _build(pm, naive=True)
