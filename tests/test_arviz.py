"""ArviZ and NumPyro's post-processing on d3pext's posteriors.

``az.from_numpyro`` on the ``MCMC`` of every built-in kernel backend of ``private_posterior``,
``Predictive`` on the privatized model (posterior predictive draws of the releases), and
``to_inference_data`` of the SPPE/SPLE estimators. One backend runs by default, the others with
``pytest -m slow``.
"""

import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro
import numpyro.distributions as dist
from numpyro.infer import Predictive

with warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)  # ArviZ announces its 1.0 refactor on import
    az = pytest.importorskip("arviz")

from d3pext.handlers import make_release, private_posterior, privatize_counts  # noqa: E402
from d3pext.inference.registry import BUILTIN_BACKENDS  # noqa: E402
from d3pext.releases.mechanisms import GeometricMechanism  # noqa: E402
from d3pext.models.bounded_gaussian import BLOOD_LEAD, private_bounded_gaussian  # noqa: E402
from d3pext.models.constrained_regression import (  # noqa: E402
    BROWNLEE_LIKE, private_constrained_regression, simulate_drinking_cirrhosis,
)
from d3pext.models.expfam import private_beta_binomial  # noqa: E402


def _poisson(n, counts=None):
    rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
    with numpyro.plate("cells", n):
        numpyro.sample("y", dist.Poisson(rate), obs=counts)


def _beta_binomial():
    return private_beta_binomial(1.0), {"x_dp": jnp.array(40.3)}, (100,)


def _bounded():
    return private_bounded_gaussian(0.5, 0.5, (0.0, 100.0), constrained=True), BLOOD_LEAD["release"], (43,)


def _counts():
    model = privatize_counts(_poisson, site="y", mechanism=GeometricMechanism.from_alpha(0.5))
    return model, {"y_dp": jnp.array([4, -2, 7, 1, 0, 9])}, (6,)


def _regression():
    s = BROWNLEE_LIKE
    model = private_constrained_regression(
        s["n"], s["epsilon"], s["bounds_x"], s["bounds_y"], s["prior"], constrained=True
    )
    records = simulate_drinking_cirrhosis(jax.random.key(0))
    return model, make_release(model, records=records, rng_key=1, reproducible=True), ()


# one case per built-in kernel backend: "method/backend" -> the model it covers
CASES = {
    "gibbs/bernstein-sheldon": _beta_binomial,
    "gibbs/kazan-reiter": _bounded,
    "gibbs/schein-bessel": _counts,
    "gibbs/bernstein-sheldon-regression": _regression,
    "naive/exponential-family": _beta_binomial,
    "naive/kazan-reiter": _bounded,
    "naive/truncated-counts": _counts,
    "naive/bernstein-sheldon-regression": _regression,
    "clt/normal-approximation": _beta_binomial,
}
FAST = {"gibbs/bernstein-sheldon"}
# test_predictive_release_follows_the_posterior takes the fast case's settings, and so its compiled sampler
NUM_WARMUP, NUM_CHAINS, NUM_SAMPLES = 5, 2, 100


def _predictive(model, samples, key, *args):
    """``Predictive(model, samples)(key, *args)`` as one compiled program (op by op: dozens)."""
    return jax.jit(lambda key, samples: Predictive(model, samples)(key, *args))(key, samples)


def test_cases_cover_every_builtin_kernel_backend():
    assert set(CASES) == {f"{b.method}/{b.name}" for b in BUILTIN_BACKENDS if b.kind == "kernel"}


@pytest.mark.parametrize(
    "case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_from_numpyro_and_predictive(case):
    model, release, args = CASES[case]()
    method = case.split("/")[0]
    mcmc = private_posterior(model, release, method=method, num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES,
                             num_chains=NUM_CHAINS, progress_bar=False)
    mcmc.run(jax.random.key(0), *args)
    samples = mcmc.get_samples()

    idata = az.from_numpyro(mcmc)
    post = idata.posterior
    assert (post.sizes["chain"], post.sizes["draw"]) == (NUM_CHAINS, NUM_SAMPLES)
    assert set(post.data_vars) == set(samples)
    for name, value in mcmc.get_samples(group_by_chain=True).items():
        np.testing.assert_array_equal(post[name].values, np.asarray(value))
    # the likelihood of a release integrates over the confidential data: no (wrong) values
    assert "log_likelihood" not in idata.groups()
    summary = az.summary(idata, var_names=[sorted(samples)[0]], kind="stats")
    assert np.isfinite(summary["mean"].to_numpy()).all()

    # posterior predictive of the releases: Predictive on the privatized model itself
    draws = NUM_CHAINS * NUM_SAMPLES
    pred = _predictive(model, samples, jax.random.key(1), *args)
    for name, value in release.items():
        assert pred[name].shape == (draws, *jnp.shape(value)), name
        assert bool(jnp.all(jnp.isfinite(pred[name])))
    idata = az.from_numpyro(mcmc, posterior_predictive={k: pred[k] for k in release})
    assert set(idata.posterior_predictive.data_vars) == set(release)
    assert idata.posterior_predictive.sizes["chain"] == NUM_CHAINS


def test_predictive_release_follows_the_posterior():
    """The release's predictive draws are centred where the posterior puts the statistic (200 draws:
    the sampler of the fast case of test_from_numpyro_and_predictive, another key)."""
    model, release, args = _beta_binomial()
    mcmc = private_posterior(model, release, num_warmup=NUM_WARMUP, num_samples=NUM_SAMPLES,
                             num_chains=NUM_CHAINS, progress_bar=False)
    mcmc.run(jax.random.key(2), *args)
    theta = mcmc.get_samples()["theta"]
    assert theta.shape == (200,)
    pred = _predictive(model, {"theta": theta}, jax.random.key(3), *args)
    assert pred["x"].shape == (200, 100)  # the (simulated) confidential records come along
    # x_dp = sum(x) + Laplace(1): its mean is 100 E[theta]
    sd = float(jnp.std(pred["x_dp"])) / np.sqrt(200)
    assert abs(float(jnp.mean(pred["x_dp"])) - 100 * float(jnp.mean(theta))) < 5 * sd


# -- SPPE / SPLE ----------------------------------------------------------------------------------


def _estimator(method):
    pytest.importorskip("flowjax")
    from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression

    post = private_posterior(
        private_linear_regression(100, 10.0, sensitivity=0.13), {"records_dp": jnp.array(PAPER_S_DP)},
        method=method, rounds=1, simulations_per_round=120, num_points=2, max_epochs=2,
        batch_size=50, num_warmup=20, num_samples=30, num_chains=2,
        flow_kwargs=dict(layers=1, width=4, knots=3), progress_bar=False,
    )
    return post.run(jax.random.key(0), 100), np.asarray(PAPER_S_DP)


@pytest.fixture(scope="module")
def sppe():
    # the small SPPE fit of test_sbi.py (one fit per process: it is compilation that costs)
    pytest.importorskip("flowjax")
    from d3pext.models.linear_regression import PAPER_S_DP
    from sbi_fits import tiny_sppe

    return tiny_sppe(), np.asarray(PAPER_S_DP)


def _check_inference_data(post, observed, num):
    idata = post.to_inference_data(num_samples=num, rng_key=jax.random.key(4))
    assert {"posterior", "observed_data"} <= set(idata.groups())
    assert (idata.posterior.sizes["chain"], idata.posterior.sizes["draw"]) == (1, num)
    assert idata.posterior["beta"].shape == (1, num, 3)
    np.testing.assert_allclose(idata.observed_data["records_dp"].values, observed, rtol=1e-6)
    assert idata.attrs["inference_method"] == post.method
    again = post.sample(jax.random.key(4), num)["beta"]
    np.testing.assert_array_equal(idata.posterior["beta"].values[0], np.asarray(again))
    default = post.to_inference_data()
    assert default.posterior.sizes["draw"] == post.num_samples
    return idata


def test_sppe_to_inference_data(sppe):
    post, observed = sppe
    idata = _check_inference_data(post, observed, 25)
    assert np.isfinite(az.summary(idata, kind="stats")["mean"].to_numpy()).all()


def test_to_inference_data_without_arviz_says_how_to_install(sppe, monkeypatch):
    post, _ = sppe
    monkeypatch.setitem(sys.modules, "arviz", None)  # "import arviz" raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[arviz\]"'):
        post.to_inference_data(num_samples=5)


@pytest.mark.slow
def test_sple_to_inference_data():
    post, observed = _estimator("sple")
    _check_inference_data(post, observed, post.num_samples)  # one NUTS shape to compile
