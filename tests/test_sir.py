"""The exact SIR simulator (models/sir.py) against closed forms, and its privatized model."""

import math

import numpy as np
import pytest
from scipy import stats

import jax
from jax import lax, random
import jax.numpy as jnp

from d3pext.models.sir import (
    SIRTrajectory,
    _kahan_add,
    gillespie_sir,
    private_sir,
)


def _simulate(key, beta, gamma, K, times, num):
    keys = random.split(key, num)
    return jax.jit(jax.vmap(lambda k: gillespie_sir(k, beta, gamma, K, jnp.asarray(times))))(keys)


def test_single_infected_recovers_at_rate_gamma():
    # K = 1: no susceptible, I(t) = 1 until an Exp(gamma) recovery time
    _, infected = _simulate(random.key(0), 2.0, 0.3, 1, [0.0, 1.0, 3.0], 4000)
    for j, t in enumerate([0.0, 1.0, 3.0]):
        k = int(infected[:, j].sum())
        assert stats.binomtest(k, 4000, math.exp(-0.3 * t)).pvalue > 1e-3


def _final_size_pmf(K, beta, gamma):
    # the embedded jump chain from (S, I) = (K - 1, 1): exact distribution of S at extinction
    prob = {(K - 1, 1): 1.0}
    final = np.zeros(K)
    for total in range(2 * K, 0, -1):  # 2S + I decreases by one at every event
        for (s, i), p in list(prob.items()):
            if 2 * s + i != total:
                continue
            del prob[(s, i)]
            if i == 0:
                final[s] += p
                continue
            r_inf, r_rec = beta * s * i / K, gamma * i
            q = r_inf / (r_inf + r_rec)
            if s > 0:
                prob[(s - 1, i + 1)] = prob.get((s - 1, i + 1), 0.0) + p * q
            prob[(s, i - 1)] = prob.get((s, i - 1), 0.0) + p * (1 - q)
    for (s, i), p in prob.items():
        final[s] += p
    return final


def test_final_size_distribution_is_exact():
    K, beta, gamma, num = 12, 1.5, 0.5, 6000
    susceptible, infected = _simulate(random.key(1), beta, gamma, K, [0.0, 1e4], num)
    assert int(infected[:, 1].max()) == 0  # all extinct by t = 1e4
    counts = np.bincount(np.asarray(susceptible[:, 1]), minlength=K)
    pmf = _final_size_pmf(K, beta, gamma)
    np.testing.assert_allclose(pmf.sum(), 1.0, atol=1e-12)
    keep = pmf * num >= 5
    observed, expected = counts[keep], pmf[keep] * num
    if (~keep).any():
        observed = np.append(observed, counts[~keep].sum())
        expected = np.append(expected, pmf[~keep].sum() * num)
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_kahan_accumulation_keeps_small_increments():
    def body(_, tc):
        return _kahan_add(*tc, jnp.float32(1e-5))

    t, _ = lax.fori_loop(0, 10**6, body, (jnp.float32(0.0), jnp.float32(0.0)))
    assert abs(float(t) - 10.0) < 1e-5  # a plain float32 sum is off by ~1e-2


def test_trajectory_distribution_and_private_model():
    d = SIRTrajectory(jnp.array([0.6, 0.6]), 0.1, 1000, [0.0, 20.0, 60.0])
    x = d.sample(random.key(2), (3,))
    assert x.shape == (3, 2, 3) and bool(jnp.all(x[..., 0] == 1))
    with pytest.raises(NotImplementedError, match="intractable"):
        d.log_prob(x)
    with pytest.raises(ValueError, match="increasing"):
        SIRTrajectory(0.5, 0.1, 100, [5.0, 1.0])
    from numpyro.handlers import seed, trace

    tr = trace(seed(private_sir(1000), 0)).get_trace(1000)
    info = tr["infected_dp"]["infer"]["privatize"]
    assert info.mechanism.epsilon == pytest.approx(10.0)  # n L / m, Proposition 4
    assert info.sensitivity == 10.0
    assert tr["infected_dp"]["value"].shape == (10,)
