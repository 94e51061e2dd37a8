"""Goodness of fit of the count distributions of seed 002: Bessel, two-sided geometric, Skellam
and the geometric-noised Poisson, against pmfs computed independently here (scipy, brute-force
sums)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sps
import scipy.stats as st

from d3pext.distributions import (
    Bessel,
    GeometricNoisedPoisson,
    Skellam,
    TwoSidedGeometric,
    bessel_mode,
    sample_bessel,
)

GOF_THRESHOLD = 1e-3  # what a correct sampler passes with probability 1 - 1e-3 (fixed seeds)
NUS = [0.0, 0.3, 1.0, 2.5, 10.0, 50.0]
AS = [0.1, 1.0, 10.0, 100.0, 2000.0]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def chi_square_pvalue(samples, ks, probs, num_bins=30):
    """Pearson chi-square of integer ``samples`` against ``probs`` on the integers ``ks``
    (consecutive cells merged into bins of about ``1 / num_bins`` probability, every expected
    count at least 5)."""
    samples = np.asarray(samples)
    n = samples.size
    assert np.all((samples >= ks[0]) & (samples <= ks[-1])), "sample outside the tabulated range"
    probs = np.asarray(probs, np.float64) / np.sum(probs)
    target = max(5.0 / n, 1.0 / num_bins)
    _, bin_of = np.unique(np.floor((np.cumsum(probs) - probs) / target), return_inverse=True)
    expected = np.bincount(bin_of, weights=probs)
    while expected.size > 2 and expected[-1] * n < 5:  # merge a thin last bin
        bin_of[bin_of == expected.size - 1] -= 1
        expected = np.bincount(bin_of, weights=probs)
    observed = np.bincount(bin_of[samples - ks[0]], minlength=expected.size)
    if expected.size < 2:  # one bin holds all the mass: nothing to test but the range
        return 1.0
    return st.chisquare(observed, n * expected).pvalue


def bessel_pmf_table(nu, a):
    """Bessel pmf on a wide window around its mode, normalised by summation (no Bessel function)."""
    mode = int(np.floor((np.sqrt(a * a + nu * nu) - nu) / 2))
    half = int(60 * np.sqrt(mode + 1)) + 60
    ks = np.arange(max(mode - half, 0), mode + half + 1)
    logw = 2 * ks * np.log(a / 2) - sps.gammaln(ks + 1) - sps.gammaln(ks + nu + 1)
    w = np.exp(logw - logw.max())
    return ks, w / w.sum()


def test_chi_square_helper_detects_a_wrong_sampler():
    rng = np.random.default_rng(0)
    ks = np.arange(0, 60)
    x = rng.poisson(10.0, 20000)
    assert chi_square_pvalue(x, ks, st.poisson(10.0).pmf(ks)) > GOF_THRESHOLD
    assert chi_square_pvalue(x, ks, st.poisson(10.3).pmf(ks)) < GOF_THRESHOLD


# ---------------------------------------------------------------------------------------------
# Bessel
# ---------------------------------------------------------------------------------------------

GRID = list(itertools.product(NUS, AS))
SAMPLES = 10000
_sample_grid = jax.jit(lambda key, nu, a: sample_bessel(key, nu, a, (SAMPLES, len(GRID))))


def test_bessel_sampler_gof_over_the_grid():
    nu = jnp.array([g[0] for g in GRID], jnp.float32)
    a = jnp.array([g[1] for g in GRID], jnp.float32)
    x, ok = _sample_grid(jax.random.PRNGKey(2), nu, a)
    assert bool(ok.all())
    x = np.asarray(x)
    pvalues = []
    for j, (v, s) in enumerate(GRID):
        ks, probs = bessel_pmf_table(v, s)
        pvalues.append(chi_square_pvalue(x[:, j], ks, probs))
    # one test per grid point at level 1e-3 / 30 (Bonferroni): a family-wise level of 1e-3
    assert min(pvalues) > GOF_THRESHOLD / len(GRID), dict(zip(GRID, np.round(pvalues, 5)))
    # and the check has power: the draws of Bessel(2.5, 10) fail against order 3.5 or 1.5
    j = GRID.index((2.5, 10.0))
    for wrong in (3.5, 1.5):
        assert chi_square_pvalue(x[:, j], *bessel_pmf_table(wrong, 10.0)) < GOF_THRESHOLD


MILLIONS = [(1e6, 2000.0), (0.0, 2e6), (3e5, 1e6), (1e6, 2e6)]
# float32 draws of 4 Bessel laws: one compile shared by the two tests below
_sample_four = jax.jit(lambda key, nu, a: sample_bessel(key, nu, a, (SAMPLES, 4)))


def test_bessel_sampler_gof_for_counts_in_the_millions_float32():
    # log p is about 1e7 here, with no digits left in float32 (before: the right tail's slope
    # rounded to 0 and every draw of (0, 2e6) failed or was off); the sampler works with
    # log p(n) - log p(mode), which keeps them
    nu, a = (jnp.array(v, jnp.float32) for v in zip(*MILLIONS))
    x, ok = _sample_four(jax.random.PRNGKey(5), nu, a)
    assert bool(ok.all())
    for j, g in enumerate(MILLIONS):
        assert chi_square_pvalue(np.asarray(x[:, j]), *bessel_pmf_table(*g)) > GOF_THRESHOLD / len(MILLIONS), g


def test_bessel_sampler_at_an_argument_far_below_the_order_float32():
    # (a / 2)^2 / ((M + 1)(M + nu + 1)) underflows in float32 here; its log was -inf, and 0 * -inf
    # at the mode made every proposal fail. The pmf is all at 0 (p(1) / p(0) = (a/2)^2 / (nu + 1))
    nu = jnp.array([5.0, 1e6, 0.0, 3.0], jnp.float32)
    a = jnp.array([4.6e-19, 2e-16, 1e-30, 1.2e-38], jnp.float32)
    x, ok = _sample_four(jax.random.PRNGKey(0), nu, a)
    assert bool(ok.all()) and int(np.asarray(x).max()) == 0


EXTREMES = [(0.0, 1e-6), (7.0, 1e-3), (0.0, 1e4), (200.0, 5e4)]


@pytest.mark.slow
def test_bessel_sampler_extremes_float64_slow(x64):
    # float64 log pmf: exact also where float32 rounding of log p (~5e5 at a = 5e4) shows
    nu, a = (jnp.array(v, jnp.float64) for v in zip(*EXTREMES))
    x, ok = jax.jit(lambda k: sample_bessel(k, nu, a, (SAMPLES, len(EXTREMES))))(
        jax.random.PRNGKey(4)
    )
    assert bool(ok.all())
    for j, g in enumerate(EXTREMES):
        assert chi_square_pvalue(np.asarray(x[:, j]), *bessel_pmf_table(*g)) > GOF_THRESHOLD, g


LOG_PROB_CASES = GRID + [(0.0, 1e-5), (3.0, 2e4)]


def test_bessel_log_prob_mean_variance(x64):
    tables = [bessel_pmf_table(nu, a) for nu, a in LOG_PROB_CASES]
    width = max(ks.size for ks, _ in tables)
    ks = np.stack([t[0][0] + np.arange(width) for t in tables]).astype(np.float64)
    nu, a = (np.array(v)[:, None] for v in zip(*LOG_PROB_CASES))
    lp, mean, var = jax.jit(
        lambda nu, a, k: (Bessel(nu, a).log_prob(k), Bessel(nu, a).mean, Bessel(nu, a).variance)
    )(nu, a, ks)
    ref = (
        (2 * ks + nu) * np.log(a / 2)
        - sps.gammaln(ks + 1)
        - sps.gammaln(ks + nu + 1)
        - (np.log(sps.ive(nu, a)) + a)
    )
    probs = np.exp(ref)
    keep = probs > 1e-200
    np.testing.assert_allclose(np.asarray(lp)[keep], ref[keep], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(np.exp(np.asarray(lp)).sum(axis=1), 1.0, atol=1e-9)
    ref_mean = (ks * probs).sum(axis=1)
    ref_var = ((ks - ref_mean[:, None]) ** 2 * probs).sum(axis=1)
    np.testing.assert_allclose(np.asarray(mean)[:, 0], ref_mean, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(np.asarray(var)[:, 0], ref_var, rtol=1e-6, atol=1e-12)
    modes = np.asarray(bessel_mode(nu, a))[:, 0].astype(int)
    at_mode = probs[np.arange(len(modes)), modes - ks[:, 0].astype(int)]
    assert np.all(at_mode >= probs.max(axis=1) * (1 - 1e-9))


def test_bessel_is_the_minimum_of_two_poissons_given_their_difference():
    # seed 002, Theorem 3: min(y1, y2) | y1 - y2 = tau ~ Bessel(|tau|, 2 sqrt(l1 l2))
    l1, l2 = 4.0, 2.5
    rng = np.random.default_rng(1)
    y1, y2 = rng.poisson(l1, 400000), rng.poisson(l2, 400000)
    for tau in (-1, 0, 3):
        m = np.minimum(y1, y2)[y1 - y2 == tau]
        ks, probs = bessel_pmf_table(abs(tau), 2 * np.sqrt(l1 * l2))
        assert m.size > 5000
        assert chi_square_pvalue(m, ks, probs) > GOF_THRESHOLD


def test_bessel_shapes_and_validation():
    d = Bessel(jnp.array([0.0, 2.0, 5.0]), jnp.array([[1.0], [30.0]]))
    assert d.batch_shape == (2, 3)
    assert jax.eval_shape(lambda k: d.sample(k, (4,)), jax.random.PRNGKey(0)).shape == (4, 2, 3)

    # the failure signal: with no proposal allowed nothing is accepted
    y, ok = jax.jit(lambda k: sample_bessel(k, 1.0, 5.0, (3,), max_iter=0))(jax.random.PRNGKey(1))
    assert jnp.issubdtype(y.dtype, jnp.integer)
    assert not bool(ok.any()) and bool((y == -1).all())
    with pytest.raises(ValueError):
        Bessel(-1.0, 1.0, validate_args=True)
    with pytest.raises(ValueError):
        Bessel(1.0, 0.0, validate_args=True)


# ---------------------------------------------------------------------------------------------
# Two-sided geometric, Skellam and the geometric-noised Poisson
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha, loc", [(0.2, 0), (0.6, -4), (0.95, 10)])
def test_two_sided_geometric_gof(alpha, loc):
    x = np.asarray(TwoSidedGeometric(alpha, loc=loc).sample(jax.random.PRNGKey(11), (SAMPLES,)))
    ks = np.arange(loc - 2000, loc + 2001)
    pmf = (1 - alpha) / (1 + alpha) * alpha ** np.abs(ks - loc)  # seed 002, eq. 6
    assert chi_square_pvalue(x, ks, pmf) > GOF_THRESHOLD


@pytest.mark.parametrize("rate1, rate2", [(0.05, 0.3), (3.0, 7.0), (250.0, 40.0)])
def test_skellam_gof(rate1, rate2):
    x = np.asarray(Skellam(rate1, rate2).sample(jax.random.PRNGKey(12), (SAMPLES,)))
    ks = np.arange(-400, 700)
    # brute-force convolution of the two Poisson pmfs
    n = np.arange(0, 1200)
    p1, p2 = st.poisson(rate1).pmf(n), st.poisson(rate2).pmf(n)
    pmf = np.array([np.sum(p1[max(k, 0) : 1200 + min(k, 0)] * p2[max(-k, 0) : 1200 - max(k, 0)])
                    for k in ks])
    assert chi_square_pvalue(x, ks, pmf) > GOF_THRESHOLD


def _noised_poisson_pmf(mu, alpha, ks):
    """sum_y Pois(y; mu) 2Geo(k - y; alpha), summed in log space."""
    y = np.arange(0, 4000)
    log_py = st.poisson(mu).logpmf(y) if mu > 0 else np.where(y == 0, 0.0, -np.inf)
    log_geo = np.log((1 - alpha) / (1 + alpha)) + np.abs(ks[:, None] - y) * np.log(alpha)
    return np.exp(sps.logsumexp(log_py + log_geo, axis=1))


NOISED_CASES = [(0.3, 0.5), (12.0, 0.9), (150.0, 0.2), (0.0, 0.7), (900.0, 0.05)]


@pytest.mark.slow
def test_geometric_noised_poisson_log_prob_and_gof_slow(x64):
    ks = np.arange(-300, 1500)
    mu, alpha = (np.array(v)[:, None] for v in zip(*NOISED_CASES))
    lp, x = jax.jit(
        lambda mu, alpha, k, key: (
            GeometricNoisedPoisson(mu, alpha).log_prob(k),
            GeometricNoisedPoisson(mu[:, 0], alpha[:, 0]).sample(key, (SAMPLES,)),
        )
    )(mu, alpha, ks, jax.random.PRNGKey(13))
    for j, (m, al) in enumerate(NOISED_CASES):
        ref = _noised_poisson_pmf(m, al, ks)
        keep = ref > 1e-250
        np.testing.assert_allclose(np.asarray(lp[j])[keep], np.log(ref[keep]), rtol=1e-9, atol=1e-9)
        assert chi_square_pvalue(np.asarray(x[:, j]), ks, ref) > GOF_THRESHOLD


def test_geometric_noised_poisson_is_the_exponentially_randomized_skellam():
    # seed 002, eq. 11: Skel(l+ + mu, l-), l+- ~ Exp(mean alpha / (1 - alpha))
    mu, alpha = 4.0, 0.7
    k1, k2 = jax.random.split(jax.random.PRNGKey(14))
    lam = jax.random.exponential(k1, (2, SAMPLES)) * alpha / (1 - alpha)
    x = np.asarray(Skellam(lam[0] + mu, lam[1]).sample(k2))
    ks = np.arange(-300, 300)
    assert chi_square_pvalue(x, ks, _noised_poisson_pmf(mu, alpha, ks)) > GOF_THRESHOLD


@pytest.mark.slow
def test_bessel_sampler_gof_large_sample_slow():
    nu = jnp.array([g[0] for g in GRID], jnp.float32)
    a = jnp.array([g[1] for g in GRID], jnp.float32)
    x, ok = jax.jit(lambda k: sample_bessel(k, nu, a, (400000, len(GRID))))(jax.random.PRNGKey(5))
    assert bool(ok.all())
    x = np.asarray(x)
    pvalues = [chi_square_pvalue(x[:, j], *bessel_pmf_table(*g), num_bins=100) for j, g in enumerate(GRID)]
    assert min(pvalues) > GOF_THRESHOLD / len(GRID), dict(zip(GRID, np.round(pvalues, 5)))
