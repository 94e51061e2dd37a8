"""The stochastic SIR epidemic with a binomial-mechanism release (seed 000, section 4.1, S3.1).

``S -> I`` at rate ``beta S I / K``, ``I -> R`` at rate ``gamma I``, from ``(K - 1, 1, 0)``. The
simulator is the exact event-driven Gillespie algorithm, one ``lax.while_loop`` per trajectory,
vmapped (lock-step) over trajectories. Event times accumulate in the default float dtype with
Kahan compensation, so that the ~10^6 increments of a ``K = 10^6`` trajectory (each ~10^-5)
keep double-precision accuracy without ``jax_enable_x64``. No approximate (tau-leaping) mode is
offered: the notes measured tau-leaping distorting the spread and the extinction rate.

Release (Proposition 4): the counts ``I(t_1..t_L)`` through the binomial mechanism with ``n``
trials and pseudo-count ``m`` (:class:`~d3pext.releases.mechanisms.BinomialMechanism`, L1 sensitivity
``L``: substituting one individual moves each count by at most one), ``epsilon = n L / m``.
The paper's vectors are the binomial counts divided by ``n``, at ``t = 0, 17, ..., 153``.

The prior is on ``(log beta, log gamma)``, normal with *variances* 0.5 and 0.2 (as in the
authors' code): sites ``"log_beta"``, ``"log_gamma"``.
"""

from __future__ import annotations

import math

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp

import numpyro
from numpyro.distributions import constraints
import numpyro.distributions as dist
from numpyro.distributions.util import promote_shapes

from d3pext.handlers.privatize import privatize
from d3pext.releases.mechanisms import BinomialMechanism

__all__ = [
    "PAPER_FLU_S_DP",
    "PAPER_SIR_S_DP",
    "PAPER_SIR_THETA",
    "PAPER_TIMES",
    "SIRTrajectory",
    "gillespie_sir",
    "private_sir",
    "sir_model",
]

PAPER_TIMES = tuple(float(t) for t in range(0, 154, 17))
"""Observation times of the paper's vectors: 0, 17, ..., 153 (L = 10 in [0, 160])."""
PAPER_SIR_THETA = (math.exp(-0.5), math.exp(-3.0))
"""True (beta, gamma) of S3.1.1."""
PAPER_SIR_S_DP = (0.0010, 0.0310, 0.6140, 0.2630, 0.1230, 0.0470, 0.0180, 0.0090, 0.0050, 0.0030)
"""s_dp of S3.1.1 (binomial counts / n, n = m = 1000, K = 10^6, epsilon = 10)."""
PAPER_FLU_S_DP = (0.0010, 0.0039, 0.0105, 0.0367, 0.0996, 0.2910, 0.3840, 0.3368, 0.3106, 0.2516)
"""The boarding-school influenza vector of S3.1.2 (K = 763). Not privatized (raw counts / 763):
use it as a demonstration only."""


def _kahan_add(t, c, dt):
    y = dt - c
    s = t + y
    return s, (s - t) - y


def gillespie_sir(
    rng_key: jax.Array,
    beta: jax.Array,
    gamma: jax.Array,
    population: int,
    times: jax.Array,
    initial_infected: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """One exact Gillespie trajectory: ``(S(times), I(times))`` (int32, shape ``(L,)``).

    >>> from jax import random
    >>> import jax.numpy as jnp
    >>> s, i = gillespie_sir(random.key(0), 0.6, 0.05, 1000, jnp.array([0.0, 10.0, 50.0]))
    >>> int(s[0]), int(i[0])
    (999, 1)
    """
    times = jnp.asarray(times, jnp.result_type(float))
    dtype = times.dtype
    beta = jnp.asarray(beta, dtype)
    gamma = jnp.asarray(gamma, dtype)
    K = int(population)
    last = times[-1]
    zeros = jnp.zeros(times.shape, jnp.int32)
    init = (jnp.zeros((), dtype), jnp.zeros((), dtype), jnp.int32(K - initial_infected),
            jnp.int32(initial_infected), zeros, zeros, jnp.int32(0))

    def cond(state):
        t, _, _, i, _, _, _ = state
        return (t <= last) & (i > 0)

    def body(state):
        t, c, s, i, obs_s, obs_i, n = state
        u = random.uniform(random.fold_in(rng_key, n), (2,), dtype, minval=jnp.finfo(dtype).tiny)
        r_inf = beta * (s.astype(dtype) / K) * i.astype(dtype)
        r_rec = gamma * i.astype(dtype)
        total = r_inf + r_rec
        t_new, c_new = _kahan_add(t, c, -jnp.log(u[0]) / total)
        hold = (times >= t) & (times < t_new)  # (S, I) holds on [t, t_new)
        obs_s = jnp.where(hold, s, obs_s)
        obs_i = jnp.where(hold, i, obs_i)
        infect = u[1] * total < r_inf
        return (t_new, c_new, s - infect, i + 2 * infect - 1, obs_s, obs_i, n + 1)

    t, _, s, i, obs_s, obs_i, _ = lax.while_loop(cond, body, init)
    after = times >= t  # extinct before these times: the state stays (s, 0)
    return jnp.where(after, s, obs_s), jnp.where(after, i, obs_i)


class SIRTrajectory(dist.Distribution):
    """The infected counts ``I(t_1..t_L)`` of the stochastic SIR model (sampling only).

    :param beta, gamma: infection and recovery rates (batched).
    :param int population: ``K``; :param times: observation times; :param initial_infected: ``I(0)``.
    """

    arg_constraints = {"beta": constraints.positive, "gamma": constraints.positive}
    pytree_data_fields = ("beta", "gamma")
    pytree_aux_fields = ("population", "times", "initial_infected")

    def __init__(self, beta, gamma, population: int, times, initial_infected: int = 1,
                 validate_args=None):
        if int(population) != population or population < 1:
            raise ValueError(f"population must be a positive integer, got {population!r}.")
        if not 1 <= initial_infected <= population:
            raise ValueError("initial_infected must lie in [1, population].")
        self.beta, self.gamma = promote_shapes(beta, gamma)
        self.population = int(population)
        self.times = tuple(float(t) for t in np.asarray(times).reshape(-1))
        if list(self.times) != sorted(self.times) or self.times[0] < 0:
            raise ValueError("times must be non-negative and increasing.")
        self.initial_infected = int(initial_infected)
        batch = jnp.broadcast_shapes(jnp.shape(beta), jnp.shape(gamma))
        super().__init__(batch, (len(self.times),), validate_args=validate_args)

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self):
        return constraints.independent(constraints.integer_interval(0, self.population), 1)

    def sample(self, key, sample_shape=()):
        shape = tuple(sample_shape) + self.batch_shape
        beta = jnp.broadcast_to(self.beta, shape).reshape(-1)
        gamma = jnp.broadcast_to(self.gamma, shape).reshape(-1)
        keys = random.split(key, beta.shape[0])
        times = jnp.asarray(self.times)
        _, infected = jax.vmap(
            lambda k, b, g: gillespie_sir(k, b, g, self.population, times, self.initial_infected)
        )(keys, beta, gamma)
        return infected.reshape(shape + self.event_shape)

    def log_prob(self, value):
        raise NotImplementedError("The SIR likelihood is intractable: the model can only be simulated.")


def sir_model(population: int = 10**6, times=PAPER_TIMES, initial_infected: int = 1) -> None:
    """Prior on ``(log beta, log gamma)`` and the infected counts at ``times`` (site ``"infected"``)."""
    log_beta = numpyro.sample("log_beta", dist.Normal(math.log(0.4), math.sqrt(0.5)))
    log_gamma = numpyro.sample("log_gamma", dist.Normal(math.log(0.125), math.sqrt(0.2)))
    numpyro.sample(
        "infected",
        SIRTrajectory(jnp.exp(log_beta), jnp.exp(log_gamma), population, times, initial_infected),
    )


def private_sir(
    population: int = 10**6,
    total_count: int = 1000,
    pseudo_count: float = 1000.0,
    num_times: int = len(PAPER_TIMES),
):
    """The privatized SIR model: release ``"infected_dp"`` = binomial counts (out of
    ``total_count``), ``epsilon = total_count num_times / pseudo_count`` (10 for the paper).

    Call it with ``(population, times)`` (defaults: the built ``population`` and
    :data:`PAPER_TIMES`); the observed release is the paper's vector times ``n``. The sensitivity
    ``L = num_times`` holds for ``num_times`` observation times only: ``times`` of another length,
    or another ``population`` than the mechanism's, are refused.

    >>> from d3pext.models.sir import private_sir
    >>> model = private_sir(1000)
    >>> # epsilon = n L / m = 1000 * 10 / 1000
    >>> from numpyro.handlers import seed, trace
    >>> tr = trace(seed(model, 0)).get_trace(1000)
    >>> tr["infected_dp"]["infer"]["privatize"].mechanism.epsilon
    10.0
    """
    if isinstance(num_times, bool) or int(num_times) != num_times or num_times < 1:
        raise ValueError(f"num_times must be a positive integer, got {num_times!r}.")
    num_times = int(num_times)
    mechanism = BinomialMechanism.from_pseudo_count(
        total_count, pseudo_count, population, sensitivity=float(num_times)
    )
    built = mechanism.population

    def check_times(length: int) -> None:
        if length != num_times:
            raise ValueError(
                f"private_sir was built for num_times={num_times} observation times (sensitivity "
                f"L = {num_times}, epsilon = {mechanism.epsilon:g}), but the model got {length}: "
                "the recorded epsilon would not be the release's (understated for more times). "
                "Build it with private_sir(..., num_times=len(times))."
            )

    def statistic(infected: jax.Array) -> jax.Array:
        check_times(jnp.shape(infected)[-1])
        return infected

    def model(population: int = built, times=PAPER_TIMES, initial_infected: int = 1) -> None:
        if population != built:
            raise ValueError(
                f"private_sir was built for population={built} (the binomial mechanism's K), but "
                f"the model was called with population={population}: the release would be modelled "
                "with the wrong K. Build it with private_sir(population, ...)."
            )
        check_times(int(np.size(times)))
        sir_model(population, times, initial_infected)

    return privatize(model, site="infected", mechanism=mechanism, statistic=statistic)
