"""Rejection approximate Bayesian computation (ABC) for privatized models: a reference posterior.

The simulator is the privatized NumPyro model run forward, exactly as for SPPE/SPLE
(:class:`d3pext.simulation.sbi.Simulator`): parameters from the prior, confidential data, the released
statistic, then one release drawn through the mechanism. Simulations whose release lies closest
to the observed one (Euclidean distance after scaling each coordinate by the median absolute
deviation of the simulated releases) are kept: the accepted parameters are draws from the ABC
posterior ``p(theta | ||s - s_obs|| <= h)``, which tends to the exact posterior as the accepted
fraction (hence ``h``) tends to zero. Being exact in that limit and free of any density estimator,
it serves as the reference against which the flow-based methods are checked, at the price of many
more simulations.

>>> import jax.numpy as jnp
>>> from jax import random
>>> import numpyro, numpyro.distributions as dist
>>> from d3pext.handlers import privatize
>>> from d3pext.releases.mechanisms import LaplaceMechanism
>>> def model(n, x=None):
...     theta = numpyro.sample("theta", dist.Beta(2.0, 2.0))
...     with numpyro.plate("records", n):
...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
>>> private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0))
>>> res = rejection_abc(private, {"x_dp": jnp.array(30.0)}, random.key(0), 50,
...                     num_simulations=20000, quantile=0.02)
>>> res.samples["theta"].shape, bool(abs(res.mean()["theta"] - 32 / 54) < 0.05)
((400,), True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
import warnings

import numpy as np

import jax
from jax import random
import jax.numpy as jnp
from jax.scipy.special import logsumexp

from d3pext._threads import one_model_at_a_time
from d3pext.simulation import rqmc

__all__ = ["ABCResult", "rejection_abc", "smc_abc"]


@dataclass(frozen=True)
class ABCResult:
    """Accepted draws of a rejection-ABC run.

    :param samples: ``{site: (num_accepted, ...)}``, constrained parameter values.
    :param unconstrained: the same draws as flat unconstrained vectors ``(num_accepted, dim)``.
    :param distances: scaled distances of the accepted releases to the observed one (sorted).
    :param threshold: the largest accepted distance ``h``.
    :param scale: per-coordinate scale of the releases used in the distance.
    :param num_simulations: number of simulations run (all generations).
    :param weights: normalized importance weights of the draws (uniform for rejection ABC).
    :param thresholds: the threshold of each generation (one entry for rejection ABC).
    """

    samples: dict
    unconstrained: jax.Array
    distances: jax.Array
    threshold: float
    scale: jax.Array
    num_simulations: int
    weights: jax.Array
    thresholds: tuple[float, ...] = ()

    @property
    def num_accepted(self) -> int:
        return int(self.distances.shape[0])

    @property
    def ess(self) -> float:
        """Effective sample size ``1 / sum w^2`` of the weighted draws."""
        return float(1.0 / jnp.sum(self.weights**2))

    def mean(self) -> dict:
        """Posterior mean of each site."""
        return {k: jnp.tensordot(self.weights, v, 1) for k, v in self.samples.items()}

    def std(self) -> dict:
        """Posterior standard deviation of each site."""
        mean = self.mean()
        return {k: jnp.sqrt(jnp.tensordot(self.weights, (v - mean[k]) ** 2, 1))
                for k, v in self.samples.items()}


def _release_method(sim) -> str:
    # "mc" maps independent uniforms through each mechanism's inverse cdf: an exact draw. Without
    # an inverse cdf, rqmc.release_points draws from the release distribution (after a warning).
    if all(rqmc.has_inverse_cdf(info.mechanism) for info in sim.releases.values()):
        return "mc"
    return "rqmc"


def _check_int(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _simulator(model, data, model_args, model_kwargs, parameters):
    from d3pext.simulation.sbi import Simulator  # the simulator lives with SPPE/SPLE

    if not data:
        raise ValueError("ABC needs the observed release: data={release site: value}.")
    return Simulator(model, data, model_args, model_kwargs, parameters)


def _simulate(sim, rng_key, num, chunk_size, z=None):
    """``num`` simulations (parameters from the prior, or the given ``z``), in equal chunks (one
    compilation; the last is padded and cut): the flat unconstrained parameters and one release
    each, as NumPy arrays."""
    method = _release_method(sim)
    size = min(chunk_size, num)
    if z is not None:
        pad = (-num) % size
        z = np.concatenate([z, z[:pad]]) if pad else z
    zs, releases = [], []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*no inverse CDF.*")
        for i, start in enumerate(range(0, num, size)):
            k_sim, k_noise = random.split(random.fold_in(rng_key, i))
            zi = None if z is None else jnp.asarray(z[start : start + size])
            zi, stat = sim.simulate(k_sim, size, zi)
            zs.append(np.asarray(zi))
            releases.append(np.asarray(sim.release_points(k_noise, stat, 1, method)[:, 0]))
    return np.concatenate(zs)[:num], np.concatenate(releases)[:num]


@jax.jit
def _log_mixture(x, centres, logw, scale_tril):
    # log sum_j w_j N(x; centres_j, L L'), by whitening both sides: |L^-1 (x - c)|^2
    xw = jax.scipy.linalg.solve_triangular(scale_tril, x.T, lower=True).T
    cw = jax.scipy.linalg.solve_triangular(scale_tril, centres.T, lower=True).T
    sq = jnp.sum(xw**2, 1)[:, None] + jnp.sum(cw**2, 1)[None] - 2 * xw @ cw.T
    log_norm = jnp.sum(jnp.log(jnp.diag(scale_tril))) + 0.5 * x.shape[1] * jnp.log(2 * jnp.pi)
    return logsumexp(logw[None] - 0.5 * jnp.maximum(sq, 0.0), 1) - log_norm


def _default_scale(s: np.ndarray) -> np.ndarray:
    med = np.median(s, 0)
    mad = np.median(np.abs(s - med), 0)
    sd = np.std(s, 0)
    return np.where(mad > 0, mad, np.where(sd > 0, sd, 1.0))


def _distances(z, s, obs, scale):
    d = np.sqrt(np.sum(((s - obs) / scale) ** 2, 1))
    finite = np.all(np.isfinite(s), 1) & np.all(np.isfinite(z), 1)
    return np.where(finite, d, np.inf)


def _closest(d, keep):
    idx = np.argsort(d, kind="stable")[:keep]
    if not np.all(np.isfinite(d[idx])):
        raise ValueError("Too few finite simulations to accept the requested number of draws.")
    return idx


def _scale_of(scale, s, obs):
    if scale is None:
        return _default_scale(s)
    sc = np.broadcast_to(np.asarray(scale, dtype=s.dtype), obs.shape)
    if not np.all(sc > 0):
        raise ValueError("scale must be positive in every coordinate.")
    return sc


@one_model_at_a_time
def rejection_abc(
    model: Callable,
    data: Mapping[str, Any],
    rng_key: jax.Array,
    *model_args: Any,
    num_simulations: int = 100_000,
    quantile: float = 0.01,
    chunk_size: int = 10_000,
    scale: jax.Array | None = None,
    parameters: tuple[str, ...] | None = None,
    **model_kwargs: Any,
) -> ABCResult:
    """Rejection ABC: keep the ``quantile`` fraction of prior simulations closest to the release.

    :param model: a privatized model (forward-simulable, as for ``method="sppe"``).
    :param data: ``{release site: observed value}``.
    :param rng_key: PRNG key; :param model_args, model_kwargs: the model's arguments.
    :param int num_simulations: prior simulations (run in chunks of ``chunk_size``, each one
        vectorised call of the simulator).
    :param float quantile: accepted fraction, in ``(0, 1]``; at least one draw is kept.
    :param scale: per-coordinate scale of the distance (default: median absolute deviation of
        the simulated releases, their standard deviation where that is zero, else 1).
    :param parameters: latent sites to infer (default: all but the confidential data), with every
        latent site their prior depends on.
    :returns: :class:`ABCResult` (uniform weights).
    """
    num_simulations = _check_int("num_simulations", num_simulations)
    chunk_size = _check_int("chunk_size", chunk_size)
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must lie in (0, 1], got {quantile!r}.")
    sim = _simulator(model, data, model_args, model_kwargs, parameters)
    z, s = _simulate(sim, rng_key, num_simulations, chunk_size)
    obs = np.asarray(sim.observed)
    sc = _scale_of(scale, s, obs)
    d = _distances(z, s, obs, sc)
    keep = max(1, int(round(quantile * num_simulations)))
    idx = _closest(d, keep)
    z_acc = jnp.asarray(z[idx])
    h = float(d[idx[-1]])
    return ABCResult(
        samples=jax.vmap(sim.constrain)(z_acc), unconstrained=z_acc, distances=jnp.asarray(d[idx]),
        threshold=h, scale=jnp.asarray(sc), num_simulations=num_simulations,
        weights=jnp.full(keep, 1.0 / keep), thresholds=(h,),
    )


@one_model_at_a_time
def smc_abc(
    model: Callable,
    data: Mapping[str, Any],
    rng_key: jax.Array,
    *model_args: Any,
    num_particles: int = 1000,
    simulations_per_generation: int = 10_000,
    generations: int = 5,
    chunk_size: int = 10_000,
    scale: jax.Array | None = None,
    parameters: tuple[str, ...] | None = None,
    **model_kwargs: Any,
) -> ABCResult:
    """Sequential Monte Carlo ABC (population Monte Carlo, Beaumont et al. 2009) with thresholds
    set by quantiles.

    Generation 1 is :func:`rejection_abc` (the ``num_particles`` closest of
    ``simulations_per_generation`` prior simulations). Each later generation draws
    ``simulations_per_generation`` parameters from the Gaussian mixture around the previous
    particles (covariance twice their weighted covariance, in the unconstrained space), keeps
    the ``num_particles`` closest (their largest distance is the new threshold ``h``) and
    weighs them by ``prior / proposal``, so that they target ``p(theta | d <= h)``. The distance
    scale is fixed after generation 1.

    :returns: :class:`ABCResult` of the last generation (weighted; ``thresholds`` per generation).
    """
    num_particles = _check_int("num_particles", num_particles)
    simulations_per_generation = _check_int("simulations_per_generation", simulations_per_generation)
    generations = _check_int("generations", generations)
    chunk_size = _check_int("chunk_size", chunk_size)
    if num_particles > simulations_per_generation:
        raise ValueError(
            f"num_particles={num_particles} exceeds simulations_per_generation="
            f"{simulations_per_generation}."
        )
    sim = _simulator(model, data, model_args, model_kwargs, parameters)
    obs = np.asarray(sim.observed)
    log_prior = sim.programs.extra.setdefault("log-prior", jax.jit(jax.vmap(sim.log_prior)))
    keys = random.split(rng_key, generations)
    z, s = _simulate(sim, keys[0], simulations_per_generation, chunk_size)
    sc = _scale_of(scale, s, obs)
    d = _distances(z, s, obs, sc)
    idx = _closest(d, num_particles)
    particles, dist, w = z[idx], d[idx], np.full(num_particles, 1.0 / num_particles)
    thresholds = [float(dist[-1])]

    for g in range(1, generations):
        mean = w @ particles
        cov = 2.0 * ((particles - mean).T @ ((particles - mean) * w[:, None]))
        eye = np.eye(cov.shape[0])
        tril = np.linalg.cholesky(cov + (1e-9 * np.trace(cov) + 1e-12) * eye)
        k_pick, k_move, k_sim = random.split(keys[g], 3)
        pick = np.asarray(
            random.choice(k_pick, num_particles, (simulations_per_generation,), p=jnp.asarray(w))
        )
        eps = np.asarray(random.normal(k_move, (simulations_per_generation, particles.shape[1])))
        proposals = particles[pick] + eps @ tril.T
        z, s = _simulate(sim, k_sim, simulations_per_generation, chunk_size, proposals)
        d = _distances(z, s, obs, sc)
        idx = _closest(d, num_particles)
        new = z[idx]
        logw = np.asarray(log_prior(jnp.asarray(new))) - np.asarray(
            _log_mixture(jnp.asarray(new), jnp.asarray(particles), jnp.log(jnp.asarray(w)), jnp.asarray(tril))
        )
        logw = np.where(np.isfinite(logw), logw, -np.inf)
        w = np.exp(logw - logw.max())
        w = w / w.sum()
        particles, dist = new, d[idx]
        thresholds.append(float(dist[-1]))
    z_acc = jnp.asarray(particles)
    return ABCResult(
        samples=jax.vmap(sim.constrain)(z_acc), unconstrained=z_acc, distances=jnp.asarray(dist),
        threshold=thresholds[-1], scale=jnp.asarray(sc),
        num_simulations=generations * simulations_per_generation, weights=jnp.asarray(w),
        thresholds=tuple(thresholds),
    )
