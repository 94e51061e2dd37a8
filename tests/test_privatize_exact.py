"""The curator's exact sums (``exact_sum``): vectorized, and bit for bit ``math.fsum``."""

import importlib
import math

import numpy as np
import pytest

from jax import random

import numpyro
import numpyro.distributions as dist

from d3pext.handlers import make_release, privatize
from d3pext.releases.mechanisms import LaplaceMechanism

P = importlib.import_module("d3pext.releases.sums")
TINY = 2.0**-1074
MAX = float(np.finfo(np.float64).max)
F32 = np.finfo(np.float32)


def _bits(a) -> list[int]:
    return np.asarray(a, np.float64).reshape(-1).view(np.uint64).tolist()


def _fsum_columns(t: np.ndarray, batch_ndim: int) -> np.ndarray:
    stat_shape = t.shape[batch_ndim:]
    rows = t.reshape(int(np.prod(t.shape[:batch_ndim])), int(np.prod(stat_shape))).astype(np.float64)
    return np.array([math.fsum(rows[:, j].tolist()) for j in range(rows.shape[1])]).reshape(stat_shape)


def _assert_fsum(t: np.ndarray, batch_ndim: int = 1) -> None:
    got, want = P.exact_sum(t, batch_ndim), _fsum_columns(t, batch_ndim)
    assert got.dtype == np.float64 and got.shape == want.shape
    assert _bits(got) == _bits(want), (got, want)


ADVERSARIAL = {
    "cancellation": [1e16, 1.0, -1e16],
    "cancellation to a tie": [2.0**53, 1.0, 2.0**-60, -(2.0**-60)],
    "round half even": [1.0, 2.0**-53, 2.0**-106],
    "exact zero": [1e300, -1e300, 1e-300, -1e-300],
    "full float64 range": [MAX / 4, -MAX / 8, 1.0, 2.0**-1022, TINY, -3.5e-310, 1e-200, 7e150, -7e150],
    "subnormals": [TINY, TINY, -2 * TINY, 3 * TINY, 2.0**-1022 - TINY, 2.0**-1023],
    "subnormal result": [2.0**-1022, -(2.0**-1022 - TINY), TINY],
    "negative zeros": [-0.0, -0.0, -0.0],
    "negative zero and cancellation": [-0.0, 1.5, -1.5],
    "integer valued": [1.0, 0.0, 1.0, 1.0, 0.0, 2.0**52, 3.0, -(2.0**52)],
    "float32 range": [float(F32.max), float(F32.tiny), float(F32.smallest_subnormal), -float(F32.max), 0.1],
    "many records of one unit": [0.1] * 1000 + [-0.3] * 333,
    "empty": [],
}


@pytest.mark.parametrize("values", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_sums_are_fsum_bit_for_bit(values):
    _assert_fsum(np.array(values, np.float64))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("batch_ndim", [1, 2])
def test_float_dtypes_and_multi_coordinate_statistics(dtype, batch_ndim):
    rng = np.random.default_rng(3)
    fin = np.finfo(dtype)
    exponents = rng.integers(fin.minexp - fin.nmant, min(fin.maxexp - 4, 900), size=(6, 50, 3, 2))
    t = (rng.normal(size=exponents.shape) * 2.0**exponents).astype(dtype)  # subnormals of dtype too
    t[0, :7] = -0.0
    t[1] = np.round(t[1].astype(np.float64) * 0)  # a coordinate block of zeros
    assert np.isfinite(t).all()
    _assert_fsum(t, batch_ndim)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int32, np.int64, np.uint16])
def test_integer_statistics_stay_exact_integers(dtype):
    t = np.random.default_rng(4).integers(0, 2 if dtype == np.bool_ else 100, size=(40, 5, 3)).astype(dtype)
    for batch_ndim in (1, 2):
        got = P.exact_sum(t, batch_ndim)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, t.astype(np.int64).sum(axis=tuple(range(batch_ndim))))


def test_empty_input_sums_to_zero():
    assert _bits(P.exact_sum(np.zeros((0, 4)), 1)) == [0] * 4
    assert _bits(P.exact_sum(np.zeros((0,), np.float32), 1)) == [0]


@pytest.mark.parametrize("block", [1, 7, 1 << 20])
def test_random_records_match_fsum_across_blocks(monkeypatch, block):
    """Seeded property check: wide exponents, signs, cancelling pairs and exact duplicates, summed in
    blocks of 1, 7 and 2**20 records (block boundaries anywhere)."""
    monkeypatch.setattr(P, "_EXACT_BLOCK", block)
    rng = np.random.default_rng(5)
    for trial in range(60):
        n, k = int(rng.integers(1, 120)), int(rng.integers(1, 4))
        low = int(rng.choice([-1074, -300, -60, -20]))
        x = rng.normal(size=(n, k)) * 2.0 ** rng.integers(low, int(rng.choice([20, 300, 900])), (n, k))
        if trial % 3 == 0:  # cancelling pairs
            x[n // 2 :] = -x[: n - n // 2][::-1]
        elif trial % 3 == 1:  # random bit patterns of finite doubles
            bits = rng.integers(0, 2**63, (n, k), dtype=np.uint64).view(np.float64)
            x = np.where(np.abs(bits) < 2.0**900, bits, x)
        rng.shuffle(x)
        _assert_fsum(x)
        _assert_fsum(x[:, :1].reshape(n))


def test_non_finite_and_overflowing_records_keep_fsum_results_and_errors():
    """A column with a non-finite record, or one huge enough to overflow a sum, goes through fsum
    itself: same inf/nan, same errors; the other columns keep the fast exact path."""
    got = P.exact_sum(np.array([[1.0, np.inf, 0.1], [2.0, 3.0, np.nan], [1e16, -1.0, 0.2]]), 1)
    assert got[0] == math.fsum([1.0, 2.0, 1e16]) and got[1] == np.inf and np.isnan(got[2])
    with pytest.raises(ValueError, match=r"-inf \+ inf"):
        P.exact_sum(np.array([np.inf, -np.inf]), 1)
    with pytest.raises(OverflowError, match="intermediate overflow"):
        P.exact_sum(np.array([MAX, MAX, -MAX]), 1)
    assert P.exact_sum(np.array([MAX / 2**30] * 8), 1) == MAX / 2**27  # below the limit


def _count_fsum_inputs(monkeypatch) -> list[int]:
    fed, fsum = [], math.fsum

    def counting(values):
        values = list(values)
        fed.append(len(values))
        return fsum(values)

    monkeypatch.setattr(math, "fsum", counting)
    return fed


def test_exact_sum_is_vectorized(monkeypatch):
    """The records are summed in NumPy: fsum sees a few exact partial sums per coordinate, not the
    200,000 records of each (0.3 us per record per coordinate: 3 s for a mean of 1e7 records)."""
    rng = np.random.default_rng(6)
    t = rng.normal(1980.0, 20.0, size=(200_000, 3))
    want = _fsum_columns(t, 1)
    fed = _count_fsum_inputs(monkeypatch)
    got = P.exact_sum(t, 1)
    assert _bits(got) == _bits(want)
    assert len(fed) == 3 and max(fed) <= 8, fed


def _model(family: str):
    def model(n, x=None):
        if family == "categorical":
            p = numpyro.sample("p", dist.Dirichlet(np.ones(4)))
            record = dist.Categorical(p)
        else:
            record = dist.Normal(numpyro.sample("mu", dist.Normal(0.0, 1.0)), 1.0)
        with numpyro.plate("records", n):
            numpyro.sample("x", record, obs=x)

    return model


@pytest.mark.parametrize("statistic", ["sample_mean", "sample_variance", "sufficient"])
def test_make_release_statistic_is_fsum_of_many_records(monkeypatch, statistic):
    """Through make_release: the released statistic of 300,000 records is what fsum gives, and fsum
    never sees the records one by one."""
    rng = np.random.default_rng(7)
    n, (a, b) = 300_000, (1900.0, 2030.0)
    if statistic == "sufficient":  # one-hot records of a categorical: a float statistic of shape (4,)
        x = rng.integers(0, 4, n)
        want = np.array([math.fsum((x == c).astype(np.float64).tolist()) for c in range(4)])
        private = privatize(_model("categorical"), site="x", mechanism=LaplaceMechanism(1.0))
    else:
        x = rng.normal(1980.0, 30.0, n)
        clipped = np.clip(x, a, b).tolist()
        mean = math.fsum(clipped) / n
        want = mean if statistic == "sample_mean" else math.fsum([(v - mean) ** 2 for v in clipped]) / (n - 1)
        private = privatize(_model("normal"), site="x", mechanism=LaplaceMechanism(1.0), statistic=statistic,
                            bounds=(a, b))
    seen = []

    def capture(self, rng_key, value, **kwargs):
        seen.append(np.asarray(value))
        return np.asarray(value)  # the statistic is what is checked (its float32 release would be rounded)

    monkeypatch.setattr(LaplaceMechanism, "release", capture)
    fed = _count_fsum_inputs(monkeypatch)
    make_release(private, n, x, rng_key=random.key(0), reproducible=True)
    assert len(seen) == 1 and _bits(seen[0]) == _bits(want)
    assert max(fed, default=0) < 100, fed  # (integer one-hot sums need no fsum at all)


def test_integer_valued_float_sums_are_exact_and_cheap_with_many_coordinates():
    """One-hot statistics of many categories (8 records x 2**20 coordinates): exact integer sums in
    float64, without fsum or the per-block splitting (which had kept partial sums of the size of the
    input per block: 177 MiB for a 32 MiB statistic)."""
    import tracemalloc

    rng = np.random.default_rng(3)
    x = (rng.random((8, 2**20)) < 0.3).astype(np.float32)
    tracemalloc.start()
    try:
        got = P.exact_sum(x, 1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, x.astype(np.int64).sum(0))
    assert peak < 2.5 * x.nbytes
    # near 2**53 the shortcut would round: the split takes over, still fsum bit for bit
    _assert_fsum(np.array([[2.0**52], [2.0**52 - 1], [3.0], [-1.0]]))
