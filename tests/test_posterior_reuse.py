"""A new ``private_posterior`` for another release of the same shapes reuses the compiled sampler:
it compiles nothing but the model's inspection, and draws exactly what a cold compile draws (so no
release value is a constant of the shared program). Built-in backends only; a user's backend may
keep release values, so it compiles per release."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro
import numpyro.distributions as dist

import d3pext.handlers.posterior as posterior
import d3pext.inference.mcmc as cached_mcmc
from d3pext.handlers import private_posterior, sample_releases
from d3pext.handlers.privatize import privatize, privatize_counts
from d3pext.inference.bounded import FlatPrior
from d3pext.inference.expfam_backend import bernstein_sheldon_kernel
from d3pext.inference.registry import register_backend, unregister_backend
from d3pext.inference.structure import inspect_model
from d3pext.models import private_bounded_gaussian, private_constrained_regression
from d3pext.models.expfam import beta_binomial_model, private_beta_binomial
from d3pext.releases.counts import GeometricMechanism
from d3pext.releases.mechanisms import GaussianMechanism, LaplaceMechanism

from compilations import count_compilations

# the one program a new object compiles: tracing the model for its structure (milliseconds)
INSPECTION = "jit(run)"


def _forget_shared():
    posterior._SHARED_KERNELS.clear()
    cached_mcmc._SHARED_LOOPS.clear()


def _draws(model, release, args, key, **kwargs):
    mcmc = private_posterior(model, release, progress_bar=False, **kwargs)
    mcmc.run(jax.random.key(key), *args)
    return mcmc, jax.device_get(mcmc.get_samples(group_by_chain=True))


def _check_reuse(model, releases, args, **kwargs):
    """The second release's draws: from the shared program (compiling only the inspection) and from
    a cold one; equal to the last bit."""
    _forget_shared()
    first, _ = _draws(model, releases[0], args, 0, **kwargs)
    with count_compilations() as compiled:
        mcmc, shared = _draws(model, releases[1], args, 1, **kwargs)
    assert set(compiled) <= {INSPECTION}, compiled
    assert mcmc.sampler.inner is first.sampler.inner
    _forget_shared()
    with count_compilations() as compiled:
        _, cold = _draws(model, releases[1], args, 1, **kwargs)
    assert len(compiled) > 1  # the cold run does compile its sampler
    jax.tree.map(np.testing.assert_array_equal, shared, cold)
    return shared


def _beta_binomial():
    return private_beta_binomial(0.5, concentration1=2.0, concentration0=3.0)


def test_another_release_reuses_the_compiled_sampler():
    model = _beta_binomial()
    releases = [{"x_dp": jnp.asarray(30.4)}, {"x_dp": jnp.asarray(71.9)}]
    draws = _check_reuse(model, releases, (100,), num_warmup=50, num_samples=100, num_chains=2)
    assert draws["theta"].shape == (2, 100)
    assert draws["theta"].mean() > 0.5  # the draws are of the second release (71.9 of 100)


PRIOR = {"concentration1": 2.0}


def _global_prior_model(n, x=None):
    beta_binomial_model(n, x, concentration1=PRIOR["concentration1"], concentration0=3.0)


def test_a_model_whose_global_changed_gets_its_own_sampler():
    # the same model function and arguments, but a global it reads changed between the two kernels:
    # another program, so the first kernel's backend and sampler must not be reused
    model = privatize(_global_prior_model, site="x", mechanism=LaplaceMechanism(0.5))
    release = {"x_dp": jnp.asarray(71.9)}
    kwargs = dict(num_warmup=50, num_samples=100, num_chains=2)
    _forget_shared()
    try:
        first, _ = _draws(model, release, (100,), 0, **kwargs)
        PRIOR["concentration1"] = 40.0
        mcmc, changed = _draws(model, release, (100,), 1, **kwargs)
        assert mcmc.sampler.inner is not first.sampler.inner
        _forget_shared()
        _, cold = _draws(model, release, (100,), 1, **kwargs)
    finally:
        PRIOR["concentration1"] = 2.0
    jax.tree.map(np.testing.assert_array_equal, changed, cold)
    assert changed["theta"].mean() > 0.7  # the prior Beta(40, 3) pulls theta up


def _exponential_fingerprint(prior, mechanism, infer=None):
    def model(n, x=None):
        lam = numpyro.sample("lam", prior, infer=infer or {})
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Exponential(lam), obs=x)

    private = privatize(model, site="x", mechanism=mechanism, bounds=(0.0, 5.0))
    return inspect_model(private, {"x_dp": jnp.asarray(30.0)}, (20,), {}).fingerprint


def test_the_fingerprint_covers_the_distributions_and_the_static_metadata():
    # each pair traces to one program (one jaxpr): the distributions built (the output tree) and the
    # static metadata of the sites (mechanism, infer entries) are what tell them apart
    laplace = LaplaceMechanism(0.2, sensitivity=5.0)  # scale 25
    gaussian = GaussianMechanism.from_sigma(25.0, 5.0, 1e-5)
    base = _exponential_fingerprint(dist.HalfNormal(1.0), laplace)
    assert base is not None and base == _exponential_fingerprint(dist.HalfNormal(1.0), laplace)
    others = [
        _exponential_fingerprint(dist.HalfNormal(1.0), gaussian),
        _exponential_fingerprint(dist.HalfCauchy(1.0), laplace),
        _exponential_fingerprint(dist.HalfNormal(1.0), laplace, {"declared": 1}),
        _exponential_fingerprint(dist.HalfNormal(1.0), laplace, {"declared": 2}),
    ]
    assert len({base, *others}) == 5


MECHANISM = {"noise": LaplaceMechanism(1.0 / 30.0, sensitivity=1.0)}


def _global_mechanism_model(n, x=None):
    with privatize(site="x", mechanism=MECHANISM["noise"]):
        beta_binomial_model(n, x, concentration1=2.0, concentration0=3.0)


def test_a_model_whose_global_mechanism_changed_gets_its_own_kernel():
    # Laplace noise of scale 30, then normal noise of sd 30: one program, other distributions and
    # release metadata; the Laplace kernel (with its mixing variances) must not analyse the release
    release = {"x_dp": jnp.asarray(500.0)}
    kwargs = dict(num_warmup=20, num_samples=20)
    _forget_shared()
    try:
        first, _ = _draws(_global_mechanism_model, release, (1000,), 0, **kwargs)
        MECHANISM["noise"] = GaussianMechanism.from_sigma(30.0, 1.0, 1e-5)
        mcmc, changed = _draws(_global_mechanism_model, release, (1000,), 1, **kwargs)
        assert mcmc.sampler.inner is not first.sampler.inner
        _forget_shared()
        _, cold = _draws(_global_mechanism_model, release, (1000,), 1, **kwargs)
    finally:
        MECHANISM["noise"] = LaplaceMechanism(1.0 / 30.0, sensitivity=1.0)
    assert sorted(changed) == ["theta", "x_dp_stat"]  # no Laplace mixing variances
    jax.tree.map(np.testing.assert_array_equal, changed, cold)


def test_sample_releases_of_a_model_whose_global_changed_gets_its_own_sampler():
    # epsilon 1, then 0.05: the sampler compiled for epsilon 1 must not run the second call
    release = {"x_dp": jnp.array([500.0])}
    kwargs = dict(num_warmup=20, num_samples=30, num_chains=2)
    posterior._SAMPLER_CACHE.clear()
    try:
        sample_releases(_global_mechanism_model, release, jax.random.key(0), 1000, **kwargs)
        MECHANISM["noise"] = LaplaceMechanism(0.05)
        changed = sample_releases(_global_mechanism_model, release, jax.random.key(1), 1000, **kwargs)
        posterior._SAMPLER_CACHE.clear()
        cold = sample_releases(_global_mechanism_model, release, jax.random.key(1), 1000, **kwargs)
    finally:
        MECHANISM["noise"] = LaplaceMechanism(1.0 / 30.0, sensitivity=1.0)
    jax.tree.map(np.testing.assert_array_equal, changed, cold)


def test_user_backends_are_not_shared():
    # a backend registered by the user may keep release values: its kernels have no structure key
    model = _beta_binomial()
    register_backend("user-gibbs")(bernstein_sheldon_kernel)
    try:
        kernels = {}
        for method in ("gibbs", "user-gibbs"):
            kernels[method] = posterior.PrivatePosterior(model, {"x_dp": jnp.asarray(30.4)}, method)
            kernels[method].prepare((100,))
        assert kernels["gibbs"].structure_key((100,), {}) is not None
        assert kernels["user-gibbs"].structure_key((100,), {}) is None
        assert kernels["gibbs"].structure_key((jnp.asarray(100),), {}) is None  # array arguments: never shared
    finally:
        unregister_backend("user-gibbs", "bernstein_sheldon_kernel")


@pytest.mark.slow
def test_one_chain_reuses_the_compiled_sampler():
    model = _beta_binomial()
    releases = [{"x_dp": jnp.asarray(30.4)}, {"x_dp": jnp.asarray(71.9)}]
    _check_reuse(model, releases, (100,), num_warmup=20, num_samples=30, num_chains=1)


def _poisson_counts():
    def model(n, counts=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with numpyro.plate("cells", n):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    model = privatize_counts(model, site="y", mechanism=GeometricMechanism.from_alpha(0.5))
    return model, [{"y_dp": jnp.array([4, -2, 7, 1, 0, 9])}, {"y_dp": jnp.array([3, 1, 2, 5, 0, 2])}], (6,)


def _bounded():
    model = private_bounded_gaussian(0.25, 0.25, (0.0, 100.0), FlatPrior(), constrained=True)
    releases = [
        {"y_mean_dp": jnp.asarray(21.7), "y_var_dp": jnp.asarray(245.3)},
        {"y_mean_dp": jnp.asarray(40.2), "y_var_dp": jnp.asarray(410.0)},
    ]
    return model, releases, (43,)


def _regression():
    model = private_constrained_regression(46, 1.1, (0.0, 100.0), (0.0, 150.0))
    releases = [
        {"records_dp": jnp.array([20.1, 10.3, 25.0, 11.2, 15.5]), "records_moments_dp": jnp.array([20.0, 10.0, 6.0, 4.0])},
        {"records_dp": jnp.array([24.9, 15.0, 21.0, 12.1, 11.0]), "records_moments_dp": jnp.array([25.0, 15.0, 10.0, 7.0])},
    ]
    return model, releases, ()


def _beta_binomial_case():
    return _beta_binomial(), [{"x_dp": jnp.asarray(30.4)}, {"x_dp": jnp.asarray(71.9)}], (100,)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, method",
    [
        (_beta_binomial_case, "gibbs"), (_beta_binomial_case, "naive"), (_beta_binomial_case, "clt"),
        (_poisson_counts, "gibbs"), (_poisson_counts, "naive"),
        (_bounded, "gibbs"), (_bounded, "naive"),
        (_regression, "gibbs"), (_regression, "naive"),
    ],
)
def test_every_builtin_backend_reuses_its_sampler_exactly(case, method):
    model, releases, args = case()
    _check_reuse(model, releases, args, method=method, num_warmup=30, num_samples=40, num_chains=3)


@pytest.mark.slow
def test_another_warmup_length_gets_its_own_sampler():
    # NUTS builds its adaptation schedule from num_warmup at init: a kernel for another warmup
    # length must not run the first kernel's sampler
    model, releases, args = _beta_binomial_case()
    _forget_shared()
    _draws(model, releases[0], args, 0, method="clt", num_warmup=30, num_samples=40, num_chains=3)
    _, shared = _draws(model, releases[1], args, 1, method="clt", num_warmup=60, num_samples=40, num_chains=3)
    _forget_shared()
    _, cold = _draws(model, releases[1], args, 1, method="clt", num_warmup=60, num_samples=40, num_chains=3)
    jax.tree.map(np.testing.assert_array_equal, shared, cold)
