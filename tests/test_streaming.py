"""DP-VI over memory-mapped data (d3pext.training.streaming): the batches are the in-memory
batchifiers' batches, the fit is DPSVI.update's, the prefetch thread's errors surface, and
files that do not match the sampler are refused."""

import os
import threading

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
from d3pext.training.minibatch import (
    FixedSizeSampler,
    PoissonSampler,
    poisson_batchify_data,
    subsample_batchify_data,
)
from d3pext.training import streaming
from d3pext.training.streaming import MemmapBatches, fit_streaming, prefetch

N = 200  # <= 256: the samplers draw by a sort, quick to compile (the Feistel walk: the slow test)


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    y = rng.integers(0, 2, N).astype(np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    return tmp_path / "x.npy", tmp_path / "y.npy", x, y


def assert_same_batches(streamed, in_memory, num_steps):
    for i in range(num_steps):
        *arrays, mask = streamed[i]
        expected, expected_mask = in_memory(i)
        np.testing.assert_array_equal(mask, np.asarray(expected_mask))
        assert len(arrays) == len(expected)
        for a, b in zip(arrays, expected):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize(
    "q, max_batch_size, oversized",
    [(0.1, None, "truncate"), (0.5, 95, "truncate"), (0.5, 95, "suppress")],
)
def test_batches_are_poisson_batchify_datas_batches(files, q, max_batch_size, oversized):
    check_batches(files, q, max_batch_size, oversized)


@pytest.mark.slow
def test_feistel_batches_are_poisson_batchify_datas_batches(tmp_path):
    """The same above 256 records, where the sampler walks a Feistel permutation."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3000, 3)).astype(np.float32), rng.integers(0, 2, 3000).astype(np.int32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    check_batches((tmp_path / "x.npy", tmp_path / "y.npy", x, y), 0.05, 140, "truncate")


def check_batches(files, q, max_batch_size, oversized):
    px, py, x, y = files
    init, get_batch = poisson_batchify_data((x, y), q, max_batch_size, oversized)
    key = jax.random.key(7)
    _, state = init(key)
    batches = MemmapBatches((px, py), get_batch.sampler, rng_key=key)
    assert batches.padded_size == get_batch.sampler.max_batch_size
    assert_same_batches(batches, lambda i: get_batch(i, state), 40)
    # iteration gives the same batches as indexing
    for i, (xb, yb, mask) in zip(range(40), batches):
        np.testing.assert_array_equal(mask, batches[i][-1])
        np.testing.assert_array_equal(xb, batches[i][0])
    masks = np.stack([batches[i][-1] for i in range(40)])
    sizes = masks.sum(axis=1)
    if max_batch_size == 140:  # the slow twin: K ~ Binomial(3000, 0.05) exceeds 140 at times
        assert (sizes == 140).any() and (sizes < 140).any()
    elif oversized == "suppress":  # K ~ Binomial(200, 0.5) exceeds 95 most of the time: empty batches
        assert (sizes == 0).sum() > 10
    elif max_batch_size is not None:  # ... or cut to 95
        assert (sizes == 95).sum() > 10 and (sizes < 95).any()
    else:
        assert len(set(masks.sum(axis=1).tolist())) > 3  # the batch size varies


def test_fixed_size_batches_are_subsample_batchify_datas(files):
    px, py, x, y = files
    init, get_batch = subsample_batchify_data((x, y), batch_size=25, return_mask=True)
    _, state = init(jax.random.key(3))
    batches = MemmapBatches([np.load(px, mmap_mode="r"), np.memmap(py, np.int32, "r", 128, (N,))],
                            get_batch.sampler, rng_key=jax.random.key(3))
    assert_same_batches(batches, lambda i: get_batch(i, state), 10)


class RecordingArray(np.ndarray):
    reads: list = []

    def __getitem__(self, index):
        RecordingArray.reads.append(np.array(index, copy=True))
        return super().__getitem__(index)


def test_rows_are_read_in_file_order_and_only_those_in_the_mask(files):
    _, _, x, _ = files
    array = x.view(RecordingArray)
    RecordingArray.reads = []
    sampler = PoissonSampler(N, 0.1)
    batches = MemmapBatches(array, sampler, rng_key=jax.random.key(0))
    idx, mask = batches.indices(0)
    xb, _ = batches[0]
    (read,) = [r for r in RecordingArray.reads if r.ndim == 1 and r.dtype.kind == "i"]
    assert (np.diff(read) > 0).all()
    np.testing.assert_array_equal(np.sort(idx[mask]), read)
    np.testing.assert_array_equal(xb[mask], x[idx[mask]])
    assert 0 < mask.sum() < len(mask) and not np.array_equal(np.sort(idx[mask]), idx[mask])


def model(xb, num_obs_total=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("data", num_obs_total, subsample_size=xb.shape[0]):
        numpyro.sample("x", dist.Normal(mu, 1.0), obs=xb)


def make_svi(sampler, **kw):
    return DPSVI(model, AutoDiagonalNormal(model), optax.adam(0.05), Trace_ELBO(), clipping_threshold=2.0,
                 dp_scale=1.0, num_obs_total=sampler.num_records, sampler=sampler, **{"delta": 1e-5, **kw})


SAMPLER = PoissonSampler(N, 0.1)


@pytest.fixture(scope="module")
def svi():
    return make_svi(SAMPLER)  # one DPSVI, compiled once for the tests below


def test_fit_streaming_is_dpsvi_update_on_the_same_batches(tmp_path, svi):
    data = (np.random.default_rng(1).normal(size=N) + 1.0).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    init, get_batch = poisson_batchify_data((data,), 0.1)
    batch_key, svi_key = jax.random.split(jax.random.key(5))
    _, batch_state = init(batch_key)
    sampler = get_batch.sampler
    assert sampler == SAMPLER

    batches = MemmapBatches(tmp_path / "d.npy", sampler, rng_key=batch_key)
    first = fit_streaming(svi, batches, 10, svi_key)
    # resumes with batches 10..14; without the prefetch thread: the same steps
    result = fit_streaming(svi, batches, 5, init_state=first.state, prefetch_depth=0)
    losses = np.concatenate([first.losses, result.losses])

    reference = svi  # init again with the same key: the same DPSVI, stepped by hand
    (xb,), mask = get_batch(0, batch_state)
    state = reference.init(svi_key, xb, mask=mask)
    expected_losses = []
    for i in range(15):
        (xb,), mask = get_batch(i, batch_state)
        state, loss = reference.update(state, xb, mask=mask)
        expected_losses.append(loss)
    np.testing.assert_array_equal(losses, np.stack(expected_losses))
    for a, b in zip(jax.tree.leaves(result.state.optim_state), jax.tree.leaves(state.optim_state)):
        np.testing.assert_array_equal(a, b)
    assert int(result.state.num_steps) == 15
    assert result.privacy == reference.privacy_spent(15)
    assert result.privacy.relation == "add_remove" and result.privacy.sampling_rate == pytest.approx(0.1)


@pytest.mark.slow
def test_fit_streaming_with_fixed_size_batches_is_dpsvi_update(tmp_path):
    """Fixed-size batches carry no mask: DPSVI gets none, and accounts substitute neighbours."""
    data = (np.random.default_rng(2).normal(size=N) + 1.0).astype(np.float32)
    np.save(tmp_path / "d.npy", data)
    init, get_batch = subsample_batchify_data((data,), batch_size=20)
    batch_key, svi_key = jax.random.split(jax.random.key(6))
    _, batch_state = init(batch_key)
    svi = make_svi(get_batch.sampler)
    result = fit_streaming(svi, MemmapBatches(tmp_path / "d.npy", get_batch.sampler, rng_key=batch_key), 6, svi_key)
    state = svi.init(svi_key, *get_batch(0, batch_state))
    for i in range(6):
        state, _ = svi.update(state, *get_batch(i, batch_state))
    for a, b in zip(jax.tree.leaves(result.state.optim_state), jax.tree.leaves(state.optim_state)):
        np.testing.assert_array_equal(a, b)
    assert result.privacy.relation == "substitute" and result.privacy.sampling_rate == pytest.approx(0.1)


def test_fit_streaming_refuses_a_mismatched_setup(tmp_path):
    np.save(tmp_path / "d.npy", np.ones(N, np.float32))
    sampler = PoissonSampler(N, 0.1)
    batches = MemmapBatches(tmp_path / "d.npy", sampler, rng_key=jax.random.key(0))
    with pytest.raises(ValueError, match="different keys"):
        fit_streaming(make_svi(sampler), batches, 2, batches.rng_key)
    # DPSVI told about fixed-size batches of padded_size records, not about the Poisson sampler
    fixed = FixedSizeSampler(N, sampler.padded_size)
    with pytest.raises(ValueError, match="sampler=batches.sampler"):
        fit_streaming(make_svi(fixed), batches, 2, jax.random.key(1))
    planned = DPSVI(model, AutoDiagonalNormal(model), optax.adam(0.05), clipping_threshold=2.0, epsilon=1.0,
                    num_steps=3, num_obs_total=N, sampler=sampler, delta=1e-5)
    with pytest.raises(ValueError, match="planned num_steps=3"):
        fit_streaming(planned, batches, 4, jax.random.key(1))


def test_file_that_does_not_match_the_sampler_is_refused(files, tmp_path):
    px, py, x, _ = files
    with pytest.raises(ValueError, match="has 200 rows, but the sampler draws from num_records=201"):
        MemmapBatches(px, PoissonSampler(N + 1, 0.1))
    with pytest.raises(ValueError, match="holds float32 records, but float64 was expected"):
        MemmapBatches(px, PoissonSampler(N, 0.1), dtype=np.float64)
    with pytest.raises(ValueError, match="holds int32 records, but float32"):
        MemmapBatches((px, py), PoissonSampler(N, 0.1), dtype=np.float32)
    MemmapBatches((px, py), PoissonSampler(N, 0.1), dtype=(np.float32, np.int32))
    np.savez(tmp_path / "a.npz", x=x)
    with pytest.raises(ValueError, match="archive"):
        MemmapBatches(tmp_path / "a.npz", PoissonSampler(N, 0.1))
    with pytest.raises(ValueError, match="cannot memory-map"):
        MemmapBatches(tmp_path / "missing.npy", PoissonSampler(N, 0.1))
    with pytest.raises(TypeError, match="PoissonSampler or a FixedSizeSampler"):
        MemmapBatches(px, "poisson")
    with pytest.raises(TypeError, match="PRNG key"):
        MemmapBatches(px, PoissonSampler(N, 0.1), rng_key=0)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "d3pext-prefetch"]


def test_prefetch_raises_the_producers_error_and_stops_its_thread():
    def items():
        yield from range(3)
        raise OSError("disk gone")

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for item in prefetch(items(), depth=2):
            seen.append(item)
    assert seen == [0, 1, 2] and not prefetch_threads()
    endless = prefetch(iter(int, 1), depth=1)  # an endless iterator, abandoned after one item
    assert next(endless) == 0
    endless.close()
    assert not prefetch_threads()
    with pytest.raises(ValueError, match="depth"):
        next(prefetch(range(3), depth=0))


def test_fit_streaming_raises_a_read_error_from_the_prefetch_thread(tmp_path, monkeypatch, svi):
    np.save(tmp_path / "d.npy", np.ones(N, np.float32))
    batches = MemmapBatches(tmp_path / "d.npy", SAMPLER, rng_key=jax.random.key(0))
    gather, calls = batches.gather, []

    def failing(indices, mask):
        calls.append(threading.current_thread().name)
        if len(calls) == 4:
            raise OSError("read failed")
        return gather(indices, mask)

    monkeypatch.setattr(batches, "gather", failing)
    with pytest.raises(OSError, match="read failed"):
        fit_streaming(svi, batches, 10, jax.random.key(1))
    assert "d3pext-prefetch" in calls and not prefetch_threads()


def mapped_kib(path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[:1].isalnum() and "-" in line.split()[0] and ":" not in line.split()[0]:
                inside = line.rstrip().endswith(os.fspath(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.parametrize("run_bytes", [16 << 20, 1 << 16])  # one run; 64 runs, each released
def test_pages_read_from_the_file_are_released(tmp_path, monkeypatch, run_bytes):
    monkeypatch.setattr(streaming, "_RUN_BYTES", run_bytes)
    path = tmp_path / "big.npy"
    data = np.arange(2**20, dtype=np.float32).reshape(2**14, 64)  # 4 MiB
    np.save(path, data)
    sampler = FixedSizeSampler(2**14, 2**14)  # every row, every page
    released = MemmapBatches(path, sampler, rng_key=jax.random.key(0))
    xb, _ = released[0]
    idx, _ = released.indices(0)
    np.testing.assert_array_equal(xb, data[idx])
    assert mapped_kib(path) < 256
    # the control: a copy-on-write map is not released, and the count above does see its pages
    kept = MemmapBatches(np.load(path, mmap_mode="c"), sampler, rng_key=jax.random.key(0))
    np.testing.assert_array_equal(kept[0][0], xb)
    assert mapped_kib(path) > 3000
