"""Exact integer samplers (d3pext.releases.exact) against their exact laws, and the float-safe
releases built on them."""

from fractions import Fraction
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from d3pext.prng import chacha_key
from d3pext.releases.exact import (
    KeyBits,
    bernoulli_exp,
    discrete_gaussian,
    discrete_gaussian_delta,
    discrete_gaussian_log_pmf,
    discrete_laplace,
    discrete_laplace_log_pmf,
    randomized_round,
    uniform_below,
)
from d3pext.releases.mechanisms import GaussianMechanism, GeometricMechanism, LaplaceMechanism

N = 40_000
P_MIN = 1e-3  # fixed seeds: each p-value is one draw; a wrong sampler gives p ~ 1e-10 or less


def _chi2_pvalue(samples, log_pmf):
    vals, counts = np.unique(samples, return_counts=True)
    ks = np.arange(vals.min() - 5, vals.max() + 6)
    expected = np.exp(log_pmf(ks)) * len(samples)
    observed = np.zeros(ks.size)
    observed[np.searchsorted(ks, vals)] = counts
    obs, exp_, o, e = [], [], 0.0, 0.0
    for oi, ei in zip(observed, expected):  # pool bins to >= 5 expected
        o, e = o + oi, e + ei
        if e >= 5:
            obs.append(o), exp_.append(e)
            o = e = 0.0
    obs[-1] += o
    exp_[-1] += e + (len(samples) - expected.sum())
    return stats.chisquare(obs, exp_).pvalue


@pytest.mark.parametrize("scale", [Fraction(3, 2), 0.7, 5, Fraction(1, 3)])
def test_discrete_laplace_matches_its_pmf(scale):
    k = discrete_laplace(KeyBits(chacha_key(1)), scale, (N,))
    assert k.dtype == np.int64
    assert _chi2_pvalue(k, lambda x: discrete_laplace_log_pmf(x, scale)) > P_MIN


@pytest.mark.parametrize("sigma2", [2, Fraction(21, 2), Fraction(1, 4)])
def test_discrete_gaussian_matches_its_pmf(sigma2):
    k = discrete_gaussian(KeyBits(chacha_key(2)), sigma2, (N,))
    assert _chi2_pvalue(k, lambda x: discrete_gaussian_log_pmf(x, sigma2)) > P_MIN


@pytest.mark.parametrize("gamma", [Fraction(1, 3), Fraction(7, 3), 0, 3])
def test_bernoulli_exp_is_exact(gamma):
    x = bernoulli_exp(KeyBits(chacha_key(3)), np.full(N, Fraction(gamma), dtype=object))
    assert stats.binomtest(int(x.sum()), N, math.exp(-float(gamma))).pvalue > P_MIN


def test_uniform_below_and_randomized_round():
    bits = KeyBits(chacha_key(4))
    u = uniform_below(bits, np.full(N, 6, dtype=np.int64))
    assert stats.chisquare(np.bincount(u, minlength=6)).pvalue > P_MIN
    big = uniform_below(bits, np.full(200, 10**30, dtype=object))
    assert all(0 <= int(v) < 10**30 for v in big) and len({int(v) for v in big}) == 200
    r = randomized_round(bits, np.full(N, Fraction(13, 4), dtype=object))
    assert set(np.unique(r)) == {3, 4}
    assert stats.binomtest(int((r == 4).sum()), N, 0.25).pvalue > P_MIN


def test_samplers_are_deterministic_given_a_key():
    a = discrete_laplace(KeyBits(chacha_key(5)), 2, (100,))
    assert np.array_equal(a, discrete_laplace(KeyBits(chacha_key(5)), 2, (100,)))
    assert not np.array_equal(a, discrete_laplace(KeyBits(chacha_key(6)), 2, (100,)))
    # threefry keys work too
    assert discrete_gaussian(KeyBits(jax.random.key(0)), 3, (10,)).shape == (10,)


def test_discrete_gaussian_delta_matches_brute_force():
    # delta(eps) = sum_k max(0, P(k) - e^eps P(k - D)) over the privacy loss, summed directly
    sigma2, d, eps = 9.0, 2, 0.8
    k = np.arange(-200, 201)
    p = np.exp(discrete_gaussian_log_pmf(k, sigma2))
    q = np.exp(discrete_gaussian_log_pmf(k - d, sigma2))
    brute = np.sum(np.maximum(p - math.exp(eps) * q, 0.0))
    assert discrete_gaussian_delta(eps, sigma2, d) == pytest.approx(brute, rel=1e-9)


def test_bad_parameters():
    bits = KeyBits(chacha_key(0))
    for bad in (0, -1.5, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            discrete_laplace(bits, bad, (3,))
    with pytest.raises(TypeError):
        discrete_gaussian(bits, "2", (3,))


# --- the float-safe releases ---------------------------------------------------------------


def test_releases_lie_on_the_grid_whatever_the_input():
    # Mironov's attack reads the lattice of float outputs; here every output is a grid point
    lap = LaplaceMechanism(1.0, sensitivity=1.0)
    for x in (0.0, 0.1, 1 / 3):
        y = np.asarray(lap.release(jax.random.key(1), jnp.full(2000, x), reproducible=True), np.float64)
        units = y / (lap.grid / 2000)  # a vector of d values uses grid sensitivity / (resolution d)
        assert np.allclose(units, np.round(units), atol=1e-6)
    gauss = GaussianMechanism(1.0, 1e-5, sensitivity=1.0)
    y = float(gauss.release(jax.random.key(2), 0.1, reproducible=True))
    assert y / (1 / 1024) == pytest.approx(round(y * 1024), abs=1e-6)


def test_scalar_releases_follow_the_nominal_law():
    lap = LaplaceMechanism(0.5, sensitivity=2.0)
    y = np.array([float(lap.release(jax.random.key(i), 0.3, reproducible=True)) for i in range(400)])
    assert stats.kstest(y - 0.3, stats.laplace(scale=4.0).cdf).pvalue > P_MIN
    geo = GeometricMechanism(1.0, sensitivity=2.0)
    k = np.asarray(geo.release(jax.random.key(3), np.zeros(N, np.int32), reproducible=True))
    assert k.dtype.kind == "i"
    assert _chi2_pvalue(k, lambda x: discrete_laplace_log_pmf(x, 2)) > P_MIN


def test_laplace_likelihood_bound():
    # the documented bound: the exact law of a scalar release (randomized rounding, then discrete
    # Laplace of scale t grid units) is grid * continuous Laplace density up to exp(+-(1/t + 1/(12 t^2)))
    for t in (4.0, 64.0):
        for a in (0.0, 0.3, 0.5, 0.9):
            lo = math.floor(a)
            w = np.array([1 - (a - lo), a - lo])  # P(j = lo), P(j = lo + 1)
            m = np.arange(-30, 31)
            log_exact = np.logaddexp(
                np.log(w[0] + 1e-300) + discrete_laplace_log_pmf(m - lo, t),
                np.log(w[1] + 1e-300) + discrete_laplace_log_pmf(m - lo - 1, t),
            )
            log_cont = -np.log(2 * t) - np.abs(m - a) / t
            assert np.max(np.abs(log_exact - log_cont)) <= 1 / t + 1 / (12 * t**2) + 1e-12


@pytest.mark.parametrize("d", [1, 3])
def test_laplace_grid_absorbs_float_error_of_the_statistic(d):
    # the statistic as computed may move between neighbours by its sensitivity plus float error
    # (under a grid unit): the release's exact law must still be epsilon-DP. Exact pmfs of the
    # grid output: randomized rounding to j, then discrete Laplace of the mechanism's scale.
    eps = 1.0
    lap = LaplaceMechanism(eps, sensitivity=1.0, resolution=8)
    r, bound = lap._grid_bound(d)
    t = bound / eps
    a = np.array([0.25] + [0.0] * (d - 1))  # grid units
    b = a.copy()
    b[0] += r + 0.75  # the sensitivity r plus 0.75 units of float error, all in one coordinate
    m = np.arange(-40, r + 41)

    def log_pmf(u):  # first coordinate's output law (the others coincide for both inputs)
        lo, w = math.floor(u), u - math.floor(u)
        return np.logaddexp(np.log1p(-w) + discrete_laplace_log_pmf(m - lo, t),
                            np.log(w + 1e-300) + discrete_laplace_log_pmf(m - lo - 1, t))

    assert np.max(np.abs(log_pmf(a[0]) - log_pmf(b[0]))) <= eps + 1e-9


def test_grid_limit_is_on_each_release_s_l1_norm():
    # a 16-vector at 8.4e14 units per value (below the old per-value limit 2^52) carried two units of
    # float rounding between neighbours, twice the slack; the limit is now 2^49 in L1 per release
    from d3pext.releases.mechanisms import to_grid_units

    with pytest.raises(ValueError, match="2\\^49"):
        to_grid_units(np.full(16, 2.0**45 / 1024), 1.0, 1024, size=16)
    units = to_grid_units(np.full((3, 16), 2.0**40 / 1024), 1.0, 1024, size=16)  # three releases
    assert units.shape == (3, 16)
    lap = LaplaceMechanism(1.0, sensitivity=1.0)
    assert lap.release_many(jax.random.key(0), jnp.full(4, 1e6), 50, reproducible=True).shape == (50, 4)
