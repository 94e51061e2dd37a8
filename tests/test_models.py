"""Tests of the DP-VI models (seed 003): logistic, hierarchical logistic, Gaussian mixture, VAE."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax, random
from scipy import stats
from scipy.special import logsumexp

import numpyro
from numpyro.handlers import seed, substitute, trace
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.svi import SVIRunResult

from d3pext import DPSVI
from d3pext.models import (
    gaussian_mixture,
    gaussian_mixture_guide,
    gaussian_mixture_likelihood,
    hierarchical_logistic_guide,
    hierarchical_logistic_logits,
    hierarchical_logistic_regression,
    logistic_guide,
    logistic_regression,
    simulate_binary_images,
    simulate_hierarchical_logistic,
    simulate_logistic,
    simulate_mixture,
    vae_guide,
    vae_model,
)


def auc(y, score) -> float:
    """Area under the ROC curve by the Mann-Whitney rank formula (ties get mid-ranks)."""
    y, ranks = np.asarray(y) == 1, stats.rankdata(np.asarray(score))
    n1, n0 = y.sum(), (~y).sum()
    return float((ranks[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


# (model, guide, positional data, keyword arguments) for each model, at a small size. Hierarchical
# logistic regression is run in its statistical test below, logistic regression in its slow one too.
CASES = {
    "logistic": lambda: (logistic_regression, logistic_guide, simulate_logistic(random.key(0), 300, 3)[:2], {}),
    "mixture": lambda: (
        gaussian_mixture,
        gaussian_mixture_guide,
        (simulate_mixture(random.key(0), 300, num_components=3).x,),
        {"num_components": 3},
    ),
    "vae": lambda: (
        vae_model,
        vae_guide,
        (simulate_binary_images(random.key(0), 300, dim=20),),
        {"hidden_dim": 8, "latent_dim": 2},
    ),
}


def _run(svi, num_steps, data, kwargs):
    """``svi.run`` for SVI, but with init and the steps in one compiled program (much faster to compile).

    DPSVI's init calibrates and checks the model in Python, so DPSVI uses its own ``run``.
    """
    if isinstance(svi, DPSVI):
        return svi.run(random.key(1), num_steps, *data, progress_bar=False, **kwargs)

    @jax.jit
    def run(key):
        state = svi.init(key, *data, **kwargs)
        state, losses = lax.scan(lambda s, _: svi.update(s, *data, **kwargs), state, None, length=num_steps)
        return svi.get_params(state), losses

    params, losses = run(random.key(1))
    return SVIRunResult(params, None, losses)


def _check_run(svi, data, kwargs, num_steps=5, batch_size=32):
    """A few steps: finite losses and parameters (and for DPSVI, the privacy report of those steps)."""
    result = _run(svi, num_steps, data, {**kwargs, "batch_size": batch_size})
    assert result.losses.shape == (num_steps,)
    assert np.all(np.isfinite(result.losses))
    assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(result.params))
    if isinstance(svi, DPSVI):
        report = result.privacy
        assert report.num_steps == num_steps and report.clipping_threshold == svi.clipping_threshold
        assert report.sampling_rate == pytest.approx(batch_size / data[0].shape[0])
        assert math.isfinite(report.epsilon) and report.epsilon > 0
    return result


def _check_runs(model, guide, data, kwargs, batch_size=32):
    """A few steps under SVI and under DPSVI (noise multiplier 1)."""
    svi = SVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    dpsvi = DPSVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    return _check_run(svi, data, kwargs, batch_size=batch_size), _check_run(dpsvi, data, kwargs, batch_size=batch_size)


@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_under_svi_and_dpsvi(name):
    _check_runs(*CASES[name]())


def _structure(model, *args, **kwargs) -> dict:
    """Sites of one run, without compiling: (type, shape (params: leaf shapes), inside the data plate)."""
    sites = {}

    def run(key):
        tr = trace(seed(model, key)).get_trace(*args, **kwargs)
        for name, site in tr.items():
            if site["type"] in ("sample", "param"):
                in_plate = any(f.name == "data" for f in site.get("cond_indep_stack", ()))
                shapes = tuple(tuple(jnp.shape(leaf)) for leaf in jax.tree.leaves(site["value"]))
                sites[name] = (site["type"], shapes[0] if site["type"] == "sample" else shapes, in_plate)
        return 0

    jax.eval_shape(run, random.key(0))
    return sites


def test_logistic_prior_is_the_papers_s0():
    """S_0 = 4 I is a covariance: the prior standard deviation of each weight is 2.

    The mean-field guide's density is the product of its Gaussian marginals.
    """
    params = {"w_loc": jnp.array([0.5, -1.0]), "w_scale": jnp.array([0.3, 2.0])}

    @jax.jit
    def run(key):
        prior = trace(seed(logistic_regression, key)).get_trace(jnp.ones((3, 2)))["w"]
        guide = trace(seed(substitute(logistic_guide, params), key)).get_trace(jnp.ones((3, 2)))["w"]
        return prior["fn"].variance, guide["value"], guide["fn"].log_prob(guide["value"])

    variance, value, log_prob = run(random.key(0))
    np.testing.assert_allclose(variance, 4.0)
    expected = stats.norm(params["w_loc"], params["w_scale"]).logpdf(np.asarray(value)).sum()
    assert float(log_prob) == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_logistic_runs_and_recovers_weights_at_large_epsilon():
    """SVI runs; DP-VI with little noise recovers the true weights within the posterior's spread.

    Slow (2000 private steps: 10-12 s). Its fast twin, test_runs_under_svi_and_dpsvi[logistic], runs
    the same model and guide under SVI and DPSVI (test_svi.py's test_large_epsilon_reaches_nonprivate_posterior
    checks a DPSVI fit of a logistic regression against the non-private one).

    Data come from the model, so (w_true - posterior mean) / posterior sd is about N(0, 1) per coordinate
    (Bernstein-von Mises). The posterior sd is the Laplace approximation at the true weights. A bound of
    4.5 sd per coordinate has a false-alarm rate below 3e-5 for 3 coordinates; the noise of the remaining
    optimisation and DP perturbation (lr decayed 50-fold) is small against it.
    """
    w_true = jnp.array([1.0, -0.5, 0.25])
    x, y, _ = simulate_logistic(random.key(0), 4000, 3, weights=w_true)
    _check_run(SVI(logistic_regression, logistic_guide, numpyro.optim.Adam(0.01), Trace_ELBO()), (x, y), {})
    p = jax.nn.sigmoid(x @ w_true)
    precision = (x * (p * (1 - p))[:, None]).T @ x + jnp.eye(3) / 4.0
    post_sd = np.sqrt(np.diag(np.linalg.inv(np.asarray(precision))))
    schedule = optax.exponential_decay(0.05, 2000, 0.02)
    svi = DPSVI(logistic_regression, logistic_guide, numpyro.optim.Adam(schedule), Trace_ELBO(), clipping_threshold=2.0,
                epsilon=20.0, delta=1e-5, num_steps=2000)  # fmt: skip
    result = _check_run(svi, (x, y), {}, num_steps=2000, batch_size=100)
    assert result.privacy.epsilon <= 20.0
    z = (np.asarray(result.params["w_loc"]) - np.asarray(w_true)) / post_sd
    assert np.all(np.abs(z) < 4.5), z
    # The mean-field scale is of the posterior sd's order, neither collapsed nor blown up. Its gradient is
    # second order in the ELBO and at this noise the DP noise moves it a lot: over keys 0-13, with
    # jax.random.normal's noise and with a tail-complete one, the ratio ranged 0.33-1.99 (84 values), and a
    # check within 50% passed for 3 and 4 keys in 14, by luck.
    ratio = np.asarray(result.params["w_scale"]) / post_sd
    assert np.all((ratio > 0.25) & (ratio < 4.0)), ratio


def _hierarchical_fit(num_steps):
    """Non-private VI on 2000 records; test AUC of the fit and of the true weights on 2000 more."""
    data = simulate_hierarchical_logistic(random.key(3), 4000)
    train, test = slice(0, 2000), slice(2000, 4000)
    svi = SVI(hierarchical_logistic_regression, hierarchical_logistic_guide, numpyro.optim.Adam(0.05), Trace_ELBO())
    result = _check_run(svi, (data.x[train], data.group[train], data.y[train]),
                        {"group_features": data.group_features}, num_steps=num_steps, batch_size=200)  # fmt: skip
    fitted = hierarchical_logistic_logits(result.params["M_loc"], data.x[test], data.group[test], data.group_features)
    oracle = jnp.sum(data.x[test] * data.weights[data.group[test]], axis=-1)
    return data, (train, test), auc(data.y[test], fitted), auc(data.y[test], oracle)


def test_hierarchical_runs_and_approaches_oracle():
    """DPSVI runs; non-private VI ranks test records almost as well as the true weights.

    Paired on one test set of 2000 records: the unpaired AUC standard error is about 0.01, the paired
    difference's much smaller, so a fit that misses the group structure (pooled AUC here: 0.92) fails.
    400 steps (40 epochs) come as close as 1500 did: AUC 0.962 against the oracle's 0.965 (1500 steps:
    0.965), and within 0.003 of it for data keys 4-6; a model that gives every record group 0's weights
    ends at 0.49 (0.37-0.72 for keys 4-6).
    """
    data, (train, _), auc_fit, auc_oracle = _hierarchical_fit(400)
    assert auc_fit > auc_oracle - 0.02, (auc_fit, auc_oracle)
    dpsvi = DPSVI(hierarchical_logistic_regression, hierarchical_logistic_guide, numpyro.optim.Adam(0.01),
                  Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)  # fmt: skip
    _check_run(dpsvi, (data.x[train], data.group[train], data.y[train]), {"group_features": data.group_features})


@pytest.mark.slow
def test_hierarchical_beats_pooled():
    """The pooled (single w) model cannot capture group-specific weights and falls behind (paired AUC)."""
    data, (train, test), auc_fit, auc_oracle = _hierarchical_fit(3000)
    pooled_svi = SVI(logistic_regression, logistic_guide, numpyro.optim.Adam(0.05), Trace_ELBO())
    pooled = _run(pooled_svi, 3000, (data.x[train], data.y[train]), {"batch_size": 200})
    auc_pooled = auc(data.y[test], data.x[test] @ pooled.params["w_loc"])
    assert auc_fit > auc_oracle - 0.01, (auc_fit, auc_oracle)
    assert auc_fit > auc_pooled + 0.02, (auc_fit, auc_pooled)


def test_mixture_likelihood_is_the_marginal():
    """log p(x) = logsumexp_j (log pi_j + sum_d log N(x_d; mu_jd, sigma_j)), computed independently."""
    rng = np.random.default_rng(0)
    k, d = 4, 3
    weights = rng.dirichlet(np.ones(k))
    locs, scales = rng.normal(size=(k, d)), rng.uniform(0.3, 2.0, size=k)
    x = rng.normal(size=(50, d)) * 2
    per_component = stats.norm(locs[None], scales[None, :, None]).logpdf(x[:, None, :]).sum(-1)
    expected = logsumexp(per_component + np.log(weights), axis=-1)
    log_prob = jax.jit(lambda *a: gaussian_mixture_likelihood(*a[:3]).log_prob(a[3]))
    np.testing.assert_allclose(log_prob(weights, locs, scales, x), expected, rtol=2e-5, atol=1e-4)


def test_mixture_model_has_no_local_latent():
    """The assignments are marginalised: the only site in the data plate is the observed one."""
    x = jnp.zeros((50, 2))
    sites = _structure(gaussian_mixture, x, batch_size=10)
    assert [n for n, (_, _, in_plate) in sites.items() if in_plate] == ["x"]
    assert sites["x"][1] == (10, 2)
    guide_sites = _structure(gaussian_mixture_guide, x, batch_size=10)
    for name in ("weights", "locs", "scales"):
        assert guide_sites[name][1] == sites[name][1]


def test_vae_has_the_papers_parameter_count():
    """784 pixels with hidden 400 and latent 50: 688 884 trainable parameters (seed 003, section 5.1)."""
    x = jnp.zeros((2, 784))
    params = {**_structure(vae_model, x), **_structure(vae_guide, x)}
    sizes = [math.prod(leaf) for kind, leaves, _ in params.values() if kind == "param" for leaf in leaves]
    assert sum(sizes) == 688_884


def test_vae_local_latent_is_per_record():
    x = jnp.zeros((40, 12))
    model_sites = _structure(vae_model, x, batch_size=8, hidden_dim=4, latent_dim=3)
    guide_sites = _structure(vae_guide, x, batch_size=8, hidden_dim=4, latent_dim=3)
    assert model_sites["z"] == guide_sites["z"] == ("sample", (8, 3), True)
    assert model_sites["x"] == ("sample", (8, 12), True)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: logistic_regression(jnp.ones(3)), ValueError, "x must be a 2-D"),
        (lambda: logistic_regression(jnp.ones((3, 2)), jnp.ones(4)), ValueError, r"y must have shape \(3,\)"),
        (lambda: logistic_regression(jnp.ones((3, 2)), batch_size=4), ValueError, r"batch_size must be in \[1, 3\]"),
        (lambda: logistic_regression(jnp.ones((3, 2)), batch_size=1.5), TypeError, "batch_size must be an int"),
        (lambda: logistic_regression(jnp.ones((3, 2)), prior_scale=0.0), ValueError, "prior_scale must be > 0"),
        (
            lambda: hierarchical_logistic_regression(
                jnp.ones((3, 2)), jnp.array([0, 1, 3]), group_features=jnp.ones((3, 2))
            ),
            ValueError,
            r"group indices must be in \[0, 2\]",
        ),
        (
            lambda: hierarchical_logistic_regression(jnp.ones((3, 2)), jnp.zeros(3), group_features=jnp.ones((3, 2))),
            TypeError,
            "integer group indices",
        ),
        (lambda: gaussian_mixture(jnp.ones((3, 2)), num_components=0), ValueError, "num_components"),
        (lambda: vae_model(jnp.ones((3, 2)), latent_dim=0), ValueError, "latent_dim must be a positive int"),
    ],
)
def test_input_validation(call, error, match):
    with pytest.raises(error, match=match):
        seed(call, 0)()
