"""Data-parallel DPSVI (``DPSVI(..., mesh=mesh)``): the records of each batch split over 4 forced
CPU devices, in a subprocess (``XLA_FLAGS`` must be set before JAX starts).

Checked: the same key gives the same gradient, dropped-record count and fit as one device (with
materialized and ghost clipping, a batch of 30 records padded to 32 slots, data sharded by rows),
and each device does about a quarter of the per-record work (flops of the compiled per-device
program). Data placed where the split step cannot take it (on a device outside the mesh, committed to
part of it, split by columns or over another axis) and records the devices cannot share evenly get
d3pext errors. The 4 devices share this machine's cores: these tests check results and flop counts, not
speed (``benchmarks/bench_data_parallel.py`` times it).
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.sharding import Mesh
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoNormal

from d3pext import DPSVI

# the subprocesses count compilations with the helper the in-process tests use
HEADER = Path(__file__).with_name("compilations.py").read_text(encoding="utf-8") + """
import copy, json
import jax, jax.numpy as jnp, numpy as np
import numpyro, numpyro.distributions as dist
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from numpyro.infer import Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal, AutoNormal
from d3pext import DPSVI
from d3pext.training.clipping import CLIPPED_SUMS
from d3pext.training.parallel import communication, data_parallel_clipped_sum
assert len(jax.devices()) == 4, jax.devices()

N, B, K = 400, 30, 8  # B = 30 records: 32 slots over 4 devices, 2 of them masked out

def model(x, y):
    # W enters only a matrix product: a ghost weight under clipping="ghost"; b is a latent global
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    W = numpyro.param("W", jnp.full((K, 3), 0.1))
    with numpyro.plate("data", x.shape[0], subsample_size=B):
        xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Categorical(logits=jnp.tanh(xb @ W) + b), obs=yb)

x = jax.random.normal(jax.random.key(0), (N, K))
y = jax.random.randint(jax.random.key(2), (N,), 0, 3)
x_bad = x.at[::7].set(jnp.nan)  # some sampled records have a non-finite loss
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, P("data"))
shard = lambda *a: tuple(jax.device_put(v, rows) for v in a)

def new_svi(**kw):
    return DPSVI(model, AutoNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(), clipping_threshold=0.5,
                 dp_scale=1.0, **kw)

def max_diff(a, b):
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
"""


def _run(code: str, timeout: int = 900) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", HEADER + textwrap.dedent(code)], env=env, capture_output=True, text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


MISPLACED = """
    from d3pext.training.parallel import check_data, process_slice, shard_records
    two = Mesh(np.array(jax.devices()[:2]), ("data",))
    grid = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    cases = {
        "outside": (two, jax.device_put(x, jax.devices()[3])),
        "part": (mesh, jax.device_put(x, jax.devices()[0])),
        "columns": (mesh, jax.device_put(x, NamedSharding(mesh, P(None, "data")))),
        "other axis": (grid, jax.device_put(x, NamedSharding(grid, P("model")))),
    }
    refused = {}
    for name, (m, xs) in cases.items():
        try:
            new_svi(mesh=m).init(jax.random.key(1), xs, y)
            refused[name] = "accepted"
        except ValueError as e:
            refused[name] = str(e)
    # what may pass: rows over the data axis, replicated, uncommitted, host arrays
    for m, spec in ((mesh, P("data")), (mesh, P()), (grid, P("data")), (grid, P()), (two, P("data"))):
        check_data((jax.device_put(x, NamedSharding(m, spec)), y, np.asarray(x)), m, "data")
    check_data({"x": jax.device_put(x, jax.devices()[0])}, Mesh(np.array(jax.devices()[:1]), ("data",)), "data")
    for name, call in (("indivisible", lambda: process_slice(402, mesh)),
                       ("uneven rows", lambda: shard_records((x[:6], y[:6]), mesh))):
        try:
            call()
            refused[name] = "accepted"
        except ValueError as e:
            refused[name] = str(e)
    xs, ys = shard_records((x[process_slice(N, mesh)], y), mesh)
    refused["sharded"] = [str(xs.sharding.spec), list(xs.shape), bool((np.asarray(xs) == np.asarray(x)).all())]
"""


@pytest.fixture(scope="module")
def four_devices() -> dict:
    """One subprocess for the default checks (JAX start-up and DPSVI.init are the slow part), the
    refusals of misplaced data (MISPLACED, under ``"refused"``) included."""
    return _run(textwrap.dedent("""
        one = new_svi()
        state = one.init(jax.random.key(1), x, y)
        # the same DPSVI with a mesh (init, the slow part, with sharded data runs in the slow test)
        four = copy.copy(one)
        four.mesh, four._steps, four._chunks = mesh, {}, {}
        params = one.optim.get_params(state.optim_state)
        out = {}
        # misplaced data is refused by update and run too, before anything is traced
        for name, call in (("update", lambda a: four.update(state, a, y)),
                           ("run", lambda a: four.run(None, 1, a, y, init_state=state, progress_bar=False))):
            try:
                call(jax.device_put(x, jax.devices()[0]))
                out[f"misplaced {name}"] = "accepted"
            except ValueError as e:
                out[f"misplaced {name}"] = str(e)
        # the state as init returns it with a mesh (replicated over it) has the types of the state the
        # step returns: the second step compiles nothing
        st, _ = four.update(four._on_mesh(state), *shard(x, y))
        with count_compilations() as step_compiles:
            for _ in range(2):
                st, _ = four.update(st, *shard(x, y))
            jax.block_until_ready(st)
        out["compiled again"] = len(step_compiles)
        for clipping in ("materialize", "ghost"):
            one.clipping = four.clipping = clipping
            f1 = jax.jit(lambda p, a: one._private_grad(p, jax.random.key(7), a, {}, True))
            f4 = jax.jit(lambda p, a: four._private_grad(p, jax.random.key(7), a, {}, True))
            for name, data in (("clean", (x, y)), ("bad", (x_bad, y))):
                (l1, g1, d1), (l4, g4, d4) = f1(params, data), f4(params, shard(*data))
                out[f"{clipping} {name}"] = dict(loss=[float(l1), float(l4)], dropped=[int(d1), int(d4)],
                                                 grad_diff=max_diff(g1, g4),
                                                 grad_scale=max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g1)))
        # flops of the per-record part, per device (the compiled SPMD program is one device's)
        for clipping in ("materialize",):  # ghost: benchmarks/bench_data_parallel.py
            for d in (1, 4):
                m = Mesh(np.array(jax.devices()[:d]), ("data",))
                part = jax.jit(lambda p, k, a, recs, mask: data_parallel_clipped_sum(
                    CLIPPED_SUMS[clipping], four._record_loss, p, k, a, {}, recs, mask, 0.5, True, True,
                    mesh=m, axis="data"))
                data = tuple(jax.device_put(v, NamedSharding(m, P("data"))) for v in (x, y))
                compiled = part.lower(params, jax.random.key(3), data, (jnp.arange(64), jnp.arange(64)),
                                      jnp.ones(64, bool)).compile()
                out[f"{clipping} flops {d}"] = compiled.cost_analysis()["flops"]
                out[f"{clipping} comm {d}"] = communication(compiled.as_text())
    """) + textwrap.dedent(MISPLACED) + "out['refused'] = refused\nprint(json.dumps(out))\n")


def test_a_mesh_state_compiles_the_step_once(four_devices):
    assert four_devices["compiled again"] == 0


@pytest.mark.parametrize("clipping", ["materialize", "ghost"])
def test_four_devices_give_the_gradient_of_one(four_devices, clipping):
    for name in ("clean", "bad"):
        got = four_devices[f"{clipping} {name}"]
        np.testing.assert_allclose(*got["loss"], rtol=1e-5)
        assert got["dropped"][0] == got["dropped"][1]
        assert got["grad_diff"] <= 1e-5 * max(1.0, got["grad_scale"]), got
    assert four_devices[f"{clipping} bad"]["dropped"][0] > 0  # the non-finite records were sampled


@pytest.mark.parametrize("clipping", ["materialize"])
def test_each_of_four_devices_does_a_quarter_of_the_per_record_work(four_devices, clipping):
    ratio = four_devices[f"{clipping} flops 4"] / four_devices[f"{clipping} flops 1"]
    # a quarter, plus each device's share of gathering the batch rows from the sharded data
    assert 0.24 < ratio < 0.33, (ratio, four_devices)


def test_only_the_batch_rows_and_the_clipped_sum_cross_devices(four_devices):
    """Data of 400 x 8 floats sharded by rows, a batch of 64: what the devices exchange is the batch's
    rows (64 x 9 values, gathered as an all-reduce) and the clipped sum (26 parameters), not the data."""
    assert four_devices["materialize comm 1"] == {"all-reduce": 4 * 26}  # a psum over one device
    comm = four_devices["materialize comm 4"]
    assert set(comm) <= {"all-reduce", "all-gather"}, comm
    assert 4 * 26 <= comm["all-reduce"] <= 4 * (64 * 9 + 26 + 64 + 8), comm
    assert sum(comm.values()) < 400 * 9 * 4 / 2, comm


def _logistic(x, y):
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with numpyro.plate("data", x.shape[0], subsample_size=10):
        xb, yb = numpyro.subsample(x, event_dim=0), numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=xb + b), obs=yb)


def test_misplaced_data_is_refused_clearly(four_devices):
    """Data the split step cannot take as placed gets a d3pext error naming the argument and the fix,
    at init (and at update/run, which check the same way), before anything is traced."""
    out = four_devices["refused"]
    assert "data argument [0] is on [CpuDevice(id=3)], outside the mesh" in out["outside"], out
    assert "committed to [CpuDevice(id=0)], only part of the mesh's 4 devices" in out["part"], out
    assert "split as P(None, 'data')" in out["columns"], out
    assert "split as P('model',)" in out["other axis"] and "'data'" in out["other axis"], out
    for name in ("outside", "part", "columns", "other axis"):
        assert "jax.device_put(x, NamedSharding(mesh, P('data')))" in out[name], out
    assert "402 records cannot be split by rows over the 4 devices" in out["indivisible"], out
    assert "holds 6 rows of data argument [0] (shape (6, 8)) for its 4 device(s)" in out["uneven rows"], out
    assert out["sharded"] == ["P('data',)", [400, 8], True], out


def test_misplaced_data_is_refused_by_update_and_run(four_devices):
    for name in ("update", "run"):
        assert "committed to [CpuDevice(id=0)], only part of the mesh's 4 devices" in four_devices[f"misplaced {name}"]


def test_mesh_misuse_is_refused_clearly():
    make = lambda **kw: DPSVI(_logistic, AutoNormal(_logistic), numpyro.optim.Adam(0.1), Trace_ELBO(),
                              clipping_threshold=1.0, dp_scale=1.0, **kw)
    mesh = Mesh(np.array(jax.devices()[:1]), ("batch",))
    with pytest.raises(ValueError, match="no axis 'data'.*'batch'"):
        make(mesh=mesh)
    with pytest.raises(ValueError, match="jax.sharding.Mesh"):
        make(mesh=jax.devices())
    with pytest.raises(ValueError, match="no mesh"):
        make(data_axis="batch")
    with pytest.raises(ValueError, match="data_axis"):
        make(mesh=mesh, data_axis=0)
    assert make(mesh=mesh, data_axis="batch").data_axis == "batch"


@pytest.mark.slow
def test_four_devices_give_the_fit_of_one():
    """Whole runs (plate mode with sharded data, d3p-style batch mode with a batch of 30 over 4 devices,
    a two-axis mesh whose second axis replicates) and a VAE under ghost clipping: the same fit."""
    out = _run("""
        out = {}
        fits = []
        for kw, data in (({}, (x, y)), ({"mesh": mesh}, shard(x, y)),
                         ({"mesh": Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))}, (x, y))):
            svi = new_svi(clipping="ghost", **kw)
            r = svi.run(jax.random.key(1), 15, *data, progress_bar=False)
            fits.append(r.params)
        out["plate"] = [max_diff(fits[0], f) for f in fits[1:]]
        # with a mesh, a run of two chunks from the state of the last one compiles nothing
        with count_compilations() as compiles:
            svi.run(jax.random.key(2), 200, x, y, init_state=r.state, progress_bar=False)
        out["compiled again"] = len(compiles)

        def batch_model(x, y):
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
            with numpyro.plate("batch", N, subsample_size=x.shape[0]):
                numpyro.sample("y", dist.Categorical(logits=jnp.tanh(x @ jnp.ones((K, 3))) + b), obs=y)
        fits = []
        for kw in ({}, {"mesh": mesh}):
            svi = DPSVI(batch_model, AutoDiagonalNormal(batch_model), numpyro.optim.Adam(0.05), Trace_ELBO(),
                        clipping_threshold=0.5, dp_scale=1.0, clipping="materialize", **kw)
            state = svi.init(jax.random.key(1), x[:B], y[:B])
            for i in range(5):
                state, _ = svi.update(state, x[i * B:(i + 1) * B], y[i * B:(i + 1) * B])
            fits.append(svi.get_params(state))
        out["batch"] = max_diff(*fits)

        from d3pext.models.vae import simulate_binary_images, vae_guide, vae_model
        xv = simulate_binary_images(jax.random.key(0), 200, dim=12)
        kw = dict(batch_size=21, hidden_dim=6, latent_dim=3)
        grads = []
        for m, data in ((None, xv), (mesh, jax.device_put(xv, rows))):
            svi = DPSVI(vae_model, vae_guide, numpyro.optim.Adam(0.1), Trace_ELBO(num_particles=2),
                        clipping_threshold=2.0, dp_scale=0.5, clipping="ghost", mesh=m)
            params = svi.optim.get_params(svi.init(jax.random.key(1), data, **kw).optim_state)
            grads.append(jax.jit(lambda p, a: svi._private_grad(p, jax.random.key(7), (a,), kw, True))(params, data))
        out["vae"] = [abs(float(grads[0][0] - grads[1][0])) / abs(float(grads[0][0])), max_diff(grads[0][1], grads[1][1])]
        print(json.dumps(out))
    """)
    assert max(out["plate"]) < 1e-4, out
    assert out["compiled again"] == 0, out
    assert out["batch"] < 1e-4, out
    assert out["vae"][0] < 1e-5 and out["vae"][1] < 1e-4, out
