"""Scrambled Sobol RQMC over release mechanisms (d3pext.simulation.rqmc) against exact expectations."""

import math

import numpy as np
import pytest

from jax import random
import jax.numpy as jnp
import numpyro.distributions as dist

from d3pext.simulation import rqmc
from d3pext.releases.mechanisms import BinomialMechanism, LaplaceMechanism, Mechanism


def test_sobol_digits_match_scipy():
    from scipy.stats import qmc

    ref = qmc.Sobol(3, scramble=False).random(16)
    np.testing.assert_array_equal(np.asarray(rqmc.sobol_digits(16, 3)) / 2.0**32, ref)


@pytest.mark.parametrize("dtype", [jnp.float32, None])
def test_scrambled_sets_are_nets_and_open(dtype):
    u = np.asarray(rqmc.scrambled_sobol(random.key(0), 16, 4, shape=(20,), dtype=dtype))
    assert u.shape == (20, 16, 4)
    assert (u > 0).all() and (u < 1).all()
    # a (0, 4, 2)-net in base 2 for the first two Sobol coordinates: one point per 4x4 cell
    for rep in u:
        cells = (rep[:, 0] * 4).astype(int) * 4 + (rep[:, 1] * 4).astype(int)
        assert sorted(cells.tolist()) == list(range(16))
    # the replicates are independent scrambles
    assert not np.allclose(u[0], u[1])


def test_scrambled_points_are_uniform_on_average():
    # unbiasedness: each point is marginally uniform, so E[u^2] = 1/3 exactly
    u = rqmc.scrambled_sobol(random.key(1), 8, 3, shape=(4000,))
    est = np.asarray(jnp.mean(u**2, axis=(1,)))
    assert abs(est.mean() - 1 / 3) < 4 * est.std() / math.sqrt(len(est)) + 1e-4


def test_laplace_tails_finite_in_float32():
    m = LaplaceMechanism(1.0, sensitivity=1.0)
    s = rqmc.release_points(m, random.key(2), jnp.zeros((200, 3), jnp.float32), 64)
    assert bool(jnp.all(jnp.isfinite(s)))
    assert float(jnp.max(jnp.abs(s))) < 18.0  # quantiles within (2^-25, 1 - 2^-25)


@pytest.mark.parametrize("method", ["rqmc", "mc"])
def test_laplace_release_moments(method):
    m = LaplaceMechanism(2.0, sensitivity=1.0)  # b = 0.5
    value = jnp.array([[1.0, -2.0]])
    s = rqmc.release_points(m, random.key(3), jnp.broadcast_to(value, (400, 2)), 64, method)
    np.testing.assert_allclose(np.asarray(s.mean((0, 1))), [1.0, -2.0], atol=0.01)
    np.testing.assert_allclose(float(jnp.abs(s - value).mean()), 0.5, atol=0.01)  # E|noise| = b


def test_binomial_release_moments():
    m = BinomialMechanism.from_pseudo_count(100, 50.0, 1000, sensitivity=1.0)
    value = jnp.array([[200.0, 900.0]])
    s = rqmc.release_points(m, random.key(4), jnp.broadcast_to(value, (100, 2)), 16)
    p = np.asarray(m.probs(value))[0]
    np.testing.assert_allclose(np.asarray(s.mean((0, 1))), 100 * p, rtol=0.01)
    np.testing.assert_allclose(np.asarray(s.var((0, 1))), 100 * p * (1 - p), rtol=0.1)
    assert np.all(np.asarray(s) == np.round(np.asarray(s)))


def test_rqmc_rmse_decays_faster_than_mc():
    m = LaplaceMechanism(1.0, sensitivity=1.0)

    def g(s):
        return jnp.sum(jnp.tanh(s - 0.3), -1) + jnp.exp(-jnp.sum(jnp.abs(s), -1))

    out = rqmc.convergence_study(g, m, jnp.zeros(3), (16, 128), random.key(5),
                                 replicates=60, reference_points=2**12)
    assert -0.7 < out["slope_mc"] < -0.3
    assert out["slope_rqmc"] < -0.8
    assert out["rmse_rqmc"][-1] < out["rmse_mc"][-1] / 4


def test_convergence_study_inverts_the_cdf_in_one_call(monkeypatch):
    # each call site of release_icdf compiles its own inverse CDF (the binomial's: a bisection over betainc)
    m = BinomialMechanism.from_pseudo_count(100, 50.0, 1000, sensitivity=1.0)
    value = jnp.array([200.0, 900.0])
    calls = []
    original = BinomialMechanism.release_icdf

    def counted(self, value, u):
        calls.append(jnp.shape(u))
        return original(self, value, u)

    monkeypatch.setattr(BinomialMechanism, "release_icdf", counted)
    out = rqmc.convergence_study(lambda s: jnp.sum(s, -1), m, value, (16, 64), random.key(7), replicates=8,
                                 reference_points=256)
    assert len([c for c in calls if c != ()]) == 1  # has_inverse_cdf's scalar probe aside
    # the same estimates as point sets drawn one case at a time
    keys = random.split(random.key(7))
    ref = rqmc.release_points(m, keys[0], value[None], 256, "rqmc")
    assert out["reference"] == pytest.approx(float(jnp.mean(jnp.sum(ref, -1))), rel=1e-6)


class _NoQuantile(Mechanism):
    kind = "normal-no-icdf"
    epsilon = 1.0
    delta = 0.1
    sensitivity = 1.0
    neighbouring = "substitute"

    def release_distribution(self, value):
        return dist.Normal(value, 1.0)

    def cost(self):
        raise NotImplementedError


def test_mechanism_without_icdf_falls_back_to_mc():
    mech = _NoQuantile()
    assert not rqmc.has_inverse_cdf(mech)
    with pytest.warns(UserWarning, match="no inverse CDF"):
        s = rqmc.release_points(mech, random.key(6), jnp.zeros((50, 2)), 16)
    assert s.shape == (50, 16, 2)
    assert abs(float(s.std()) - 1.0) < 0.1


def test_bad_input():
    m = LaplaceMechanism(1.0, sensitivity=1.0)
    with pytest.raises(ValueError, match="num_points"):
        rqmc.release_points(m, random.key(0), jnp.zeros((2, 2)), 0)
    with pytest.raises(ValueError, match="method"):
        rqmc.release_points(m, random.key(0), jnp.zeros((2, 2)), 4, method="sobol")
    with pytest.raises(ValueError, match="release axis"):
        rqmc.release_points(m, random.key(0), jnp.zeros(()), 4)
