"""SPPE and SPLE (d3pext.simulation.sbi) on the linear-regression example of seed 000, against an exact
importance-sampling reference; the linear-regression model's statistic and sensitivity."""

import itertools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import jax
from jax import random
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist

pytest.importorskip("flowjax")

from d3pext.handlers import available_methods, private_posterior, privatize  # noqa: E402
from d3pext.releases.mechanisms import LaplaceMechanism  # noqa: E402
from d3pext.models.linear_regression import (  # noqa: E402
    PAPER_S_DP,
    linear_regression_naive_posterior,
    linear_regression_reference,
    linear_regression_sensitivity,
    linear_regression_statistic,
    private_linear_regression,
)

PAPER_DA_MCMC = np.array([-0.62, -2.72, 0.54])  # seed 000, Table 1
S_OBS = {"records_dp": jnp.array(PAPER_S_DP)}


# -- the model ---------------------------------------------------------------------------------


def _record_stat(r):
    x = np.concatenate([[1.0], r[:-1]])
    y = r[-1]
    q = len(x)
    xx = np.outer(x, x)
    rows, cols = np.triu_indices(q)
    keep = ~((rows == 0) & (cols == 0))
    return np.concatenate([x * y, [y * y], xx[rows[keep], cols[keep]]])


@pytest.mark.parametrize("p", [1, 2])
def test_sensitivity_bound_by_brute_force(p):
    # every pair of records in [-1, 1]^(p+1) on a grid plus random pairs: the L1 change of the
    # per-record statistic never exceeds n * Delta = (p + 1)(p + 9/4), and comes close to it
    grid = np.linspace(-1, 1, 9)
    recs = np.array(list(itertools.product(grid, repeat=p + 1)))
    rng = np.random.default_rng(0)
    recs = np.concatenate([recs, rng.uniform(-1, 1, (2000, p + 1)), [[1.0] * p + [-0.5]]])
    t = np.array([_record_stat(r) for r in recs])
    worst = max(np.abs(t[i] - t).sum(1).max() for i in range(len(t)))
    bound = linear_regression_sensitivity(p, 1)
    assert worst <= bound
    assert worst > 0.7 * bound
    if p == 2:  # the paper's (p^2 + 3p + 3)/n = 13/n is valid too, the naive count 15 is loose
        assert bound <= 13.0


def test_statistic_matches_direct_computation():
    rng = np.random.default_rng(1)
    records = rng.normal(0, 8, (50, 3))
    z = np.clip(records, -10, 10) / 10
    expected = np.mean([_record_stat(r) for r in z], 0)
    np.testing.assert_allclose(np.asarray(linear_regression_statistic(jnp.asarray(records))),
                               expected, rtol=1e-5, atol=1e-6)


def test_smaller_sensitivity_is_refused():
    with pytest.raises(ValueError, match="proven bound"):
        private_linear_regression(100, 10.0, sensitivity=0.1)


def test_naive_posterior_reproduces_the_paper():
    # one compiled program (op by op: about 45)
    mean, cov = jax.jit(lambda s: linear_regression_naive_posterior(s, 100))(jnp.array(PAPER_S_DP))
    np.testing.assert_allclose(np.asarray(mean), [-4.63, -6.23, -5.10], atol=0.01)
    lo = np.asarray(mean) - 1.96 * np.sqrt(np.diag(np.asarray(cov)))
    np.testing.assert_allclose(lo, [-5.04, -6.57, -5.40], atol=0.02)


# -- errors ------------------------------------------------------------------------------------


def test_methods_registered():
    assert {"sppe", "sple"} <= set(available_methods())


@pytest.mark.parametrize(
    "kwargs, match",
    [({"rounds": 0}, "rounds"), ({"simulations_per_round": 0}, "simulations_per_round"),
     ({"simulations_per_round": 50}, "batch_size"), ({"integration": "qmc"}, "integration"),
     ({"num_atoms": 1}, "num_atoms")],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        private_posterior(private_linear_regression(100, 10.0), S_OBS, method="sppe", **kwargs)


def test_bad_release_and_unsimulable_model():
    model = private_linear_regression(100, 10.0)
    post = private_posterior(model, {"records_dp": jnp.zeros(8)}, method="sppe")
    with pytest.raises(ValueError, match="shape"):
        post.run(random.key(0), 100)
    post = private_posterior(model, {"x_dp": jnp.zeros(9)}, method="sple")
    with pytest.raises(ValueError, match="not release sites"):
        post.run(random.key(0), 100)

    class NoSampler(dist.Normal):
        def sample(self, key, sample_shape=()):
            raise NotImplementedError("no sampler")

    def model2(n):
        mu = numpyro.sample("mu", dist.Normal(0, 1))
        with numpyro.plate("n", n):
            numpyro.sample("x", NoSampler(mu, 1.0))

    private = privatize(model2, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=1.0),
                        statistic=lambda x: jnp.clip(x, -1, 1).sum())
    post = private_posterior(private, {"x_dp": jnp.array(1.0)}, method="sppe")
    with pytest.raises(ValueError, match="cannot be simulated forward"):
        post.run(random.key(0), 10)


def _mean_model(n):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Normal(mu, 1.0))


_PRIVATE_MEAN = privatize(_mean_model, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=2.0),
                          statistic=lambda x: jnp.clip(x, -1, 1).sum(keepdims=True))


def test_simulators_of_one_model_share_their_programs_not_their_releases():
    from d3pext.simulation.sbi import Simulator

    a = Simulator(_PRIVATE_MEAN, {"x_dp": jnp.array([3.0])}, (20,))
    b = Simulator(_PRIVATE_MEAN, {"x_dp": jnp.array([-5.0])}, (20,))
    c = Simulator(_PRIVATE_MEAN, {"x_dp": jnp.array([3.0])}, (30,))  # other arguments: other programs
    assert a.programs is b.programs and a.programs is not c.programs
    assert float(b.observed[0]) == -5.0
    for x, y in zip(a.simulate(random.key(0), 8), b.simulate(random.key(0), 8)):
        np.testing.assert_array_equal(x, y)  # the release is not an input of the simulation
    # the statistic of 30 records can exceed that of 20: c's program is its own
    assert float(jnp.abs(c.simulate(random.key(1), 400)[1]).max()) > 20.0

    # a model that reads a changed global is traced and compiled again
    shift = [0.0]

    def drifting(n):
        mu = numpyro.sample("mu", dist.Normal(shift[0], 1.0))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Normal(mu, 1.0))

    private = privatize(drifting, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=2.0),
                        statistic=lambda x: jnp.clip(x, -1, 1).sum(keepdims=True))
    before = Simulator(private, {"x_dp": jnp.array([3.0])}, (20,))
    shift[0] = 5.0
    after = Simulator(private, {"x_dp": jnp.array([3.0])}, (20,))
    assert after.programs is not before.programs
    assert float(after.constrain(after.simulate(random.key(0), 200)[0].mean(0))["mu"]) > 4.0

    from d3pext.simulation.sbi import _hashable

    # arguments key the programs by type and value; where there is no faithful key, none is shared
    assert _hashable(0.0) != _hashable(-0.0) and _hashable(1) != _hashable(True) != _hashable(1.0)
    assert _hashable(np.arange(3)) == _hashable(np.arange(3)) != _hashable(np.arange(3.0))
    assert _hashable(np.array(1.0)) != _hashable(np.array([1.0])) != _hashable(np.array([[1.0]]))
    big = np.zeros(50_000)
    assert _hashable(big) == _hashable(big.copy()) != _hashable(np.where(np.arange(50_000) == 7, 1e-9, big))
    for value in (object(), np.array([None])):
        with pytest.raises(TypeError):
            _hashable(value)


def test_a_second_fit_of_the_same_model_compiles_no_simulation_or_sampler():
    # another release, another seed: the simulator, the release points, the round's bookkeeping
    # and SPLE's NUTS sampler are reused; only what is new (none here) compiles
    from compilations import count_compilations

    fit = dict(rounds=1, simulations_per_round=200, num_points=2, max_epochs=2, num_warmup=20,
               num_chains=2, flow_kwargs=dict(layers=1, width=4, knots=3), progress_bar=False)
    draws = {}
    for i, release in enumerate((3.0, -4.0)):
        post = private_posterior(_PRIVATE_MEAN, {"x_dp": jnp.array([release])}, method="sple", **fit)
        with count_compilations() as compiled:
            post.run(random.key(i), 20)
            draws[release] = post.sample(random.key(10 + i), 40)["mu"]
        if i == 1:
            assert not compiled, compiled
    # each posterior follows its own release: the statistic clip(x).sum() moves with mu
    assert float(draws[3.0].mean()) > float(draws[-4.0].mean())
    # the chains start from the last round's parameters, or from prior draws where those are too few
    assert post._init_points(random.key(0), 2).shape == (2, 1)
    post._last_parameters = post._last_parameters[:3]
    assert post._init_points(random.key(0), 2).shape == (2, 1)


# -- simulation rounds over several devices ---------------------------------------------------


def test_simulation_round_over_four_devices_matches_one():
    # a round's simulations (from the prior and from given parameters) and RQMC releases, split
    # over 4 forced CPU devices (10 rows, padded to 12), equal those of one device for the same keys
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from jax import random
        import numpyro, numpyro.distributions as dist
        from d3pext.handlers import private_posterior, privatize
        from d3pext.releases.mechanisms import LaplaceMechanism
        from d3pext.simulation.sbi import Simulator
        assert len(jax.devices()) == 4, jax.devices()

        def model(n):
            mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
            sd = numpyro.sample("sd", dist.HalfNormal(1.0))
            with numpyro.plate("records", n):
                numpyro.sample("x", dist.Normal(mu, sd))

        clip = lambda x: jnp.clip(x, -1, 1)
        private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=2.0),
                            statistic=lambda x: jnp.stack([clip(x).sum(), jnp.abs(clip(x)).sum()]))
        data = {"x_dp": jnp.array([3.0, 10.0])}
        out, used = {}, {}
        for name, devices in (("four", None), ("one", jax.devices()[:1])):
            post = private_posterior(private, data, method="sppe", devices=devices)
            sim = Simulator(private, data, (20,), devices=post.devices)
            assert len(sim.devices) == (4 if devices is None else 1)
            inner = sim._simulate_given
            def spy(keys, z, inner=inner, name=name):
                res = inner(keys, z)
                used[name] = (keys.shape[0], len(res[1].sharding.device_set))
                return res
            sim._simulate_given = spy
            z, stat = sim.simulate(random.key(0), 10)
            z2, stat2 = sim.simulate(random.key(1), 10, z + 0.5)
            s = sim.release_points(random.key(2), stat, 4)
            assert s.shape == (10, 4, 2)
            out[name] = [np.asarray(a) for a in (z, stat, z2, stat2, s)]
        assert used == {"four": (12, 4), "one": (10, 1)}, used
        print(all(np.array_equal(a, b) for a, b in zip(out["four"], out["one"])))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-1] == "True"


# -- SPPE, fast twin -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_sppe():
    # one round (maximum likelihood); the atomic loss of later rounds is checked directly below.
    # Shared with test_arviz.py (one fit per process).
    from sbi_fits import tiny_sppe

    return tiny_sppe()


def test_sppe_tiny_run(tiny_sppe):
    post = tiny_sppe
    assert [d["round"] for d in post.diagnostics] == [1]
    assert all(d["epochs"] >= 1 and np.isfinite(d["best_valid_loss"]) for d in post.diagnostics)
    draws = post.sample(random.key(1), 500)
    assert draws["beta"].shape == (500, 3)
    lp = post.log_prob({"beta": draws["beta"][:10]})
    assert lp.shape == (10,) and bool(jnp.all(jnp.isfinite(lp)))
    # the posterior has left the prior N(0, 1) towards the reference (beta_1 near -2.7)
    assert float(draws["beta"][:, 1].mean()) < -1.0


def test_a_second_fit_of_the_same_architecture_compiles_no_training(tiny_sppe):
    # e.g. a sweep over epsilon: the shared trainer's epoch and validation pass, and the flow's
    # log_prob, are reused (only the simulator, whose noise scale is a constant, compiles again)
    from compilations import count_compilations
    from d3pext.handlers import private_posterior
    from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression

    post = private_posterior(
        private_linear_regression(100, 3.0, sensitivity=0.13), {"records_dp": jnp.array(PAPER_S_DP)},
        method="sppe", rounds=1, simulations_per_round=420, num_points=4, max_epochs=40,
        learning_rate=5e-3, num_samples=500, flow_kwargs=dict(layers=2, width=8, knots=4), progress_bar=False,
    )  # the settings of tiny_sppe (which shares its trainer), at another epsilon
    with count_compilations() as compiled:
        post.run(random.key(1), 100)
    assert post.diagnostics[0]["epochs"] >= 1
    assert not {"jit(epoch)", "jit(valid)"} & set(compiled), compiled


def test_sppe_log_prob_is_normalized(tiny_sppe):
    # Riemann sum of exp(log_prob) over a grid covering the posterior
    post = tiny_sppe
    draws = np.asarray(post.sample(random.key(2), 2000)["beta"])
    lo, hi = draws.min(0) - 1.5, draws.max(0) + 1.5
    axes = [np.linspace(a, b, 44) for a, b in zip(lo, hi)]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    cell = np.prod([(a[1] - a[0]) for a in axes])
    mass = float(jnp.sum(jnp.exp(post.log_prob({"beta": jnp.asarray(grid, jnp.float32)})))) * cell
    assert abs(mass - 1.0) < 0.05


def test_atomic_loss_matches_its_formula(tiny_sppe):
    import equinox as eqx

    from d3pext.simulation.sbi import _make_atomic_loss

    flow = tiny_sppe.flow
    B, M = 6, 3
    k1, k2, k3 = random.split(random.key(3), 3)
    batch = {"z": random.normal(k1, (B, 3)), "s": random.normal(k2, (B, M, 9)),
             "logp": random.normal(k3, (B,))}
    # with num_atoms = B every other example is an atom: the loss is deterministic
    z_all = jnp.broadcast_to(batch["z"][None, None], (B, M, B, 3)).reshape(-1, 3)
    s_all = jnp.broadcast_to(batch["s"][:, :, None], (B, M, B, 9)).reshape(-1, 9)

    # one compiled call (eagerly, flowjax compiles its layer scan again for every operation):
    # the loss, and log q(theta_k | s_ij) for every example i, release point j and atom k
    @eqx.filter_jit
    def both(flow, batch, z_all, s_all):
        return _make_atomic_loss(B)(flow, batch, random.key(0)), flow.log_prob(z_all, s_all)

    got, lq = both(flow, batch, z_all, s_all)
    lq = np.asarray(lq).reshape(B, M, B)
    logits = lq - np.asarray(batch["logp"])[None, None, :]
    own = logits[np.arange(B), :, np.arange(B)]  # (B, M): theta_i with its own releases
    log_norm = np.log(np.exp(logits).sum(-1))
    expected = -(own - log_norm).mean(1)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


# -- slow: SPPE and SPLE against the exact reference --------------------------------------------


@pytest.fixture(scope="module")
def reference():
    return linear_regression_reference(jnp.array(PAPER_S_DP), random.key(0), 100, 10.0,
                                       sensitivity=0.13)


@pytest.mark.slow
def test_reference_matches_paper_da_mcmc(reference):
    assert reference["ess"] > 300
    np.testing.assert_allclose(np.asarray(reference["mean"]), PAPER_DA_MCMC, atol=0.15)


def _weighted_quantiles(x, w, qs):
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    return np.interp(qs, cw / cw[-1], x[order])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sppe", "sple"])
def test_sppe_sple_match_reference(method, reference):
    model = private_linear_regression(100, 10.0, sensitivity=0.13)
    post = private_posterior(
        model, S_OBS, method=method, rounds=4, simulations_per_round=1000, num_points=8,
        max_epochs=100, patience=10, flow_kwargs=dict(layers=4, width=32), progress_bar=False,
        num_warmup=200, num_chains=4,
    )
    post.run(random.key(0), 100)
    draws = np.asarray(post.sample(random.key(1), 4000)["beta"])
    ref_mean = np.asarray(reference["mean"])
    assert np.all(np.abs(draws.mean(0) - ref_mean) < 0.3)
    samples, w = np.asarray(reference["samples"]), np.asarray(reference["weights"])
    naive_mean, _ = linear_regression_naive_posterior(jnp.array(PAPER_S_DP), 100)
    for j in range(3):
        lo, hi = np.percentile(draws[:, j], [2.5, 97.5])
        rlo, rhi = _weighted_quantiles(samples[:, j], w, [0.025, 0.975])
        overlap = max(0.0, min(hi, rhi) - max(lo, rlo)) / (rhi - rlo)
        assert overlap > 0.7
        # the naive posterior mean lies outside the reference 95% interval
        assert not rlo < float(naive_mean[j]) < rhi


# -- what the simulator refuses, and what keys its shared programs ----------------------------


_CONFIG = {"epsilon": 10.0}


def _global_epsilon_model(n, x=None):
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    with privatize(site="x", mechanism=LaplaceMechanism(_CONFIG["epsilon"])):
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)


def test_programs_are_keyed_by_the_mechanisms():
    # a model that reads its epsilon from a global (a sweep): the noise enters no forward run, and
    # the second epsilon was served the first one's release points (noise sd 0.139 at scale 10)
    from d3pext.simulation.sbi import Simulator

    sims = []
    try:
        for eps in (10.0, 0.1, 0.1):
            _CONFIG["epsilon"] = eps
            sim = Simulator(_global_epsilon_model, {"x_dp": jnp.array(30.0)}, (100,))
            _, stat = sim.simulate(random.key(0), 2000)
            noise = sim.release_points(random.key(1), stat, 1, "mc")[:, 0] - stat
            scale = sim.releases["x_dp"].mechanism.scale
            np.testing.assert_allclose(float(jnp.std(noise)), np.sqrt(2) * scale, rtol=0.15)
            sims.append(sim)
    finally:
        _CONFIG["epsilon"] = 10.0
    assert sims[0].programs is not sims[1].programs and sims[1].programs is sims[2].programs


def test_observed_sites_other_than_releases_are_refused():
    # public data observed beside the release: every simulation held it fixed and its likelihood
    # never entered the posterior (ABC and SPPE means 0.22, exact 0.45)
    from d3pext.simulation.abc import rejection_abc
    from d3pext.simulation.sbi import Simulator

    def model(n, y_pub, x=None):
        theta = numpyro.sample("theta", dist.Beta(2.0, 2.0))
        with numpyro.plate("pub", y_pub.shape[0]):
            numpyro.sample("y_pub", dist.Bernoulli(theta), obs=y_pub)
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)

    private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0))
    data, y_pub = {"x_dp": jnp.array(10.0)}, jnp.array([1] * 18 + [0] * 2)
    match = r"observes \['y_pub'\], which are not releases"
    with pytest.raises(ValueError, match=match):
        rejection_abc(private, data, random.key(0), 50, y_pub, num_simulations=100)
    with pytest.raises(ValueError, match=match):
        private_posterior(private, data, method="sppe", progress_bar=False).run(random.key(0), 50, y_pub)

    def with_factor(n, x=None):
        theta = numpyro.sample("theta", dist.Beta(2.0, 2.0))
        numpyro.factor("penalty", -(theta**2))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)

    private = privatize(with_factor, site="x", mechanism=LaplaceMechanism(1.0))
    with pytest.raises(ValueError, match="penalty"):
        Simulator(private, data, (50,))


def _mean_of_records(n, x=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def test_confidential_data_passed_to_the_simulator_is_refused():
    # with the records given, every simulation held them: each simulated statistic was the true one,
    # ABC returned the prior and SPPE/SPLE trained on noisy copies of the true statistic
    from d3pext.simulation.abc import rejection_abc
    from d3pext.simulation.sbi import Simulator

    private = privatize(_mean_of_records, site="x", mechanism=LaplaceMechanism(1.0),
                        statistic="sample_mean", bounds=(-5.0, 5.0))
    data, x = {"x_dp": jnp.array(1.05)}, jnp.ones(100)
    match = "confidential site 'x' of release 'x_dp' is observed"
    with pytest.raises(ValueError, match=match):
        Simulator(private, data, (100, x))
    with pytest.raises(ValueError, match=match):
        rejection_abc(private, data, random.key(0), 100, x, num_simulations=100)
    assert Simulator(private, data, (100,)).parameters == ("mu",)


def _nuisance_model(n, x=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    theta = numpyro.sample("theta", dist.Normal(mu, 0.3))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Bernoulli(logits=theta), obs=x)


def test_parameters_must_hold_the_latent_ancestors_of_their_prior():
    # parameters=("theta",) with theta ~ N(mu, 0.3): log_prior was p(theta | one fixed draw of mu)
    # (-32.9 at theta = 0 against the marginal -0.96), and SMC-ABC's mean 0.31 against the exact 1.27
    from scipy.stats import norm

    from d3pext.simulation.abc import smc_abc
    from d3pext.simulation.sbi import Simulator

    private = privatize(_nuisance_model, site="x", mechanism=LaplaceMechanism(1.0))
    data = {"x_dp": jnp.array(40.0)}
    match = r"depends on the latent sites \['mu'\].*parameters=\('mu', 'theta'\)"
    with pytest.raises(ValueError, match=match):
        Simulator(private, data, (50,), parameters=("theta",))
    with pytest.raises(ValueError, match=match):
        smc_abc(private, data, random.key(0), 50, num_particles=10, simulations_per_generation=100,
                parameters=("theta",))
    # with its ancestor, the joint prior; a left-out descendant is drawn given the parameters
    sim = Simulator(private, data, (50,), parameters=("mu", "theta"))
    np.testing.assert_allclose(float(jax.jit(sim.log_prior)(jnp.array([0.5, 1.0]))),  # (op by op: a dozen programs)
                               norm.logpdf(0.5) + norm.logpdf(1.0, 0.5, 0.3), rtol=1e-5)
    sim = Simulator(private, data, (50,), parameters=("mu",))
    np.testing.assert_allclose(float(jax.jit(sim.log_prior)(jnp.array([0.5]))), norm.logpdf(0.5), rtol=1e-5)

    def after_the_data(n, x=None):  # a "parameter" drawn given the confidential records
        with numpyro.plate("records", n):
            x = numpyro.sample("x", dist.Normal(0.0, 1.0), obs=x)
        numpyro.sample("s", dist.Normal(x.mean(), 1.0))

    private = privatize(after_the_data, site="x", mechanism=LaplaceMechanism(1.0),
                        statistic="sample_mean", bounds=(-5.0, 5.0))
    with pytest.raises(ValueError, match=r"depends on \['x'.*confidential data"):
        Simulator(private, {"x_dp": jnp.array(0.1)}, (20,))


def test_prior_ancestors_through_a_user_distribution_or_a_handler_are_found():
    # theta ~ MyNormal(mu), a distribution class without arg_constraints: mu is a plain attribute,
    # no pytree leaf, and parameters=("theta",) was accepted (log_prior at one fixed draw of mu)
    from numpyro.distributions import constraints

    from d3pext.simulation.sbi import Simulator

    class MyNormal(dist.Distribution):
        support = constraints.real

        def __init__(self, loc):
            self.loc = loc
            super().__init__(batch_shape=jnp.shape(loc))

        def sample(self, key, sample_shape=()):
            return self.loc + random.normal(key, sample_shape + self.batch_shape)

        def log_prob(self, x):
            return -0.5 * (x - self.loc) ** 2 - 0.9189385

    def user(n, x=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        theta = numpyro.sample("theta", MyNormal(mu))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(logits=theta), obs=x)

    def scaled(n, x=None):  # a power prior whose weight is another site
        w = numpyro.sample("w", dist.Uniform(0.1, 1.0))
        with numpyro.handlers.scale(scale=w):
            theta = numpyro.sample("theta", dist.Normal(0.0, 1.0))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(logits=theta), obs=x)

    data = {"x_dp": jnp.array(40.0)}
    for model, other in ((user, "mu"), (scaled, "w")):
        private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0))
        with pytest.raises(ValueError, match=rf"depends on the latent sites \['{other}'\]"):
            Simulator(private, data, (50,), parameters=("theta",))
        assert Simulator(private, data, (50,), parameters=(other, "theta")).parameters == (other, "theta")
