"""Checks of d3pext.releases.mechanisms: noise laws, privacy bounds, calibration, quantiles, validation."""

import math
import warnings

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.stats as st

from d3pext.accountants.ledger import PrivacyCost, analytic_gaussian_delta
from d3pext.releases.mechanisms import (
    BinomialMechanism,
    GaussianMechanism,
    GeometricMechanism,
    LaplaceMechanism,
    Mechanism,
)

GOF_THRESHOLD = 1e-3  # fixed seeds; a correct sampler passes with probability 1 - 1e-3
N = 20000


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LaplaceMechanism(0.0), "epsilon"),
        (lambda: LaplaceMechanism(-1.0), "epsilon"),
        (lambda: LaplaceMechanism(math.inf), "epsilon"),
        (lambda: LaplaceMechanism(math.nan), "epsilon"),
        (lambda: LaplaceMechanism(1.0, sensitivity=0.0), "sensitivity"),
        (lambda: LaplaceMechanism(1.0, sensitivity=-2.0), "sensitivity"),
        (lambda: LaplaceMechanism(1.0, neighbouring="swap"), "neighbouring"),
        (lambda: GaussianMechanism(1.0, 0.0), "delta"),
        (lambda: GaussianMechanism(1.0, 1.0), "delta"),
        (lambda: GaussianMechanism(1.0, -1e-5), "delta"),
        (lambda: GaussianMechanism(0.0, 1e-5), "epsilon"),
        (lambda: GaussianMechanism(1.0, 1e-5, 1.0, noise_multiplier=1.0), "too small"),
        (lambda: GaussianMechanism.from_sigma(0.0, 1.0, 1e-5), "sigma"),
        (lambda: GeometricMechanism(0.0), "epsilon"),
        (lambda: GeometricMechanism(1.0, sensitivity=0.0), "sensitivity"),
        (lambda: GeometricMechanism.from_alpha(1.0), "alpha"),
        (lambda: GeometricMechanism.from_alpha(0.0), "alpha"),
        (lambda: GeometricMechanism.from_alpha(1.5), "alpha"),
        (lambda: BinomialMechanism(1.0, total_count=0, population=10), "total_count"),
        (lambda: BinomialMechanism(1.0, total_count=2.5, population=10), "total_count"),
        (lambda: BinomialMechanism(1.0, total_count=10, population=0), "population"),
        (lambda: BinomialMechanism(-1.0, total_count=10, population=10), "epsilon"),
        (lambda: BinomialMechanism.from_pseudo_count(10, 0.0, 10), "pseudo_count"),
        (lambda: BinomialMechanism.from_pseudo_count(10, -3.0, 10), "pseudo_count"),
    ],
)
def test_invalid_parameters_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_type_errors_and_missing_sensitivity():
    with pytest.raises(TypeError, match="epsilon"):
        LaplaceMechanism("1.0")
    m = LaplaceMechanism(1.0)
    for call in (m.cost, m.noise_distribution, lambda: m.release_distribution(0.0)):
        with pytest.raises(ValueError, match="sensitivity"):
            call()
    with pytest.raises(ValueError, match="sensitivity"):
        m.release(jax.random.PRNGKey(0), 1.0)
    with pytest.raises(ValueError, match="sensitivity"):
        m.with_sensitivity(0.0)
    with pytest.raises(NotImplementedError, match="release_icdf"):
        BinomialMechanism(1.0, 10, 10).noise_icdf(0.5)


def test_release_refuses_invalid_values():
    with pytest.raises(ValueError, match="integer"):
        GeometricMechanism(1.0).release(jax.random.PRNGKey(0), jnp.array([1.0, 2.5]))
    b = BinomialMechanism(1.0, total_count=10, population=100)
    with pytest.raises(ValueError, match="population"):
        b.release(jax.random.PRNGKey(0), jnp.array([5, 101]))
    with pytest.raises(ValueError, match="population"):
        b.release(jax.random.PRNGKey(0), -1)


# ---------------------------------------------------------------------------------------------
# structure: frozen, hashable, jit-static, with_sensitivity, costs
# ---------------------------------------------------------------------------------------------


def test_mechanisms_are_hashable_and_static():
    mechs = [
        LaplaceMechanism(1.0, 2.0),
        GaussianMechanism(1.0, 1e-5, 2.0),
        GeometricMechanism(0.5),
        BinomialMechanism(2.0, 50, 1000),
    ]
    assert all(isinstance(m, Mechanism) for m in mechs)
    assert len({*mechs, *mechs}) == 4
    assert LaplaceMechanism(1.0, 2.0) == LaplaceMechanism(1.0, 2.0)
    with pytest.raises(AttributeError):
        mechs[0].epsilon = 3.0

    def log_lik(mech, value, release):
        return mech.release_distribution(value).log_prob(release)

    log_lik = jax.jit(log_lik, static_argnums=0)
    np.testing.assert_allclose(
        log_lik(mechs[0], 1.0, 3.0), st.laplace(1.0, 2.0).logpdf(3.0), rtol=1e-6
    )


def test_with_sensitivity_and_costs():
    lap = LaplaceMechanism(0.5).with_sensitivity(2.0)
    assert (lap.scale, lap.epsilon, lap.delta) == (4.0, 0.5, 0.0)
    cost = lap.cost()
    assert isinstance(cost, PrivacyCost)
    assert (cost.mechanism, cost.epsilon, cost.delta) == ("laplace", 0.5, 0.0)
    assert cost.neighbouring == "substitute"
    assert cost.parameters == {"sensitivity": 2.0, "scale": 4.0}

    gauss = GaussianMechanism(1.0, 1e-5)
    g2, g6 = gauss.with_sensitivity(2.0), gauss.with_sensitivity(6.0)
    assert g2.noise_multiplier == g6.noise_multiplier and g6.sigma == pytest.approx(3 * g2.sigma)
    assert g2.cost().noise_multiplier == g2.noise_multiplier and g2.cost().delta == 1e-5

    geo = GeometricMechanism.from_alpha(0.25, sensitivity=2.0)
    assert geo.epsilon == pytest.approx(2 * math.log(4)) and geo.alpha == pytest.approx(0.25)
    assert geo.cost().parameters["alpha"] == pytest.approx(0.25)

    # Proposition 4 of seed 000: epsilon = n * L / m for L counts that each move by one.
    b = BinomialMechanism.from_pseudo_count(100, 50.0, 1000, sensitivity=3.0)
    assert b.epsilon == pytest.approx(6.0) and b.pseudo_count == pytest.approx(50.0)
    assert b.cost().parameters["total_count"] == 100
    b2 = BinomialMechanism(2.0, 100, 1000).with_sensitivity(2.0)
    assert b2.pseudo_count == pytest.approx(100.0)


def test_gaussian_from_sigma_round_trip():
    m = GaussianMechanism(0.7, 1e-6, sensitivity=3.0)
    back = GaussianMechanism.from_sigma(m.sigma, 3.0, 1e-6)
    assert back.epsilon == pytest.approx(0.7, rel=1e-10)
    assert back.sigma == m.sigma  # the given sigma is kept exactly
    assert analytic_gaussian_delta(back.epsilon, back.noise_multiplier) <= 1e-6 * (1 + 1e-12)
    with pytest.raises(ValueError, match="smaller delta"):
        GaussianMechanism.from_sigma(1e3, 1.0, 0.5)


# ---------------------------------------------------------------------------------------------
# release laws
# ---------------------------------------------------------------------------------------------


def test_additive_release_distribution_is_value_plus_noise():
    e = jnp.linspace(-5.0, 5.0, 11)
    for m in (LaplaceMechanism(0.5, 2.0), GaussianMechanism(1.0, 1e-5, 2.0)):
        lp_release = m.release_distribution(3.0).log_prob(3.0 + e)
        np.testing.assert_allclose(lp_release, m.noise_distribution().log_prob(e), rtol=1e-6)
    geo = GeometricMechanism(0.7, 2.0)
    k = jnp.arange(-10, 11)
    np.testing.assert_allclose(
        geo.release_distribution(4).log_prob(4 + k), geo.noise_distribution().log_prob(k), rtol=1e-6
    )


def test_laplace_and_gaussian_releases_follow_the_noise_law():
    value = jnp.full(N, 3.0)
    lap = LaplaceMechanism(0.5, 2.0)
    noise = np.asarray(lap.release(jax.random.PRNGKey(1), value) - value, np.float64)
    assert st.kstest(noise, st.laplace(scale=4.0).cdf).pvalue > GOF_THRESHOLD
    gauss = GaussianMechanism(1.0, 1e-5, 2.0)
    noise = np.asarray(gauss.release(jax.random.PRNGKey(2), value) - value, np.float64)
    assert st.kstest(noise, st.norm(scale=gauss.sigma).cdf).pvalue > GOF_THRESHOLD


def _chi_square_pvalue(samples, pmf, support):
    counts = np.array([(samples == k).sum() for k in support])
    expected = samples.size * pmf(support)
    counts = np.append(counts, samples.size - counts.sum())  # everything outside `support`
    expected = np.append(expected, samples.size - expected.sum())
    assert expected.min() >= 5
    return st.chisquare(counts, expected).pvalue


def test_geometric_and_binomial_releases_follow_their_laws():
    geo = GeometricMechanism(1.0, sensitivity=2.0)
    value = jnp.full(N, 7)
    noise = np.asarray(geo.release(jax.random.PRNGKey(3), value) - value)
    pmf = st.dlaplace(1.0 / 2.0).pmf
    assert _chi_square_pvalue(noise, pmf, np.arange(-12, 13)) > GOF_THRESHOLD

    b = BinomialMechanism(2.0, total_count=30, population=200)
    s = np.asarray(b.release(jax.random.PRNGKey(4), jnp.full(N, 150)))
    ref = st.binom(30, (150 + b.pseudo_count) / (200 + 2 * b.pseudo_count))
    assert _chi_square_pvalue(s, ref.pmf, np.arange(13, 25)) > GOF_THRESHOLD


def test_release_without_key_uses_os_entropy():
    m = LaplaceMechanism(1.0, 1.0)
    a, b = m.release(None, jnp.zeros(4)), m.release(None, jnp.zeros(4))
    assert a.shape == (4,) and not np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# privacy guarantees, numerically
# ---------------------------------------------------------------------------------------------


def test_laplace_log_density_ratio_is_at_most_epsilon():
    m = LaplaceMechanism(0.8, sensitivity=2.5)
    y = jnp.linspace(-40.0, 40.0, 8001)
    ratio = m.release_distribution(0.0).log_prob(y) - m.release_distribution(2.5).log_prob(y)
    assert float(jnp.max(jnp.abs(ratio))) == pytest.approx(0.8, rel=1e-5)  # attained
    ratio = m.release_distribution(1.0).log_prob(y) - m.release_distribution(-1.0).log_prob(y)
    assert float(jnp.max(jnp.abs(ratio))) <= 0.8 * 2.0 / 2.5 * (1 + 1e-5)
    # A vector statistic with L1 distance equal to the sensitivity.
    yy = jnp.stack(jnp.meshgrid(y[::40], y[::40]), -1)
    lp = lambda v: m.release_distribution(v).log_prob(yy).sum(-1)  # noqa: E731
    ratio = lp(jnp.array([0.0, 0.0])) - lp(jnp.array([1.5, -1.0]))
    assert float(jnp.max(jnp.abs(ratio))) == pytest.approx(0.8, rel=1e-5)


def test_geometric_probability_ratio_is_epsilon():
    m = GeometricMechanism(0.9, sensitivity=3.0)
    y = jnp.arange(-100, 101)
    for other in (1, 2, 3, -3):
        ratio = m.release_distribution(0).log_prob(y) - m.release_distribution(other).log_prob(y)
        assert float(jnp.max(jnp.abs(ratio))) == pytest.approx(0.9 * abs(other) / 3.0, rel=1e-5)


def test_binomial_mechanism_ratio_bound_of_proposition_4():
    n, population, epsilon = 20, 50, 1.0
    m = BinomialMechanism(epsilon, total_count=n, population=population)
    c = jnp.arange(population)[:, None]
    s = jnp.arange(n + 1)[None, :]
    ratio = m.release_distribution(c).log_prob(s) - m.release_distribution(c + 1).log_prob(s)
    worst = float(jnp.max(jnp.abs(ratio)))
    # Exact worst case n log(1 + 1/m), attained at the ends; never above epsilon = n / m.
    assert worst == pytest.approx(n * math.log1p(1 / m.pseudo_count), abs=1e-5)  # float32
    assert worst <= epsilon
    # L = 3 counts that each move by one: sensitivity 3, total log ratio at most epsilon.
    m3 = BinomialMechanism(epsilon, total_count=n, population=population, sensitivity=3.0)
    r3 = m3.release_distribution(c).log_prob(s) - m3.release_distribution(c + 1).log_prob(s)
    assert 3 * float(jnp.max(jnp.abs(r3))) <= epsilon


@pytest.mark.parametrize("epsilon, delta", [(0.1, 1e-6), (1.0, 1e-5), (3.0, 1e-3)])
def test_analytic_gaussian_calibration(epsilon, delta):
    m = GaussianMechanism(epsilon, delta, sensitivity=2.0)
    # Closed form, by direct integration of delta = int max(0, p(y) - e^eps q(y)) dy with
    # p = N(0, sigma^2), q = N(sensitivity, sigma^2): positive where y < y_star.
    sigma, sens = m.sigma, 2.0
    y_star = sens / 2 - sigma**2 * epsilon / sens
    p, q = st.norm(0.0, sigma), st.norm(sens, sigma)
    direct = p.cdf(y_star) - math.exp(epsilon) * q.cdf(y_star)
    quad, _ = scipy.integrate.quad(
        lambda y: max(0.0, p.pdf(y) - math.exp(epsilon) * q.pdf(y)), -60 * sigma, y_star, limit=200
    )
    assert direct == pytest.approx(delta, rel=1e-8)
    assert quad == pytest.approx(delta, rel=1e-6)
    # dp-accounting's privacy-loss-distribution accountant (sensitivity-1 Gaussian pair, i.e.
    # ADD_OR_REMOVE_ONE for a single GaussianDpEvent) agrees.
    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    accountant.compose(dp_accounting.GaussianDpEvent(m.noise_multiplier))
    assert accountant.get_epsilon(delta) == pytest.approx(epsilon, rel=1e-6)
    # Smallest: 1% less noise breaks the target.
    assert analytic_gaussian_delta(epsilon, 0.99 * m.noise_multiplier) > delta


# ---------------------------------------------------------------------------------------------
# quantile functions
# ---------------------------------------------------------------------------------------------

U = np.concatenate(
    [[1e-300, 1e-12, 0.25, 0.5, 0.75, 1 - 1e-12, 1 - 2**-53], np.linspace(0.01, 0.99, 99)]
)


def test_additive_noise_icdf_matches_scipy(x64):
    lap, gauss = LaplaceMechanism(0.5, 2.0), GaussianMechanism(1.0, 1e-5, 2.0)
    geo = GeometricMechanism(0.5)

    @jax.jit
    def quantiles(u):
        k = geo.noise_icdf(u)
        cdf = geo.noise_distribution().cdf
        return (lap.noise_icdf(u), gauss.noise_icdf(u), lap.release_icdf(5.0, u), k, cdf(k),
                cdf(k - 1))

    q_lap, q_gauss, q_release, k, cdf_k, cdf_below = quantiles(U)
    np.testing.assert_allclose(q_lap, st.laplace(scale=4.0).ppf(U), rtol=1e-12)
    np.testing.assert_allclose(q_gauss, st.norm(scale=gauss.sigma).ppf(U), rtol=1e-9)
    np.testing.assert_allclose(q_release, 5.0 + st.laplace(scale=4.0).ppf(U), rtol=1e-12)
    assert np.all(np.asarray(cdf_k) >= U) and np.all(np.asarray(cdf_below) < U)


def test_laplace_icdf_float32_is_finite_near_one():
    u = jnp.array([2.0**-24, 0.5, 1 - 2.0**-24], jnp.float32)
    x = LaplaceMechanism(1.0, 1.0).noise_icdf(u)
    assert x.dtype == jnp.float32 and np.all(np.isfinite(x))
    np.testing.assert_allclose(x, st.laplace.ppf(np.asarray(u, np.float64)), rtol=1e-6)


def test_binomial_release_icdf_matches_scipy(x64):
    m = BinomialMechanism(1.5, total_count=37, population=500)
    values = np.array([0, 3, 250, 499, 500])
    p = (values + m.pseudo_count) / (500 + 2 * m.pseudo_count)
    # Random quantiles, the extremes, and points just below the jumps of the cdf at value 250.
    jumps = st.binom(37, p[2]).cdf(np.arange(37)) * (1 - 1e-12)
    u = np.concatenate([[1e-12, 1 - 1e-12], np.linspace(0.005, 0.995, 60), jumps])
    got = np.asarray(m.release_icdf(values[:, None], u[None, :]))
    np.testing.assert_array_equal(got, st.binom(37, p[:, None]).ppf(u[None, :]))
    np.testing.assert_array_equal(got[2, -37:], np.arange(37))


# ---------------------------------------------------------------------------------------------
# heavier twins (pytest -m slow)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_releases_follow_their_laws_slow():
    n = 500000
    value = jnp.full(n, -2.0)
    lap = LaplaceMechanism(0.1, 3.0)
    noise = np.asarray(lap.release(jax.random.PRNGKey(31), value) - value, np.float64)
    assert st.kstest(noise, st.laplace(scale=30.0).cdf).pvalue > GOF_THRESHOLD
    gauss = GaussianMechanism(0.3, 1e-8, 3.0)
    noise = np.asarray(gauss.release(jax.random.PRNGKey(32), value) - value, np.float64)
    assert st.kstest(noise, st.norm(scale=gauss.sigma).cdf).pvalue > GOF_THRESHOLD
    # Tails: the fraction beyond 4 sigma (6.3e-5) is right, not cut off.
    beyond = np.mean(np.abs(noise) > 4 * gauss.sigma)
    assert abs(beyond - 2 * st.norm.sf(4)) < 4 * math.sqrt(2 * st.norm.sf(4) / n)
    geo = GeometricMechanism(0.05)
    noise = np.asarray(geo.release(jax.random.PRNGKey(33), jnp.zeros(n, jnp.int32)))
    support = np.arange(-60, 61)
    assert _chi_square_pvalue(noise, st.dlaplace(0.05).pmf, support) > GOF_THRESHOLD


def test_release_refuses_nonfinite_values_and_warns_on_explicit_keys():
    import warnings

    from d3pext.releases.mechanisms import ReproducibleReleaseWarning

    m = LaplaceMechanism(1.0, sensitivity=1.0)
    for bad in (float("nan"), float("inf"), jnp.array([1.0, -jnp.inf])):
        with pytest.raises(ValueError, match="non-finite"):
            m.release(None, bad)
    with pytest.warns(ReproducibleReleaseWarning, match="explicit key"):
        m.release(jax.random.key(0), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.release(jax.random.key(0), 1.0, reproducible=True)  # the opt-out for tests
        m.release(None, 1.0)  # OS entropy: no warning
    # the same key gives the same noise; no key gives fresh noise
    assert m.release(jax.random.key(0), 1.0, reproducible=True) == m.release(jax.random.key(0), 1.0, reproducible=True)
    assert m.release(None, 1.0) != m.release(None, 1.0)


def test_geometric_mechanism_needs_an_integer_sensitivity():
    # integer releases of neighbours differ by >= 1: sensitivity 0.5 would double the true epsilon
    with pytest.raises(ValueError, match="positive integer"):
        GeometricMechanism(1.0, sensitivity=0.5)
    assert GeometricMechanism(1.0, sensitivity=2.0).alpha == pytest.approx(math.exp(-0.5))


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="checks a process with 64-bit types off")
def test_a_release_rounded_off_its_law_by_float32_warns():
    """A mean of 1e7 birth years at scale 1.2e-5 came back as one of 3 float32 values (error sd 4.7
    scales instead of 1.4): the release keeps its privacy, but not the law inference assumes."""
    from d3pext.releases.mechanisms import ReleasePrecisionWarning

    with pytest.warns(ReleasePrecisionWarning, match=r"float32 numbers .* apart, more than 1/4 of the noise's scale"):
        LaplaceMechanism(1.0, sensitivity=1.2e-5).release(None, np.float64(1989.4083912571587))
    with pytest.warns(ReleasePrecisionWarning):
        GaussianMechanism(1.0, 1e-5, sensitivity=1.0).release(None, np.full(2, 2e7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReleasePrecisionWarning)
        LaplaceMechanism(1.0, sensitivity=1.0).release(None, np.float64(2e5))
        LaplaceMechanism(1.0, sensitivity=1.0).release(None, np.float64(1.2e6))  # spacing 1/8 of the scale
        GeometricMechanism(1.0).release(None, np.int64(2 * 10**7))
