"""Tests for d3pext.training.minibatch: Feistel fixed-size batches and Poisson subsampling.

Statistical tests use fixed seeds and reject at p < 1e-3. Uniformity of B-subsets is
checked three ways: a chi-square over all C(N, B) subsets (small N), and a Mahalanobis
(chi-square) test on the single and pair inclusion frequencies of a set of records,
whose exact mean and covariance under uniform sampling follow from the probability
that j given records are all included: B^(j) / N^(j) (falling factorials) without
replacement, q^j for Poisson sampling.
"""

import itertools
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from d3pext.training import minibatch
from d3pext.accountants import Relation
from d3pext.training.minibatch import (
    FixedSizeSampler,
    PoissonSampler,
    _feistel,
    _feistel_rank_walk,
    _feistel_walk,
    _threefry2x32,
    feistel_indices,
    poisson_batchify_data,
    subsample_batchify_data,
)
from d3pext.prng import chacha_key

ALPHA = 1e-3


def draw(sampler_fn, num_draws: int, seed: int = 0, key_fn=jax.random.key) -> np.ndarray:
    keys = jax.random.split(key_fn(seed), num_draws)
    return jax.tree.map(np.asarray, jax.jit(jax.vmap(sampler_fn))(keys))


def subset_pvalue(indices: np.ndarray, num_records: int) -> float:
    """Chi-square of the frequencies of all C(N, B) unordered subsets."""
    batch_size = indices.shape[1]
    codes = (np.sort(indices, axis=1) * num_records ** np.arange(batch_size)).sum(1)
    cells = [
        sum(c * num_records**i for i, c in enumerate(subset))
        for subset in itertools.combinations(range(num_records), batch_size)
    ]
    counts = np.array([np.sum(codes == c) for c in cells])
    assert counts.sum() == len(indices)
    return stats.chisquare(counts).pvalue


def inclusion_pvalue(included: np.ndarray, joint_prob) -> tuple[float, int]:
    """Mahalanobis test of single and pair inclusion frequencies of K records.

    ``included``: bool[S, K]; ``joint_prob(j)``: P(j given records all included).
    Returns the p-value and the degrees of freedom (rank of the covariance).
    """
    num_draws, k = included.shape
    groups = [(i,) for i in range(k)] + list(itertools.combinations(range(k), 2))
    x = included.astype(float)
    features = np.stack([x[:, g].prod(1) for g in groups], axis=1)
    mean = np.array([joint_prob(len(g)) for g in groups])
    cov = np.array(
        [[joint_prob(len(set(g) | set(h))) - joint_prob(len(g)) * joint_prob(len(h))
          for h in groups] for g in groups]
    )  # fmt: skip
    eigval, eigvec = np.linalg.eigh(cov)
    keep = eigval > 1e-9 * eigval.max()
    z = eigvec[:, keep].T @ (features.mean(0) - mean)
    stat = num_draws * np.sum(z**2 / eigval[keep])
    return stats.chi2.sf(stat, keep.sum()), int(keep.sum())


def without_replacement(num_records: int, batch_size: int):
    return lambda j: math.perm(batch_size, j) / math.perm(num_records, j)


def included_records(indices: np.ndarray, records, mask=None) -> np.ndarray:
    hit = indices[:, :, None] == np.asarray(records)[None, None, :]
    if mask is not None:
        hit &= mask[:, :, None]
    return hit.any(1)


# ---------------------------------------------------------------------------
# Feistel network and cycle walking


@pytest.mark.parametrize("num_bits", [0, 1, 4, 9, 21])
def test_feistel_is_a_bijection(num_bits):
    round_keys = jax.random.bits(jax.random.key(num_bits), (16, 2), jnp.uint32)
    out = _feistel(jnp.arange(2**num_bits, dtype=jnp.uint32), round_keys, num_bits)
    np.testing.assert_array_equal(np.sort(np.asarray(out)), np.arange(2**num_bits))


@pytest.mark.parametrize("num_bits", [0, 1, 9, 21])
def test_feistel_keeps_inputs_past_the_domain_past_it(num_bits):
    # the rank walk's later passes may read inputs of 2**b and more and count only images below N
    round_keys = jax.random.bits(jax.random.key(num_bits), (16, 2), jnp.uint32)
    x = jnp.uint32(2**num_bits) + jnp.arange(4096, dtype=jnp.uint32)
    out = np.asarray(_feistel(x, round_keys, num_bits))
    assert (out >= 2**num_bits).all()
    np.testing.assert_array_equal(out >> num_bits, np.asarray(x) >> num_bits)


def test_threefry_matches_jax():
    from jax.extend.random import threefry2x32_p

    k0, k1, x0, x1 = jax.random.bits(jax.random.key(0), (4, 100), jnp.uint32)
    expected = threefry2x32_p.bind(k0, k1, x0, x1)
    np.testing.assert_array_equal(jax.jit(_threefry2x32)(k0, k1, x0, x1), expected)


@pytest.mark.parametrize(
    "key", [jax.random.key(7), jax.random.PRNGKey(7), chacha_key(7)], ids=["typed", "raw", "chacha"]
)
def test_round_keys_are_jax_random_bits(key):
    # the written-out hash for Threefry keys, jax.random.bits for others: the same round keys either way
    expected = jax.random.bits(key, (16, 2), jnp.uint32)
    np.testing.assert_array_equal(jax.jit(minibatch._round_keys, static_argnums=1)(key, 16), expected)
    if key.dtype != chacha_key(0).dtype:  # Threefry: no hash loop
        lowered = jax.jit(minibatch._round_keys, static_argnums=1).trace(key, 16).lower(lowering_platforms=("cpu",))
        assert "stablehlo.while" not in lowered.as_text()


@pytest.mark.parametrize("num_records", [10, 513])
def test_cycle_walk_is_a_permutation(num_records):
    walk = jax.jit(jax.vmap(lambda k: _feistel_walk(k, num_records, num_records, 16)))
    out = np.asarray(walk(jax.random.split(jax.random.key(num_records), 3)))
    np.testing.assert_array_equal(np.sort(out, axis=1), np.tile(np.arange(num_records), (3, 1)))


@pytest.mark.parametrize("num_records", [300, 513, 1000])
def test_rank_walk_is_a_permutation(num_records):
    walk = jax.jit(jax.vmap(lambda k: _feistel_rank_walk(k, num_records, num_records, 16)))
    out = np.asarray(walk(jax.random.split(jax.random.key(num_records), 3)))
    np.testing.assert_array_equal(np.sort(out, axis=1), np.tile(np.arange(num_records), (3, 1)))


def test_rank_walk_passes_do_not_change_the_result(monkeypatch):
    # the result is a function of the permutation alone: the first B in-range images of
    # 0, 1, 2, ...; forcing many short passes (7 inputs each) must give the same subset
    # and order as the single pass, including a full permutation (B = N)
    keys = jax.random.split(jax.random.key(5), 4)

    def walks():  # traced afresh on each call, so _chunk_size is read again
        return [
            np.asarray(jax.jit(jax.vmap(lambda k: _feistel_rank_walk(k, n, b, 16)))(keys))
            for n, b in ((513, 40), (600, 600))
        ]

    expected = walks()
    monkeypatch.setattr(minibatch, "_chunk_size", lambda *args: 7)
    for e, g in zip(expected, walks()):
        np.testing.assert_array_equal(e, g)


@pytest.mark.parametrize(
    "num_records,batch_size",
    [(1, 1), (2, 2), (3, 2), (10, 3), (17, 5), (1000, 100), (2**20 + 1, 1000)],
)  # fmt: skip
def test_distinct_and_in_range(num_records, batch_size):
    # ChaCha keys: the same code path after the round keys; they are covered below
    # and in the scan test
    key_fns = (jax.random.key, chacha_key) if num_records > 2**20 else (jax.random.key,)
    num_draws = 16 if num_records > 2**20 else 64
    for key_fn, walk in itertools.product(key_fns, ("rank", "cycle")):
        idx = draw(lambda k: feistel_indices(k, num_records, batch_size, walk=walk), num_draws, key_fn=key_fn)
        assert idx.dtype == np.int32 and idx.shape == (num_draws, batch_size)
        assert idx.min() >= 0 and idx.max() < num_records
        assert all(len(set(row)) == batch_size for row in idx.tolist())


def test_uniform_subsets_small_n():
    """N = 10, B = 3, 30 000 draws.

    Subset chi-square (119 df, alpha = 1e-3) has power 0.99 against a chi-square
    divergence of 3.7e-3 from uniform (noncentrality 110), i.e. rms relative deviations
    of 6% over the subsets; the single + pair inclusion test (44 df) against 2.6e-3. A
    d3p-like weak sampler, a 4-round Feistel walk, has divergence about 0.02 (measured
    with 1e6 draws) and must be rejected by the same test.
    """
    n, b, s = 10, 3, 30_000
    idx = draw(lambda k: feistel_indices(k, n, b), s, seed=1)
    assert subset_pvalue(idx, n) > ALPHA
    p, df = inclusion_pvalue(included_records(idx, range(n)), without_replacement(n, b))
    assert df == 44 and p > ALPHA  # 10 singles + 45 pairs, 11 linear constraints
    # random order: every position is uniform over the records
    for pos in range(b):
        assert stats.chisquare(np.bincount(idx[:, pos], minlength=n)).pvalue > ALPHA
    weak = draw(lambda k: _feistel_rank_walk(k, n, b, 4), s, seed=1)
    assert subset_pvalue(weak, n) < 1e-6


def test_uniform_subsets_feistel_odd_bits():
    """N = 300 (a 9-bit Feistel domain, unbalanced 5 + 4 bits), B = 10, 20 000 draws.

    Singles over all 300 records (299 df) have power 0.99 against divergence 8e-3
    (inclusion probabilities off by 2.8% rms over the records); singles + pairs of 12
    records that differ in single bits (78 df) against 4.7e-3. A 2-round network must
    fail.
    """
    n, b, s = 300, 10, 20_000
    records = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 257, 299]
    idx = draw(lambda k: feistel_indices(k, n, b), s, seed=2)
    counts = np.bincount(idx.ravel(), minlength=n)
    p = b / n
    # counts are hypergeometric-multinomial: covariance S p (1-p) N/(N-1) (I - 11'/N)
    stat = np.sum((counts - s * p) ** 2) / (s * p * (1 - p) * n / (n - 1))
    assert stats.chi2.sf(stat, n - 1) > ALPHA
    pv, df = inclusion_pvalue(included_records(idx, records), without_replacement(n, b))
    assert df == 78 and pv > ALPHA
    assert stats.chisquare(np.bincount(idx[:, 0], minlength=n)).pvalue > ALPHA
    weak = draw(lambda k: _feistel_walk(k, n, b, 2), s, seed=2)
    assert inclusion_pvalue(included_records(weak, records), without_replacement(n, b))[0] < 1e-6


def test_uniform_large_odd_domain():
    # N = 2**20 + 1: a 21-bit domain, about half of it outside [0, N) (the worst case
    # for cycle walking). 256 draws of 1000: bins of the value and of its low bits.
    n, b = 2**20 + 1, 1000
    idx = draw(lambda k: feistel_indices(k, n, b), 256, seed=3).ravel()
    assert stats.chisquare(np.bincount(idx * 64 // n, minlength=64)).pvalue > ALPHA
    assert stats.chisquare(np.bincount(idx % 64, minlength=64)).pvalue > ALPHA
    assert stats.chisquare(np.bincount((idx >> 10) % 64, minlength=64)).pvalue > ALPHA


@pytest.mark.slow
def test_uniform_subsets_heavy():
    """1e6 draws at N = 10, B = 3: power 0.99 against divergence 1.1e-4 (rms 1%)."""
    n, b = 10, 3
    idx = np.concatenate(
        [draw(lambda k: feistel_indices(k, n, b), 250_000, seed=10 + i) for i in range(4)]
    )
    assert subset_pvalue(idx, n) > ALPHA
    for n, b, s in [(300, 30, 200_000), (513, 500, 20_000)]:
        records = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, n - 1]
        idx = draw(lambda k: feistel_indices(k, n, b), s, seed=20)
        pv, _ = inclusion_pvalue(included_records(idx, records), without_replacement(n, b))
        assert pv > ALPHA
        assert stats.chisquare(np.bincount(idx[:, 0], minlength=n)).pvalue > ALPHA


# ---------------------------------------------------------------------------
# Samplers


def test_fixed_size_sampler():
    sampler = FixedSizeSampler(num_records=1000, batch_size=32)
    assert sampler.q == 0.032 and sampler.padded_size == 32
    assert sampler.relation is Relation.SUBSTITUTE
    assert sampler.extra_delta(2.0, 10**6) == 0.0
    # up to N = 256 a batch heads a sort on 64-bit keys: a tie (at most C(N, 2) / 2**64) is counted
    assert FixedSizeSampler(256, 32).extra_delta(2.0, 10**6) == pytest.approx((1 + math.exp(2.0)) * 10**6 * 256 * 255 / 2 / 2**64)
    assert FixedSizeSampler(1, 1).extra_delta(2.0, 10) == 0.0
    assert hash(sampler) == hash(FixedSizeSampler(1000, 32))
    idx, mask = jax.jit(sampler)(chacha_key(0))
    assert idx.shape == (32,) and mask.dtype == bool and bool(mask.all())
    assert len(set(np.asarray(idx).tolist())) == 32


def test_poisson_batch_size_and_tail():
    for n, q in [(1, 0.5), (10, 0.3), (1000, 0.01), (60_000, 256 / 60_000), (10**7, 1e-4)]:
        sampler = PoissonSampler(n, q)
        m = sampler.max_batch_size
        dist = stats.binom(n, q)
        assert sampler.tail_probability == dist.sf(m) <= 1e-12
        assert m == 1 or dist.sf(m - 1) > 1e-12
        assert sampler.padded_size == m and sampler.q == q
        # accounted at the bound that every neighbour's default meets, not at a function of the private N
        assert sampler.accounted_tail_probability == (1e-12 if q < 1 else 0.0)
        assert sampler.extra_delta(1.0, 100) == pytest.approx((1 + math.e) * 100 * sampler.accounted_tail_probability)
    full = PoissonSampler(50, 1.0)
    assert full.max_batch_size == 50 and full.tail_probability == full.accounted_tail_probability == 0.0
    sampler = PoissonSampler(1000, 0.05, max_batch_size=60)
    p_tail = stats.binom(1000, 0.05).sf(60)
    assert sampler.tail_probability == p_tail
    assert sampler.relation is Relation.ADD_REMOVE
    # a given B_max: the neighbour with one more record truncates more often (1.5% here, 25% at N = 200,
    # q = 0.1, B_max = 55), and the step's delta holds only with the larger tail
    p_neighbour = stats.binom(1001, 0.05).sf(60)
    assert sampler.accounted_tail_probability == p_neighbour > 1.01 * p_tail
    assert sampler.extra_delta(1.0, 100) == pytest.approx((1 + math.e) * 100 * p_neighbour)
    loose = PoissonSampler(100, 0.1, tail_bound=1e-3)
    assert loose.max_batch_size < PoissonSampler(100, 0.1).max_batch_size


def test_poisson_count_table_is_exact():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    n, q = 1000, mpmath.mpf(5) / 100
    sampler = PoissonSampler(n, 0.05)
    offset, table = sampler._count_offset, sampler._count_table.astype(object)
    thresholds = [(int(h) << 32 | int(lo)) for h, lo in zip(*table)]
    cdf, total = {}, mpmath.mpf(0)
    for k in range(sampler.max_batch_size + 1):
        total += mpmath.binomial(n, k) * q**k * (1 - q) ** (n - k)
        cdf[k] = total
    assert cdf[offset - 1] * 2**64 < 1  # all below the table: always counted
    for j, t in enumerate(thresholds):
        exact = cdf[offset + j]
        assert abs(t / mpmath.mpf(2) ** 64 - exact) <= 1e-12 * min(exact, 1 - exact) + 2**-63


def count_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square of observed counts 0..len(probs)-1 against probs, sparse cells pooled."""
    observed = np.bincount(counts, minlength=len(probs)).astype(float)
    assert len(observed) == len(probs)
    expected = probs * len(counts)
    order = np.argsort(expected)
    pooled_o, pooled_e, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order:  # pool the smallest cells until each pool expects >= 5
        acc_o, acc_e = acc_o + observed[i], acc_e + expected[i]
        if acc_e >= 5:
            pooled_o.append(acc_o), pooled_e.append(acc_e)
            acc_o = acc_e = 0.0
    pooled_o[-1] += acc_o
    pooled_e[-1] += acc_e
    return stats.chisquare(pooled_o, pooled_e).pvalue


def test_poisson_batches():
    """N = 1000, q = 0.05, 20 000 draws: sizes ~ Binomial(N, q), inclusions independent."""
    n, q, s = 1000, 0.05, 20_000
    sampler = PoissonSampler(n, q)
    idx, mask = draw(sampler, s, seed=4)
    sizes = mask.sum(1)
    # masks are prefixes, indices distinct and in range
    assert np.all(mask == (np.arange(sampler.max_batch_size) < sizes[:, None]))
    assert idx.min() >= 0 and idx.max() < n
    assert all(len(set(row)) == len(row) for row in idx[:200].tolist())
    dist = stats.binom(n, q)
    probs = dist.pmf(np.arange(sampler.max_batch_size + 1))
    assert count_pvalue(sizes, probs / probs.sum()) > ALPHA
    # per-record inclusion counts ~ independent Binomial(S, q): chi-square, N df
    counts = np.bincount(idx[mask], minlength=n)
    stat = np.sum((counts - s * q) ** 2) / (s * q * (1 - q))
    assert stats.chi2.sf(stat, n) > ALPHA
    records = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 999]
    p, df = inclusion_pvalue(included_records(idx, records, mask), lambda j: q**j)
    assert df == 78 and p > ALPHA


@pytest.mark.parametrize("oversized", ["truncate", "suppress"])
def test_poisson_truncation(oversized):
    n, q, cap, s = 300, 0.07, 22, 20_000  # P(K > 22) = 0.34
    sampler = PoissonSampler(n, q, max_batch_size=cap, oversized=oversized)
    idx, mask = draw(sampler, s, seed=5)
    dist = stats.binom(n, q)
    probs = dist.pmf(np.arange(cap + 1))
    if oversized == "truncate":
        probs[cap] += dist.sf(cap)
    else:
        probs[0] += dist.sf(cap)
    assert count_pvalue(mask.sum(1), probs) > ALPHA
    # a truncated batch is a uniform random cap-subset, not the highest indices
    full = mask.all(1)
    counts = np.bincount(idx[full].ravel(), minlength=n)
    expected = full.sum() * cap / n
    stat = np.sum((counts - expected) ** 2) / (expected * (1 - cap / n) * n / (n - 1))
    assert stats.chi2.sf(stat, n - 1) > ALPHA


def test_samplers_in_scan_and_fori_loop():
    samplers = [FixedSizeSampler(5000, 50), PoissonSampler(5000, 0.01)]

    @jax.jit
    def run(key):
        _, scanned = jax.lax.scan(
            lambda c, t: (c, [smp(jax.random.fold_in(key, t)) for smp in samplers]),
            0,
            jnp.arange(4),
        )

        def count(t, acc):
            idx, mask = samplers[1](jax.random.fold_in(key, t))
            return acc.at[idx].add(mask)

        totals = jax.lax.fori_loop(0, 4, count, jnp.zeros(5000, jnp.int32))
        return scanned, totals, samplers[1](jax.random.fold_in(key, 2))

    for key in (jax.random.key(6), chacha_key(6)):
        scanned, totals, direct = run(key)
        for idx, mask in scanned:
            rows = np.asarray(idx).tolist()
            assert all(len(set(row)) == len(row) for row in rows)
            assert len({tuple(row) for row in rows}) == 4  # the steps differ
        assert int(totals.sum()) == int(scanned[1][1].sum())
        np.testing.assert_array_equal(direct[0], scanned[1][0][2])
        np.testing.assert_array_equal(direct[1], scanned[1][1][2])


def test_samplers_as_static_arguments():
    @partial(jax.jit, static_argnums=0)
    def batch_sum(sampler, key, data):
        idx, mask = sampler(key)
        return jnp.sum(jnp.where(mask, data[idx], 0.0)), mask.sum()

    data = jnp.ones(100)
    total, size = batch_sum(FixedSizeSampler(100, 7), jax.random.key(0), data)
    assert float(total) == 7.0 and int(size) == 7
    poisson = PoissonSampler(100, 0.2)
    assert poisson == PoissonSampler(100, 0.2) and hash(poisson) == hash(PoissonSampler(100, 0.2))
    assert poisson != PoissonSampler(100, 0.2, oversized="suppress")
    total, size = batch_sum(poisson, jax.random.key(0), data)
    assert float(total) == int(size) > 0


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: FixedSizeSampler(10, 11), ValueError, "batch_size"),
        (lambda: FixedSizeSampler(10, 0), ValueError, "batch_size"),
        (lambda: FixedSizeSampler(0, 1), ValueError, "num_records"),
        (lambda: FixedSizeSampler(10.0, 1), TypeError, "num_records"),
        (lambda: FixedSizeSampler(2**31, 1), ValueError, "num_records"),
        (lambda: PoissonSampler(10, 0.0), ValueError, "sampling_rate"),
        (lambda: PoissonSampler(10, 1.5), ValueError, "sampling_rate"),
        (lambda: PoissonSampler(10, "0.1"), TypeError, "sampling_rate"),
        (lambda: PoissonSampler(0, 0.1), ValueError, "num_records"),
        (lambda: PoissonSampler(10, 0.1, max_batch_size=11), ValueError, "max_batch_size"),
        (lambda: PoissonSampler(10, 0.1, tail_bound=0.0), ValueError, "tail_bound"),
        (lambda: PoissonSampler(10, 0.1, oversized="drop"), ValueError, "oversized"),
        (lambda: PoissonSampler(10, 0.1).extra_delta(-1.0, 5), ValueError, "epsilon"),
        (lambda: PoissonSampler(10, 0.1).extra_delta(1.0, -5), ValueError, "num_steps"),
        (lambda: feistel_indices(jax.random.key(0), 5, 6), ValueError, "batch_size"),
        (lambda: feistel_indices(jax.random.key(0), 500, 6, walk="sort"), ValueError, "walk"),
        (lambda: subsample_batchify_data((np.ones(5),), 2, with_replacement=True),
         ValueError, "replacement"),
        (lambda: subsample_batchify_data((np.ones(5),)), ValueError, "exactly one"),
        (lambda: subsample_batchify_data((np.ones(5), np.ones(4)), 2), ValueError, "length"),
        (lambda: subsample_batchify_data((), 2), ValueError, "non-empty"),
        (lambda: poisson_batchify_data((np.ones(5),), 0.1, max_batch_size=1.5),
         ValueError, "quantile"),
    ],
)  # fmt: skip
def test_validation(make, error, match):
    with pytest.raises(error, match=match):
        make()


# ---------------------------------------------------------------------------
# d3p-compatible batchifiers


def test_subsample_batchify_data():
    x, y = np.arange(100.0), np.arange(200.0).reshape(100, 2)
    init, get_batch = subsample_batchify_data((x, y), q=0.1, return_mask=True)
    num_batches, state = init(jax.random.key(0))
    assert num_batches == 10 and get_batch.sampler == FixedSizeSampler(100, 10)
    (bx, by), mask = get_batch(3, state)
    assert bx.shape == (10,) and by.shape == (10, 2) and bool(mask.all())
    np.testing.assert_array_equal(by[:, 0], 2 * bx)
    assert len(set(np.asarray(bx).tolist())) == 10
    init, get_batch = subsample_batchify_data((x,), batch_size=7)
    assert init(jax.random.key(0))[0] == 14
    (b0,), (b1,) = get_batch(0, state), get_batch(1, state)
    assert b0.shape == (7,) and not np.array_equal(b0, b1)


def test_poisson_batchify_data():
    x = np.arange(1, 1001, dtype=np.float32)
    init, get_batch = poisson_batchify_data((x,), q=0.02, max_batch_size=30)
    num_batches, state = init(chacha_key(0))
    assert num_batches == 50 and get_batch.sampler.max_batch_size == 30
    for i in range(3):
        (batch,), mask = get_batch(i, state)
        assert batch.shape == mask.shape == (30,)
        np.testing.assert_array_equal(batch == 0, ~mask)  # padding zeroed, data >= 1
    _, get_batch = poisson_batchify_data((x,), q=0.02, max_batch_size=0.99)
    sampler = get_batch.sampler
    assert sampler.max_batch_size == int(stats.binom(1000, 0.02).ppf(0.99))
    assert sampler.tail_probability == stats.binom(1000, 0.02).sf(sampler.max_batch_size)
    _, get_batch = poisson_batchify_data((x,), q=0.02, handle_oversized_batch="suppress")
    assert get_batch.sampler.oversized == "suppress"
    assert get_batch.sampler.tail_probability <= 1e-12
