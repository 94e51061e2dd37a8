"""Checks of d3pext.distributions.truncated_gamma (truncated gamma, TGM) and of the inverse-Gaussian draws used by the
Kazan & Reiter sampler, against exact (mpmath / scipy) densities and CDFs."""

import math

import jax
import jax.numpy as jnp
import mpmath as mp
import numpy as np
import pytest
import scipy.stats as st

from d3pext.distributions import InverseGaussian
from d3pext.inference.draws import laplace_mixing_variance
from d3pext.distributions.truncated_gamma import (
    TGM,
    log_gamma_mass,
    log_gammainc,
    log_gammaincc,
    tgm_log_weights,
    truncated_gamma,
    truncated_gamma_icdf,
)

# fixed seeds; a correct sampler passes each check with probability 1 - 1e-3 for a fresh seed
GOF_THRESHOLD = 1e-3
mp.mp.dps = 40


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def pit_gof(u, bins=50):
    """Probability integral transform ``u = F(x)``: KS and binned chi-square p-values."""
    u = np.asarray(u, np.float64)
    counts = np.bincount(np.clip((u * bins).astype(int), 0, bins - 1), minlength=bins)
    return min(st.kstest(u, "uniform").pvalue, st.chisquare(counts).pvalue)


def mp_log_p(a, x):
    return float(mp.log(mp.gammainc(a, 0, x, regularized=True)))


def mp_log_q(a, x):
    return float(mp.log(mp.gammainc(a, x, mp.inf, regularized=True)))


# (a, x) from deep lower tail to deep upper tail; the direct P or Q underflows at the extremes
LOG_GAMMA_CASES = [
    (0.5, 1e-300), (0.5, 3.0), (0.5, 800.0), (1.0, 1e3), (21.0, 1e-30), (21.0, 5.0), (21.0, 21.0),
    (21.0, 60.0), (21.0, 4.4e7), (500.0, 100.0), (500.0, 480.0), (500.0, 1600.0), (500.0, 3000.0),
]


def test_log_incomplete_gamma_matches_mpmath(x64):
    a, x = (jnp.array(v, jnp.float64) for v in zip(*LOG_GAMMA_CASES))
    log_p, log_q = jax.jit(lambda a, x: (log_gammainc(a, x), log_gammaincc(a, x)))(a, x)
    for (ai, xi), lp, lq in zip(LOG_GAMMA_CASES, np.asarray(log_p), np.asarray(log_q)):
        ref_p, ref_q = mp_log_p(ai, xi), mp_log_q(ai, xi)
        assert lp == pytest.approx(ref_p, rel=1e-10, abs=1e-12), (ai, xi)
        assert lq == pytest.approx(ref_q, rel=1e-10, abs=1e-12), (ai, xi)


def test_log_gamma_mass_matches_mpmath(x64):
    cases = [(21.0, 0.0, 5.0), (21.0, 4.4e7, math.inf), (21.0, 30.0, 31.0), (3.0, 1e-8, 2e-8),
             (500.0, 1500.0, 1600.0), (0.5, 0.0, 1e-200), (2.0, 5.0, 5.0)]
    a, lo, hi = (jnp.array(v, jnp.float64) for v in zip(*cases))
    got = np.asarray(jax.jit(log_gamma_mass)(a, lo, hi))
    for (ai, l, h), g in zip(cases, got):
        if h <= l:
            assert g == -np.inf
            continue
        ref = float(mp.log(mp.gammainc(ai, l, mp.inf if math.isinf(h) else h, regularized=True)))
        assert g == pytest.approx(ref, rel=1e-9, abs=1e-12), (ai, l, h)


# beta from 10 to 1e8 as in Example 1 of seed 001 (alpha = (n-1)/2 = 21, lam = eps2 n = 10.75)
TGM_BETAS = [12.0, 100.0, 1e3, 1e5, 1e8]


def mp_tgm_log_weights(alpha, beta, lam, tau, upper):
    a, b, l, t = (mp.mpf(v) for v in (alpha, beta, lam, tau))
    u = mp.inf if math.isinf(upper) else mp.mpf(upper)
    cut = min(max(t, 0), u)
    w1 = mp.exp(-l * t) * mp.gammainc(a, 0, (b - l) * cut) / (b - l) ** a
    w2 = mp.exp(l * t) * mp.gammainc(a, (b + l) * cut, (b + l) * u) / (b + l) ** a
    return w1, w2


# tau and upper traced: one compile for the four cases below (as constants, one each)
_tgm_log_weights = jax.jit(lambda b, tau, upper: tgm_log_weights(21.0, b, 10.75, tau, upper))


@pytest.mark.parametrize("upper", [math.inf, 0.25])
@pytest.mark.parametrize("tau", [0.22, -0.05])
def test_tgm_weights_match_mpmath(x64, tau, upper):
    betas = jnp.array(TGM_BETAS)
    lw1, lw2 = _tgm_log_weights(betas, tau, upper)
    for beta, g1, g2 in zip(TGM_BETAS, np.asarray(lw1), np.asarray(lw2)):
        w1, w2 = mp_tgm_log_weights(21.0, beta, 10.75, tau, upper)
        ref1 = -mp.inf if w1 == 0 else mp.log(w1)  # unregularized: Gamma(alpha) included
        ref2 = mp.log(w2)
        if ref1 == -mp.inf:
            assert g1 == -np.inf
        else:
            assert g1 == pytest.approx(float(ref1), rel=1e-10, abs=1e-9), beta
        assert g2 == pytest.approx(float(ref2), rel=1e-10, abs=1e-9), beta
        # the mixture weight pi1 itself
        pi1 = float(w1 / (w1 + w2))
        got = float(np.exp(g1 - np.logaddexp(g1, g2)))
        assert got == pytest.approx(pi1, rel=1e-8, abs=1e-300), beta


def mp_tgm_cdf(alpha, beta, lam, tau, upper, x):
    a, b, l, t = (mp.mpf(v) for v in (alpha, beta, lam, tau))
    u = mp.inf if math.isinf(upper) else mp.mpf(upper)
    x = mp.mpf(x)
    cut = min(max(t, 0), u)
    part1 = mp.exp(-l * t) * mp.gammainc(a, 0, (b - l) * min(x, cut)) / (b - l) ** a
    part2 = mp.exp(l * t) * mp.gammainc(a, (b + l) * cut, (b + l) * max(x, cut)) / (b + l) ** a
    w1, w2 = mp_tgm_log_weights(alpha, beta, lam, tau, upper)
    return float((part1 + part2) / (w1 + w2))


TGM_SAMPLES = 10000


# Two compiled programs shared by the TGM tests: the draws (the sampler with its inversion fallback), and the
# CDF and log density at (5, TGM_SAMPLES) values, which the fallback=False tests below use too. (One program
# for both compiled about as long as these two apart, and the fallback=False program compiled a CDF of its
# own: 48 s of CPU for the three programs, 37 s now.)


@jax.jit
def _tgm_draws(key, alpha, beta, lam, tau, upper):
    """TGM_SAMPLES draws of each of 5 TGMs."""
    keys = jax.random.split(key, alpha.shape[0])
    return jax.vmap(lambda k, *p: TGM(*p).sample(k, (TGM_SAMPLES,)))(keys, alpha, beta, lam, tau, upper)


@jax.jit
def _tgm_cdf_log_prob(alpha, beta, lam, tau, upper, values):
    """CDF and log density of each of 5 TGMs at its row of ``values`` (5, TGM_SAMPLES)."""

    def one(a, b, l, t, u, x):
        d = TGM(a, b, l, t, u)
        return d.cdf(x), d.log_prob(jnp.clip(x, 0.0, u))

    return jax.vmap(one)(alpha, beta, lam, tau, upper, values)


def _tgm_params(beta, tau, upper, alpha=21.0, lam=10.75):
    return [jnp.asarray(np.broadcast_to(np.asarray(v, np.float64), (5,))) for v in (alpha, beta, lam, tau, upper)]


def tgm_cdf(params, values):
    """CDF and log density (NumPy) at ``values``: (5, TGM_SAMPLES), or one row for all 5 TGMs, repeated to
    TGM_SAMPLES (the first ``len(values)`` columns are those values)."""
    values = np.broadcast_to(np.resize(np.asarray(values, np.float64), np.shape(values)[:-1] + (TGM_SAMPLES,)),
                             (5, TGM_SAMPLES))
    return [np.asarray(v) for v in _tgm_cdf_log_prob(*params, jnp.asarray(values))]


def tgm_batch(seed, beta, tau, upper, alpha=21.0, lam=10.75):
    """Draws of 5 TGMs and their CDF at the draws."""
    params = _tgm_params(beta, tau, upper, alpha, lam)
    x = np.asarray(_tgm_draws(jax.random.key(seed), *params))
    return x, tgm_cdf(params, x)[0]


def test_tgm_cdf_and_log_prob_exact(x64):
    xs = np.array([0.05, 0.15, 0.2, 0.22, 0.23, 0.249])
    cdf, log_prob = tgm_cdf(_tgm_params(100.0, 0.22, 0.25), xs)
    for x, c in zip(xs, cdf[0]):
        assert c == pytest.approx(mp_tgm_cdf(21.0, 100.0, 10.75, 0.22, 0.25, x), rel=1e-10)
    # the density is the derivative of the CDF (both sides of the kink at tau)
    for x, lp in zip(xs, log_prob[0]):
        h = 1e-7
        slope = (mp_tgm_cdf(21.0, 100.0, 10.75, 0.22, 0.25, x + h)
                 - mp_tgm_cdf(21.0, 100.0, 10.75, 0.22, 0.25, x - h)) / (2 * h)
        assert float(np.exp(lp)) == pytest.approx(slope, rel=1e-5), x


@pytest.mark.parametrize("upper", [math.inf, 0.25])
def test_tgm_sampler_gof(x64, upper):
    # beta over the whole range of Example 1; KS + chi-square on F(x)
    x, u = tgm_batch(6, TGM_BETAS, 0.22, upper)
    assert np.all(np.isfinite(x)) and np.all(x > 0) and np.all(x <= upper)
    for beta, ui in zip(TGM_BETAS, u):
        assert pit_gof(ui) > GOF_THRESHOLD, beta
    # independent check of the CDF used above at the draws' quartiles (mpmath)
    for beta, xi, ui in zip(TGM_BETAS, x, u):
        for q in (0.25, 0.75):
            i = np.argsort(xi)[int(q * TGM_SAMPLES)]
            assert ui[i] == pytest.approx(mp_tgm_cdf(21.0, beta, 10.75, 0.22, upper, xi[i]), rel=1e-7)


def test_tgm_sampler_degenerate_components(x64):
    # tau <= 0: Gamma(alpha, beta + lam) on (0, upper]; tau >= upper: Gamma(alpha, beta - lam)
    x, _ = tgm_batch(2, 100.0, [-0.1, -0.1, 0.5, 0.5, 0.22], 0.25)
    for xi, rate in zip(x[:4], [110.75, 110.75, 89.25, 89.25]):
        g = st.gamma(21.0, scale=1 / rate)
        assert st.kstest(xi, lambda v: g.cdf(v) / g.cdf(0.25)).pvalue > GOF_THRESHOLD


def test_tgm_rejects_beta_below_lambda():
    with pytest.raises(ValueError, match="beta > lam"):
        TGM(21.0, 10.0, 10.75, 0.22)
    with pytest.raises(ValueError, match="upper > 0"):
        TGM(21.0, 100.0, 10.75, 0.22, 0.0)


@pytest.mark.slow
def test_truncated_gamma_matches_numpyro_truncated_gamma(x64):
    # where NumPyro's TruncatedGamma is accurate (moderate tails), both agree
    from numpyro.distributions.truncated import TwoSidedTruncatedGamma
    import numpyro.distributions as dist

    ref = TwoSidedTruncatedGamma(dist.Gamma(21.0, 100.0), 0.1, 0.3)
    x = jax.jit(lambda k: truncated_gamma(k, 21.0, 100.0, 0.1, 0.3, (TGM_SAMPLES,)))(jax.random.key(3))
    assert pit_gof(ref.cdf(x)) > GOF_THRESHOLD
    u = jnp.linspace(0.01, 0.99, 25)
    np.testing.assert_allclose(ref.cdf(truncated_gamma_icdf(u, 21.0, 100.0, 0.1, 0.3)), u, rtol=1e-9)


# (concentration, rate, low, high): deep tails where the direct normalizer underflows
TRUNC_GAMMA_CASES = [
    (21.0, 2e8, 0.0, 0.22), (21.0, 1.0, 200.0, math.inf), (20.5, 30.0, 4.0, math.inf),
    (0.5, 1.0, 0.0, 1e-250), (21.0, 20.0, 0.0, 0.01), (500.0, 1.0, 1500.0, 1600.0),
]


@pytest.mark.parametrize("a, rate, low, high", TRUNC_GAMMA_CASES)
def test_truncated_gamma_icdf_inverts_exact_cdf(x64, a, rate, low, high):
    u = np.array([1e-6, 0.01, 0.3, 0.5, 0.7, 0.99, 1 - 1e-6])
    x = np.asarray(jax.jit(truncated_gamma_icdf)(jnp.array(u), a, rate, low, high))
    assert np.all((x >= low) & (x <= high))
    def upper_q(z):  # Gamma(a, z); differences of these are exact at high precision
        return mp.gammainc(a, z, mp.inf)

    with mp.workdps(80):
        lo = mp.mpf(low) * rate
        hi = mp.inf if math.isinf(high) else mp.mpf(high) * rate
        if low == 0:  # lower tail: ratios of lower incomplete gammas
            got_all = [mp.gammainc(a, 0, mp.mpf(float(xi)) * rate) / mp.gammainc(a, 0, hi) for xi in x]
        else:
            mass = upper_q(lo) - upper_q(hi)
            got_all = [(upper_q(lo) - upper_q(mp.mpf(float(xi)) * rate)) / mass for xi in x]
    for ui, xi, got in zip(u, x, got_all):
        # quantiles are exact up to the float64 spacing of x times the density
        assert float(got) == pytest.approx(ui, rel=1e-6, abs=1e-12), (ui, xi)


@pytest.mark.slow
def test_truncated_gamma_sampler_deep_tail_gof(x64):
    # mass 1e-87 above low: PIT through the exact (mpmath) CDF on a subsample
    a, rate, low = 21.0, 1.0, 200.0
    x = np.asarray(jax.jit(lambda k: truncated_gamma(k, a, rate, low, math.inf, (2000,)))(jax.random.key(4)))
    with mp.workdps(60):
        mass = mp.gammainc(a, low, mp.inf)
        u = [float(1 - mp.gammainc(a, float(xi), mp.inf) / mass) for xi in x]
    assert st.kstest(u, "uniform").pvalue > GOF_THRESHOLD


# Inverse Gaussian: the Laplace scale mixture's precision (d3pext.distributions, shared) and
# the kernel's draw (d3pext.inference.expfam_gibbs.laplace_mixing_variance), including very large means
IG_MEANS = [1.0, 1e4, 1e8, 1e12, math.inf]


@jax.jit
def _ig_sample(key, m, lam):
    """Draws and the CDF at the first 200 (one compile for every mean; eager, the CDF compiled each operation)."""
    d = InverseGaussian(m, lam)
    x = d.sample(key, (TGM_SAMPLES,))
    return x, d.cdf(x[:200])


_mixing = jax.jit(lambda key, gap, b: laplace_mixing_variance(key, jnp.full(TGM_SAMPLES, gap), b))


def _ig_ref(mean, lam):
    return st.levy(scale=lam) if math.isinf(mean) else st.invgauss(mean / lam, scale=lam)


@pytest.mark.parametrize("mean", IG_MEANS)
def test_inverse_gaussian_gof_large_mean(x64, mean):
    lam = 4.0
    x, cdf = (np.asarray(v) for v in _ig_sample(jax.random.key(7), jnp.float64(mean), lam))
    assert np.all(np.isfinite(x)) and np.all(x > 0)
    ref = _ig_ref(mean, lam)
    assert pit_gof(ref.cdf(x)) > GOF_THRESHOLD
    np.testing.assert_allclose(cdf, ref.cdf(x[:200]), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("gap", [1.0, 1e-4, 1e-8, 1e-12, 0.0])
def test_laplace_mixing_precision_gof(x64, gap):
    # precision 1 / omega^2 ~ IG(1 / (b gap), 1 / b^2) for Laplace scale b (seed 001 eq. 42)
    b = 1 / (0.25 * 43)
    v = _mixing(jax.random.key(8), jnp.float64(gap), b)
    precision = 1 / np.asarray(v)
    mean = math.inf if gap == 0 else 1 / (b * gap)
    assert pit_gof(_ig_ref(mean, 1 / b**2).cdf(precision)) > GOF_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("upper", [math.inf, 0.25, 0.05])
@pytest.mark.parametrize("tau", [0.22, 0.02, -0.05, 0.3])
def test_tgm_sampler_gof_slow(x64, tau, upper):
    for seed, betas in enumerate(np.geomspace(11.0, 1e8, 15).reshape(3, 5)):
        for rep in range(5):
            _, u = tgm_batch(100 * seed + rep, betas, tau, upper)
            for beta, ui in zip(betas, u):
                assert pit_gof(ui) > GOF_THRESHOLD / 10, beta


# ---------------------------------------------------------------------------------------------
# The rejection samplers (truncated_gamma_from_uniforms, tgm_from_uniforms) across regimes, by
# the probability integral transform through independent CDFs (scipy's incomplete gammas for the
# truncated gamma, the mpmath-checked TGM.cdf for the TGM); one compile per sampler.

# (concentration, rate, low, high): small / unit / large shape, narrow / wide truncation, far tail
REJECTION_GAMMA_CASES = [
    (0.5, 1.0, 0.0, math.inf), (0.5, 1.0, 0.3, 2.0), (0.9, 2.0, 5.0, math.inf), (1.0, 1.0, 3.0, 4.0),
    (1.5, 3.0, 0.0, 0.05), (21.0, 100.0, 0.1, 0.3), (21.0, 1.0, 60.0, math.inf),
    (20.5, 30.0, 4.0, math.inf), (500.0, 1.0, 480.0, 481.0), (500.0, 1.0, 0.0, math.inf),
]
SLOW_REJECTION_GAMMA_CASES = REJECTION_GAMMA_CASES + [
    (0.1, 1.0, 0.0, math.inf), (0.5, 1.0, 1e-8, 1e-4), (0.5, 1.0, 30.0, math.inf), (2.0, 1.0, 0.0, 1e-3),
    (3.0, 0.5, 0.0, math.inf), (21.0, 1.0, 100.0, 101.0), (21.0, 2e8, 0.0, 0.22), (1e4, 1.0, 0.0, math.inf),
    (1e4, 1.0, 1e4 + 300.0, math.inf),
]


def _gamma_pit(x, a, rate, low, high):
    """F(x) of Gamma(a, rate) on [low, high] from scipy, in the tail the interval lies in."""
    import scipy.special as sps

    lo, hi, z = low * rate, high * rate, np.asarray(x, np.float64) * rate
    if lo >= a:
        q_lo, q_hi = sps.gammaincc(a, lo), sps.gammaincc(a, hi)
        return (q_lo - sps.gammaincc(a, z)) / (q_lo - q_hi)
    p_lo, p_hi = sps.gammainc(a, lo), sps.gammainc(a, hi)
    return (sps.gammainc(a, z) - p_lo) / (p_hi - p_lo)


@jax.jit
def _rejection_gamma_batch(key, a, rate, low, high):
    keys = jax.random.split(key, a.shape[0])
    return jax.vmap(lambda k, *p: truncated_gamma(k, *p, (TGM_SAMPLES,)))(keys, a, rate, low, high)


def _check_rejection_gamma(cases, seed, threshold):
    params = [jnp.array(v, jnp.float64) for v in zip(*cases)]
    x = np.asarray(_rejection_gamma_batch(jax.random.key(seed), *params))
    for (a, rate, low, high), xi in zip(cases, x):
        assert np.all((xi >= low) & (xi <= high)) and np.all(np.isfinite(xi)), (a, rate, low, high)
        assert pit_gof(_gamma_pit(xi, a, rate, low, high)) > threshold, (a, rate, low, high)


@pytest.mark.slow  # fast twin: test_rejection_without_fallback_gof (eight of these cases, without compiling the fallback)
def test_truncated_gamma_rejection_gof(x64):
    _check_rejection_gamma(REJECTION_GAMMA_CASES, 11, GOF_THRESHOLD)


@pytest.mark.slow
def test_truncated_gamma_rejection_gof_slow(x64):
    for seed in range(3):
        _check_rejection_gamma(SLOW_REJECTION_GAMMA_CASES, 20 + seed, GOF_THRESHOLD / 10)


@pytest.mark.slow
def test_truncated_gamma_rejection_concrete_shapes_and_retry_keys(x64):
    # concrete shapes compile only their regime; a function i -> key is accepted for the retries
    from d3pext.distributions.truncated_gamma import truncated_gamma_from_uniforms

    u = jax.random.uniform(jax.random.key(5), (2, TGM_SAMPLES), jnp.float64, minval=1e-300)
    retry = jax.random.key(6)
    for a, rate, low, high in [(0.5, 1.0, 0.3, 2.0), (21.0, 1.0, 60.0, math.inf)]:
        x = np.asarray(truncated_gamma_from_uniforms(u, lambda i: jax.random.fold_in(retry, i), a, rate, low, high))
        assert pit_gof(_gamma_pit(x, a, rate, low, high)) > GOF_THRESHOLD, a


@pytest.mark.slow
def test_truncated_gamma_rejection_float32():
    x = np.asarray(truncated_gamma(jax.random.key(9), 21.0, 100.0, 0.1, 0.3, (TGM_SAMPLES,)))
    assert x.dtype == np.float32 and np.all((x >= 0.1) & (x <= 0.3))
    assert pit_gof(_gamma_pit(x, 21.0, 100.0, 0.1, 0.3)) > GOF_THRESHOLD


def test_tgm_rejection_regimes_gof(x64):
    # alpha < 1 (component chosen by weight), alpha = 1 (piecewise exponential), a dominant
    # Laplace kink (lam >> spread of the gamma), tau far beyond upper, narrow upper
    alpha = [0.5, 1.0, 21.0, 21.0, 3.0]
    beta = [100.0, 12.0, 1010.0, 100.0, 1e4]
    lam = [10.75, 10.75, 1000.0, 10.75, 10.75]
    tau = [0.02, 0.02, 0.01, 3.0, 2e-4]
    upper = [0.25, 0.25, math.inf, 0.25, 2.5e-4]
    _, u = tgm_batch(12, beta, tau, upper, alpha=alpha, lam=lam)
    for params, ui in zip(zip(alpha, beta, lam, tau, upper), u):
        assert pit_gof(ui) > GOF_THRESHOLD, params


# ---------------------------------------------------------------------------------------------
# fallback=False (the Kazan & Reiter sweep): no inversion compiled, the same exact rejection law


@jax.jit
def _no_fallback_batch(key, a, rate, low, high, alpha, beta, lam, tau, upper):
    """TGM_SAMPLES draws of each of 8 truncated gammas and 5 TGMs (their CDF: _tgm_cdf_log_prob)."""
    from d3pext.distributions.truncated_gamma import tgm_from_uniforms, truncated_gamma_from_uniforms

    def one(sampler):
        def draw(k, *p):
            k_u, k_r = jax.random.split(k)
            u = jax.random.uniform(k_u, (2, TGM_SAMPLES), jnp.float64, minval=1e-300)
            return sampler(u, k_r, *p, fallback=False)

        return draw

    k1, k2 = jax.random.split(key)
    gamma = jax.vmap(one(truncated_gamma_from_uniforms))(jax.random.split(k1, a.shape[0]), a, rate, low, high)
    return gamma, jax.vmap(one(tgm_from_uniforms))(jax.random.split(k2, alpha.shape[0]), alpha, beta, lam, tau, upper)


def no_fallback_batch(seed, gamma_cases, tgm_cases):
    assert len(gamma_cases) == 8 and len(tgm_cases) == 5  # one compile
    params = [jnp.array(v, jnp.float64) for v in (*zip(*gamma_cases), *zip(*tgm_cases))]
    x, y = _no_fallback_batch(jax.random.key(seed), *params)
    return np.asarray(x), np.asarray(y)


def test_rejection_without_fallback_gof(x64):
    cases = REJECTION_GAMMA_CASES[:8]
    tgm_cases = [(21.0, 1e4, 10.75, 0.22, math.inf), (21.0, 100.0, 10.75, 0.22, 0.25),
                 (0.5, 100.0, 10.75, 0.02, 0.25), (21.0, 2e8, 10.75, 0.22, 0.25), (1.0, 12.0, 10.75, 0.02, 0.25)]
    x, y = no_fallback_batch(31, cases, tgm_cases)
    for (a, rate, low, high), xi in zip(cases, x):
        assert np.all((xi >= low) & (xi <= high)), (a, rate, low, high)
        assert pit_gof(_gamma_pit(xi, a, rate, low, high)) > GOF_THRESHOLD, (a, rate, low, high)
    u = tgm_cdf([jnp.array(v, jnp.float64) for v in zip(*tgm_cases)], y)[0]
    for p, yi, ui in zip(tgm_cases, y, u):
        assert np.all((yi > 0) & (yi <= p[-1])), p
        assert pit_gof(ui) > GOF_THRESHOLD, p


def test_rejection_without_fallback_nan_parameters(x64):
    # a NaN parameter gives NaN (the other lanes their draws), in both samplers and both shape regimes; the
    # compiled program of the test above (eager, this test compiled the sampler again: 3-5 s)
    nan = math.nan
    gamma_cases = [(2.0, 1.0, 0.0, math.inf), (nan, 1.0, 0.0, math.inf), (2.0, 1.0, nan, math.inf),
                   (0.5, nan, 0.3, 2.0), *REJECTION_GAMMA_CASES[4:8]]
    tgm_cases = [(21.0, 100.0, 10.75, 0.22, 0.25), (nan, 100.0, 10.75, 0.22, 0.25), (0.5, 100.0, 10.75, nan, 0.25),
                 (21.0, 100.0, 10.75, 0.22, nan), (0.5, 100.0, 10.75, 0.02, 0.25)]
    x, y = no_fallback_batch(0, gamma_cases, tgm_cases)
    for draws, cases in ((x, gamma_cases), (y, tgm_cases)):
        for xi, p in zip(draws, cases):
            assert np.all(np.isnan(xi)) if np.isnan(p).any() else np.all(np.isfinite(xi)), p
