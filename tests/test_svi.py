"""Tests of DPSVI: the private gradient (clipping, noise, rescaling), the loss split, the API and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import numpyro
import numpyro.distributions as dist
from numpyro.handlers import seed, substitute, trace
from numpyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDelta, AutoDiagonalNormal

from d3pext import DPSVI
from d3pext.training.svi import DPSVIState


def logistic(x, y, batch_size=100):
    w = numpyro.sample("w", dist.Normal(0, 2).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
        xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)


def logistic_batch(xb, yb, num_records):
    """d3p style: the model gets one batch and knows N."""
    w = numpyro.sample("w", dist.Normal(0, 2).expand([xb.shape[1]]).to_event(1))
    with numpyro.plate("batch", num_records, xb.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)


def simulate(key, n, w):
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (n, w.shape[0]))
    y = jax.random.bernoulli(ky, jax.nn.sigmoid(x @ w)).astype(jnp.float32)
    return x, y


W_TRUE = jnp.array([1.0, -1.0, 0.5])


@pytest.fixture(scope="module")
def data():
    return simulate(jax.random.key(0), 2000, W_TRUE)


def _private_grads(svi, state, *args, num=1, **kwargs):
    params = svi.optim.get_params(state.optim_state)
    keys = jax.random.split(jax.random.key(123), num)
    fn = jax.jit(jax.vmap(lambda k: svi._private_grad(params, k, args, kwargs, False)[1]))
    return fn(keys)


def test_matches_exact_gradient_without_clipping_or_noise(data):
    """With C huge and sigma tiny, the private gradient is the ELBO gradient of the batch it drew."""
    x, y = data
    guide = AutoDelta(logistic)
    svi = DPSVI(logistic, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1e8, dp_scale=1e-12)
    state = svi.init(jax.random.key(1), x, y)
    params = svi.optim.get_params(state.optim_state)
    params = jax.tree.map(lambda p: p + 0.3, params)
    step_key = jax.random.key(7)

    @jax.jit  # the private gradient and the reference in one program (op by op, the reference compiled ~50)
    def both(p):
        _, grads, _ = svi._private_grad(p, step_key, (x, y), {}, False)
        indices, _ = svi.sampler(jax.random.split(step_key, 3)[0])

        def neg_elbo(p):
            w = svi.constrain_fn(p)["w_auto_loc"]
            logits = x[indices] @ w
            loglik = jnp.sum(dist.Bernoulli(logits=logits).log_prob(y[indices])) * x.shape[0] / indices.shape[0]
            return -(loglik + dist.Normal(0, 2).log_prob(w).sum())

        return grads, jax.grad(neg_elbo)(p)

    grads, expected = both(params)
    np.testing.assert_allclose(grads["w_auto_loc"], expected["w_auto_loc"], rtol=1e-4)


def test_noise_std_is_sigma_times_c(data):
    """A model whose records do not move the parameters: the private gradient is pure noise * N / B."""
    x, y = data

    def model(x, y):
        numpyro.param("theta", jnp.zeros(4))
        with numpyro.plate("data", x.shape[0], subsample_size=50):
            numpyro.sample("y", dist.Bernoulli(0.5), obs=numpyro.subsample(y, event_dim=0))

    sigma, c = 1.7, 0.3
    svi = DPSVI(model, lambda x, y: None, numpyro.optim.SGD(0.1), Trace_ELBO(), clipping_threshold=c, dp_scale=sigma)
    state = svi.init(jax.random.key(0), x, y)
    grads = _private_grads(svi, state, x, y, num=2000)["theta"]
    noise = np.asarray(grads).ravel() / (x.shape[0] / 50)
    # variance test: (n-1) s^2 / sigma^2 ~ chi2(n-1); and normality of the noise
    n = noise.size
    statistic = (n - 1) * noise.var(ddof=1) / (sigma * c) ** 2
    assert stats.chi2(n - 1).sf(statistic) > 1e-3 and stats.chi2(n - 1).cdf(statistic) > 1e-3
    assert stats.kstest(noise / (sigma * c), "norm").pvalue > 1e-3


def test_clipping_bounds_each_record(data):
    """Every record's gradient points the same way with norm >> C: the sum is exactly B * C along it."""
    x, y = data

    def model(x, y):
        theta = numpyro.param("theta", jnp.zeros(2))
        with numpyro.plate("data", x.shape[0], subsample_size=40):
            yb = numpyro.subsample(y, event_dim=0)
            numpyro.factor("big", 1e3 * (yb + 1.0) * (theta[0] + 2 * theta[1]))

    c = 0.5
    svi = DPSVI(model, lambda x, y: None, numpyro.optim.SGD(0.1), Trace_ELBO(), clipping_threshold=c, dp_scale=1e-9)
    state = svi.init(jax.random.key(0), x, y)
    grads = _private_grads(svi, state, x, y, num=3)["theta"]
    direction = -jnp.array([1.0, 2.0]) / jnp.sqrt(5.0)
    expected = x.shape[0] * c * direction  # N / B * (B * C)
    np.testing.assert_allclose(grads, jnp.broadcast_to(expected, grads.shape), rtol=1e-4)


def test_batch_mode_equals_plate_mode_on_the_same_batch(data):
    """d3p-style batches give the same private gradient as plate mode when the same records are used."""
    x, y = data
    n = x.shape[0]
    plate = DPSVI(logistic, AutoDelta(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=0.7, dp_scale=1e-9)
    state = plate.init(jax.random.key(1), x, y)
    params = jax.tree.map(lambda p: p + 0.5, plate.optim.get_params(state.optim_state))
    step_key = jax.random.key(3)
    indices = jax.jit(lambda k: plate.sampler(jax.random.split(k, 3)[0])[0])(step_key)  # the batch plate mode draws

    guide = AutoDelta(logistic_batch)
    batch = DPSVI(logistic_batch, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=0.7, dp_scale=1e-9, num_records=n)
    batch.init(jax.random.key(1), x[indices], y[indices])
    assert batch.structure.num_records == n and not batch.structure.plate_mode
    # both private gradients in one compiled program
    g_plate, g_batch = jax.jit(lambda p, a: (plate._private_grad(p, step_key, (x, y), {}, False)[1],
                                             batch._private_grad(p, step_key, a, {}, False)[1]))(params, (x[indices], y[indices]))
    np.testing.assert_allclose(g_batch["w_auto_loc"], g_plate["w_auto_loc"], rtol=1e-4)


@pytest.mark.filterwarnings("ignore:privacy spent is reported as epsilon=inf")  # sigma = 0.05: no privacy
def test_large_epsilon_reaches_nonprivate_posterior(data):
    """DPSVI with little noise ends where non-private SVI does (the fast twin of the slow
    test_epsilon_one_accuracy_close_to_nonprivate)."""
    x, y = data
    guide = AutoDiagonalNormal(logistic)
    common = dict(optim=numpyro.optim.Adam(0.02), loss=Trace_ELBO())
    private = DPSVI(logistic, guide, **common, clipping_threshold=5.0, dp_scale=0.05).run(
        jax.random.key(0), 2000, x, y, progress_bar=False
    )
    # SVI.run's fit with its init and steps in one compiled program (SVI.run initialises op by op). The
    # guide is set up already (by DPSVI's init): under this trace it keeps its state
    svi = SVI(logistic, guide, **common)

    @jax.jit
    def nonprivate(key):
        state = svi.init(key, x, y)
        state, _ = jax.lax.scan(lambda s, _: svi.update(s, x, y), state, None, length=2000)
        return svi.get_params(state)

    np.testing.assert_allclose(private.params["auto_loc"], nonprivate(jax.random.key(0))["auto_loc"], atol=0.12)
    assert private.privacy.epsilon > 100  # sigma = 0.05 is (almost) no privacy: inf when out of reach


def test_run_reports_privacy_and_respects_plan(data):
    x, y = data
    svi = DPSVI(
        logistic, AutoDiagonalNormal(logistic), optax.adam(0.05), clipping_threshold=1.0,
        epsilon=2.0, delta=1e-5, num_steps=200,
    )
    result = svi.run(jax.random.key(0), 200, x, y, progress_bar=False)
    assert result.losses.shape == (200,) and bool(jnp.all(jnp.isfinite(result.losses)))
    report = result.privacy
    assert report.epsilon <= 2.0 and report.epsilon > 1.9
    assert report.num_steps == 200 and report.sampling_rate == pytest.approx(100 / 2000)
    assert report.relation == "substitute"
    assert int(result.state.num_steps) == 200
    with pytest.raises(ValueError, match="exceed the planned"):
        svi.run(None, 1, x, y, init_state=result.state, progress_bar=False)
    again = svi.privacy_spent(result.state)
    assert again.epsilon == pytest.approx(report.epsilon, rel=1e-6)


@pytest.fixture(scope="module")
def logistic_dpsvi():
    """One DPSVI for the tests of update and stable_update, and of run with the default key, on the
    logistic data: an object compiles its programs once (each test starts from its own init), a new one
    compiles them again."""
    return DPSVI(logistic, AutoDiagonalNormal(logistic), numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=1.0,
                 dp_scale=1.0)


def test_update_and_stable_update(data, logistic_dpsvi):
    x, y = data
    svi = logistic_dpsvi
    state = svi.init(jax.random.key(0), x, y)
    assert isinstance(state, DPSVIState)
    state, loss = svi.update(state, x, y)
    state, loss2 = svi.stable_update(state, x, y)
    assert jnp.isfinite(loss) and jnp.isfinite(loss2) and int(state.num_steps) == 2
    assert set(svi.get_params(state)) == {"auto_loc", "auto_scale"}
    assert jnp.isfinite(svi.evaluate(state, x, y))


def test_update_and_stable_update_drop_non_finite_records(data, logistic_dpsvi):
    x, y = data
    y_bad = y.at[:1000].set(jnp.nan)
    svi = logistic_dpsvi  # the programs of test_update_and_stable_update, given non-finite records
    state = svi.init(jax.random.key(0), x, y)
    for update in (svi.stable_update, svi.update):
        state, _ = update(state, x, y_bad)
        assert all(bool(jnp.all(jnp.isfinite(v))) for v in svi.get_params(state).values())
    # about half of each batch of 100 lies in the first 1000 of 2000 records
    assert 60 < int(state.num_dropped) < 140


def test_local_latents_get_independent_noise_per_record():
    """A local latent per record (amortized guide): identical records must not share the variational noise."""

    def model(x):
        with numpyro.plate("data", x.shape[0], subsample_size=8):
            xb = numpyro.subsample(x, event_dim=0)
            z = numpyro.sample("z", dist.Normal(0, 1))
            numpyro.sample("x", dist.Normal(z, 1), obs=xb)

    def guide(x):
        a = numpyro.param("a", 0.5)
        with numpyro.plate("data", x.shape[0], subsample_size=8):
            xb = numpyro.subsample(x, event_dim=0)
            numpyro.sample("z", dist.Normal(a * xb, 1.0))

    x = jnp.ones(64)
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=100.0, dp_scale=1e-9)
    state = svi.init(jax.random.key(0), x)
    params = svi.optim.get_params(state.optim_state)
    grads = jax.jit(jax.vmap(jax.grad(svi._record_loss), in_axes=(None, None, None, None, 0)))(
        params, jax.random.key(1), (x,), {}, (jnp.zeros(8, jnp.int32), jnp.arange(8))
    )
    assert len(np.unique(np.round(np.asarray(grads["a"]), 6))) == 8




def _per_record_traces(model, guide, y, pick):
    """``pick(model_trace, guide_trace)`` of DPSVI's runs on each record position ``0..len(y) - 1`` of one key."""
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    params = svi.optim.get_params(svi.init(jax.random.key(0), y).optim_state)

    def one(position):
        return pick(*svi._run_traces(params, jax.random.key(1), (y,), {}, position, position[None]))

    return jax.jit(jax.vmap(one))(jnp.arange(y.shape[0]))


def test_model_only_local_latents_draw_independently_of_the_guide():
    """A local latent of the model alone (drawn from its prior in the model) and the guide's local latent
    of the same record come from different keys: they once shared the record's first key, and were equal."""

    def model(y):
        with numpyro.plate("data", y.shape[0], subsample_size=8):
            yb = numpyro.subsample(y, event_dim=0)
            u = numpyro.sample("u", dist.Normal(0, 1))
            z = numpyro.sample("z", dist.Normal(0, 1))
            numpyro.sample("y", dist.Normal(u + z, 1), obs=yb)

    def guide(y):
        loc = numpyro.param("loc", 0.0)
        with numpyro.plate("data", y.shape[0], subsample_size=8):
            numpyro.sample("z", dist.Normal(loc, 1))

    pick = lambda model_trace, guide_trace: (model_trace["u"]["value"][0], guide_trace["z"]["value"][0])
    u, z = (np.asarray(a) for a in _per_record_traces(model, guide, jnp.zeros(400), pick))
    assert not np.any(u == z)
    # 400 records: |r| < 0.15 is within 3 standard errors of independence (seeded, deterministic)
    assert abs(np.corrcoef(u, z)[0, 1]) < 0.15
    assert len(np.unique(u)) == len(np.unique(z)) == 400


def test_prng_key_inside_the_data_plate_is_per_record():
    """numpyro.prng_key() inside the data plate (dropout in an encoder) draws per record, like a sample
    site; it once took the enclosing seed's key, the same for every record of the batch."""

    def model(y):
        with numpyro.plate("data", y.shape[0], subsample_size=8):
            yb = numpyro.subsample(y, event_dim=0)
            u = jax.random.normal(numpyro.prng_key(), jnp.shape(yb))
            numpyro.deterministic("u", u)
            numpyro.sample("y", dist.Normal(numpyro.param("m", 0.0) + 0.1 * u, 1), obs=yb)

    def guide(y):
        pass

    u = np.asarray(_per_record_traces(model, guide, jnp.zeros(100), lambda model_trace, _: model_trace["u"]["value"][0]))
    assert len(np.unique(u)) == 100
    assert abs(u.mean()) < 0.3 and 0.75 < u.std() < 1.25  # 100 standard normals (seeded)
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(clipping_threshold=1.0), "exactly one of"),
        (dict(clipping_threshold=1.0, dp_scale=1.0, epsilon=1.0, num_steps=10), "exactly one of"),
        (dict(clipping_threshold=float("inf"), dp_scale=1.0), "clipping_threshold"),
        (dict(clipping_threshold=-1.0, dp_scale=1.0), "clipping_threshold"),
        (dict(clipping_threshold=1.0, dp_scale=0.0), "dp_scale"),
        (dict(clipping_threshold=1.0, epsilon=0.0, num_steps=10), "epsilon"),
        (dict(clipping_threshold=1.0, epsilon=1.0), "num_steps"),
        (dict(clipping_threshold=1.0, epsilon=1.0, delta=1.0, num_steps=10), "delta"),
        (dict(clipping_threshold=1.0, dp_scale=1.0, sampler="shuffle"), "sampler"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPSVI(logistic, AutoDiagonalNormal(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), **kwargs)


def test_unsupported_loss_and_missing_c():
    with pytest.raises(NotImplementedError, match="Trace_ELBO"):
        DPSVI(logistic, AutoDiagonalNormal(logistic), numpyro.optim.Adam(0.1), TraceMeanField_ELBO(), 1.0, 1.0)
    with pytest.raises(TypeError, match="clipping_threshold"):
        DPSVI(logistic, AutoDiagonalNormal(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), dp_scale=1.0)


def _init(model, *args, **kwargs):
    svi = DPSVI(model, AutoDelta(model), numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    return svi.init(jax.random.key(0), *args, **kwargs)


def test_model_structure_errors(data):
    x, y = data

    def no_plate(x, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
        numpyro.sample("y", dist.Bernoulli(logits=x @ w).to_event(1), obs=y)

    with pytest.raises(ValueError, match="no data plate"):
        _init(no_plate, x, y)

    def leaky(x, y):
        m = numpyro.sample("m", dist.Normal(jnp.mean(x), 1.0))  # the prior peeks at the data
        with numpyro.plate("data", x.shape[0], subsample_size=10):
            numpyro.sample("y", dist.Normal(m, 1.0), obs=numpyro.subsample(y, event_dim=0))

    with pytest.raises(ValueError, match="depend on the data"):
        _init(leaky, x[:, 0], y)

    def scales(x, y):
        m = numpyro.sample("m", dist.Normal(0, 1.0))
        with numpyro.plate("data", x.shape[0], subsample_size=10):
            numpyro.sample("y", dist.Normal(m, 1.0), obs=numpyro.subsample(y, event_dim=0))
            with numpyro.handlers.scale(scale=2.0):
                numpyro.sample("x", dist.Normal(m, 1.0), obs=numpyro.subsample(x, event_dim=0))

    with pytest.raises(ValueError, match="different scales"):
        _init(scales, x[:, 0], y)

    def mutable(x, y):
        numpyro.primitives.mutable("count", jnp.zeros(()))
        logistic(x, y)

    with pytest.raises(ValueError, match="mutable"):
        _init(mutable, x, y)

    with pytest.raises(ValueError, match="different numbers of records"):
        _init(logistic, x, y[:-1])
    svi = DPSVI(logistic, AutoDelta(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), 1.0, 1.0, num_obs_total=10)
    with pytest.raises(ValueError, match="larger than the number of records"):
        svi.init(jax.random.key(0), x[:50], y[:50], batch_size=None)


@pytest.mark.slow
def test_epsilon_one_accuracy_close_to_nonprivate():
    """Seed 003's claim: at epsilon = 1 on N = 10000, test accuracy within 1 point of non-private SVI.

    Slow (its programs, for 10 features, are its own: 15 s, nearly all compilation). Its fast twin,
    test_large_epsilon_reaches_nonprivate_posterior, runs the same code path (DPSVI.run of logistic
    regression with AutoDiagonalNormal against non-private SVI); test_run_reports_privacy_and_respects_plan
    runs a DPSVI planned for an epsilon."""
    w_true = jax.random.normal(jax.random.key(42), (10,))
    x, y = simulate(jax.random.key(1), 15000, w_true)
    (x_train, y_train), (x_test, y_test) = (x[:10000], y[:10000]), (x[10000:], y[10000:])
    guide = AutoDiagonalNormal(logistic)
    steps = 3000

    def accuracy(w):
        return float(jnp.mean(((x_test @ w) > 0) == (y_test > 0.5)))

    nonprivate = SVI(logistic, guide, numpyro.optim.Adam(0.01), Trace_ELBO()).run(
        jax.random.key(0), steps, x_train, y_train, progress_bar=False
    )
    svi = DPSVI(logistic, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=1.0,
                epsilon=1.0, delta=1e-5, num_steps=steps)
    private = svi.run(jax.random.key(0), steps, x_train, y_train, progress_bar=False)
    assert private.privacy.epsilon <= 1.0
    gap = accuracy(nonprivate.params["auto_loc"]) - accuracy(private.params["auto_loc"])
    assert gap < 0.01, gap


def test_default_key_is_os_entropy_chacha(data, logistic_dpsvi):
    """rng_key=None: batches and noise from a ChaCha20 key seeded by the OS; two runs differ."""
    x, y = data
    svi = logistic_dpsvi  # its guide is set up and its structure checked: init compiles one program
    first = svi.run(None, 20, x, y, progress_bar=False)
    second = svi.run(None, 20, x, y, progress_bar=False)
    assert "chacha" in str(jax.random.key_impl(first.state.rng_key)).lower()
    assert not np.allclose(first.params["auto_loc"], second.params["auto_loc"])


def test_poisson_sampler_plate_mode(data):
    """sampler='poisson': add/remove accounting, the padded slots never contribute, delta includes the tail."""
    x, y = data
    svi = DPSVI(logistic, AutoDiagonalNormal(logistic), numpyro.optim.Adam(0.05), Trace_ELBO(),
                clipping_threshold=1.0, epsilon=1.0, delta=1e-5, num_steps=50, sampler="poisson",
                sampling_rate=0.05)
    result = svi.run(jax.random.key(0), 50, x, y, progress_bar=False)
    report = result.privacy
    assert report.relation == "add_remove" and report.sampler == "PoissonSampler"
    assert report.epsilon <= 1.0 and report.delta > 1e-5  # the truncation's tail probability is added
    assert bool(jnp.all(jnp.isfinite(result.losses)))


@pytest.mark.parametrize("form", ["poisson", "batch"])
def test_ghost_and_reweighted_clipping_equal_materialized(data, form):
    """clipping='ghost' (one pass) and 'reweight' (norms, then one weighted backward pass) give the
    materialized clipped sum, including Poisson padding slots and, under stable_update, records with
    non-finite gradients. (Logistic regression has no ghost weights: this checks the direct leaves.)"""
    x, y = data
    y_bad = y.at[:700].set(jnp.nan)  # about a third of every batch is non-finite
    step_key = jax.random.key(7)
    svis, params = {}, {}
    model = logistic_batch if form == "batch" else logistic
    guide = AutoDiagonalNormal(model)  # one guide: set up (op by op) by the first init, then traced with it
    for clipping in ("materialize", "ghost", "reweight"):
        if form == "batch":
            args, bad = (x[:100], y[:100]), (x[:100], y_bad[:100])
            svi = DPSVI(model, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=0.3,
                        dp_scale=0.5, num_records=x.shape[0], clipping=clipping)
        else:
            args, bad = (x, y), (x, y_bad)
            svi = DPSVI(model, guide, numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=0.3,
                        dp_scale=0.5, sampler=form, sampling_rate=0.05, delta=1e-5, clipping=clipping)
        state = svi.init(jax.random.key(1), *args)
        svis[clipping] = svi
        params[clipping] = jax.tree.map(lambda p: p + 0.3, svi.optim.get_params(state.optim_state))
    # the three private gradients in one compiled program (three programs took twice as long to compile)
    outputs = jax.jit(lambda ps: {c: svi._private_grad(ps[c], step_key, bad, {}, True) for c, svi in svis.items()})(params)
    loss_m, grads_m, dropped_m = outputs["materialize"]
    for clipping in ("ghost", "reweight"):
        loss_r, grads_r, dropped_r = outputs[clipping]
        assert int(dropped_r) == int(dropped_m) > 0
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads_r))
        np.testing.assert_allclose(loss_r, loss_m, rtol=1e-5)
        for name in grads_m:
            np.testing.assert_allclose(grads_r[name], grads_m[name], rtol=2e-4, atol=1e-5)


def _small_vae():
    from d3pext.models.vae import simulate_binary_images, vae_guide, vae_model

    x = simulate_binary_images(jax.random.key(0), 200, dim=12)
    return vae_model, vae_guide, x, dict(batch_size=20, hidden_dim=6, latent_dim=3)


def test_ghost_norms_and_sum_of_a_vae_record_loss():
    """The VAE's per-record ELBO term (2 particles, so each record gives the decoder's products two
    rows): the five Dense kernels are ghost weights, and the norms and the weighted sum equal those of
    materialized per-record gradients. (The whole private step is compared in the slow twin below.)"""
    from d3pext.training.ghost import PerRecordGradients

    vae_model, vae_guide, x, kw = _small_vae()
    svi = DPSVI(vae_model, vae_guide, numpyro.optim.Adam(0.1), Trace_ELBO(num_particles=2),
                clipping_threshold=2.0, dp_scale=0.5)
    params = svi.optim.get_params(svi.init(jax.random.key(1), x, **kw).optim_state)
    key, idx = jax.random.key(3), jnp.arange(20)
    per_record = PerRecordGradients(svi._record_loss)

    @jax.jit  # everything in one compiled program (the sums op by op compiled a dozen more)
    def both(p):
        _, norms, parts = jax.vmap(lambda r: per_record(p, key, (x,), kw, r))((idx, idx))
        grads = jax.vmap(lambda r: jax.grad(svi._record_loss)(p, key, (x,), kw, r))((idx, idx))
        direct = jnp.sqrt(sum(jnp.sum(g.reshape(20, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
        w = jnp.minimum(1.0, 2.0 / norms)
        weighted = per_record.weighted_sum(parts, w)
        return norms, direct, w, jax.tree.leaves(weighted), [jnp.tensordot(w, g, 1) for g in jax.tree.leaves(grads)]

    # the identity holds in float32: on a GPU the reference's own products would round to TF32
    with jax.default_matmul_precision("highest"):
        norms, direct, w, weighted, expected = both(params)
    assert per_record.num_ghost == 5  # the biases get per-record gradients
    np.testing.assert_allclose(norms, direct, rtol=1e-5)
    assert bool(jnp.any(w < 1))
    assert len(weighted) == len(expected)
    for got, want in zip(weighted, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_ghost_clipping_on_a_vae_equals_materialized():
    """On a small VAE (encoder and decoder kernels are ghost weights; two ELBO particles, so each
    record contributes two rows to the decoder's products), with Poisson padding and non-finite
    records, the one-pass ghost sum equals the materialized clipped sum."""
    vae_model, vae_guide, x, kw = _small_vae()
    x_bad = x.at[:40].set(jnp.nan)
    svis, params = {}, {}
    for clipping in ("materialize", "ghost"):  # "reweight" shares the ghost norms (checked above)
        svi = DPSVI(vae_model, vae_guide, numpyro.optim.Adam(0.1), Trace_ELBO(num_particles=2),
                    clipping_threshold=2.0, dp_scale=0.5, sampler="poisson", sampling_rate=0.1, delta=1e-5,
                    clipping=clipping)
        state = svi.init(jax.random.key(1), x, **kw)
        svis[clipping] = svi
        params[clipping] = svi.optim.get_params(state.optim_state)
    # one compiled program for both
    outputs = jax.jit(lambda ps: {c: svi._private_grad(ps[c], jax.random.key(7), (x_bad,), kw, True)
                                  for c, svi in svis.items()})(params)
    (loss_m, grads_m, _), (loss_g, grads_g, _) = outputs["materialize"], outputs["ghost"]
    np.testing.assert_allclose(loss_g, loss_m, rtol=1e-5)
    for g_g, g_m in zip(jax.tree.leaves(grads_g), jax.tree.leaves(grads_m)):
        assert bool(jnp.all(jnp.isfinite(g_g)))
        np.testing.assert_allclose(g_g, g_m, rtol=2e-4, atol=1e-5)


def test_clipping_choice_is_validated_and_auto_picks_by_size(data):
    with pytest.raises(ValueError, match="clipping"):
        DPSVI(logistic, AutoDelta(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0,
              dp_scale=1.0, clipping="ghosts")
    x, y = data
    svi = DPSVI(logistic, AutoDelta(logistic), numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    svi.init(jax.random.key(0), x, y)
    assert svi._clipping_mode({"w": jnp.zeros(3)}) == "materialize"  # 100 x 3 values
    assert svi._clipping_mode({"w": jnp.zeros((400, 784))}) == "ghost"  # 100 x 313,600 values


def test_noise_is_one_standard_normal_draw_per_dtype():
    # the noise of all parameter arrays of one dtype comes from one draw (one compiled hash), split
    # into the arrays' shapes: standard normal, independent across arrays and entries
    from d3pext.training.svi import _standard_normals

    like = [jnp.zeros((3, 4)), jnp.zeros((5,), jnp.bfloat16), jnp.zeros((2,))]
    draws = jax.jit(jax.vmap(lambda k: _standard_normals(k, like)))(jax.random.split(jax.random.key(3), 4000))
    assert [d.shape[1:] for d in draws] == [(3, 4), (5,), (2,)]
    assert [d.dtype for d in draws] == [jnp.float32, jnp.bfloat16, jnp.float32]
    flat = np.concatenate([np.asarray(d, np.float64).reshape(4000, -1) for d in draws], axis=1)
    assert np.all(np.abs(flat.mean(0)) < 0.08) and np.all(np.abs(flat.std(0) - 1) < 0.06)
    corr = np.corrcoef(flat, rowvar=False)[np.triu_indices(flat.shape[1], 1)]
    assert np.max(np.abs(corr)) < 0.08  # 4000 draws: sd of a null correlation 0.016, 171 pairs


def test_noise_groups_of_several_dtypes_draw_from_keys_of_their_own():
    """Parameters of two dtypes: neither group draws from the noise key itself (the first group's words
    hash counter pairs (i, n + i) of that key, which the second's fold_in(key, n) once equalled)."""
    from d3pext._threefry_cpu import threefry2x32_unrolled
    from d3pext.training.noise import standard_normal
    from d3pext.training.svi import _standard_normals

    @jax.jit  # one compiled program (op by op: two dozen)
    def draws(key):
        like = [jnp.zeros((), jnp.float32), jnp.zeros((4,), jnp.bfloat16)]
        z = _standard_normals(key, like)
        first, second = jax.random.split(key)
        words = jax.random.key_data(first)  # what the first group's first draw is made from
        behind_first_draw = threefry2x32_unrolled(words[0], words[1], jnp.uint32(0), jnp.uint32(1))
        own = (standard_normal(first, (1,))[0], standard_normal(second, (4,), jnp.bfloat16))
        return z, own, behind_first_draw, jax.random.key_data(second)

    z, (first_draw, second_draws), behind_first_draw, second_words = draws(jax.random.key(123))
    assert float(z[0]) == float(first_draw)
    np.testing.assert_array_equal(z[1], second_draws)
    assert [int(w) for w in behind_first_draw] != [int(w) for w in second_words]
