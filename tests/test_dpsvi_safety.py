"""DPSVI under attack and misuse: data that would bypass clipping and noise, non-finite records,
steps past the plan, Poisson-padded batches, d3p's call forms, and the errors bad inputs get."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro
import numpyro.distributions as dist
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

from d3pext import DPSVI
from d3pext.training.dependence import dependent_outputs, jaxpr_dependence
from d3pext.training.minibatch import PoissonSampler, poisson_batchify_data

N, B = 200, 20
X = jax.random.normal(jax.random.key(0), (N,)) + 1.0


def normal_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", x.shape[0], subsample_size=B):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))


def dpsvi(model, **kw):
    kw = {"clipping_threshold": 2.0, "dp_scale": 1.0, **kw}
    return DPSVI(model, AutoDiagonalNormal(model), optax.adam(0.05), Trace_ELBO(), **kw)


# ------------------------------------------------------------------ data that would bypass the mechanism


def with_prior_loc(statistic):
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(statistic(x), 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))

    return model


@pytest.mark.parametrize("statistic", [jnp.std, lambda x: jnp.max(x) - jnp.min(x), lambda x: 0.0 * x[0] + 1.0])
def test_data_reaching_a_global_site_is_refused_naming_it(statistic):
    """jnp.std(x) and max - min look constant to a comparison of records; even 0 * x[0] is refused:
    the analysis follows dataflow, and a dataflow path exists."""
    with pytest.raises(ValueError, match="model site 'mu' outside the data plate 'data' can depend on the data"):
        dpsvi(with_prior_loc(statistic)).init(jax.random.key(0), X)


def keyword_model(x, y=None):
    # y's mean reaches the global prior: refused when y is positional, and it must be when it is a keyword
    w = numpyro.sample("w", dist.Normal(jnp.mean(y), 3.0))
    with numpyro.plate("data", x.shape[0], subsample_size=B):
        numpyro.sample("y", dist.Normal(w * numpyro.subsample(x, event_dim=0), 1.0), obs=numpyro.subsample(y, event_dim=0))


def test_record_data_passed_by_keyword_is_refused():
    """Keyword arrays are public to DPSVI (not subsampled, isolated or proven): a record array passed by
    keyword would carry its mean into the unclipped prior above. It is refused at init, update and run."""
    y = 2.0 * X
    with pytest.raises(ValueError, match="model site 'w' outside the data plate"):
        dpsvi(keyword_model).init(jax.random.key(0), X, y)
    message = "keyword argument 'y' has 200 rows, as many as the data: DPSVI treats keyword arrays as public"
    with pytest.raises(ValueError, match=message):
        dpsvi(keyword_model).init(jax.random.key(0), X, y=y)
    with pytest.raises(ValueError, match=message):
        dpsvi(keyword_model).run(jax.random.key(0), 2, X, y=y, progress_bar=False)
    svi = dpsvi(normal_model)
    state = svi.init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="keyword argument 'w' has 200 rows"):
        svi.update(state, X, w=jnp.ones(N))
    # a public array that has as many rows, bound to the model, is a constant of its program
    def weighted(x, weights=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            scale = numpyro.subsample(weights, event_dim=0)
            numpyro.sample("x", dist.Normal(mu, 1.0 / scale), obs=numpyro.subsample(x, event_dim=0))

    state = dpsvi(functools.partial(weighted, weights=jnp.ones(N))).init(jax.random.key(0), X)
    assert int(state.num_steps) == 0


def test_a_model_computing_across_its_batch_is_refused():
    """``xb - jnp.mean(xb, 0)`` after ``numpyro.subsample`` passed every check: each record's term is computed
    in a batch of one, where the centred covariates are 0, and DPSVI fitted the noise (w about [-0.3, -0.1,
    -0.1] where SVI finds [3.6, -3.7, 1.2]) without an error. Refused in plate and in batch mode; a model
    whose terms are per record, local latent variables included, is not."""
    x = jax.random.normal(jax.random.key(0), (N, 3))
    y = (x @ jnp.array([1.0, -1.0, 0.5]) > 0) * 1.0

    def centred(x, y):
        w = numpyro.sample("w", dist.Normal(0, 2).expand([3]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Bernoulli(logits=(xb - jnp.mean(xb, 0)) @ w), obs=yb)

    message = "the terms of a record change with the other records of its batch"
    with pytest.raises(ValueError, match=message):
        dpsvi(centred).init(jax.random.key(0), x, y)

    def batch_centred(xb, yb, num_obs_total=None):
        w = numpyro.sample("w", dist.Normal(0, 2).expand([3]).to_event(1))
        with numpyro.plate("data", num_obs_total, subsample_size=xb.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=(xb - jnp.mean(xb, 0)) @ w), obs=yb)

    with pytest.raises(ValueError, match=message):
        dpsvi(batch_centred, num_obs_total=N).init(jax.random.key(0), x[:B], y[:B])

    # batch operations that leave the first record of a batch alone, and records equal to the first
    def first_subtracted(x, y):
        w = numpyro.sample("w", dist.Normal(0, 2).expand([3]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
            numpyro.sample("y", dist.Bernoulli(logits=(xb - xb[0]) @ w), obs=yb)

    with pytest.raises(ValueError, match=message):
        dpsvi(first_subtracted).init(jax.random.key(0), x, y)
    repeated = jnp.concatenate([x[:1], x[:1], x[:1], x[3:]])  # records 0-2 alike: another is compared
    with pytest.raises(ValueError, match=message):
        dpsvi(centred).init(jax.random.key(0), repeated, y)

    def local_latent(x):  # a per-record latent with per-record keys: the same terms in any batch
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            z = numpyro.sample("z", dist.Normal(mu, 1.0))
            numpyro.sample("x", dist.Normal(z, 1.0), obs=numpyro.subsample(x, event_dim=0))

    def local_guide(x):
        numpyro.sample("mu", dist.Normal(numpyro.param("m", 0.0), 1.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B) as idx:
            loc = numpyro.param("z_loc", jnp.zeros(x.shape[0]))
            numpyro.sample("z", dist.Normal(loc[idx], 1.0))

    svi = DPSVI(local_latent, local_guide, optax.adam(0.05), Trace_ELBO(), clipping_threshold=2.0, dp_scale=1.0)
    state = svi.init(jax.random.key(0), X)
    assert int(state.num_steps) == 0


def test_a_public_keyword_array_with_a_row_per_record_is_refused():
    """A public array with a row per record of the batch (declared in public_kwargs) reached each record's
    term whole: with B = 2 an update fitted another model without an error, with B = 10 init failed with a
    broadcasting error."""

    def model(xb, offsets=None, num_obs_total=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", num_obs_total, subsample_size=xb.shape[0]):
            numpyro.sample("x", dist.Normal(mu + offsets, 1.0), obs=xb)

    for b in (2, 10):
        svi = dpsvi(model, num_obs_total=N, public_kwargs=("offsets",))
        with pytest.raises(ValueError, match=f"observed site 'x' has a distribution with {b} rows along the data plate"):
            svi.init(jax.random.key(0), X[:b], offsets=jnp.arange(b, dtype=jnp.float32))


def test_data_in_a_param_initial_value_is_refused():
    def model(x):
        shift = numpyro.param("shift", jnp.mean(x))
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            numpyro.sample("x", dist.Normal(mu + shift, 1.0), obs=numpyro.subsample(x, event_dim=0))

    with pytest.raises(ValueError, match="model param 'shift'"):
        dpsvi(model).init(jax.random.key(0), X)


def test_a_global_term_that_reads_which_records_were_sampled_is_refused():
    # the plate's indices are the batch: an unclipped global term that depends on them would reveal
    # it, and the subsampling's amplification assumes the batch is secret
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B) as idx:
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))
        numpyro.sample("tau", dist.Normal(0.01 * jnp.sum(idx), 1.0))

    with pytest.raises(ValueError, match="model site 'tau' .* can depend on the data or on which records"):
        dpsvi(model).init(jax.random.key(0), X)


def test_the_steps_run_the_proven_global_program():
    # the global part's program proven at init is what the steps evaluate: the model is not traced
    # again for it, and the results are those of tracing it afresh
    svi = dpsvi(normal_model)
    svi.init(jax.random.key(0), X)
    assert len(svi._global_programs) == 1
    svi._global_loss = None  # a step that traced the global part afresh would fail
    kept = svi.run(jax.random.key(1), 30, X, progress_bar=False)
    fresh = dpsvi(normal_model)
    fresh.init(jax.random.key(0), X)
    fresh._global_programs.clear()  # nothing kept: the steps trace (and prove) the global part afresh
    traced = fresh.run(jax.random.key(1), 30, X, progress_bar=False)
    assert fresh._global_programs == {}
    for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(traced.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_a_step_proves_the_global_part_for_types_that_init_did_not_see():
    # whatever init proved, a step runs only a proven global part: with init's check skipped, the
    # step's own proof still refuses a global site that reads the data
    svi = dpsvi(with_prior_loc(jnp.std))
    svi._check_global_independence = lambda *args: None
    state = svi.init(jax.random.key(0), X)
    assert svi._global_programs == {}
    with pytest.raises(ValueError, match="model site 'mu' outside the data plate 'data' can depend on the data"):
        svi.update(state, X)
    clean = dpsvi(normal_model)
    state = clean.init(jax.random.key(0), X)
    clean._global_programs.clear()  # nothing kept: the step proves it, and runs
    state, loss = clean.update(state, X)
    assert np.isfinite(float(loss))


def test_a_record_term_reading_other_records_is_refused():
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0], subsample_size=B):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x - jnp.mean(x), event_dim=0))

    with pytest.raises(ValueError, match="reads more than one record"):
        dpsvi(model).init(jax.random.key(0), X)


def test_the_record_term_sees_only_its_own_record():
    """By construction: the model is run on N copies of the record, so a term that reads other
    records (here the data's max) reads the record itself."""
    svi = dpsvi(normal_model)
    state = svi.init(jax.random.key(0), X)
    params = svi.optim.get_params(state.optim_state)
    key, record = jax.random.key(1), (jnp.asarray(3), jnp.asarray(0))
    record_loss = jax.jit(lambda data: svi._record_loss(params, key, (data,), {}, record))  # op by op: ~70 programs
    other = X.at[5].set(1e6)  # another record changed
    own = record_loss(X)
    assert float(record_loss(other)) == float(own)
    changed = X.at[3].add(1.0)  # the record itself changed
    assert float(record_loss(changed)) != float(own)


def test_dependence_analysis_follows_calls_and_is_conservative_in_loops():
    def f(x, w):
        inside = jax.jit(lambda a, b: (b * 2.0, jnp.sum(a)))(x, w)
        looped = jax.lax.fori_loop(0, 3, lambda i, c: c + w + 0.0 * jnp.sum(x), 0.0)
        return {"clean": inside[0] + jax.nn.softplus(w), "dirty": inside[1], "loop": looped}

    assert dependent_outputs(f, jnp.ones(3), 0.5) == {"clean": False, "dirty": True, "loop": True}
    closed = jax.make_jaxpr(lambda a, b: (a + 1.0, b))(1.0, 2.0)
    assert jaxpr_dependence(closed, [False, True]) == [False, True]


def test_dependence_analysis_follows_the_carry_of_loops():
    """Data that reach an output only after two iterations, or that set a loop's trip count, were once
    missed (the loop body was analysed as a call, once); what never meets the data stays clean."""
    lax = jax.lax

    def lagged(x):  # the carry's second slot takes the data one iteration late
        return lax.fori_loop(0, x.shape[0], lambda i, c: (c[0] + x[i], c[0]), (0.0, 0.0))[1]

    def trip_count(x):  # the data set how often a constant is added
        return lax.while_loop(lambda c: c[1] < c[0], lambda c: (c[0], c[1] + 1.0), (jnp.max(x), 0.0))[1]

    def branch_index(x, w):
        return lax.cond(jnp.sum(x) > 0, lambda w: w, lambda w: -w, w)

    x = jnp.array([0.5, 3.2, 7.9])
    for f in (lagged, trip_count):
        assert dependent_outputs(f, x) is True
        assert float(f(x)) != float(f(x.at[0].set(20.0)))  # and it does depend on them
    assert dependent_outputs(branch_index, x, 1.0) is True

    def clean(x, w):  # the data reach the stacked outputs only; the carry is a function of w alone
        carry, ys = lax.scan(lambda c, xi: (c * 0.5 + w, c + xi), w, x)
        steps = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * w), (0, w))[1]
        chosen = lax.cond(w > 0, lambda a, b: a, lambda a, b: b, w, jnp.sum(x))
        return {"carry": carry, "ys": ys, "while": steps, "cond": chosen}

    assert dependent_outputs(clean, x, 0.5) == {"carry": False, "ys": True, "while": False, "cond": True}


def test_a_global_prior_read_from_the_data_through_a_loop_is_refused():
    def model(x):
        lagged = jax.lax.fori_loop(0, x.shape[0], lambda i, c: (c[0] + x[i], c[0]), (0.0, 0.0))[1]
        mu = numpyro.sample("mu", dist.Normal(lagged / x.shape[0], 1.0))
        with numpyro.plate("data", x.shape[0], subsample_size=20):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))

    def guide(x):
        numpyro.sample("mu", dist.Normal(numpyro.param("loc", 0.0), 0.1))

    svi = DPSVI(model, guide, numpyro.optim.SGD(1.0), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    with pytest.raises(ValueError, match="can depend on the data"):
        svi.init(jax.random.key(1), jax.random.normal(jax.random.key(0), (200,)))


# ------------------------------------------------------------------ non-finite records


@pytest.mark.parametrize("clipping", ["materialize", "ghost", "reweight", "auto"])
def test_a_non_finite_record_is_dropped_not_spread(clipping):
    x_bad = X.at[7].set(jnp.inf)
    svi = dpsvi(normal_model, clipping=clipping)
    with pytest.warns(UserWarning, match="non-finite loss or gradient and were left out"):
        result = svi.run(jax.random.key(0), 40, x_bad, progress_bar=False)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(result.params))
    # record 7 is in a batch of 20 out of 200 with probability 0.1 per step
    assert 0 < int(result.state.num_dropped) <= 40
    assert result.privacy.num_steps == 40


# ------------------------------------------------------------------ the plan


def test_steps_past_the_plan_are_refused_and_a_larger_plan_reaccounts():
    svi = dpsvi(normal_model, dp_scale=None, epsilon=1.0, delta=1e-5, num_steps=5)
    state = svi.init(jax.random.key(0), X)
    for _ in range(5):
        state, _ = svi.update(state, X)
    with pytest.raises(ValueError, match="exceed the planned num_steps=5"):
        svi.update(state, X)
    with pytest.raises(ValueError, match="exceed the planned num_steps=5"):
        svi.stable_update(state, X)
    with pytest.raises(ValueError, match="exceed the planned num_steps=5"):
        svi.run(None, 1, X, init_state=state, progress_bar=False)
    assert svi.privacy_spent(state).epsilon <= 1.0
    report = svi.extend_plan(8)
    assert report.num_steps == 8 and report.epsilon > 1.0
    state, _ = svi.update(state, X)
    assert int(state.num_steps) == 6 and svi.privacy_spent(state).epsilon > svi.privacy_spent(5).epsilon


def test_steps_past_the_plan_under_the_callers_jit_change_nothing():
    svi = dpsvi(normal_model, dp_scale=None, epsilon=1.0, delta=1e-5, num_steps=3)
    state = svi.init(jax.random.key(0), X)
    loop = jax.jit(lambda s: jax.lax.fori_loop(0, 6, lambda i, s: svi.update(s, X)[0], s))
    state = loop(state)
    assert int(state.num_steps) == 3
    after_plan = state.optim_state
    state2 = loop(state)
    assert int(state2.num_steps) == 3
    for a, b in zip(jax.tree.leaves(after_plan), jax.tree.leaves(state2.optim_state)):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ d3p's batch mode


def batch_model(xb, num_obs_total=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("batch", num_obs_total, subsample_size=xb.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xb)


def test_poisson_padded_batches_with_mask_are_honoured_and_accounted_as_poisson():
    init, get_batch = poisson_batchify_data((X,), q=0.1)
    _, batchifier = init(jax.random.key(3))
    (xb,), mask = get_batch(0, batchifier)
    assert not bool(mask.all())
    svi = dpsvi(batch_model, num_obs_total=N, sampler=get_batch.sampler, delta=1e-5)
    state = svi.init(jax.random.key(0), xb, mask=mask)  # d3p scripts may pass the mask here too
    report = svi.privacy_spent(10)
    assert report.relation == "add_remove" and report.sampling_rate == pytest.approx(0.1)
    # what sits in the padding slots cannot matter: not even a NaN
    garbage = jnp.where(mask, xb, jnp.nan)
    s1, loss1 = svi.update(state, xb, mask=mask)
    s2, loss2 = svi.update(state, garbage, mask=mask)
    assert int(s2.num_dropped) == 0
    for a, b in zip(jax.tree.leaves(s1.optim_state), jax.tree.leaves(s2.optim_state)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="carry a mask"):
        svi.update(state, xb)


def test_autoguide_initial_point_does_not_depend_on_the_data():
    """NumPyro redraws an AutoGuide's initial point until the model's log density on the data is finite:
    for y ~ Uniform(0, theta) that made theta's starting value depend on the largest record. DPSVI sets
    the guide up from the model without its likelihood."""
    from numpyro.infer.autoguide import AutoNormal

    def model(x):
        theta = numpyro.sample("theta", dist.LogNormal(0.0, 1.0))
        with numpyro.plate("data", 20, subsample_size=10):
            numpyro.sample("x", dist.Uniform(0.0, theta, validate_args=True), obs=numpyro.subsample(x, event_dim=0))

    def initial(x):
        svi = DPSVI(model, AutoNormal(model), numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0,
                    dp_scale=1.0)
        return float(svi.get_params(svi.init(jax.random.key(0), x))["theta_auto_loc"])

    x = jnp.full((20,), 0.05)
    assert {initial(x), initial(x.at[3].set(5.0)), initial(x.at[11].set(50.0))} == {initial(x)}


def test_get_epsilon_counts_whole_epochs_and_includes_the_extra_delta():
    """3 epochs of 25 of 60,000 records are 7,200 steps (3 / q in floats is 7199.999...: int() dropped a
    step); the epsilon returned holds at the delta asked, the sampler's and the noise's extra included."""
    from d3pext.training.minibatch import FixedSizeSampler, PoissonSampler

    svi = dpsvi(batch_model, num_obs_total=N)
    svi.init(jax.random.key(0), X[:B])
    svi.sampler = FixedSizeSampler(60_000, 25)
    assert svi._steps_of_epochs(3) == 7200 and svi._steps_of_epochs(1.3) == 3120
    svi.sampler = FixedSizeSampler(186, 2)
    assert svi.get_epsilon(1e-5, num_epochs=1) == svi.get_epsilon(1e-5, 93)

    init, get_batch = poisson_batchify_data((X,), q=0.1, max_batch_size=55)  # a truncation term near delta
    (xb,), mask = get_batch(0, init(jax.random.key(3))[1])
    svi = dpsvi(batch_model, num_obs_total=N, sampler=get_batch.sampler, delta=1e-5)
    svi.init(jax.random.key(0), xb, mask=mask)
    steps, delta = 100, 1e-5
    eps = svi.get_epsilon(delta, steps)
    assert eps > svi.privacy_spent(steps, delta).epsilon  # the accountant's epsilon at delta is not enough
    assert svi.privacy_spent(steps, delta).delta > delta
    # at the epsilon returned, the accountant's delta plus the extra delta is within delta
    assert svi.privacy_spent(steps, delta - svi._extra_delta(eps, steps)).epsilon <= eps
    init, get_batch = poisson_batchify_data((X,), q=0.1, max_batch_size=0.99)  # no epsilon at delta = 1e-5
    (xb,), mask = get_batch(0, init(jax.random.key(3))[1])
    svi = dpsvi(batch_model, num_obs_total=N, sampler=get_batch.sampler, delta=1e-5)
    svi.init(jax.random.key(0), xb, mask=mask)
    with pytest.raises(ValueError, match="not below delta"):
        svi.get_epsilon(1e-5, 100)


def test_data_and_states_must_be_the_ones_the_object_accounts_for():
    """update or run on data of another size than init saw (plate-mode indices into fewer rows were
    clamped to the last one, a record sampled several times a batch), and a run resumed from a state
    whose steps another DPSVI took with other privacy settings (its earlier steps accounted at this
    one's noise), are refused; the same settings resume."""
    svi = dpsvi(normal_model)
    state = svi.init(jax.random.key(0), X)
    for call in (lambda: svi.update(state, X[:16]), lambda: svi.stable_update(state, X[:16]),
                 lambda: svi.run(None, 1, X[:16], init_state=state, progress_bar=False)):
        with pytest.raises(ValueError, match="initialised for N=200 records"):
            call()
    first = dpsvi(normal_model, dp_scale=None, epsilon=1.0, delta=1e-5, num_steps=100)
    done = first.run(jax.random.key(1), 10, X, progress_bar=False).state
    larger_plan = dpsvi(normal_model, dp_scale=None, epsilon=1.0, delta=1e-5, num_steps=200)  # a larger sigma
    larger_plan.init(jax.random.key(2), X)
    with pytest.raises(ValueError, match="other privacy settings"):
        larger_plan.run(None, 5, X, init_state=done, progress_bar=False)
    with pytest.raises(ValueError, match="other privacy settings"):  # a planned object checks update too
        larger_plan.update(done, X)
    same = dpsvi(normal_model, dp_scale=None, epsilon=1.0, delta=1e-5, num_steps=100)
    same.init(jax.random.key(3), X)
    assert int(same.run(None, 5, X, init_state=done, progress_bar=False).state.num_steps) == 15


def test_an_unplanned_object_refuses_steps_another_dpsvi_took():
    """Without a plan (a noise multiplier given), update and privacy_spent had taken a state whose steps
    another DPSVI took at a smaller noise multiplier and accounted them all at this one's: 10 steps at
    sigma 0.6 then 1 at sigma 3 were reported as epsilon 0.82 (11 steps at sigma 3), while the first
    10 alone cost 9.0."""
    low = dpsvi(normal_model, dp_scale=0.6)
    done = low.run(jax.random.key(1), 10, X, progress_bar=False).state
    high = dpsvi(normal_model, dp_scale=3.0)
    state = high.init(jax.random.key(2), X)
    for call in (lambda: high.update(done, X), lambda: high.stable_update(done, X), lambda: high.privacy_spent(done)):
        with pytest.raises(ValueError, match="other privacy settings"):
            call()
    for _ in range(3):  # its own states go on without a device read of the count
        state, _ = high.update(state, X)
    assert high.privacy_spent(state).num_steps == 3
    assert low.privacy_spent(done).epsilon > 5 * high.privacy_spent(11).epsilon  # what had been reported


def test_run_refuses_one_batch_for_all_steps():
    """Batch mode: run() would take the one batch it is given in every step, while the accountant
    counts a fresh sample of B of the N records per step; a batch of all N records is a full-batch run."""
    svi = dpsvi(batch_model, num_obs_total=N)
    with pytest.raises(ValueError, match="in every step"):
        svi.run(jax.random.key(0), 3, X[:B], progress_bar=False)
    assert dpsvi(batch_model, num_obs_total=N).run(jax.random.key(0), 3, X, progress_bar=False).privacy.sampling_rate == 1.0


def test_a_mask_without_a_poisson_sampler_is_refused():
    init, get_batch = poisson_batchify_data((X,), q=0.1)
    (xb,), mask = get_batch(0, init(jax.random.key(3))[1])
    svi = dpsvi(batch_model, num_obs_total=N)
    state = svi.init(jax.random.key(0), xb)
    with pytest.raises(ValueError, match="sampler=get_batch.sampler"):
        svi.update(state, xb, mask=mask)


def test_num_obs_total_reaches_the_model_and_get_epsilon_takes_d3p_form():
    seen = []

    def model(xb, num_obs_total=None):
        seen.append(num_obs_total)
        batch_model(xb, num_obs_total)

    svi = dpsvi(model, num_obs_total=N)
    state = svi.init(jax.random.key(0), X[:B])
    assert set(seen) == {N}
    full_scale = svi.evaluate(state, X[:B])
    assert np.isfinite(float(full_scale))
    # d3p: get_epsilon(delta, q, num_epochs=E) counts E / q steps
    assert svi.get_epsilon(1e-5, B / N, num_epochs=2) == svi.get_epsilon(1e-5, 2 * N // B)
    with pytest.raises(ValueError, match="not this run's sampling rate"):
        svi.get_epsilon(1e-5, 0.5, num_epochs=2)


def test_a_scale_handler_on_the_likelihood_warns():
    scaled = numpyro.handlers.scale(normal_model, 1.0 / N)
    with pytest.warns(UserWarning, match="clipping_threshold then bounds the gradient of 0.005"):
        dpsvi(scaled).init(jax.random.key(0), X)


# ------------------------------------------------------------------ bad inputs get d3pext errors


def sized_model(size, subsample_size):
    def model(x):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", size, subsample_size=subsample_size):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=numpyro.subsample(x, event_dim=0))

    return model


@pytest.mark.parametrize(
    "model, data, message",
    [
        (sized_model(N, 0), X, "subsample_size=0 must be between 1 and the plate's size 200"),
        (sized_model(N, N + 10), X, "subsample_size=210 must be between 1 and the plate's size 200"),
        (sized_model(5, None), X[:7], r"plate\(data, 5, dim=-1\) invalid shape"),
    ],
    ids=["subsample-0", "subsample-above-N", "plate-5-data-7"],
)
# NumPyro itself warns about a subsample larger than the plate before d3pext refuses it
@pytest.mark.filterwarnings("ignore:subsample_size does not match len")
def test_plate_sizes_are_checked_against_the_data(model, data, message):
    with pytest.raises(ValueError, match=message):
        dpsvi(model).init(jax.random.key(0), data)


def test_an_integer_key_and_a_vanishing_noise_multiplier_get_clear_messages():
    with pytest.raises(TypeError, match="rng_key must be a JAX PRNG key"):
        dpsvi(normal_model).init(0, X)
    svi = dpsvi(normal_model, dp_scale=1e-300)
    svi.init(jax.random.key(0), X)
    with pytest.warns(UserWarning, match="epsilon=inf: sigma=1e-300 is too small to account"):
        assert svi.privacy_spent(1).epsilon == float("inf")


# ------------------------------------------------------------------ compile once


def test_a_second_run_with_the_same_shapes_does_not_compile_again():
    svi = dpsvi(normal_model)
    svi.run(jax.random.key(0), 20, X, progress_bar=False)
    (chunk,) = svi._chunks.values()
    compiled = chunk._cache_size()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about either
        svi.run(jax.random.key(1), 20, X, progress_bar=False)
    assert svi._chunks == {next(iter(svi._chunks)): chunk} and chunk._cache_size() == compiled


def test_d3p_helpers_work_or_say_what_to_write_instead():
    from d3pext.training.clipping import clip_gradient, normalize_gradient
    from d3pext.training.minibatch import split_batchify_data

    tree = {"a": jnp.array([3.0]), "b": jnp.array([[4.0]])}
    clipped = clip_gradient(tree, 1.0)
    assert float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(clipped)))) == pytest.approx(1.0)
    for a, b in zip(jax.tree.leaves(clip_gradient(tree, 10.0)), jax.tree.leaves(tree)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(normalize_gradient(tree)["a"], [0.6])
    assert float(normalize_gradient({"z": jnp.zeros(2)})["z"].sum()) == 0.0
    with pytest.raises(NotImplementedError, match="use subsample_batchify_data|Use subsample_batchify_data"):
        split_batchify_data((X,), 10)
    with pytest.raises(TypeError, match="rng_suite= is d3p's"):
        dpsvi(normal_model, rng_suite="d3p.random")


# ------------------------------------------------------------------ data that reach the fit by other paths


def test_record_data_given_to_the_constructor_is_refused():
    # NumPyro's SVI(..., **static_kwargs): y there is as public to DPSVI as a call's keyword, and its
    # mean would reach the unclipped prior (one substituted y moved the gradient 5 C)
    message = "keyword argument 'y' given to DPSVI's constructor has 200 rows, as many as the data"
    with pytest.raises(ValueError, match=message):
        dpsvi(keyword_model, y=2.0 * X).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match=message):
        dpsvi(keyword_model, y=2.0 * X).run(jax.random.key(0), 2, X, progress_bar=False)


def test_data_in_a_param_constraint_is_refused():
    # the constraint becomes the parameter's transform, its bounds constants of every step: the
    # released parameter landed on min(x') - 1
    from numpyro.distributions import constraints

    def guide(x, bounds):
        m = numpyro.param("m", 0.0, constraint=constraints.interval(*bounds(x)))
        numpyro.sample("mu", dist.Normal(m, 0.1))

    def svi(bounds):
        return DPSVI(normal_model, functools.partial(guide, bounds=bounds), optax.adam(0.05), Trace_ELBO(),
                     clipping_threshold=2.0, dp_scale=1.0)

    svi(lambda x: (-10.0, 10.0)).init(jax.random.key(0), X)
    with pytest.raises(ValueError, match="the constraint of guide param 'm' can depend on the data"):
        svi(lambda x: (jnp.min(x) - 1.0, jnp.max(x) + 1.0)).init(jax.random.key(0), X)


Y = 2.0 * X + 0.1


def closed_over_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", x.shape[0], subsample_size=B) as idx:
        numpyro.sample("y", dist.Normal(mu * numpyro.subsample(x, event_dim=0), 1.0), obs=Y[idx])


def full_batch_model(x):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(mu * x, 1.0))


@pytest.mark.parametrize("model", [closed_over_model, numpyro.handlers.condition(full_batch_model, {"y": Y})])
def test_observations_not_from_the_positional_data_are_refused(model):
    # conditioned (or closed-over) observations are not kept apart per record: with condition, each
    # record's term broadcast against all N of them (record 0's loss was the whole data's)
    with pytest.raises(ValueError, match="observed site 'y' in the data plate 'data' does not take its observed value"):
        dpsvi(model).init(jax.random.key(0), X)


def test_observations_of_other_records_in_a_record_term_are_refused():
    def model(x, y):  # a closed-over array of N rows: each record's term reads all N
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(mu * x, 1.0), obs=y - Y)

    with pytest.raises(ValueError, match="observed site 'y' has 200 values along the data plate 'data'"):
        dpsvi(model).init(jax.random.key(0), X, Y)


def test_an_autoguide_starts_from_no_record():
    # init_to_median (AutoDelta's default) draws the local t from its prior Normal(c_i, 1): the initial
    # locations were copies of the prototype batch's records, outside clipping and noise
    from numpyro.infer.autoguide import AutoDelta

    def model(c, y):
        s = numpyro.sample("s", dist.HalfNormal(1.0))
        with numpyro.plate("data", c.shape[0], subsample_size=B):
            t = numpyro.sample("t", dist.Normal(numpyro.subsample(c, event_dim=0), 1.0))
            numpyro.sample("y", dist.Normal(t, s), obs=numpyro.subsample(y, event_dim=0))

    def initial(c):
        svi = DPSVI(model, AutoDelta(model), optax.adam(0.01), clipping_threshold=1.0, dp_scale=1.0)
        return svi.get_params(svi.init(jax.random.key(3), c, X))

    first, second = initial(X), initial(X + 100.0)  # every record moved: whichever the prototype's batch holds
    for name in first:
        np.testing.assert_array_equal(first[name], second[name])
    assert float(jnp.max(jnp.abs(first["t_auto_loc"]))) < 10.0


def test_poisson_sampling_rate_is_stated_not_taken_from_the_private_number_of_records():
    # add/remove neighbours differ in N: a step scaled by N / B revealed N in its noise's variance
    def svi(**kw):
        return dpsvi(normal_model, sampler="poisson", delta=1e-5, **kw)

    for n in (N, N + 1):
        data = jnp.concatenate([X, X[:1]])[:n]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            stated = svi(sampling_rate=0.1)
            stated.init(jax.random.key(0), data)
        assert stated.sampler.q == 0.1 and stated.privacy_spent(10).sampling_rate == 0.1
    with pytest.raises(ValueError, match=r"sampler='poisson' needs its rate: .*sampling_rate=q"):
        svi()
    with pytest.raises(ValueError, match="sampling_rate must be in"):
        svi(sampling_rate=1.5)
    with pytest.raises(ValueError, match="sampler='poisson' needs its rate and delta"):  # both at once
        dpsvi(normal_model, sampler="poisson")
    # the default delta, min(1e-5, 0.1 / N), would publish N (N = 20,000 gave delta 5e-6 in the report)
    for sampler in ("poisson", PoissonSampler(N, 0.1)):
        with pytest.raises(ValueError, match="Poisson sampling needs delta="):
            dpsvi(normal_model, sampler=sampler, **({"sampling_rate": 0.1} if sampler == "poisson" else {}))
    with pytest.raises(ValueError, match="sampling_rate= is the rate of sampler='poisson'"):
        dpsvi(normal_model, sampling_rate=0.1)


def test_the_record_plate_is_named_when_observations_share_several_plates():
    """Observed sites in a plate of individuals and a subsampled plate of genes: DPSVI had taken the
    subsampled plate for the records, and with as many genes a batch as individuals, a fit on every
    individual's row in every step was accounted at q = 8 / 200 (epsilon 1.14 for 3 steps, against
    20.1 at the true q = 1)."""
    n, d, k = 8, 200, 8
    y = jnp.asarray(np.random.default_rng(0).normal(size=(n, d)), jnp.float32)

    def model(y):
        mu = numpyro.param("mu", jnp.zeros(d))
        with numpyro.plate("individuals", n, dim=-2):
            with numpyro.plate("genes", d, subsample_size=k, dim=-1) as g:
                numpyro.sample("y", dist.Normal(mu[g], 1.0), obs=numpyro.subsample(y, event_dim=0))

    svi = DPSVI(model, lambda y: None, numpyro.optim.SGD(0.01), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    with pytest.raises(ValueError, match=r"all in the plates \['genes', 'individuals'\]: name the plate"):
        svi.init(jax.random.key(0), y)


def test_record_data_passed_by_keyword_in_another_layout_is_refused():
    """Covariates of the records laid out (features, records) by keyword passed the rows-only check, and a
    global prior at their mean moved the noise-free gradient by 337 against a bound of 4."""
    n, b, d = 6, 3, 4
    y = jnp.asarray(np.random.default_rng(0).normal(size=(n,)), jnp.float32)
    xt = jnp.ones((d, n))

    def model(y, xt=None):
        w = numpyro.sample("w", dist.Normal(jnp.mean(xt, axis=1), 1.0).to_event(1))
        with numpyro.plate("data", n, subsample_size=b) as idx:
            numpyro.sample("y", dist.Normal(xt[:, idx].T @ w, 1.0), obs=numpyro.subsample(y, event_dim=0))

    with pytest.raises(ValueError, match=r"keyword argument 'xt' has an axis of 6 \(shape \(4, 6\)\), as many as the data"):
        dpsvi(model).init(jax.random.key(0), y, xt=xt)

    # batch mode: the keyword array holds all N records while the positional data is a batch of B
    def batch(yb, y_all=None, num_obs_total=None):
        theta = numpyro.sample("theta", dist.Beta(1.0 + jnp.sum(y_all), 1.0))
        with numpyro.plate("data", num_obs_total, subsample_size=yb.shape[0]):
            numpyro.sample("y", dist.Bernoulli(theta), obs=yb)

    y_all = (jnp.arange(200) % 3 == 0).astype(jnp.float32)
    with pytest.raises(ValueError, match=r"keyword argument 'y_all' has an axis of 200 \(shape \(200,\)\)"):
        dpsvi(batch, num_obs_total=200).init(jax.random.key(0), y_all[:10], y_all=y_all)


def test_public_keyword_array_of_the_batch_size_is_accepted_when_declared():
    """A public array whose rows happen to equal the batch size (group features with as many groups as
    records per batch) was refused with no way to say it is public other than binding it to the model
    and the guide; ``public_kwargs=`` names it. Undeclared, it is still refused, and the message says how."""
    groups, n, b = 10, 200, 10
    features = jnp.linspace(-1.0, 1.0, groups)

    def model(yb, group=None, group_features=None, num_obs_total=None):
        slope = numpyro.sample("slope", dist.Normal(0.0, 1.0))
        with numpyro.plate("data", num_obs_total, subsample_size=yb.shape[0]):
            numpyro.sample("y", dist.Normal(slope * group_features[group], 1.0), obs=yb)

    y = jnp.asarray(np.random.default_rng(1).normal(size=(n,)), jnp.float32)
    group = jnp.arange(n) % groups
    with pytest.raises(ValueError, match=r"has 10 rows, as many as the data.*public_kwargs=\('group_features',\)"):
        dpsvi(model, num_obs_total=n).init(jax.random.key(0), y[:b], group[:b], group_features=features)
    svi = dpsvi(model, num_obs_total=n, public_kwargs=("group_features",))
    state = svi.init(jax.random.key(0), y[:b], group[:b], group_features=features)
    state, _ = svi.update(state, y[b : 2 * b], group[b : 2 * b], group_features=features)
    assert int(state.num_steps) == 1
    # declaring one name leaves the others checked
    with pytest.raises(ValueError, match="keyword argument 'other' has 10 rows"):
        svi.update(state, y[:b], group[:b], group_features=features, other=jnp.ones(b))
    with pytest.raises(TypeError, match="public_kwargs must be a sequence of keyword argument names"):
        dpsvi(model, public_kwargs="group_features")


def test_a_batch_mode_report_says_its_sampling_is_assumed():
    """In batch mode the caller draws the batches and the accountant assumes how: the report says so (a
    loop over fixed slices was reported exactly as if sampled)."""

    def batch(xb, num_obs_total=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
        with numpyro.plate("data", num_obs_total, subsample_size=xb.shape[0]):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=xb)

    svi = dpsvi(batch, num_obs_total=N)
    svi.init(jax.random.key(0), X[:B])
    report = svi.privacy_spent(10)
    assert report.sampler == "FixedSizeSampler (assumed: batch mode)"
    assert "FixedSizeSampler (assumed: batch mode), substitute neighbours" in str(report)
    plate = dpsvi(normal_model)
    plate.init(jax.random.key(0), X)
    assert plate.privacy_spent(10).sampler == "FixedSizeSampler"
