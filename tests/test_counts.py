"""Locally private counts (seed 002): the count augmentation against the exact conditional, a
Geweke joint-distribution test of the factorization sampler, bad input, and the method against
the naive baseline on synthetic data."""

import jax
import jax.numpy as jnp
from jax import lax, random
import numpy as np
import pytest
import scipy.stats as st

from d3pext.inference.counts import CountGibbs, CountGibbsState, sample_true_counts
from d3pext.releases.counts import HeterogeneousGeometricMechanism, limited_precision_mechanism
from d3pext.handlers.privatize import privatize, privatize_counts
from d3pext.distributions import GeometricNoisedPoisson
from d3pext.handlers import make_release, private_posterior, sample_releases
from d3pext.inference.structure import RELEASES_KWARG
from d3pext.handlers.posterior import PrivatePosterior
from d3pext.releases.mechanisms import GeometricMechanism
from d3pext.models.poisson_factorization import (
    private_community_model,
    private_topic_model,
    simulate_topic_corpus,
    topic_rates,
)

GOF_THRESHOLD = 1e-3


def chi_square_pvalue(samples, ks, probs):
    """Pearson chi-square of integer samples against ``probs`` on ``ks`` (cells merged so that
    every expected count is at least 5)."""
    samples = np.asarray(samples)
    n = samples.size
    probs = np.asarray(probs) / np.sum(probs)
    bins, acc, edges = [], 0.0, []
    for i, p in enumerate(probs):
        acc += p
        if acc * n >= 5:
            edges.append(i)
            acc = 0.0
    edges[-1] = len(probs) - 1
    bin_of = np.searchsorted(edges, np.arange(len(probs)))
    expected = np.bincount(bin_of, weights=probs)
    assert np.all((samples >= ks[0]) & (samples <= ks[-1]))
    observed = np.bincount(bin_of[samples - ks[0]], minlength=expected.size)
    return st.chisquare(observed, n * expected).pvalue


# ---------------------------------------------------------------------------------------------
# The single-count chain: y | y~, mu has stationary law Pois(y; mu) 2Geo(y~ - y; alpha)
# ---------------------------------------------------------------------------------------------

RELEASES = np.array([-3, 0, 2, 9, 1])
RATES = np.array([3.0, 3.0, 0.4, 5.0, 12.0])
ALPHAS = np.array([0.6, 0.3, 0.8, 0.6, 0.9])
# 2000 chains (4000 took twice the run time): the power checks below reject y~ = 8 and the rate 4
# at p < 1e-86, and a rate 10% off in every cell is rejected in three of the five at p < 1e-6
CHAINS, STEPS = 2000, 40


@jax.jit
def _count_chains(key):
    shape = (CHAINS, RELEASES.size)
    y_t = jnp.broadcast_to(jnp.asarray(RELEASES), shape)
    la = jnp.log(jnp.asarray(ALPHAS, jnp.float32))
    lam0 = jnp.broadcast_to((ALPHAS / (1 - ALPHAS))[:, None], (RELEASES.size, 2)).astype(jnp.float32)

    def step(carry, key):
        y, lam, fails = carry
        y, lam, ok = sample_true_counts(key, y_t, jnp.asarray(RATES, jnp.float32), lam, la)
        return (y, lam, fails + jnp.sum(~ok)), None

    init = (jnp.maximum(y_t, 0), jnp.broadcast_to(lam0, (*shape, 2)), 0)
    (y, _, fails), _ = lax.scan(step, init, random.split(key, STEPS))
    return y, fails


def exact_count_posterior(y_t, mu, alpha, ks):
    log_p = st.poisson(mu).logpmf(ks) + np.abs(y_t - ks) * np.log(alpha)
    p = np.exp(log_p - log_p.max())
    return p / p.sum()


def test_single_count_chain_stationary_distribution():
    y, fails = _count_chains(random.PRNGKey(0))
    assert int(fails) == 0
    y = np.asarray(y)
    ks = np.arange(0, 200)
    for j in range(RELEASES.size):
        exact = exact_count_posterior(RELEASES[j], RATES[j], ALPHAS[j], ks)
        assert chi_square_pvalue(y[:, j], ks, exact) > GOF_THRESHOLD / RELEASES.size, j
    # power: the draws for y~ = 9 are not those of y~ = 8 or of the rate 4
    assert chi_square_pvalue(y[:, 3], ks, exact_count_posterior(8, 5.0, 0.6, ks)) < GOF_THRESHOLD
    assert chi_square_pvalue(y[:, 3], ks, exact_count_posterior(9, 4.0, 0.6, ks)) < GOF_THRESHOLD


# ---------------------------------------------------------------------------------------------
# Geweke joint-distribution test of the factorization sampler
# ---------------------------------------------------------------------------------------------

D, V, K = 3, 4, 2
HYPER = {"a0": 1.0, "b0": 1.0}
GEWEKE_ALPHA = 0.5


def _joint_draws(key, num):
    """Marginal-conditional simulator: (theta, phi, y, lambda, y~) from the joint (NumPy's
    generator, seeded by ``key``: JAX's gamma and Poisson samplers compiled for these shapes took
    7 s, and NumPy's are independent of the code under test)."""
    rng = np.random.default_rng(np.asarray(random.key_data(key)).tolist())
    theta = (rng.gamma(HYPER["a0"], size=(num, D, K)) / HYPER["b0"]).astype(np.float32)
    phi = (rng.gamma(HYPER["a0"], size=(num, K, V)) / HYPER["b0"]).astype(np.float32)
    y = rng.poisson(np.asarray(topic_rates(theta, phi), np.float64)).astype(np.int32)
    lam = (rng.exponential(size=(num, D, V, 2)) * GEWEKE_ALPHA / (1 - GEWEKE_ALPHA)).astype(np.float32)
    g = rng.poisson(lam.astype(np.float64)).astype(np.int32)
    z = {"theta": theta, "phi": phi, "counts": y, "counts_dp_noise_rates": lam}
    return {k: jnp.asarray(v) for k, v in z.items()}, jnp.asarray(y + g[..., 0] - g[..., 1])


def _geweke_kernel(log_alpha_in_kernel=None):
    model = private_topic_model(alpha=GEWEKE_ALPHA)
    release = {"counts_dp": jnp.zeros((D, V), jnp.int32)}
    inner = PrivatePosterior(model, release, "gibbs").prepare((D, V, K), HYPER)
    assert isinstance(inner, CountGibbs)
    if log_alpha_in_kernel is not None:  # a deliberately wrong kernel, to check the test's power
        (blk,) = inner.blocks
        inner = CountGibbs(
            inner.model, [type(blk)(blk.source, blk.release, blk.noise_rates, log_alpha_in_kernel, False, blk.updates)]
        )
    return inner


def _numpy_poisson(key, rates):
    """Poisson draws by NumPy's generator, seeded by ``key``, in the compiled chain (a host callback, once per
    step for all chains): JAX's Poisson sampler added 4.5 s to the compilation of the chain."""

    def draw(key, rates):
        rng = np.random.default_rng(np.asarray(key).ravel().tolist())
        return rng.poisson(np.asarray(rates, np.float64)).astype(np.int32)

    return jax.pure_callback(draw, jax.ShapeDtypeStruct(rates.shape, jnp.int32), key, rates, vmap_method="expand_dims")


def _successive_conditional(inner, key, num, steps):
    """Geweke's successive-conditional simulator started from exact joint draws: each step is a
    Gibbs sweep given y~, then y~ regenerated given the state. Both leave the joint invariant, so
    every step's state is again a draw from the joint."""
    key_joint, key_run = random.split(key)
    z, y_t = _joint_draws(key_joint, num)

    def chain(key, z, y_t):
        def step(carry, key):
            z, y_t = carry
            key_sweep, key_noise = random.split(key)
            kwargs = {**HYPER, RELEASES_KWARG: {"counts_dp": y_t}}
            zero = jnp.zeros((), jnp.int32)
            state = inner.sample(CountGibbsState(z, key_sweep, zero, zero), (D, V, K), kwargs)
            z = state.z
            g = _numpy_poisson(key_noise, z["counts_dp_noise_rates"])
            return (z, z["counts"] + g[..., 0] - g[..., 1]), None

        (z, y_t), _ = lax.scan(step, (z, y_t), random.split(key, steps))
        return z, y_t

    return jax.jit(jax.vmap(chain))(random.split(key_run, num), z, y_t)


def _geweke_statistics(z, y_t):
    theta, phi, y, lam = (np.asarray(z[k]) for k in ("theta", "phi", "counts", "counts_dp_noise_rates"))
    return {
        "sum theta": theta.sum((1, 2)),
        "theta[0,0]": theta[:, 0, 0],
        "sum phi": phi.sum((1, 2)),
        "mu[0,0]": np.asarray(topic_rates(theta, phi))[:, 0, 0],
        "sum y": y.sum((1, 2)),
        "lambda+[0,0]": lam[:, 0, 0, 0],
        "sum y~": np.asarray(y_t).sum((1, 2)),
    }


def _geweke_pvalues(inner, num, steps, seed):
    z, y_t = _successive_conditional(inner, random.PRNGKey(seed), num, steps)
    z_ref, y_ref = _joint_draws(random.PRNGKey(seed + 1), num)
    a, b = _geweke_statistics(z, y_t), _geweke_statistics(z_ref, y_ref)
    return {k: st.ks_2samp(a[k], b[k]).pvalue for k in a}


def test_geweke_factorization_sampler():
    pvalues = _geweke_pvalues(_geweke_kernel(), num=600, steps=6, seed=10)
    assert min(pvalues.values()) > GOF_THRESHOLD / len(pvalues), pvalues


@pytest.mark.slow
def test_geweke_factorization_sampler_slow():
    pvalues = _geweke_pvalues(_geweke_kernel(), num=6000, steps=60, seed=20)
    assert min(pvalues.values()) > GOF_THRESHOLD / len(pvalues), pvalues
    # power: a kernel that assumes the wrong noise level drifts away from the joint
    wrong = _geweke_pvalues(_geweke_kernel(np.log(0.2)), num=6000, steps=60, seed=20)
    assert min(wrong.values()) < GOF_THRESHOLD / len(wrong), wrong


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def _poisson_model(n, counts=None):
    import numpyro
    import numpyro.distributions as dist

    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
    with numpyro.plate("cells", n):
        numpyro.sample("y", dist.Poisson(rate), obs=counts)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="alpha"):
        GeometricMechanism.from_alpha(1.2)
    with pytest.raises(ValueError, match="alpha"):
        GeometricMechanism.from_alpha(0.0)
    with pytest.raises(ValueError, match="alpha"):
        HeterogeneousGeometricMechanism.from_alpha(np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match="alpha"):
        private_topic_model(alpha=[0.3, -0.1])
    with pytest.raises(ValueError, match="epsilon"):
        limited_precision_mechanism(0.0, N=2)
    with pytest.raises(ValueError, match="epsilon"):
        limited_precision_mechanism(-1.0)
    with pytest.raises(ValueError, match="N must"):
        limited_precision_mechanism(1.0, N=0)
    with pytest.raises(ValueError, match="N must"):
        limited_precision_mechanism(1.0, N=1.5)
    with pytest.raises(ValueError, match="positive integer"):
        privatize_counts(_poisson_model, site="y", mechanism=GeometricMechanism(1.0, sensitivity=0.5))
    with pytest.raises(ValueError, match="or alpha"):
        private_topic_model()
    private = privatize_counts(_poisson_model, site="y", mechanism=limited_precision_mechanism(1.0))
    # non-integer confidential counts, and non-integer releases
    with pytest.raises(ValueError, match="integers"):
        make_release(private, 3, jnp.array([1.0, 2.5, 0.0]), rng_key=0)
    with pytest.raises(ValueError, match="non-negative"):
        make_release(private, 3, jnp.array([1, -2, 0]), rng_key=0)
    with pytest.raises(ValueError, match="integers"):
        private_posterior(private, {"y_dp": jnp.array([1.0, 2.5, -1.0])}).run(random.PRNGKey(0), 3)
    # shapes that do not match the model
    with pytest.raises(ValueError, match="shape"):
        private_posterior(private, {"y_dp": jnp.array([1, 2])}).run(random.PRNGKey(0), 3)
    with pytest.raises(ValueError, match="shape"):
        make_release(private_topic_model(1.0), 4, 5, 2, np.ones((4, 6), np.int64), rng_key=0)
    with pytest.raises(ValueError, match="broadcast"):
        make_release(private_topic_model(alpha=np.full(3, 0.5)), 4, 5, 2, np.ones((4, 5), np.int64), rng_key=0)
    with pytest.raises(ValueError, match="self-loops"):
        make_release(private_community_model(1.0), 3, 2, np.ones((3, 3), np.int64), rng_key=0)
    with pytest.raises(ValueError, match="geometric"):
        from d3pext.releases.mechanisms import LaplaceMechanism

        privatize_counts(_poisson_model, site="y", mechanism=LaplaceMechanism(1.0))


def test_bernstein_sheldon_backend_declines_records():
    # the exponential-family backends are registered first and must pass records releases on
    from d3pext.inference.registry import backends, build_kernel
    from d3pext.inference.structure import inspect_model

    private = privatize_counts(_poisson_model, site="y", mechanism=limited_precision_mechanism(1.0))
    pm = inspect_model(private, {"y_dp": jnp.array([3, -1, 4])}, (3,), {})
    from d3pext.inference.structure import NotApplicable

    for method in ("gibbs", "naive"):
        first = backends(method)[0]
        assert first.name not in ("schein-bessel", "truncated-counts")
        with pytest.raises(NotApplicable, match="records"):
            first.build(pm, {})
    # the gamma rate of the Poisson counts gets its conjugate update; without it, NUTS
    naive = build_kernel(pm, "naive", {})
    assert isinstance(naive, CountGibbs) and naive.blocks[0].conjugate == ("rate",)
    assert isinstance(build_kernel(pm, "naive", {"conjugate": False}).blocks[0][0], CountGibbs)


def test_local_privacy_epsilon():
    # Theorem 1: epsilon = N ln(1/alpha); the heterogeneous mechanism reports the worst record
    m = limited_precision_mechanism(2.0, N=4)
    assert m.alpha == pytest.approx(np.exp(-0.5))
    h = HeterogeneousGeometricMechanism.from_alpha(np.array([[0.2], [0.5]]), sensitivity=3)
    assert h.epsilon == pytest.approx(3 * np.log(5))
    assert h.cost().epsilon == pytest.approx(3 * np.log(5))


# ---------------------------------------------------------------------------------------------
# Posterior of a Poisson-gamma model (NUTS for the rate) against a brute-force grid
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_poisson_gamma_posterior_matches_grid_slow():
    release = jnp.array([4, -2, 7, 1, 0, 9])
    alpha = 0.5
    private = privatize_counts(_poisson_model, site="y", mechanism=GeometricMechanism.from_alpha(alpha))
    mcmc = private_posterior(private, {"y_dp": release}, num_warmup=1000, num_samples=4000,
                             num_chains=4, progress_bar=False)
    mcmc.run(random.PRNGKey(3), release.size)
    rate = np.asarray(mcmc.get_samples()["rate"])
    grid = np.linspace(1e-3, 25, 5000)
    with jax.enable_x64(True):
        loglik = np.asarray(
            GeometricNoisedPoisson(grid[:, None], alpha).log_prob(np.asarray(release)[None]).sum(1)
        )
    log_post = st.gamma(2.0, scale=2.0).logpdf(grid) + loglik
    w = np.exp(log_post - log_post.max())
    cdf = np.cumsum(w) / w.sum()
    mean = (grid * w).sum() / w.sum()
    sd = np.sqrt(((grid - mean) ** 2 * w).sum() / w.sum())
    assert abs(rate.mean() - mean) < 0.1 * sd  # loose; the KS test below is the sharp check
    assert abs(rate.std() - sd) < 0.05 * sd
    thinned = rate[::10]
    assert st.kstest(thinned, lambda x: np.interp(x, grid, cdf)).pvalue > GOF_THRESHOLD


# ---------------------------------------------------------------------------------------------
# The method against the naive baseline (seed 002, Figure 4 ordering)
# ---------------------------------------------------------------------------------------------


def _reconstruction_errors(num_docs, alpha0, seed, num_warmup, num_samples):
    key_data, key_alpha, key_release, key_run = random.split(random.key(seed), 4)
    data = simulate_topic_corpus(key_data, num_docs=num_docs)
    # heterogeneous noise: alpha_d ~ Beta(c alpha0, c (1 - alpha0)), c = 10 (section 5.1)
    alpha = np.asarray(random.beta(key_alpha, 10 * alpha0, 10 * (1 - alpha0), (num_docs,)))
    model = private_topic_model(alpha=np.clip(alpha, 1e-3, 1 - 1e-3))
    args = (num_docs, 15, 3)
    release = make_release(model, *args, data.counts, rng_key=key_release)
    errors = {}
    for method in ("gibbs", "naive"):
        s = sample_releases(model, {k: v[None] for k, v in release.items()}, key_run, *args,
                            method=method, num_warmup=num_warmup, num_samples=num_samples, num_chains=2)
        mu = np.asarray(topic_rates(s["theta"][0], s["phi"][0]).mean((0, 1)))
        errors[method] = np.abs(mu - data.counts).mean()
    return errors


@pytest.mark.slow
def test_method_beats_naive_at_high_privacy_slow():
    for seed in range(2):
        errors = _reconstruction_errors(num_docs=90, alpha0=0.8, seed=seed, num_warmup=500, num_samples=500)
        assert errors["gibbs"] < 0.8 * errors["naive"], errors


# ---------------------------------------------------------------------------------------------
# Conjugate gamma update of a Poisson rate (in place of NUTS)
# ---------------------------------------------------------------------------------------------

CONJ_RELEASE = jnp.array([4, -2, 7, 1, 0, 9])
CONJ_ALPHA = 0.5


def _grid_posterior(release, alpha, prior_shape=2.0, prior_rate=0.5):
    """Exact posterior of the rate on a grid: Gamma prior times the marginal likelihood of the
    release (Poisson convolved with two-sided geometric noise), independent of the sampler."""
    grid = np.linspace(1e-3, 25, 5000)
    # log p(y~ | rate) = log sum_y Pois(y; rate) 2Geo(y~ - y; alpha), y = 0..200 (the mass above 200 is below
    # 1e-60 on the grid): NumPy, in place of GeometricNoisedPoisson.log_prob (tests/test_bessel.py checks it),
    # whose eager evaluation compiled each of its operations here (4-7 s)
    from scipy.special import logsumexp

    y = np.arange(201)
    log_geo = np.log((1 - alpha) / (1 + alpha)) + np.abs(np.asarray(release)[:, None] - y) * np.log(alpha)
    loglik = logsumexp(st.poisson.logpmf(y, grid[:, None])[:, None, :] + log_geo, axis=-1).sum(1)
    log_post = st.gamma(prior_shape, scale=1 / prior_rate).logpdf(grid) + loglik
    w = np.exp(log_post - log_post.max())
    w /= w.sum()
    mean = (grid * w).sum()
    return grid, np.cumsum(w), mean, np.sqrt(((grid - mean) ** 2 * w).sum())


def _check_rate_draws(rate, release, alpha):
    """Posterior mean within 4 Monte Carlo standard errors (ESS-based) of the grid, sd within
    10%, and a KS test of draws thinned to about one per effective sample."""
    from numpyro.diagnostics import effective_sample_size

    grid, cdf, mean, sd = _grid_posterior(release, alpha)
    ess = float(effective_sample_size(rate))
    draws = rate.ravel()
    assert abs(draws.mean() - mean) < 4 * sd / np.sqrt(ess), (draws.mean(), mean, sd, ess)
    assert abs(draws.std() - sd) < 0.1 * sd, (draws.std(), sd)
    step = max(1, int(np.ceil(draws.size / ess)))
    assert st.kstest(draws[::step], lambda x: np.interp(x, grid, cdf)).pvalue > GOF_THRESHOLD


def _conj_private(extra=None):
    import numpyro
    import numpyro.distributions as dist

    def model(n, counts=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with numpyro.plate("cells", n):
            numpyro.sample("y", dist.Poisson(extra(rate) if extra else rate), obs=counts)

    return privatize_counts(model, site="y", mechanism=GeometricMechanism.from_alpha(CONJ_ALPHA))


def test_conjugate_rate_update_detected():
    import numpyro
    import numpyro.distributions as dist

    data = {"y_dp": CONJ_RELEASE}
    args = (CONJ_RELEASE.size,)
    inner = PrivatePosterior(_poisson_private(), data, "gibbs").prepare(args)
    assert isinstance(inner, CountGibbs) and inner.blocks[0].conjugate == ("rate",)
    # off on request, and where the rate is not the Poisson rate itself: NUTS
    nuts = PrivatePosterior(_poisson_private(), data, "gibbs", conjugate=False).prepare(args)
    assert type(nuts).__name__ == "Gibbs"
    doubled = PrivatePosterior(_conj_private(lambda r: 2 * r), data, "gibbs").prepare(args)
    assert type(doubled).__name__ == "Gibbs"

    # nor where the rate enters another factor
    def shared(n, counts=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        numpyro.sample("other", dist.Normal(rate, 1.0), obs=3.0)
        with numpyro.plate("cells", n):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    private = privatize_counts(shared, site="y", mechanism=GeometricMechanism.from_alpha(CONJ_ALPHA))
    assert type(PrivatePosterior(private, data, "gibbs").prepare(args)).__name__ == "Gibbs"


def test_conjugate_rate_update_needs_the_rate_itself():
    # min(rate, 50) equals the rate where the model is traced (the rate starts below 8), but is
    # another likelihood: Gamma(a + sum y, b + n) is not its full conditional
    data, args = {"y_dp": CONJ_RELEASE}, (CONJ_RELEASE.size,)
    capped = PrivatePosterior(_conj_private(lambda r: jnp.minimum(r, 50.0)), data, "gibbs").prepare(args)
    assert type(capped).__name__ == "Gibbs"  # NUTS keeps the rate
    assert isinstance(capped.blocks[0][0], CountGibbs) and capped.blocks[0][0].blocks[0].conjugate == ()


@pytest.mark.parametrize("bounds_method", ["clamp", "truncate"])
@pytest.mark.parametrize("method", ["gibbs", "naive"])
def test_bounded_count_releases_are_refused(bounds_method, method):
    # the augmentation takes a release as count + noise; counts clamped into (or dropped outside)
    # the bounds are another release: 200 Poisson(20) counts clamped at 10 gave a rate of 10.2 +- 0.5
    import numpyro
    import numpyro.distributions as dist

    def model(n, counts=None):
        rate = numpyro.sample("rate", dist.Gamma(1.0, 0.05))
        with numpyro.plate("cells", n):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    mechanism = GeometricMechanism(2.0, sensitivity=None)
    private = privatize(model, site="y", mechanism=mechanism, statistic="records", bounds=(0.0, 10.0),
                        bounds_method=bounds_method)
    with pytest.raises(ValueError, match=r"schein-bessel|truncated-counts") as err:
        PrivatePosterior(private, {"y_dp": jnp.array([3, 12, -1, 10])}, method).prepare((4,))
    assert "bounds=(0.0, 10.0)" in str(err.value) and "does not model" in str(err.value)


def test_the_confidential_counts_are_not_drawn_before_the_run():
    # they start from the release: a Poisson draw for them cost 2-3 s of compilation per shape (a
    # shape of its own here, so that no earlier test has compiled it)
    from compilations import count_compilations

    release = np.arange(-2, 9)
    args, kwargs = (release.size,), {RELEASES_KWARG: {"y_dp": release}}
    with count_compilations() as compiled:
        inner = PrivatePosterior(_poisson_private(), {"y_dp": release}, "gibbs").prepare(args)
        state = inner.init(random.PRNGKey(0), 0, None, args, kwargs)
    assert not [name for name in compiled if "poisson" in name], compiled
    np.testing.assert_array_equal(state.z["y"], np.maximum(release, 0))


def test_a_chain_whose_bessel_draws_keep_failing_fails_the_run():
    # non-finite noise rates (what JAX's binomial at p = 1 produced on a GPU) make every Bessel
    # draw of the cell fail; the counts were then kept silently for the rest of the run
    args, kwargs = (CONJ_RELEASE.size,), {RELEASES_KWARG: {"y_dp": CONJ_RELEASE}}
    inner = PrivatePosterior(_poisson_private(), {"y_dp": CONJ_RELEASE}, "gibbs").prepare(args)
    kernel = CountGibbs(inner.model, inner.blocks, max_stalls=3)
    state = kernel.init(random.PRNGKey(0), 0, None, args, kwargs)
    site = inner.blocks[0].noise_rates
    state = state._replace(z={**state.z, site: state.z[site].at[2, 0].set(jnp.nan)})
    sweep = jax.jit(lambda st: kernel.sample(st, args, kwargs))
    # noise rates that underflow against the rates (p = mu / (mu + lambda+) is 1 in float32): a
    # valid sweep, finite counts and rates
    tiny = np.finfo(np.float32).tiny
    fine = sweep(state._replace(z={**state.z, site: jnp.full_like(state.z[site], tiny)}))
    assert int(fine.num_failures) == 0 and np.all(np.asarray(fine.z["y"]) >= 0)
    assert all(np.all(np.isfinite(np.asarray(v))) for v in fine.z.values())
    for _ in range(2):  # failures below max_stalls in a row pass, and are counted
        state = sweep(state)
        assert int(state.num_failures) == 1
    with pytest.raises((RuntimeError, ValueError), match=r"CountGibbs: the count update .* 3 sweeps in a row"):
        jax.block_until_ready(sweep(state))
    with pytest.raises(ValueError, match="max_stalls"):
        CountGibbs(inner.model, inner.blocks, max_stalls=0)


def _poisson_private():
    return privatize_counts(_poisson_model, site="y", mechanism=GeometricMechanism.from_alpha(CONJ_ALPHA))


POISSON_PRIVATE = _poisson_private()


def _conjugate_rate_draws(release, key):
    # one model object and one set of settings: the second release reuses the compiled sampler. 2000 draws
    # per chain (5000 before): a count update assuming alpha = 0.4 for the release's 0.5 still fails the grid
    # check with KS p-values 6e-16, 4e-13, 1e-8 (keys 3, 4, 6; threshold 1e-3), a conjugate update with one
    # count too few (b + n - 1) at 51-56 standard errors; the correct sampler passes keys 3, 4, 6, 7
    mcmc = private_posterior(POISSON_PRIVATE, {"y_dp": release}, num_warmup=500,
                             num_samples=2000, num_chains=4, progress_bar=False)
    mcmc.run(random.PRNGKey(key), release.size)
    assert isinstance(mcmc.sampler.inner, CountGibbs)
    return np.asarray(mcmc.get_samples(group_by_chain=True)["rate"])


def test_conjugate_rate_posterior_matches_grid():
    _check_rate_draws(_conjugate_rate_draws(CONJ_RELEASE, 3), CONJ_RELEASE, CONJ_ALPHA)


def test_counts_in_the_millions_in_float32():
    # the Bessel sampler's log pmf (about 1.3e7 here) has no digits left in float32; its ratio to
    # the mode does. Before, 94% of the draws failed, the counts stayed put, and the rate's
    # posterior mean was 0.899e6. With noise of sd ~1 on counts of 1e6, the posterior is the
    # conjugate Gamma(2 + sum, 0.5 + 6) up to a shift far below its sd (about 380)
    from numpyro.diagnostics import effective_sample_size

    release = jnp.array([1000003, 999998, 1000010, 999990, 1000001, 1000005])
    assert not jax.config.jax_enable_x64
    rate = _conjugate_rate_draws(release, 5)
    shape, rate_param = 2.0 + float(release.sum()), 0.5 + release.size
    mcse = rate.std() / np.sqrt(float(effective_sample_size(rate)))
    assert abs(rate.mean() - shape / rate_param) < 4 * mcse + 5.0, (rate.mean(), shape / rate_param, mcse)
    assert abs(rate.std() / (np.sqrt(shape) / rate_param) - 1) < 0.1


def test_the_count_split_never_draws_at_a_degenerate_probability(monkeypatch):
    # JAX's binomial divides by log1p(-p) = 0 at p = 0 or 1; on an H100 such draws were NaN, the
    # counts kept 0 from then on, and the rate's posterior mean was 5/6 of the right one. Here
    # every probability reaching random.binomial must be in (0, 1/2], and the degenerate splits
    # are exact: all events from the rate when the other rate underflows, none when the rate is 0
    from d3pext.inference.counts import _binomial_split

    seen = []
    binomial = random.binomial

    def checked(key, n, p, shape=None, dtype=float):
        seen.append(np.asarray(p))
        return binomial(key, n, p, shape, dtype)

    monkeypatch.setattr(random, "binomial", checked)
    tiny = np.finfo(np.float32).tiny
    n = jnp.array([1e6, 1e6, 5.0, 5.0, 0.0, 7.0])
    rate = jnp.array([1e6, 0.0, 1.0, 2.0, 3.0, 1e-3])
    other = jnp.array([tiny, 1.0, 0.0, 2.0, 1.0, 1e30])
    k = np.asarray(_binomial_split(random.PRNGKey(0), n, rate, other))
    p = np.concatenate([x.ravel() for x in seen])
    assert p.size and np.all((p > 0) & (p <= 0.5)), p
    assert k[0] == 1e6 and k[1] == 0 and k[2] == 5 and k[4] == 0 and k[5] == 0 and 0 <= k[3] <= 5


def test_the_count_split_keeps_the_small_share_accurate_in_float32():
    # 1 - p at counts of 1e6 and a noise rate near 1 is about 1e-6: from p in float32 it is 1%
    # off (mean share 1.0729 instead of 1.0833), 5 standard errors at this size
    from d3pext.inference.counts import _binomial_split

    n, rate, other = 1e6, 923078.0, 1.0
    k = jax.jit(lambda key: _binomial_split(key, jnp.full((200_000,), n), jnp.full((200_000,), rate),
                                            jnp.full((200_000,), other)))(random.PRNGKey(2))
    share = n - np.asarray(k, np.float64)
    expected = n * other / (rate + other)
    assert abs(share.mean() - expected) < 3 * np.sqrt(expected / share.size), (share.mean(), expected)


@pytest.mark.slow
def test_conjugate_and_nuts_rate_posteriors_agree_slow():
    from numpyro.infer import MCMC

    for conjugate in (True, False):
        kernel = PrivatePosterior(_poisson_private(), {"y_dp": CONJ_RELEASE}, "gibbs", conjugate=conjugate)
        mcmc = MCMC(kernel, num_warmup=1000, num_samples=10000, num_chains=4,
                    chain_method="vectorized", progress_bar=False)
        mcmc.run(random.PRNGKey(4), CONJ_RELEASE.size)
        _check_rate_draws(np.asarray(mcmc.get_samples(group_by_chain=True)["rate"]), CONJ_RELEASE, CONJ_ALPHA)


# ---------------------------------------------------------------------------------------------
# The count split and the merged factorization sweep
# ---------------------------------------------------------------------------------------------


def test_split_counts_is_the_multinomial(monkeypatch):
    # (n_1..n_K) ~ Mult(n, rates / sum rates): each share's marginal is Binomial(n, p_k), the pair
    # (n_1, n_3) has the trinomial pmf, a zero rate gets nothing, and a count with all rates 0 is dropped
    from d3pext.inference.counts import split_counts

    seen = []
    binomial = random.binomial

    def checked(key, n, p, shape=None, dtype=float):
        jax.debug.callback(lambda v: seen.append(np.asarray(v)), p)  # (inside the split's scan)
        return binomial(key, n, p, shape, dtype)

    monkeypatch.setattr(random, "binomial", checked)
    rates = np.array([0.5, 0.0, 2.0, 1e-3, 3.0], np.float32)
    n, num = 9, 40_000
    # two more rows, in the same call (one compile): a count with all rates 0, and one with a single rate
    counts = jnp.concatenate([jnp.full((num,), n), jnp.array([4, 2])])
    all_rates = np.concatenate([np.broadcast_to(rates, (num, 5)), [[0.0] * 5, [1.0] + [0.0] * 4]]).astype(np.float32)
    shares = np.asarray(split_counts(random.PRNGKey(3), counts, jnp.asarray(all_rates))).astype(int)
    shares, dropped = shares[:num], shares[num:]
    assert np.array_equal(shares.sum(1), np.full(num, n)) and not shares[:, 1].any()
    probs = rates / rates.sum()
    for k in (0, 2, 3, 4):
        ks = np.arange(n + 1)
        assert chi_square_pvalue(shares[:, k], ks, st.binom.pmf(ks, n, probs[k])) > GOF_THRESHOLD, k
    pairs = np.array([(a, b) for a in range(n + 1) for b in range(n + 1 - a)])
    third = 1 - probs[0] - probs[2]
    pmf = st.multinomial.pmf(np.column_stack([pairs, n - pairs.sum(1)]), n, [probs[0], probs[2], third])
    code = {tuple(p): i for i, p in enumerate(pairs)}
    observed = np.array([code[(a, b)] for a, b in shares[:, [0, 2]].astype(int)])
    order = np.argsort(-pmf)  # cells merged from the most probable down
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    assert chi_square_pvalue(rank[observed], np.arange(pmf.size), pmf[order]) > GOF_THRESHOLD
    assert np.array_equal(dropped, [[0, 0, 0, 0, 0], [2, 0, 0, 0, 0]])
    p = np.concatenate([x.ravel() for x in seen])
    assert p.size and np.all((p > 0) & (p <= 0.5)), p  # never a draw at probability 1 (or 0)


def test_the_factorization_sweep_draws_its_gamma_variates_in_one_call():
    # Schein et al.'s split of y+ and the topic allocation are one multinomial split, and the noise
    # rates' gamma variates are drawn with the factors': a sweep compiles one gamma sampler (two before)
    inner = _geweke_kernel()
    kwargs = {**HYPER, RELEASES_KWARG: {"counts_dp": jnp.zeros((D, V), jnp.int32)}}
    state = inner.init(random.PRNGKey(0), 10, None, (D, V, K), kwargs)
    jaxpr = jax.make_jaxpr(lambda s: inner.sample(s, (D, V, K), kwargs))(state)

    def gammas(jaxpr):
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name == "random_gamma"
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    inner_jaxpr = getattr(sub, "jaxpr", sub)
                    if hasattr(inner_jaxpr, "eqns"):
                        found += gammas(inner_jaxpr)
        return found

    assert gammas(jaxpr.jaxpr) == 1


@pytest.mark.parametrize("where", ["prior", "records"])
@pytest.mark.parametrize("handler", ["mask", "scale"])
def test_conjugate_rate_update_refuses_masked_or_scaled_sites(where, handler):
    # Gamma(a + sum y, b + n) is the full conditional of the unweighted prior and records only; a
    # power prior (scale) or a masked prior was updated as if the handler were not there
    import numpyro
    import numpyro.distributions as dist

    weight = {"mask": lambda: numpyro.handlers.mask(mask=False),
              "scale": lambda: numpyro.handlers.scale(scale=0.1)}[handler]
    neutral = lambda: numpyro.handlers.scale(scale=1.0)  # noqa: E731

    def model(n, counts=None):
        with weight() if where == "prior" else neutral():
            rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with numpyro.plate("cells", n):
            with weight() if where == "records" else neutral():
                numpyro.sample("y", dist.Poisson(rate), obs=counts)

    private = privatize_counts(model, site="y", mechanism=GeometricMechanism.from_alpha(CONJ_ALPHA))
    kernel = PrivatePosterior(private, {"y_dp": CONJ_RELEASE}, "gibbs").prepare((CONJ_RELEASE.size,))
    assert type(kernel).__name__ == "Gibbs"  # NUTS keeps the rate
    assert isinstance(kernel.blocks[0][0], CountGibbs) and kernel.blocks[0][0].blocks[0].conjugate == ()
