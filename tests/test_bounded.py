"""Kazan & Reiter bounded Gaussian (d3pext.inference.bounded): posteriors against brute-force grid
posteriors of the exact Laplace likelihood, the backend's choices, analyst utilities, errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special as sps
import scipy.stats as st

import numpyro
from numpyro.diagnostics import effective_sample_size

from d3pext.inference.bounded import (
    FlatPrior,
    JeffreysPrior,
    KazanReiterGibbs,
    NormalInverseGamma,
    check_prior,
    fraction_infeasible,
    hpd_interval,
    posterior_predictive,
    sigma2_cap,
    to_unit_scale,
)
from d3pext.handlers import make_release, private_posterior, sample_releases
from d3pext.releases.mechanisms import LaplaceMechanism
from d3pext.models.bounded_gaussian import BLOOD_LEAD, bounded_gaussian_model, private_bounded_gaussian

from compilations import count_compilations

BOUNDS = BLOOD_LEAD["bounds"]
N = BLOOD_LEAD["n"]
EPS = 0.25
NIG = BLOOD_LEAD["prior"]


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# ---------------------------------------------------------------------------------------------
# Brute-force grid posterior from the exact likelihood (unit scale), independent of the sampler:
# p(ym, yv | mu, s2) = int int N(Ybar; mu, s2/n) Gamma(S2; (n-1)/2, (n-1)/(2 s2))
#                      Lap(ym; Ybar, 1/lam1) Lap(yv; S2, 1/lam2) [feasible] dYbar dS2


def _log_normal_laplace(d, s, lam):
    """log of int N(x; 0, s^2) Lap(d - x; 1/lam) dx (closed form)."""
    a = lam**2 * s**2 / 2
    return np.log(lam / 2) + np.logaddexp(
        a - lam * d + sps.log_ndtr(d / s - lam * s), a + lam * d + sps.log_ndtr(-d / s - lam * s)
    )


def _log_gamma_interval(alpha, lo, hi):
    """log of the regularized incomplete gamma mass on [lo, hi] (scipy, tail-aware)."""
    with np.errstate(divide="ignore"):
        upper = np.log(np.clip(sps.gammaincc(alpha, lo) - sps.gammaincc(alpha, hi), 0, None))
        lower = np.log(np.clip(sps.gammainc(alpha, hi) - sps.gammainc(alpha, lo), 0, None))
    return np.where(hi <= lo, -np.inf, np.where(lo >= alpha, upper, lower))


def _log_variance_likelihood(s2, yv, n, lam, top):
    """log int_0^top Gamma(S2; alpha, beta) Lap(yv; S2, 1/lam) dS2 (top may be inf)."""
    alpha, beta = (n - 1) / 2, (n - 1) / (2 * s2)
    cut = np.clip(yv, 0, top)
    r1, r2 = beta - lam, beta + lam
    lw1 = -lam * yv - alpha * np.log(r1 / beta) + _log_gamma_interval(alpha, 0 * cut, r1 * cut)
    lw2 = lam * yv - alpha * np.log(r2 / beta) + _log_gamma_interval(alpha, r2 * cut, r2 * top)
    return np.log(lam / 2) + np.logaddexp(lw1, lw2)


def grid_posterior_means(prior, constrained, ym, yv, n, lam1, lam2, size=160, cells=300):
    # sigma^2 on a geometric grid (the posterior can sit anywhere from 1e-4 to the cap), mu on a
    # uniform one; midpoints with their cell widths as quadrature weights
    cap = (n - 1) / (2 * lam2)
    s2_max = min(cap, 0.25) if constrained else cap
    s2_edges = np.concatenate([[0.0], np.geomspace(1e-6 * s2_max, s2_max, 2 * size)])
    s2, ds2 = (s2_edges[1:] + s2_edges[:-1]) / 2, np.diff(s2_edges)
    mu_lo, mu_hi = (0.0, 1.0) if constrained else (ym - 1.5, ym + 1.5)
    mu_edges = np.linspace(mu_lo, mu_hi, 3 * size + 1)
    mu, dmu = (mu_edges[1:] + mu_edges[:-1]) / 2, np.diff(mu_edges)
    M, S = np.meshgrid(mu, s2, indexing="ij")
    if isinstance(prior, NormalInverseGamma):
        a, b = BOUNDS
        mu0, s0 = (prior.mu0 - a) / (b - a), prior.sigma0_sq / (b - a) ** 2
        log_prior = st.norm.logpdf(M, mu0, np.sqrt(S / prior.kappa0)) + st.invgamma.logpdf(
            S, prior.nu0 / 2, scale=prior.nu0 * s0 / 2
        )
    else:
        log_prior = np.zeros_like(M)
    if not constrained:
        log_lik = _log_normal_laplace(ym - M, np.sqrt(S / n), lam1) + _log_variance_likelihood(
            S, yv, n, lam2, np.inf
        )
    else:
        log_prior = np.where(S <= M * (1 - M), log_prior, -np.inf)
        # Ybar in cells of [0, 1]: exact normal mass per cell times the smooth factors
        edges = np.linspace(0, 1, cells + 1)
        ybar = (edges[1:] + edges[:-1]) / 2
        top = n / (n - 1) * ybar * (1 - ybar)
        smooth = np.log(lam1 / 2) - lam1 * np.abs(ym - ybar)[None, :] + _log_variance_likelihood(
            s2[:, None], yv, n, lam2, top[None, :]
        )  # (s2, cells)
        lik = np.empty_like(M)
        for i in range(0, len(mu), 40):  # chunks of mu, to bound memory
            z = (edges[None, None, :] - M[i : i + 40, :, None]) / np.sqrt(S[i : i + 40, :, None] / n)
            mass = np.diff(sps.ndtr(z), axis=-1)  # (mu, s2, cells)
            lik[i : i + 40] = np.einsum("msc,sc->ms", mass, np.exp(smooth))
        log_lik = np.log(lik + 1e-300)
    log_post = log_prior + log_lik + np.log(dmu)[:, None] + np.log(ds2)[None, :]
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    return float((w * M).sum()), float((w * S).sum())


# ---------------------------------------------------------------------------------------------
# Posterior checks


_MODELS = {}


def _model(prior, constrained):
    # one model object per variant, so that sample_releases reuses its compiled sampler
    key = (prior, constrained)
    if key not in _MODELS:
        _MODELS[key] = private_bounded_gaussian(EPS, EPS, BOUNDS, prior, constrained)
    return _MODELS[key]


def _mcmc_draws(prior, constrained, releases, num_chains, num_samples, num_warmup=300, seed=0, sites=False):
    model = _model(prior, constrained)
    out = sample_releases(
        model, releases, jax.random.key(seed), N, num_warmup=num_warmup,
        num_samples=num_samples, num_chains=num_chains,
    )
    if sites:
        return out
    mu, s2 = to_unit_scale(BOUNDS, np.asarray(out["mu"]), np.asarray(out["sigma2"]))
    return mu, s2  # (releases, chains, samples)


def _check_against_grid(prior, constrained, releases, num_chains, num_samples, size, cells):
    mu, s2 = _mcmc_draws(prior, constrained, releases, num_chains, num_samples)
    lam1 = lam2 = EPS * N
    ym, yv = to_unit_scale(BOUNDS, np.asarray(releases["y_mean_dp"]), np.asarray(releases["y_var_dp"]))
    for r in range(len(ym)):
        ref = grid_posterior_means(prior, constrained, ym[r], yv[r], N, lam1, lam2, size, cells)
        for draws, target in zip((mu[r], s2[r]), ref):
            ess = float(effective_sample_size(draws))
            mcse = draws.std() / math.sqrt(ess)
            assert abs(draws.mean() - target) < 4 * mcse, (prior, constrained, r, draws.mean(), target, mcse)


EXAMPLE_RELEASE = {k: jnp.array([v]) for k, v in BLOOD_LEAD["release"].items()}
VARIANTS = [(NIG, False), (NIG, True), (FlatPrior(), False), (FlatPrior(), True)]


def test_posterior_matches_grid(x64):
    # the fast twin: constrained, informative prior (exact sigma^2 update), Example 1's release
    _check_against_grid(NIG, True, EXAMPLE_RELEASE, 16, 2000, size=60, cells=200)


@pytest.mark.slow
@pytest.mark.parametrize("prior, constrained", VARIANTS)
def test_posterior_matches_grid_slow(x64, prior, constrained):
    releases = {"y_mean_dp": jnp.array([34.3027, 20.0, 61.5]), "y_var_dp": jnp.array([2224.80, 150.0, -300.0])}
    _check_against_grid(prior, constrained, releases, 64, 5000, size=120, cells=400)


@pytest.mark.slow
def test_paper_sigma2_update_differs(x64):
    # the paper's update (shape (n + nu0)/2, no kappa0 term) is not the full conditional: its
    # constrained posterior mean of sigma^2 falls short of the exact (grid) one
    paper = NormalInverseGamma(NIG.mu0, NIG.kappa0, NIG.nu0, NIG.sigma0_sq, sigma2_update="paper")
    _, s2_paper = _mcmc_draws(paper, True, EXAMPLE_RELEASE, 128, 3000)
    ym, yv = to_unit_scale(BOUNDS, *(float(v[0]) for v in EXAMPLE_RELEASE.values()))
    _, exact = grid_posterior_means(NIG, True, ym, yv, N, EPS * N, EPS * N, 120, 400)
    draws = s2_paper[0]
    mcse = draws.std() / math.sqrt(float(effective_sample_size(draws)))
    assert draws.mean() < exact - 3 * mcse


def test_constrained_draws_are_feasible_and_backend_choice(x64):
    # same compiled sampler as test_posterior_matches_grid
    s = {k: np.asarray(v) for k, v in _mcmc_draws(NIG, True, EXAMPLE_RELEASE, 16, 2000, sites=True).items()}
    assert float(fraction_infeasible(s["mu"].ravel(), s["sigma2"].ravel(), BOUNDS)) == 0.0
    ybar, s2 = s["y_mean_dp_stat"], s["y_var_dp_stat"]
    assert np.all((ybar >= 0) & (ybar <= 100) & (s2 > 0))
    assert np.all(s2 <= N / (N - 1) * ybar * (100 - ybar) * (1 + 1e-9))
    assert np.all(s["sigma2"] < sigma2_cap(N, EPS, BOUNDS))
    assert np.all(s["y_mean_dp_noise_var"] > 0)
    model = _model(NIG, True)
    naive = private_posterior(model, BLOOD_LEAD["release"], method="naive", num_warmup=10,
                              num_samples=10, num_chains=2, progress_bar=False)
    naive.run(jax.random.key(1), N)
    assert isinstance(naive.sampler.inner, KazanReiterGibbs) and naive.sampler.inner.naive
    first = naive.get_samples()
    assert sorted(first) == ["mu", "sigma2"]
    # a second run (same shapes, new key) compiles nothing (NumPyro's own MCMC compiles the
    # sampling loop again on every run; private_posterior returns a CachedMCMC)
    with count_compilations() as compiled:
        naive.run(jax.random.key(2), N)
        second = naive.get_samples()
    assert compiled == [], compiled
    assert not np.array_equal(first["mu"], second["mu"])


@pytest.mark.slow
def test_second_run_does_not_compile_slow(x64):
    # the full Kazan & Reiter sampler through private_posterior, vectorized chains
    mcmc = private_posterior(_model(FlatPrior(), True), BLOOD_LEAD["release"], num_warmup=20,
                             num_samples=30, num_chains=3, progress_bar=False)
    mcmc.run(jax.random.key(0), N)
    first = mcmc.get_samples()["mu"]
    with count_compilations() as compiled:
        mcmc.run(jax.random.key(1), N)
        second = mcmc.get_samples()["mu"]
    assert compiled == [], compiled
    assert second.shape == (90,) and not np.array_equal(first, second)


def test_release_and_sensitivities(x64):
    model = private_bounded_gaussian(0.5, 1.0, (10.0, 20.0))
    y = jnp.linspace(9.0, 21.0, 25)  # records outside the bounds are clipped
    tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(25, y)
    info_m, info_v = tr["y_mean_dp"]["infer"]["privatize"], tr["y_var_dp"]["infer"]["privatize"]
    assert info_m.sensitivity == pytest.approx(10.0 / 25) and info_v.sensitivity == pytest.approx(100.0 / 25)
    clipped = np.clip(np.asarray(y), 10, 20)
    np.testing.assert_allclose(tr["y_mean_dp"]["infer"]["statistic"], clipped.mean())
    np.testing.assert_allclose(tr["y_var_dp"]["infer"]["statistic"], clipped.var(ddof=1))
    release = make_release(model, 25, y, rng_key=3)
    assert sorted(release) == ["y_mean_dp", "y_var_dp"]


def test_bad_input_errors():
    with pytest.raises(ValueError, match="a < b"):
        private_bounded_gaussian(0.5, 0.5, (1.0, 1.0))
    with pytest.raises(ValueError, match="epsilon"):
        LaplaceMechanism(0.0)
    with pytest.raises(ValueError, match="Theorem 4"):
        check_prior(JeffreysPrior())
    with pytest.raises(ValueError, match="Jeffreys"):
        NormalInverseGamma(0.5, 0.0, 1.0, 0.1)
    with pytest.raises(ValueError, match="n >= 3"):
        numpyro.handlers.seed(bounded_gaussian_model, 0)(2)
    model = private_bounded_gaussian(0.5, 0.5, BOUNDS)
    with pytest.raises(ValueError, match="shape"):
        private_posterior(model, {"y_mean_dp": jnp.ones(2), "y_var_dp": 1.0},
                          num_warmup=1, num_samples=1, progress_bar=False).run(jax.random.key(0), N)
    with pytest.raises(ValueError, match="needs bounds"):
        from d3pext.handlers import privatize

        privatize(bounded_gaussian_model, site="y", mechanism=LaplaceMechanism(1.0), statistic="sample_mean")


def test_hpd_interval_matches_known_intervals(x64):
    draws = jnp.asarray(st.norm.rvs(size=(3, 40000), random_state=1))
    lo, hi = hpd_interval(draws, 0.95)
    np.testing.assert_allclose(lo, -1.96, atol=0.04)
    np.testing.assert_allclose(hi, 1.96, atol=0.04)
    lo, hi = hpd_interval(jnp.asarray(st.expon.rvs(size=40000, random_state=2)), 0.9)
    assert float(lo) < 1e-3 and float(hi) == pytest.approx(-math.log(0.1), abs=0.05)
    # brute force: the shortest window holding ceil(0.8 N) sorted draws
    x = np.sort(st.gamma.rvs(2.0, size=501, random_state=3))
    k = math.ceil(0.8 * x.size) - 1
    i = np.argmin(x[k:] - x[: x.size - k])
    assert tuple(map(float, hpd_interval(jnp.asarray(x), 0.8))) == (x[i], x[i + k])


def test_posterior_predictive_truncated_normal(x64):
    y = np.asarray(posterior_predictive(jax.random.key(0), jnp.full(20000, 30.0), jnp.full(20000, 900.0), BOUNDS))
    ref = st.truncnorm(-1.0, (100 - 30) / 30, loc=30, scale=30)
    assert st.kstest(y, ref.cdf).pvalue > 1e-3
    y = np.asarray(posterior_predictive(jax.random.key(1), jnp.full(20000, 30.0), jnp.full(20000, 900.0)))
    assert st.kstest(y, st.norm(30, 30).cdf).pvalue > 1e-3


def test_model_inspection_compiles_one_program():
    # inspect_model traces the privatized model once, under jit: run op by op (as it was, inside
    # ensure_compile_time_eval) every primitive of the model compiled a program of its own, in every
    # new process (about 20 for this model, 1.2 s of a Kazan & Reiter sampler's first run)
    from d3pext.inference.structure import inspect_model

    model = private_bounded_gaussian(0.3, 0.7, (0.0, 9.0), NormalInverseGamma(2.0, 1.5, 3.0, 2.5), True)
    jax.clear_caches()  # nothing compiled by an earlier test is reused
    with count_compilations() as compiled:
        pm = inspect_model(model, {"y_mean_dp": 4.0, "y_var_dp": 3.0}, (17,), {})
    assert len(compiled) <= 2, compiled
    assert sorted(pm.releases) == ["y_mean_dp", "y_var_dp"]
