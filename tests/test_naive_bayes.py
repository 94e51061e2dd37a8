"""The naive-Bayes log-linear model of seed 000 S3.3 (models/naive_bayes.py): its release, its
exact likelihood against brute-force enumeration, the importance-sampling reference, and SPPE/SPLE
against that reference."""

import itertools
from math import factorial

import numpy as np
import pytest
from scipy import stats

import jax
from jax import random
import jax.numpy as jnp
from numpyro.handlers import seed, substitute, trace

from d3pext.handlers import make_release, private_posterior
from d3pext.models.naive_bayes import (
    PAPER_CLASS_PROBS,
    PAPER_FEATURE_PROBS,
    PAPER_M,
    NaiveBayesRecords,
    naive_bayes_log_likelihood,
    naive_bayes_naive_posterior,
    naive_bayes_reference,
    naive_bayes_sensitivity,
    naive_bayes_statistic,
    private_naive_bayes,
    simulate_naive_bayes,
)

# -- the model and its release -------------------------------------------------------------------


def _counts(records, num_classes, levels):
    out = []
    for i in range(num_classes):
        for k, j_k in enumerate(levels):
            for j in range(j_k):
                out.append(np.sum((records[:, 0] == i) & (records[:, k + 1] == j)))
    return np.array(out, float)


def test_statistic_counts_cells_in_paper_order():
    rng = np.random.default_rng(0)
    levels = (2, 3, 2)
    records = np.column_stack([rng.integers(0, 3, 40)] + [rng.integers(0, j, 40) for j in levels])
    got = np.asarray(naive_bayes_statistic(jnp.asarray(records), 3, levels))
    np.testing.assert_allclose(got, _counts(records, 3, levels) / 40, atol=1e-7)
    # each feature's proportions add to one
    per = got.reshape(3, -1)
    np.testing.assert_allclose([per[:, :2].sum(), per[:, 2:5].sum(), per[:, 5:].sum()], 1.0, atol=1e-6)


def test_paper_release_is_noisy_proportions():
    # the vector S3.3 prints as r is the private m: its features do not add up to one exactly
    m = np.array(PAPER_M).reshape(2, 2, 2)  # (i, k, j)
    sums = m.sum((0, 2))
    assert np.all(np.abs(sums - 1) > 1e-3) and np.all(np.abs(sums - 1) < 0.02)


def test_sensitivity_is_worst_case_substitution():
    # brute force over all pairs of records: the L1 change of the proportions is at most 2K/n
    for levels in [(2, 2), (3, 2, 2)]:
        cells = list(itertools.product(range(2), *[range(j) for j in levels]))
        base = np.array([list(cells[0])] * 5)
        worst = 0.0
        for a, b in itertools.product(cells, repeat=2):
            d1 = base.copy()
            d1[0], d2 = a, base.copy()
            d2[0] = b
            worst = max(worst, np.abs(_counts(d1, 2, levels) - _counts(d2, 2, levels)).sum() / 5)
        assert worst == pytest.approx(naive_bayes_sensitivity(5, len(levels)))


TRUTH = {"class_probs": jnp.array(PAPER_CLASS_PROBS),
         **{f"feature_probs_{k + 1}": jnp.array(p) for k, p in enumerate(PAPER_FEATURE_PROBS)}}


def test_release_has_the_paper_noise_scale():
    # parameters substituted: eager Dirichlet sampling would only cost compilation time here
    model = substitute(private_naive_bayes(100, 10.0), data=TRUTH)
    tr = trace(seed(model, 0)).get_trace()
    info = tr["records_dp"]["infer"]["privatize"]
    assert info.mechanism.scale == pytest.approx(2 * 2 / (100 * 10.0))
    assert info.mechanism.neighbouring == "substitute"
    assert set(tr) >= {"class_probs", "feature_probs_1", "feature_probs_2", "records", "records_dp"}
    records = simulate_naive_bayes(random.key(1))
    release = make_release(model, records=records, rng_key=3)["records_dp"]
    stat = naive_bayes_statistic(records)
    assert release.shape == (8,) and float(jnp.max(jnp.abs(release - stat))) < 0.1
    noise = info.mechanism.release(random.key(2), jnp.broadcast_to(stat, (500, 8))) - stat
    noise = np.asarray(noise).reshape(-1)
    assert stats.kstest(noise, stats.laplace(scale=info.mechanism.scale).cdf).pvalue > 1e-3


def test_model_refuses_arguments_other_than_the_built_ones():
    """The sensitivity 2K/n is fixed at build time: the model must not take another n or K
    (n = 10 records under a model built for 100 were accepted: neighbours differed by 10 times
    the stated sensitivity)."""
    model = substitute(private_naive_bayes(100, 1.0), data=TRUTH)
    small = jnp.zeros((10, 3), jnp.int32)
    for kwargs, match in [
        (dict(n=10, records=small), "built for n=100.*called with n=10"),
        (dict(levels=(2, 2, 2)), r"called with levels=\(2, 2, 2\)"),
        (dict(num_classes=3), "called with num_classes=3"),
    ]:
        with pytest.raises(ValueError, match=match):
            trace(seed(model, 0)).get_trace(**kwargs)
    # the built values may be passed again
    tr = trace(seed(model, 0)).get_trace(100, 2, (2, 2), records=jnp.zeros((100, 3), jnp.int32))
    assert tr["records_dp"]["infer"]["privatize"].sensitivity == pytest.approx(0.04)


def test_records_distribution_matches_probabilities():
    d = NaiveBayesRecords(jnp.array(PAPER_CLASS_PROBS), [jnp.array(p) for p in PAPER_FEATURE_PROBS])
    x = np.asarray(d.sample(random.key(0), (20000,)))
    cells = list(itertools.product(range(2), range(2), range(2)))
    probs = np.exp(np.asarray(d.log_prob(jnp.array(cells))))
    assert probs.sum() == pytest.approx(1.0, abs=1e-5)
    observed = np.array([np.sum(np.all(x == c, 1)) for c in cells])
    probs = probs.astype(np.float64)
    assert stats.chisquare(observed, probs / probs.sum() * len(x)).pvalue > 1e-3


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: private_naive_bayes(100, 10.0, sensitivity=0.03), "below 2K/n"),
        (lambda: private_naive_bayes(100, 0.0), "epsilon"),
        (lambda: private_naive_bayes(100, 1.0, levels=(2, 1)), "levels"),
        (lambda: private_naive_bayes(0, 1.0), "n must"),
        (lambda: private_naive_bayes(100, 1.0, num_classes=1), "num_classes"),
        (lambda: make_release(substitute(private_naive_bayes(4), data=TRUTH),
                              records=jnp.array([[0, 0, 2]] * 4), rng_key=0), "column 2"),
        (lambda: make_release(substitute(private_naive_bayes(4), data=TRUTH),
                              records=jnp.zeros((5, 3), int), rng_key=0), "shape"),
        (lambda: naive_bayes_log_likelihood(jnp.zeros(6), jnp.array([0.5, 0.5]),
                                            jnp.full((2, 2, 2), 0.5), 10, 0.1), "I = 2"),
        (lambda: naive_bayes_log_likelihood(jnp.zeros(8), jnp.array([0.5, 0.5]),
                                            jnp.full((2, 2, 2), 0.5), 10, 0.0), "scale"),
        (lambda: naive_bayes_naive_posterior(jnp.zeros(7)), "shape"),
    ],
)
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# -- the exact likelihood -----------------------------------------------------------------------


def _brute_force_log_likelihood(release, p, q, n, b):
    """Sum over every table of counts of the ``2 * 2^K`` cells ``(y, x_1..x_K)`` (multinomial)."""
    K = q.shape[0]
    cells = list(itertools.product(range(2), *[range(2)] * K))
    cp = np.array([p[c[0]] * np.prod([q[k, c[0], c[k + 1]] for k in range(K)]) for c in cells])
    total = 0.0
    for multiset in itertools.combinations_with_replacement(range(len(cells)), n):
        comp = np.bincount(multiset, minlength=len(cells))
        prob = factorial(n) * np.prod([cp[c] ** comp[c] / factorial(comp[c]) for c in range(len(cells))])
        counts = np.zeros((2, K, 2))
        for c, cell in zip(comp, cells):
            for k in range(K):
                counts[cell[0], k, cell[k + 1]] += c
        stat = counts.reshape(-1) / n
        total += prob * np.prod(np.exp(-np.abs(release - stat) / b) / (2 * b))
    return np.log(total)


@pytest.mark.parametrize("K, n, b", [(2, 4, 0.3), (2, 3, 0.05), (1, 4, 0.2)])
def test_exact_likelihood_matches_brute_force(K, n, b):
    rng = np.random.default_rng(K * 10 + n)
    for _ in range(2):
        p = rng.dirichlet([2, 2])
        q = rng.dirichlet([2, 2], (K, 2))
        release = rng.uniform(-0.1, 0.6, 4 * K)
        expected = _brute_force_log_likelihood(release, p, q, n, b)
        got = naive_bayes_log_likelihood(jnp.asarray(release), jnp.asarray(p), jnp.asarray(q), n, b)
        assert float(got) == pytest.approx(expected, abs=2e-4)


def test_exact_likelihood_against_monte_carlo():
    # n = 20: E over simulated tables of the Laplace density (unbiased), against the exact sum
    n, b = 20, 0.05
    p, q = jnp.array(PAPER_CLASS_PROBS), jnp.array(PAPER_FEATURE_PROBS)
    release = jnp.array(PAPER_M)
    d = NaiveBayesRecords(p, list(q))
    recs = jax.vmap(lambda k: d.sample(k, (n,)))(random.split(random.key(5), 10000))
    stat = naive_bayes_statistic(recs)
    lik = jnp.exp(jnp.sum(-jnp.abs(release - stat) / b - jnp.log(2 * b), -1))
    mc, se = float(lik.mean()), float(lik.std() / np.sqrt(lik.shape[0]))
    exact = float(jnp.exp(naive_bayes_log_likelihood(release, p, q, n, b)))
    assert abs(mc - exact) < 4 * se + 1e-3 * exact


def test_reference_recovers_the_conjugate_posterior_without_noise():
    # with negligible noise and a release of exact proportions, the posterior is
    # Dirichlet(alpha + counts): the IS reference (exact likelihood) must reproduce its moments
    records = simulate_naive_bayes(random.key(7), 30)
    release = naive_bayes_statistic(records)
    ref = naive_bayes_reference(release, random.key(8), n=30, epsilon=1e4, num_draws=2000, stages=3)
    assert ref["ess"] > 300
    conc = naive_bayes_naive_posterior(release, n=30)
    for site, c in conc.items():
        c = np.asarray(c)
        mean = c / c.sum(-1, keepdims=True)
        sd = np.sqrt(mean * (1 - mean) / (c.sum(-1, keepdims=True) + 1))
        np.testing.assert_allclose(np.asarray(ref["mean"][site]), mean, atol=4 * sd.max() / np.sqrt(300))
        np.testing.assert_allclose(np.asarray(ref["sd"][site]), sd, rtol=0.2)


# -- SPPE, fast twin ------------------------------------------------------------------------------


def test_simulator_maps_simplices_to_unconstrained_space():
    # what SPPE/SPLE see: 1 + 2 * 2 stick-breaking coordinates, a round trip to the simplices, and
    # the prior density in those coordinates (Dirichlet(2) densities times the Jacobian)
    from d3pext.simulation.sbi import Simulator

    sim = Simulator(private_naive_bayes(), {"records_dp": jnp.array(PAPER_M)})
    assert sim.dim == 5 and sim.release_dim == 8
    assert set(sim.parameters) == {"class_probs", "feature_probs_1", "feature_probs_2"}
    z = sim.unconstrain(TRUTH)
    back = sim.constrain(z)
    for k, v in TRUTH.items():
        np.testing.assert_allclose(np.asarray(back[k]), np.asarray(v), atol=1e-6)
    # for J = 2 the stick-breaking coordinate u of a row (a, 1 - a) is logit(a), with
    # d a / d u = a (1 - a); Dirichlet(2, 2) density of the row: 6 a (1 - a)
    rows = np.array([PAPER_CLASS_PROBS[0]] + [PAPER_FEATURE_PROBS[k][i][0] for k in range(2) for i in range(2)])
    expected = np.sum(np.log(6 * rows * (1 - rows)) + np.log(rows * (1 - rows)))
    assert float(sim.log_prior(z)) == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_sppe_tiny_run_on_simplex_parameters():
    # ~50 s on this CPU (compiling the simulator with three Dirichlet samplers and the flow), too
    # much for the default run; the simplex handling has the fast check above
    pytest.importorskip("flowjax")

    post = private_posterior(
        private_naive_bayes(), {"records_dp": jnp.array(PAPER_M)}, method="sppe", rounds=1,
        simulations_per_round=320, num_points=2, max_epochs=15, learning_rate=5e-3, batch_size=50,
        flow_kwargs=dict(layers=2, width=8, knots=4), progress_bar=False,
    )
    post.run(random.key(0))
    assert post.simulator.dim == 5  # 1 + 2 * 2 stick-breaking coordinates
    draws = post.sample(random.key(1), 1000)
    assert draws["class_probs"].shape == (1000, 2) and draws["feature_probs_2"].shape == (1000, 2, 2)
    for v in draws.values():
        assert bool(jnp.all(v > 0)) and np.allclose(np.asarray(v.sum(-1)), 1.0, atol=1e-5)
    lp = post.log_prob({k: v[:10] for k, v in draws.items()})
    assert lp.shape == (10,) and bool(jnp.all(jnp.isfinite(lp)))
    # one round of a tiny flow has already moved p_1 from the prior mean 0.5 towards 0.77
    assert float(draws["class_probs"][:, 0].mean()) > 0.6


# -- slow: SPPE and SPLE against the exact reference ----------------------------------------------

SITES = ("class_probs", "feature_probs_1", "feature_probs_2")


def _free(d):
    """The five free parameters ``p_1, p^1_{1,1}, p^1_{2,1}, p^2_{1,1}, p^2_{2,1}``."""
    d = {k: np.asarray(v) for k, v in d.items()}
    return np.stack([d["class_probs"][..., 0], d["feature_probs_1"][..., 0, 0],
                     d["feature_probs_1"][..., 1, 0], d["feature_probs_2"][..., 0, 0],
                     d["feature_probs_2"][..., 1, 0]], -1)


def _naive_moments(conc):
    mean = {k: np.asarray(v) / np.asarray(v).sum(-1, keepdims=True) for k, v in conc.items()}
    sd = {k: np.sqrt(mean[k] * (1 - mean[k]) / (np.asarray(v).sum(-1, keepdims=True) + 1))
          for k, v in conc.items()}
    return _free(mean), _free(sd)


@pytest.fixture(scope="module")
def paper_reference():
    return naive_bayes_reference(jnp.array(PAPER_M), random.key(0))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sppe", "sple"])
def test_sppe_sple_match_exact_reference(method, paper_reference):
    # Measured (3 rounds x 1000, 2026-11): |mean - exact| <= 0.014 (SPPE), 0.015 (SPLE); posterior
    # sd ratios SPPE 1.16-1.42, SPLE 1.0-1.15. The exact posterior sd is 0.042-0.097, so the
    # tolerance 0.05 is about half an sd to one sd.
    pytest.importorskip("flowjax")
    import d3pext.simulation.sbi  # noqa: F401

    ref = paper_reference
    assert ref["ess"] > 2000
    ref_mean, ref_sd = _free(ref["mean"]), _free(ref["sd"])
    post = private_posterior(
        private_naive_bayes(), {"records_dp": jnp.array(PAPER_M)}, method=method, rounds=3,
        simulations_per_round=1000, num_points=8, max_epochs=100, patience=10,
        flow_kwargs=dict(layers=4, width=32), progress_bar=False, num_warmup=200, num_chains=4,
    )
    post.run(random.key(0))
    draws = _free(post.sample(random.key(1), 4000))
    assert np.all(np.abs(draws.mean(0) - ref_mean) < 0.05)
    ratio = draws.std(0) / ref_sd
    assert np.all((ratio > 0.7) & (ratio < 1.6))
    # the truth lies within 3 exact-posterior sds of the flows' means
    truth = np.array([PAPER_CLASS_PROBS[0], PAPER_FEATURE_PROBS[0][0][0], PAPER_FEATURE_PROBS[0][1][0],
                      PAPER_FEATURE_PROBS[1][0][0], PAPER_FEATURE_PROBS[1][1][0]])
    assert np.all(np.abs(draws.mean(0) - truth) < 3 * ref_sd)


@pytest.mark.slow
def test_naive_posterior_against_exact(paper_reference):
    # At the paper's setting (epsilon = 10, n = 100) the noise scale is 0.004, 0.4 of a count: the
    # naive posterior is within 0.01 of the exact one (measured 0.0075), closer than the flows
    # get with 3 rounds. With epsilon = 0.5 (scale 0.08, 8 counts) it is wrong and over-confident.
    ref_mean = _free(paper_reference["mean"])
    naive_mean, _ = _naive_moments(naive_bayes_naive_posterior(jnp.array(PAPER_M)))
    assert np.abs(naive_mean - ref_mean).max() < 0.01

    truth = {"class_probs": jnp.array(PAPER_CLASS_PROBS),
             **{f"feature_probs_{k + 1}": jnp.array(p) for k, p in enumerate(PAPER_FEATURE_PROBS)}}
    records = simulate_naive_bayes(random.key(2024))
    model = substitute(private_naive_bayes(100, 0.5), data=truth)
    release = make_release(model, records=records, rng_key=2025)["records_dp"]
    ref = naive_bayes_reference(release, random.key(1), epsilon=0.5)
    assert ref["ess"] > 2000
    ref_mean, ref_sd = _free(ref["mean"]), _free(ref["sd"])
    naive_mean, naive_sd = _naive_moments(naive_bayes_naive_posterior(release))
    # each parameter's error in its own posterior sd (1.26 sd at worst for this release)
    assert (np.abs(naive_mean - ref_mean) / ref_sd).max() > 0.5
    assert np.all(naive_sd < ref_sd)


def test_curator_proportions_move_by_at_most_their_sensitivity():
    """The released proportions are integer counts divided in float64: in float32, one substituted record
    of 2e6 had moved them by 1.043x the sensitivity 2K / n (1.19x at 1e7), beyond the one grid unit of
    slack the float-safe Laplace release keeps for rounding."""
    from d3pext.handlers.privatize import _release_placeholder

    n = 2_000_000
    c = np.arange(1, n)
    f = lambda k: (k.astype(np.float32) / np.float32(n)).astype(np.float64)  # noqa: E731
    c = int(c[np.argmax(np.abs(f(c) - f(c - 1)) + np.abs(f(n - c + 1) - f(n - c)))])  # worst for float32
    records = np.zeros((n, 3), np.int32)
    records[c:, 1:] = 1
    neighbour = records.copy()
    neighbour[0] = [0, 1, 1]
    model = private_naive_bayes(n=n, epsilon=1.0)

    def statistic(r):
        tr = trace(substitute(seed(model, 0), substitute_fn=_release_placeholder)).get_trace(records=r)
        return np.asarray(tr["records_dp"]["infer"]["statistic"]), tr["records_dp"]["infer"]["privatize"]

    (first, info), (second, _) = statistic(records), statistic(neighbour)
    assert first.dtype == np.float64
    assert np.abs(second - first).sum() <= info.sensitivity * (1 + 1e-12)
    np.testing.assert_array_equal(first * n, np.round(first * n))  # c / n, correctly rounded
