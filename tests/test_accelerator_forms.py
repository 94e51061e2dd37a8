"""The accelerator forms of the samplers against their CPU forms.

``lax.platform_dependent`` picks one form per backend (on a GPU: no data-dependent loop where one
can be avoided, since each of its checks waits for the host), so a CPU run never executes the GPU
forms: they are checked here directly, draw for draw where the bits are the same, by goodness of
fit where they differ.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import random

from d3pext._backend import forced_form
from d3pext.inference.draws import truncated_normal_from_uniforms, uniform_pairs


def _in_form(form, fn, *args):
    """``fn(*args)`` compiled in ``form`` (a fresh jit: nothing traced in another form is reused)."""
    with forced_form(form):
        return np.asarray(jax.jit(lambda *a: fn(*a))(*args))


@pytest.mark.parametrize("loc", [0.0, 8.0, -3.0])
def test_truncated_normal_gpu_form_equals_cpu_form(loc):
    """Every lane inverted and selected (no loop) gives the very draws of the loop that inverts only
    when some lane's plain draw falls outside; mixed lanes, all inside, and all outside."""
    n = 3000
    locs = jnp.concatenate([jnp.full(n, loc), jnp.linspace(-2.0, 5.0, n)])
    w = uniform_pairs(random.key(3), locs.shape, jnp.float32)
    draw = lambda form: _in_form(form, lambda w, m: truncated_normal_from_uniforms(w, m, 1.0, 1.0, 2.0), w, locs)
    looped, selected = draw("cpu"), draw("accelerator")
    assert np.all((selected >= 1.0) & (selected <= 2.0))
    np.testing.assert_array_equal(selected, looped)


@pytest.fixture
def accelerator_rejection():
    """The rejection samplers' accelerator form (many proposals per lane and round) on this backend."""
    with jax.enable_x64(True), forced_form("accelerator"):
        yield


def test_rejection_gpu_form_gof(accelerator_rejection):
    """The first accepted of 16 proposals per round is the same exact law: truncated gammas with shapes
    below and above 1 (the two envelopes) and a TGM with its Laplace kink inside the interval."""
    from d3pext.distributions.truncated_gamma import tgm_from_uniforms, truncated_gamma_from_uniforms
    from test_tgm import GOF_THRESHOLD, TGM_SAMPLES, _gamma_pit, pit_gof

    gamma_cases = [(0.5, 1.0, 0.3, 2.0), (0.9, 2.0, 5.0, np.inf), (21.0, 100.0, 0.1, 0.3)]
    alpha, beta, lam, tau, upper = 21.0, 100.0, 10.75, 0.22, 0.25

    @jax.jit
    def draws(key):
        keys = random.split(key, 2 * len(gamma_cases) + 2)
        u = lambda k: random.uniform(k, (2, TGM_SAMPLES), jnp.float64, minval=1e-300)
        gammas = [truncated_gamma_from_uniforms(u(keys[2 * i]), keys[2 * i + 1], *p, fallback=False)
                  for i, p in enumerate(gamma_cases)]
        return gammas, tgm_from_uniforms(u(keys[-2]), keys[-1], alpha, beta, lam, tau, upper, fallback=False)

    gammas, tgm = draws(random.key(41))
    for p, x in zip(gamma_cases, gammas):
        x = np.asarray(x)
        assert np.all((x >= p[2]) & (x <= p[3])), p
        assert pit_gof(_gamma_pit(x, *p)) > GOF_THRESHOLD, p
    # the TGM's CDF by quadrature of its density x^(alpha-1) exp(-beta x - lam |x - tau|) on (0, upper]
    grid = np.linspace(0.0, upper, 200_001)[1:]
    log_f = (alpha - 1) * np.log(grid) - beta * grid - lam * np.abs(grid - tau)
    cdf = np.cumsum(np.exp(log_f - log_f.max()))
    x = np.asarray(tgm)
    assert np.all((x > 0) & (x <= upper))
    assert pit_gof(np.interp(x, grid, cdf / cdf[-1])) > GOF_THRESHOLD


@pytest.mark.parametrize("num_records, batch_size", [(1000, 100), (300, 300), (70_001, 1000)])
def test_feistel_rank_walk_gpu_form_equals_cpu_form(num_records, batch_size):
    """The first pass outside the loop with its rounds unrolled: the same indices as the rolled loop."""
    from d3pext.training.minibatch import _feistel_rank_walk

    keys = random.split(random.key(5), 64)
    walk = lambda form: _in_form(form, jax.vmap(lambda k: _feistel_rank_walk(k, num_records, batch_size, 16)), keys)
    np.testing.assert_array_equal(walk("accelerator"), walk("cpu"))


def test_dpsvi_step_gpu_form_equals_cpu_form():
    """The plan check as selects (accelerator) or as a branch around the optimizer's update (CPU): the
    same state after a step within the plan, and after one past it (nothing updated, nothing counted)."""
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    from d3pext import DPSVI

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0, 1).expand([3]).to_event(1))
        with numpyro.plate("data", x.shape[0], subsample_size=20) as idx:
            numpyro.sample("y", dist.Bernoulli(logits=x[idx] @ w), obs=y[idx])

    x = random.normal(random.key(0), (100, 3))
    y = (x[:, 0] > 0).astype(jnp.float32)
    states = {}
    for form in ("cpu", "accelerator"):
        with forced_form(form):
            svi = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.1), Trace_ELBO(), clipping_threshold=1.0,
                        epsilon=1.0, num_steps=1)
            state = svi.init(random.key(1), x, y)
            within, _ = jax.jit(svi._jitted_step((), False))(state, (x, y), {}, None, svi._settings())
            past, _ = jax.jit(svi._jitted_step((), False))(within, (x, y), {}, None, svi._settings())
        states[form] = (within, past)
    for form_state in states.values():
        within, past = form_state
        assert int(within.num_steps) == 1 and int(past.num_steps) == 1
        for new, old in zip(jax.tree.leaves(past.optim_state), jax.tree.leaves(within.optim_state)):
            np.testing.assert_array_equal(new, old)
    for cpu, accelerator in zip(states["cpu"], states["accelerator"]):
        np.testing.assert_array_equal(random.key_data(cpu.rng_key), random.key_data(accelerator.rng_key))
        assert int(cpu.num_dropped) == int(accelerator.num_dropped)
        for a, b in zip(jax.tree.leaves(cpu.optim_state), jax.tree.leaves(accelerator.optim_state)):
            np.testing.assert_allclose(a, b, rtol=1e-6)


def test_where_the_cpu_is_the_only_backend_only_its_form_is_traced():
    # lax.platform_dependent traces every form; a program of a CPU-only process can only run on the
    # CPU, so the accelerator form is not traced there (a fifth of a Gibbs sampler's tracing)
    from d3pext import _backend

    traced = []

    def form(name, offset):
        def fn(x):
            traced.append(name)
            return x + offset

        return fn

    def program(x):
        return _backend.by_backend(form("cpu", 1.0), form("accelerator", 2.0), x)

    import jax.extend.backend

    result = float(jax.jit(program)(1.0))
    if set(jax.extend.backend.backends()) == {"cpu"}:
        assert result == 2.0 and traced == ["cpu"]
    else:  # platform_dependent traces every form and lowers the default device's
        assert sorted(traced) == ["accelerator", "cpu"]
        assert result == (2.0 if jax.default_backend() == "cpu" else 3.0)
    traced.clear()
    with forced_form("accelerator"):  # a new function: jit keeps the form of a program it has traced
        assert float(jax.jit(lambda x: program(x))(1.0)) == 3.0
    assert traced == ["accelerator"]
