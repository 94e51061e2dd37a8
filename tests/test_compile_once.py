"""DPSVI compiles once per model structure: a second ``run``/``update``/``init`` with the same shapes
and a new key compiles nothing (issue: time to first result is compilation)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import Trace_ELBO

from d3pext import DPSVI

from compilations import count_compilations as compilations


def model(x, batch_size=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size) as idx:
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=x[idx])


def guide(x, batch_size=None):
    loc = numpyro.param("loc", 0.0)
    numpyro.sample("mu", dist.Normal(loc, 0.5))


def make():
    return DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, dp_scale=1.0)


X = jnp.asarray(np.random.default_rng(0).normal(1.0, 1.0, 300), jnp.float32)


def test_counter_sees_a_compilation():
    # the listener must see a fresh program, or the tests below could not fail
    with compilations() as compiled:
        jax.jit(lambda v: jnp.sin(v) * 3.25 + 0.125)(jnp.arange(7.0)).block_until_ready()
    assert compiled
    # and a program read back from the test process's compilation cache (tests/conftest.py): the same
    # program again, from a new function object, whose jit cache misses (JAX's compile event spans
    # the cache lookup)
    program = lambda key: jax.random.gamma(key, 2.5, (9,))  # about 0.3 s to compile: cached
    key = jax.random.key(3)
    with compilations() as first:
        jax.jit(program)(key).block_until_ready()
    with compilations() as again:
        jax.jit(lambda k: program(k))(key).block_until_ready()
    assert len(first) == len(again) == 1, (first, again)


def test_second_run_compiles_nothing():
    svi = make()
    svi.run(jax.random.key(0), 30, X, batch_size=50, progress_bar=False)
    with compilations() as compiled:
        result = svi.run(jax.random.key(1), 30, X, batch_size=50, progress_bar=False)
        jax.block_until_ready(result.params)
    assert compiled == [], f"{len(compiled)} program(s) compiled again"
    # and a different number of steps reuses the compiled step chunks too
    with compilations() as compiled:
        jax.block_until_ready(svi.run(jax.random.key(2), 45, X, batch_size=50, progress_bar=False).params)
    assert compiled == [], f"{len(compiled)} program(s) compiled for a new number of steps"


def test_update_and_init_compile_once():
    svi = make()
    state = svi.init(jax.random.key(0), X, batch_size=50)
    state, loss = svi.update(state, X, batch_size=50)
    jax.block_until_ready(loss)
    with compilations() as compiled:
        for _ in range(3):
            state, loss = svi.update(state, X, batch_size=50)
        jax.block_until_ready(loss)
        state = svi.init(jax.random.key(5), X, batch_size=50)
        state, loss = svi.update(state, X, batch_size=50)
        jax.block_until_ready(loss)
    assert compiled == [], f"{len(compiled)} program(s) compiled again"


@pytest.mark.parametrize("sampler", ["fixed", "poisson"])
def test_update_compiles_only_its_step_after_init_and_equals_run(sampler):
    # the batch sampler and the noise compile in init, a program of their own (shared by objects with the
    # same sampler); the first update then compiles the model's step alone, and a loop of updates is run's
    # loop to the bit. A batch size no other test uses: its draws are compiled by this test's first init.
    def make_one():
        return DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, dp_scale=1.0,
                     sampler=sampler, sampling_rate=47 / 300 if sampler == "poisson" else None, delta=1e-5)

    svi = make_one()
    with compilations() as in_init:
        state = svi.init(jax.random.key(3), X, batch_size=47)
    with compilations() as compiled:
        state, loss = svi.update(state, X, batch_size=47)
        jax.block_until_ready(loss)
    assert "jit(_next_key_and_draws)" in in_init and compiled == ["jit(_step)"], (in_init, compiled)
    for _ in range(3):
        state, loss = svi.update(state, X, batch_size=47)
    other = make_one()
    with compilations() as in_init:
        result = other.run(jax.random.key(3), 4, X, batch_size=47, progress_bar=False)
        other.init(jax.random.key(4), X, batch_size=47)
    assert "jit(_next_key_and_draws)" not in in_init, in_init  # run draws inside its loop; init found them
    assert float(loss) == float(result.losses[-1])
    np.testing.assert_array_equal(svi.get_params(state)["loc"], result.params["loc"])
    np.testing.assert_array_equal(jax.random.key_data(state.rng_key), jax.random.key_data(result.state.rng_key))


def test_objects_that_differ_in_sigma_or_plan_compile_the_same_programs():
    # sigma C and the plan are arguments of the compiled step and loop, not constants: a sweep over
    # epsilons compiles programs that the persistent compilation cache finds (the CLI, the notebooks)
    def lowered(epsilon, num_steps):
        svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, epsilon=epsilon,
                    num_steps=num_steps)
        state = svi.init(jax.random.key(0), X, batch_size=50)
        settings = svi._settings()
        step = svi._jitted_step((("batch_size", 50),), False).lower(state, (X,), {}, None, settings)
        chunk = svi._jitted_chunk((("batch_size", 50),), False).lower(state, (X,), {}, None, settings, np.int32(1))
        return svi.dp_scale, step.as_text(), chunk.as_text()

    sigma_1, *programs_1 = lowered(1.0, 100)
    sigma_2, *programs_2 = lowered(4.0, 300)
    assert sigma_1 > 1.5 * sigma_2  # the calibrated sigmas differ ...
    assert programs_1 == programs_2  # ... the programs do not


def test_a_longer_plan_compiles_nothing():
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, epsilon=1.0, num_steps=2)
    state = svi.init(jax.random.key(0), X, batch_size=50)
    for _ in range(2):
        state, _ = svi.update(state, X, batch_size=50)
    # compile run's loop too (from a fresh state: this one has used up the plan)
    svi.run(None, 1, X, batch_size=50, init_state=svi.init(jax.random.key(1), X, batch_size=50), progress_bar=False)
    svi.extend_plan(4)
    with compilations() as compiled:
        state, loss = svi.update(state, X, batch_size=50)
        result = svi.run(None, 1, X, batch_size=50, init_state=state, progress_bar=False)
        jax.block_until_ready((loss, result.params))
    assert compiled == [], f"{len(compiled)} program(s) compiled again"
    assert int(state.num_steps) == 3 and int(result.state.num_steps) == 4  # the new plan holds in both


def test_planned_updates_do_not_wait_for_the_device(monkeypatch):
    # the plan check of update reads the step count from the host's record of the states that
    # update returned, not from the device (reading an array waits for the step that computes it)
    svi = DPSVI(model, guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0,
                epsilon=1.0, num_steps=5)
    state = svi.init(jax.random.key(0), X, batch_size=50)
    state, _ = svi.update(state, X, batch_size=50)
    array_type = type(state.num_steps)

    def no_reads(self):
        raise AssertionError("update read the step count from the device")

    with monkeypatch.context() as patch:
        patch.setattr(array_type, "__int__", no_reads)
        patch.setattr(array_type, "__index__", no_reads)
        for _ in range(4):
            state, loss = svi.update(state, X, batch_size=50)
    assert int(state.num_steps) == 5
    try:
        svi.update(state, X, batch_size=50)
    except ValueError as error:
        assert "exceed the planned num_steps=5" in str(error)
    else:
        raise AssertionError("a sixth step was not refused")


def test_init_is_one_compiled_program_and_matches_op_by_op():
    """init runs NumPyro's init and the structure traces as one compiled program (not one program per
    primitive of the model); it gives the op-by-op init's state, to rounding."""
    svi, eager = make(), make()
    eager._op_by_op_init = True
    state = svi.init(jax.random.key(3), X, batch_size=50)
    assert len(svi._inits) == 1 and not svi._op_by_op_init
    expected = eager.init(jax.random.key(3), X, batch_size=50)
    assert not eager._inits
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(expected)):
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert svi.structure == eager.structure and svi.sampler == eager.sampler


def test_init_falls_back_op_by_op_for_stateful_guides_and_traced_constraints():
    from numpyro.distributions import constraints
    from numpyro.infer.autoguide import AutoNormal

    # an AutoGuide sets up its prototype on its first call: never under a trace, and one form per object
    svi = DPSVI(model, AutoNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, dp_scale=1.0)
    first = svi.init(jax.random.key(4), X, batch_size=50)
    assert svi._op_by_op_init and not svi._inits
    again = svi.init(jax.random.key(4), X, batch_size=50)
    for a, b in zip(jax.tree.leaves(first.optim_state), jax.tree.leaves(again.optim_state)):
        np.testing.assert_array_equal(a, b)
    svi.run(jax.random.key(5), 10, X, batch_size=50, progress_bar=False)

    # a param constraint built from an array keyword argument would hold a tracer: op by op instead
    def bounded_guide(x, upper=None, batch_size=None):
        loc = numpyro.param("loc", 0.5, constraint=constraints.interval(0.0, upper))
        numpyro.sample("mu", dist.Normal(loc, 0.5))

    def bounded_model(x, upper=None, batch_size=None):
        model(x, batch_size)

    svi = DPSVI(bounded_model, bounded_guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0,
                dp_scale=1.0)
    result = svi.run(jax.random.key(6), 10, X, upper=jnp.float32(3.0), batch_size=50, progress_bar=False)
    assert not svi._inits and 0.0 < float(result.params["loc"]) < 3.0


def test_a_model_dpsvi_cannot_fit_is_refused_before_anything_compiles():
    # the structure comes from the traced init: no op-by-op init of an AutoGuide (seconds of small
    # programs) and no compiled init before the error
    from numpyro.infer.autoguide import AutoDiagonalNormal

    def no_plate(x, batch_size=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        numpyro.sample("x", dist.Normal(mu, 1.0).expand([x.shape[0]]).to_event(1), obs=x)

    def mutable(x, batch_size=None):
        numpyro.primitives.mutable("count", jnp.zeros(()))
        model(x, batch_size)

    key = jax.random.key(0)
    for bad, message in ((no_plate, "no data plate"), (mutable, "mutable state")):
        for make_guide in (AutoDiagonalNormal, lambda m: guide):
            svi = DPSVI(bad, make_guide(bad), numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0,
                        dp_scale=1.0)
            with compilations() as compiled, pytest.raises(ValueError, match=message):
                svi.init(key, X, batch_size=50)
            assert compiled == [], (bad.__name__, len(compiled))


# ------------------------------------------------------------------ the same programs in every process

_DEMO_PROGRAMS = """
import sys, jax
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
from d3pext.cli import _run_demo
from d3pext.datasets import load_breast_cancer
_run_demo(load_breast_cancer(), epsilon=1.0, delta=None, steps=3, batch_size=50, clip=1.0, learning_rate=0.05, seed=0)
"""


def test_demo_programs_hit_the_compile_cache_in_a_new_process(tmp_path):
    # Every program the demo compiles must be the same in the next process, or the persistent cache
    # misses. Python's string hashing differs between processes (PYTHONHASHSEED here), and so does
    # the order of any set of site names: NumPyro's Trace_ELBO sums its terms in that order, and with
    # it as the demo's non-private loss this test failed (one new cache entry in the second process).
    import os
    import subprocess
    import sys

    def run(hash_seed):
        env = {**os.environ, "PYTHONHASHSEED": str(hash_seed), "JAX_PLATFORMS": "cpu"}
        subprocess.run([sys.executable, "-c", _DEMO_PROGRAMS, str(tmp_path)], env=env, check=True, timeout=300,
                       capture_output=True)  # fmt: skip
        return {p.name for p in tmp_path.iterdir()}

    first = run(1)
    assert any(name.startswith("jit_chunk") for name in first)  # the private fit was cached
    assert run(3) == first  # a set of {"w", "obs"} iterates in opposite orders under these two seeds


def test_the_global_independence_proof_is_kept_per_signature(monkeypatch):
    # the proof traces the model's global terms (a tenth of a warm demo): a later init with the same
    # structure and types of data, parameters and key holds it already; other shapes prove it again
    from d3pext.training import svi as svi_module

    proofs = []
    real = svi_module.dependent_outputs
    monkeypatch.setattr(svi_module, "dependent_outputs", lambda *a, **k: proofs.append(1) or real(*a, **k))
    svi = make()
    svi.init(jax.random.key(0), X, batch_size=50)
    first = len(proofs)
    assert first > 0
    svi.init(jax.random.key(1), X + 1.0, batch_size=50)
    assert len(proofs) == first
    svi.init(jax.random.key(1), X[:200], batch_size=50)  # another number of records
    assert len(proofs) > first


def test_run_returns_the_constrained_parameters_of_its_final_state():
    # run's loop returns them (get_params op by op compiled a program of its own in each new process)
    def positive_guide(x, batch_size=None):
        scale = numpyro.param("scale", 0.5, constraint=dist.constraints.positive)
        numpyro.sample("mu", dist.Normal(scale, 0.5))

    svi = DPSVI(model, positive_guide, numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=2.0, dp_scale=1.0)
    result = svi.run(jax.random.key(0), 30, X, batch_size=50, progress_bar=False)
    assert float(result.params["scale"]) > 0
    assert jax.tree.map(float, result.params) == jax.tree.map(float, svi.get_params(result.state))
