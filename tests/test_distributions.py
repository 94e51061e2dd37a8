"""Checks of d3pext.distributions against exact densities (scipy) and goodness-of-fit tests."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sps
import scipy.stats as st


from d3pext.distributions import (
    InverseGaussian,
    Skellam,
    TwoSidedGeometric,
    exponential_fine_tail,
    integer,
    log_bessel_ive,
)

# Fixed seeds make every test deterministic; the threshold is what a correct sampler passes
# with probability 1 - 1e-3 for a fresh seed.
GOF_THRESHOLD = 1e-3


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def density_gof(samples, density):
    """The nearest-neighbour goodness-of-fit test of ``numpyro.distributions.gof``
    (``density_goodness_of_fit``) with scipy's chi-square tail: numpyro 0.22's ``_chi2sf``
    sums 100 series terms and returns p = 1.0 for statistics above about 200, i.e. it passes
    grossly wrong samplers (a half-normal checked against the normal density gets 1.0)."""
    order = np.argsort(samples)
    samples, density = np.asarray(samples, np.float64)[order], np.asarray(density)[order]
    sparsity = 0.5 * (1 / density[1:] + 1 / density[:-1])
    spacings = samples.size / sparsity * np.diff(samples)  # standard exponential if correct
    uniform = np.exp(-spacings)
    bins = int(round(uniform.size ** (1 / 3)))
    counts = np.bincount(np.clip((uniform * bins).astype(int), 0, bins - 1), minlength=bins)
    return st.chisquare(counts).pvalue


def discrete_gof(samples, pmf, num_bins=40):
    """Pearson chi-square p-value of integer samples against ``pmf``, on consecutive bins of
    about ``1 / num_bins`` probability each (an atom heavier than that is a bin of its own)."""
    samples = np.asarray(samples)
    n = samples.size
    span = int(samples.max() - samples.min()) + 10
    ks = np.arange(samples.min() - span, samples.max() + span + 1)
    probs = np.asarray(pmf(ks), np.float64)
    target = max(5.0 / n, 1.0 / num_bins)
    _, bin_of = np.unique(np.floor((np.cumsum(probs) - probs) / target), return_inverse=True)
    expected = np.bincount(bin_of, weights=probs)
    if expected[-1] < target / 2:  # merge a small last bin into its neighbour
        bin_of[bin_of == expected.size - 1] -= 1
        expected = np.bincount(bin_of, weights=probs)
    observed = np.bincount(bin_of[samples - ks[0]], minlength=expected.size)
    assert expected.size >= 3 and n * expected.min() >= 5
    return st.chisquare(observed, n * expected / expected.sum()).pvalue


def test_density_gof_detects_a_wrong_sampler():
    x = np.random.default_rng(0).normal(size=5000)
    assert density_gof(x, st.norm.pdf(x)) > GOF_THRESHOLD
    assert density_gof(x, st.norm(scale=1.5).pdf(x)) < GOF_THRESHOLD
    assert density_gof(np.abs(x), st.norm.pdf(x)) < GOF_THRESHOLD


# ---------------------------------------------------------------------------------------------
# exponential_fine_tail
# ---------------------------------------------------------------------------------------------


def test_exponential_fine_tail_is_standard_exponential():
    e = exponential_fine_tail(jax.random.PRNGKey(0), (100000,))
    assert e.dtype == jnp.float32 and np.all(np.asarray(e) >= 0)
    assert st.kstest(np.asarray(e, np.float64), st.expon.cdf).pvalue > GOF_THRESHOLD
    # Memoryless tail: beyond 6 it is again a standard exponential (about 250 draws).
    tail = np.asarray(e, np.float64)[np.asarray(e) > 6.0] - 6.0
    assert 150 < tail.size < 350
    assert st.kstest(tail, st.expon.cdf).pvalue > GOF_THRESHOLD


# ---------------------------------------------------------------------------------------------
# log_bessel_ive
# ---------------------------------------------------------------------------------------------


def _ive_grid():
    orders = np.concatenate([np.arange(0, 70), np.arange(0, 40) + 0.5, [150, 1000, 1e4, 1e5]])
    args = np.logspace(-8, 8, 81)
    v, x = np.meshgrid(orders, args)
    with np.errstate(divide="ignore"):
        ref = np.log(sps.ive(v, x))
    ok = np.isfinite(ref)
    return v[ok], x[ok], ref[ok]


def test_log_bessel_ive_matches_scipy_float64(x64):
    v, x, ref = _ive_grid()
    got = np.asarray(log_bessel_ive(v, x))
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    assert err.max() < 1e-12


def test_log_bessel_ive_matches_scipy_float32():
    v, x, ref = _ive_grid()
    got = np.asarray(log_bessel_ive(v.astype(np.float32), x.astype(np.float32)))
    assert got.dtype == np.float32
    err = np.abs(got - ref) / np.maximum(1.0, np.abs(ref))
    assert err.max() < 5e-6


def test_log_bessel_ive_where_scipy_underflows(x64):
    # scipy.special.ive is 0 here; check the three-term recurrence I_{v-1} - I_{v+1} = (2v/x) I_v.
    v = np.array([40.0, 500.0, 1000.0, 5e4, 3.0, 1.0])
    x = np.array([1e-3, 10.0, 3.0, 20.0, 1e-200, 1e-150])
    lower, mid, upper = (np.asarray(log_bessel_ive(v + d, x)) for d in (-1, 0, 1))
    assert np.all(np.isfinite(mid)) and np.all(mid < -300)
    lhs = lower + np.log(-np.expm1(upper - lower))
    np.testing.assert_allclose(lhs, np.log(2 * v / x) + mid, rtol=1e-13, atol=1e-12)


def test_log_bessel_ive_mpmath(x64):
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 30
    for v, x in [(0, 1e-6), (5, 1e-6), (200, 3.0), (1e4, 10.0), (33, 0.5), (50, 1e4), (3, 20.0)]:
        ref = float(mpmath.log(mpmath.besseli(v, x)) - x)
        assert abs(float(log_bessel_ive(float(v), x)) - ref) <= 1e-13 * max(1.0, abs(ref))


def test_log_bessel_ive_gradient(x64):
    # d/dx log(I_v(x) e^-x) = I_{v+1}(x) / I_v(x) + v / x - 1; at x = 0, v = 0 it is -1.
    v = np.array([0.0, 0.0, 3.0, 3.0, 31.0, 40.0, 3.0, 100.0, 0.0])
    x = np.array([0.5, 1.5, 1e-5, 2.0, 5.0, 5.0, 1e3, 50.0, 0.0])
    grad = np.asarray(jax.jit(jax.vmap(jax.grad(log_bessel_ive, argnums=1)))(v, x))
    ref = sps.ive(v[:-1] + 1, x[:-1]) / sps.ive(v[:-1], x[:-1]) + v[:-1] / x[:-1] - 1
    np.testing.assert_allclose(grad[:-1], ref, rtol=1e-10)
    assert grad[-1] == -1.0
    assert np.isnan(jax.grad(log_bessel_ive, argnums=0)(2.0, 1.0))  # order: not implemented


def test_log_bessel_ive_at_zero(x64):
    assert float(log_bessel_ive(0.0, 0.0)) == 0.0
    assert float(log_bessel_ive(2.0, 0.0)) == -np.inf


# ---------------------------------------------------------------------------------------------
# InverseGaussian
# ---------------------------------------------------------------------------------------------

IG_PARAMS = [
    (1.0, 1.0),
    (2.0, 0.01),
    (1e-3, 1e3),
    (1.0, 1e4),
    (1e6, 1.0),
    (np.inf, 2.0),
    (np.inf, 1e-3),
]
IG_SAMPLES = 5000

# Parameters are traced arguments of fixed shape, so each helper compiles once per dtype.
ig_log_prob_cdf = jax.jit(
    lambda m, lam, x: (InverseGaussian(m, lam).log_prob(x), InverseGaussian(m, lam).cdf(x))
)
ig_sample = jax.jit(lambda key, m, lam: InverseGaussian(m, lam).sample(key, (IG_SAMPLES,)))


def _scipy_ig(mean, lam):
    return st.levy(scale=lam) if np.isinf(mean) else st.invgauss(mean / lam, scale=lam)


@pytest.mark.parametrize("mean, lam", IG_PARAMS)
def test_inverse_gaussian_log_prob_and_cdf_match_scipy(x64, mean, lam):
    ref = _scipy_ig(mean, lam)
    x = ref.ppf(np.linspace(0.001, 0.999, 101))
    log_prob, cdf = ig_log_prob_cdf(mean, lam, x)
    np.testing.assert_allclose(log_prob, ref.logpdf(x), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(cdf, ref.cdf(x), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mean, lam", IG_PARAMS)
def test_inverse_gaussian_sampler_gof(x64, mean, lam):
    x = ig_sample(jax.random.PRNGKey(11), mean, lam)
    assert np.all(np.isfinite(x)) and np.all(x > 0)
    log_prob, _ = ig_log_prob_cdf(mean, lam, x)
    assert density_gof(x, np.exp(np.asarray(log_prob))) > GOF_THRESHOLD
    assert st.kstest(np.asarray(x), _scipy_ig(mean, lam).cdf).pvalue > GOF_THRESHOLD


@pytest.mark.parametrize("mean", [1e6, 1e12, np.inf])
def test_inverse_gaussian_float32_huge_mean(mean):
    # The textbook MSH root mu + mu^2 y / (2 lam) - ... cancels to 0 in float32 at such means.
    x = ig_sample(jax.random.PRNGKey(3), jnp.float32(mean), jnp.float32(1.0))
    assert x.dtype == jnp.float32 and np.all(np.isfinite(x)) and np.all(x > 0)
    assert st.kstest(np.asarray(x, np.float64), _scipy_ig(mean, 1.0).cdf).pvalue > GOF_THRESHOLD
    log_prob, cdf = ig_log_prob_cdf(jnp.float32(mean), jnp.float32(1.0), x)
    assert np.all(np.isfinite(log_prob)) and np.all((cdf >= 0) & (cdf <= 1))


def test_inverse_gaussian_levy_limit_gradients():
    # Gradients at mean = inf are finite and equal to the Levy limit's.
    def lp(m, lam, x):
        return InverseGaussian(m, lam).log_prob(x)

    def cdf(m, lam, x):
        return InverseGaussian(m, lam).cdf(x)

    grads = jax.jit(lambda *a: (jax.grad(lp, (0, 1, 2))(*a), jax.grad(cdf, (0, 1, 2))(*a)))
    (g_mean, g_lam, g_x), g_cdf = grads(jnp.inf, 2.0, 1.5)
    assert float(g_mean) == 0.0
    np.testing.assert_allclose(g_lam, 1 / (2 * 2.0) - 1 / (2 * 1.5), rtol=1e-6)
    np.testing.assert_allclose(g_x, -1.5 / 1.5 + 2.0 / (2 * 1.5**2), rtol=1e-6)
    # Levy cdf erfc(sqrt(lam / (2x))): d/dx = sqrt(lam / (2 pi x^3)) exp(-lam / (2x)) = density.
    assert float(g_cdf[0]) == 0.0
    np.testing.assert_allclose(g_cdf[2], np.exp(lp(np.inf, 2.0, 1.5)), rtol=1e-5)
    # Continuity: a huge finite mean gives nearly the same gradients.
    (_, g_lam_big, g_x_big), _ = grads(1e12, 2.0, 1.5)
    np.testing.assert_allclose((g_lam_big, g_x_big), (g_lam, g_x), rtol=1e-5)
    # Through a mean computed as eps / |y - s| that hits s = y, under jit and vmap.
    f = jax.jit(jax.vmap(jax.grad(lambda lam, m: lp(m, lam, 0.7))))
    g = f(jnp.array([1.0, 2.0]), jnp.array([1.0, 1.0]) / jnp.array([0.0, 0.5]))
    assert np.all(np.isfinite(g))


def test_inverse_gaussian_shapes_jit_vmap():
    key = jax.random.PRNGKey(0)
    d = InverseGaussian(jnp.array([1.0, jnp.inf, 3.0]), jnp.array([[1.0], [2.0]]))
    assert d.batch_shape == (2, 3)
    assert jax.eval_shape(lambda k: d.sample(k, (4,)), key).shape == (4, 2, 3)
    assert jax.eval_shape(d.log_prob, jnp.ones((5, 1, 1))).shape == (5, 2, 3)
    assert not d.has_rsample
    assert d.support(jnp.array(1.0)) and not d.support(jnp.array(-1.0))
    vsample = jax.jit(jax.vmap(lambda k, m: InverseGaussian(m, 2.0).sample(k)))
    xs = vsample(jax.random.split(key, 4), jnp.arange(1.0, 5.0))
    assert xs.shape == (4,) and np.all(xs > 0)
    np.testing.assert_allclose(InverseGaussian(2.0, 4.0).variance, 2.0)
    with pytest.raises(ValueError):
        InverseGaussian(-1.0, 1.0, validate_args=True)
    with pytest.raises(ValueError):
        InverseGaussian(1.0, 0.0, validate_args=True)


# ---------------------------------------------------------------------------------------------
# TwoSidedGeometric
# ---------------------------------------------------------------------------------------------

GEO_SAMPLES = 20000
geo_log_prob_cdf = jax.jit(
    lambda la, k: (
        TwoSidedGeometric(log_alpha=la).log_prob(k),
        TwoSidedGeometric(log_alpha=la).cdf(k),
        TwoSidedGeometric(log_alpha=la).cdf(k + 0.5),
    )
)
geo_icdf = jax.jit(lambda la, q: TwoSidedGeometric(log_alpha=la, loc=-3).icdf(q))
geo_cdf = jax.jit(lambda la, k: TwoSidedGeometric(log_alpha=la, loc=-3).cdf(k))
geo_sample = jax.jit(
    lambda key, la: TwoSidedGeometric(log_alpha=la, loc=5).sample(key, (GEO_SAMPLES,))
)


@pytest.mark.parametrize("alpha", [1e-6, 0.1, 0.5, 0.9, 0.999])
def test_two_sided_geometric_log_prob_and_cdf_match_scipy(x64, alpha):
    ref = st.dlaplace(-np.log(alpha))
    k = np.arange(-60, 61) * max(1, int(1 / (1 - alpha)) // 20)
    lp, cdf, cdf_mid = geo_log_prob_cdf(np.log(alpha), k)
    assert np.all(np.isfinite(lp))  # scipy's pmf underflows for alpha = 1e-6 beyond |k| = 50
    ok = ref.pmf(k) > 1e-300
    np.testing.assert_allclose(lp[ok], ref.logpmf(k[ok]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cdf, ref.cdf(k), rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(cdf_mid, ref.cdf(k), rtol=1e-10, atol=1e-15)
    variance = TwoSidedGeometric(alpha).variance
    np.testing.assert_allclose(variance, 2 * alpha / (1 - alpha) ** 2, rtol=1e-9)


def test_two_sided_geometric_log_alpha_near_one(x64):
    # alpha = exp(-1e-9) is not representable as 1 - alpha in float32; log_alpha keeps it exact.
    lp, cdf, _ = geo_log_prob_cdf(-1e-9, np.array([0, -1]))
    assert float(np.exp(lp[0])) == pytest.approx(np.tanh(0.5e-9), rel=1e-9)
    assert float(cdf[1]) == pytest.approx(np.exp(-1e-9) / (1 + np.exp(-1e-9)), rel=1e-12)


@pytest.mark.parametrize("alpha", [1e-6, 0.3, 0.9, 0.999])
def test_two_sided_geometric_sampler_chi_square(alpha):
    x = geo_sample(jax.random.PRNGKey(7), jnp.log(jnp.float32(alpha)))
    assert jnp.issubdtype(x.dtype, jnp.integer)
    if alpha < 1e-3:  # essentially a point mass: P(x != 5) = 2 alpha / (1 + alpha)
        assert int((x != 5).sum()) <= 5
        return
    assert discrete_gof(x, st.dlaplace(-np.log(alpha), loc=5).pmf) > GOF_THRESHOLD


@pytest.mark.parametrize("alpha", [0.01, 0.5, 0.95])
def test_two_sided_geometric_icdf_inverts_cdf(x64, alpha):
    la = np.log(alpha)
    k = np.arange(-200, 200) - 3
    u = np.asarray(geo_cdf(la, k))
    # icdf(cdf(k)) = k wherever float64 separates cdf(k) from cdf(k - 1) and from 1.
    distinct = (u > np.asarray(geo_cdf(la, k - 1))) & (u < 1)
    assert distinct.sum() > 50
    np.testing.assert_array_equal(geo_icdf(la, np.where(distinct, u, 0.5))[distinct], k[distinct])
    q = np.random.default_rng(0).uniform(size=400)
    q[:4] = [1e-300, 1e-12, 0.5, 1 - 1e-12]
    kq = np.asarray(geo_icdf(la, q))
    assert np.all(np.asarray(geo_cdf(la, kq)) >= q)
    assert np.all(np.asarray(geo_cdf(la, kq - 1)) < q)
    edges = np.zeros(400)
    edges[1] = 1.0
    assert np.asarray(geo_icdf(la, edges))[:2].tolist() == [-np.inf, np.inf]


def test_two_sided_geometric_validation_and_shapes():
    with pytest.raises(ValueError, match="exactly one"):
        TwoSidedGeometric(0.5, log_alpha=-1.0)
    with pytest.raises(ValueError):
        TwoSidedGeometric(1.0, validate_args=True)
    with pytest.raises(ValueError):
        TwoSidedGeometric(0.0, validate_args=True)
    with pytest.raises(ValueError):
        TwoSidedGeometric(0.5, loc=0.5, validate_args=True)
    d = TwoSidedGeometric(jnp.array([0.2, 0.5]), loc=jnp.array([[0], [10]]))
    assert d.batch_shape == (2, 2)
    assert jax.eval_shape(lambda k: d.sample(k, (3,)), jax.random.PRNGKey(0)).shape == (3, 2, 2)
    assert bool(integer(jnp.array(3.0))) and not bool(integer(jnp.array(3.5)))
    f = jax.jit(jax.vmap(lambda a, k: TwoSidedGeometric(a).log_prob(k)))
    lp = f(jnp.array([0.5, 0.5]), jnp.array([0, 2]))
    np.testing.assert_allclose(lp, np.log([1 / 3, 1 / 12]), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# Skellam
# ---------------------------------------------------------------------------------------------

SKELLAM_SAMPLES = 20000
skellam_log_prob = jax.jit(lambda r1, r2, k: Skellam(r1, r2).log_prob(k))
skellam_sample = jax.jit(lambda key, r1, r2: Skellam(r1, r2).sample(key, (SKELLAM_SAMPLES,)))


@pytest.mark.parametrize(
    "rate1, rate2", [(3.0, 1.0), (1e-3, 2e-3), (0.5, 40.0), (1e4, 1e4), (2e3, 50.0), (1e5, 3e5)]
)
def test_skellam_log_prob_matches_scipy(x64, rate1, rate2):
    ref = st.skellam(rate1, rate2)
    mean, sd = rate1 - rate2, math.sqrt(rate1 + rate2)
    k = np.round(np.linspace(mean - 6 * sd - 3, mean + 6 * sd + 3, 201))
    lp = skellam_log_prob(rate1, rate2, k)
    np.testing.assert_allclose(lp, ref.logpmf(k), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("rate1, rate2", [(1e-3, 2e-3), (1e4, 1e4), (1e6, 2e6), (30.0, 0.01)])
def test_skellam_pmf_sums_to_one(x64, rate1, rate2):
    mean, sd = rate1 - rate2, math.sqrt(rate1 + rate2)
    k = math.floor(mean - 12 * sd) - 10 + np.arange(50000)  # one shape: one compilation
    assert k[-1] > mean + 12 * sd
    lp = np.asarray(skellam_log_prob(rate1, rate2, k))
    assert np.all(np.isfinite(lp))
    assert abs(np.exp(lp).sum() - 1) < 1e-10
    np.testing.assert_allclose((k * np.exp(lp)).sum(), mean, atol=1e-8 * max(1.0, sd))


@pytest.mark.parametrize("rate1, rate2", [(3.0, 1.0), (0.2, 0.05), (400.0, 900.0)])
def test_skellam_sampler_chi_square(rate1, rate2):
    x = skellam_sample(jax.random.PRNGKey(5), rate1, rate2)
    assert jnp.issubdtype(x.dtype, jnp.integer)
    assert discrete_gof(x, st.skellam(rate1, rate2).pmf) > GOF_THRESHOLD


def test_exponential_mixture_of_skellam_is_two_sided_geometric():
    # Seed 002, Theorem 2: tau ~ Skel(l+, l-), l+- ~ Exp(mean alpha / (1 - alpha)) => 2Geo(alpha).
    alpha = 0.6
    key_rates, key_tau = jax.random.split(jax.random.PRNGKey(9))
    rates = jax.random.exponential(key_rates, (2, SKELLAM_SAMPLES)) * alpha / (1 - alpha)
    tau = jax.jit(lambda key, r: Skellam(r[0], r[1]).sample(key))(key_tau, rates)
    assert discrete_gof(tau, st.dlaplace(-np.log(alpha)).pmf) > GOF_THRESHOLD


def test_skellam_gradients_shapes_jit():
    r1, r2, k = np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.5, 0.5]), np.array([-3, 0, 7])
    d = Skellam(r1, 0.5)
    assert d.batch_shape == (3,)
    assert jax.eval_shape(lambda key: d.sample(key, (2,)), jax.random.PRNGKey(0)).shape == (2, 3)
    np.testing.assert_allclose(d.mean, [0.5, 1.5, 2.5])
    np.testing.assert_allclose(d.variance, [1.5, 2.5, 3.5])
    grad = jax.jit(jax.grad(lambda r1, r2, k: Skellam(r1, r2).log_prob(k).sum(), argnums=(0, 1)))
    g1, g2 = grad(r1, r2, k)
    # Chain rule through
    # log P = -(sqrt r1 - sqrt r2)^2 + k/2 log(r1/r2) + log ive(|k|, 2 sqrt(r1 r2)).
    x = 2 * np.sqrt(r1 * r2)
    dlog_ive = sps.ive(abs(k) + 1, x) / sps.ive(abs(k), x) + abs(k) / x - 1
    ref1 = -(1 - np.sqrt(r2 / r1)) + k / (2 * r1) + dlog_ive * np.sqrt(r2 / r1)
    ref2 = -(1 - np.sqrt(r1 / r2)) - k / (2 * r2) + dlog_ive * np.sqrt(r1 / r2)
    np.testing.assert_allclose(g1, ref1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g2, ref2, rtol=1e-5, atol=1e-6)
    for k in [np.array([0, 0, 0]), np.array([500, -500, 1])]:
        assert all(np.all(np.isfinite(g)) for g in grad(r1, r2, k))
    with pytest.raises(ValueError):
        Skellam(0.0, 1.0, validate_args=True)


# ---------------------------------------------------------------------------------------------
# heavier twins (pytest -m slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mean", [1e-6, 1e-2, 1.0, 1e3, 1e9, np.inf])
@pytest.mark.parametrize("lam", [1e-4, 1.0, 1e4])
def test_inverse_gaussian_sampler_wide_grid_slow(x64, mean, lam):
    d = InverseGaussian(mean, lam)
    x = np.asarray(d.sample(jax.random.PRNGKey(21), (200000,)))
    assert np.all(np.isfinite(x)) and np.all(x > 0)
    assert st.kstest(x, _scipy_ig(mean, lam).cdf).pvalue > GOF_THRESHOLD
    lp = np.asarray(d.log_prob(x[:20000]))
    assert density_gof(x[:20000], np.exp(lp)) > GOF_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("rate1, rate2", [(1e-2, 3.0), (7.0, 7.0), (50.0, 0.5), (3e3, 2e3)])
def test_skellam_sampler_chi_square_slow(rate1, rate2):
    x = Skellam(rate1, rate2).sample(jax.random.PRNGKey(22), (200000,))
    assert discrete_gof(x, st.skellam(rate1, rate2).pmf, num_bins=100) > GOF_THRESHOLD


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.05, 0.6, 0.99])
def test_two_sided_geometric_and_skellam_mixture_slow(alpha):
    key_geo, key_rates, key_tau = jax.random.split(jax.random.PRNGKey(23), 3)
    pmf = st.dlaplace(-np.log(alpha)).pmf
    x = TwoSidedGeometric(alpha).sample(key_geo, (200000,))
    assert discrete_gof(x, pmf, num_bins=100) > GOF_THRESHOLD
    rates = jax.random.exponential(key_rates, (2, 200000)) * alpha / (1 - alpha)
    tau = Skellam(rates[0], rates[1]).sample(key_tau)
    assert discrete_gof(tau, pmf, num_bins=100) > GOF_THRESHOLD
