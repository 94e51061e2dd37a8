"""Minibatch samplers for DP-VI: Feistel fixed-size batches and Poisson subsampling.

The samplers run on device inside ``jit``, ``vmap``, ``lax.scan`` and
``lax.fori_loop`` in ``O(batch size)`` work, and declare the neighbouring relation
that their privacy amplification needs (:class:`~d3pext.accountants.Relation`):

* :class:`FixedSizeSampler`: a uniform random subset of exactly ``B`` records,
  drawn without replacement (``Relation.SUBSTITUTE``).
* :class:`PoissonSampler`: every record joins independently with probability
  ``q`` (``Relation.ADD_REMOVE``), padded to a static maximum size with a mask.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from d3pext._backend import by_backend
from d3pext._threefry_cpu import random_bits_unrolled
from d3pext._threefry_cpu import threefry2x32_unrolled as _threefry2x32
from d3pext.accountants import Relation

__all__ = [
    "FixedSizeSampler",
    "PoissonSampler",
    "feistel_indices",
    "poisson_batchify_data",
    "split_batchify_data",
    "subsample_batchify_data",
]

_MAX_RECORDS = 2**31 - 1  # int32 indices


def _binomial(n: int, p: float):
    """``scipy.stats.binom(n, p)``; scipy.stats is imported here, on first use (it takes about a
    second to import, which every DPSVI program would otherwise pay)."""
    from scipy import stats

    return stats.binom(n, p)


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = operator.index(value)
    if not low <= value <= high:
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return value


# Up to N = 256 a batch is the head of a random sort (exact); above, the Feistel walk.
_SORT_MAX_RECORDS = 256
# Feistel rounds on domains of 2**9 and more. On 2**9 (the smallest used) no bias is
# detectable from 6 rounds on (exact pattern test, 1e5 draws); 16 leaves a margin of
# 10 rounds. Tiny domains need far more: on 2**3 values the total-variation distance
# from uniform still is 0.18 after 12 rounds and shrinks only by 0.69 per two rounds
# (exact computation over all 8! permutations), hence the sort below 2**9.
_FEISTEL_ROUNDS = 16


def _round_keys(rng_key: jax.Array, num_rounds: int) -> jax.Array:
    """``jax.random.bits(rng_key, (num_rounds, 2), jnp.uint32)``, the Feistel network's round keys:
    for a Threefry key from the hash written out (one fused kernel instead of the hash loop)."""
    return random_bits_unrolled(rng_key, (num_rounds, 2))


def _feistel(x: jax.Array, round_keys: jax.Array, num_bits: int, unroll: bool = False) -> jax.Array:
    """A keyed bijection of ``[0, 2**num_bits)``: alternating (unbalanced) Feistel rounds.

    The value splits into a high part ``L`` of ``ceil(b/2)`` bits and a low part ``R``
    of ``floor(b/2)`` bits; rounds alternate ``L ^= F_i(R)`` and ``R ^= F_i(L)``, each
    an involution, so any ``b`` (odd included) is a power-of-two domain of exactly
    ``2**b`` values. ``F_i`` is Threefry-2x32 keyed by round key ``i``, on the input
    word and the round index. Bits of ``x`` above the ``b`` low ones pass through unchanged, so an
    input of ``2**b`` or more maps to one of ``2**b`` or more.
    """
    low_bits = np.uint32(num_bits // 2)
    high_mask = np.uint32((1 << (num_bits - num_bits // 2)) - 1)
    low_mask = np.uint32((1 << (num_bits // 2)) - 1)

    def one_round(i: jax.Array, x: jax.Array) -> jax.Array:
        # The two halves stay packed in one word and a round XORs F into one of them: the loop
        # carries one array, and the (unrolled) hash has a single consumer, so XLA compiles one copy
        # of it (with the halves carried apart, each half's update fused its own copy).
        even = i % 2 == 0
        half = jnp.where(even, x & low_mask, lax.shift_right_logical(x, low_bits))
        f = _threefry2x32(round_keys[i, 0], round_keys[i, 1], half, i.astype(jnp.uint32))[0]
        return x ^ jnp.where(even, lax.shift_left(f & high_mask, low_bits), f & low_mask)

    return lax.fori_loop(0, round_keys.shape[0], one_round, x, unroll=unroll)


def _feistel_walk(
    rng_key: jax.Array, num_records: int, batch_size: int, num_rounds: int
) -> jax.Array:
    """Feistel permutation of ``[0, 2**b)`` at ``0..B-1``, cycle-walked into ``[0, N)``."""
    num_bits = (num_records - 1).bit_length()
    round_keys = _round_keys(rng_key, num_rounds)
    n = np.uint32(num_records)
    permute = partial(_feistel, round_keys=round_keys, num_bits=num_bits)
    # Cycle walking (seed 003, eq. 8, with f applied at least once): follow x, f(x),
    # f(f(x)), ... until it falls in [0, N). The walk restricted to [0, N) is again
    # a bijection, so distinct starts 0..B-1 give distinct indices.
    x = permute(lax.iota(jnp.uint32, batch_size))
    x = lax.while_loop(
        lambda x: jnp.any(x >= n), lambda x: jnp.where(x >= n, permute(x), x), x
    )
    return x.astype(jnp.int32)


def _chunk_size(num_records: int, batch_size: int, num_bits: int) -> int:
    """Static number of Feistel inputs per pass of :func:`_feistel_rank_walk`.

    Among ``M`` distinct inputs the number whose image lands in ``[0, N)`` is
    hypergeometric with mean ``M p``, ``p = N / 2**b``, and variance below
    ``M p (1 - p)``; ``M`` is the smallest with ``M p - 4 sd >= B``, so a second pass
    is needed with probability below about ``3e-5``.
    """
    domain = 1 << num_bits
    p = num_records / domain
    z = 4.0
    # M p - z sqrt(M p (1 - p)) >= B: a quadratic in sqrt(M)
    root = (z * math.sqrt(p * (1 - p)) + math.sqrt(z * z * p * (1 - p) + 4 * p * batch_size)) / (2 * p)
    return int(min(domain, math.ceil(root * root)))


def _feistel_rank_walk(
    rng_key: jax.Array, num_records: int, batch_size: int, num_rounds: int
) -> jax.Array:
    """The first ``B`` values of ``pi(0), pi(1), ...`` that fall in ``[0, N)``.

    ``pi`` is the Feistel permutation of ``[0, 2**b)``. The in-range values of the
    sequence, in order, are a bijection of ``[0, N)`` (the permutation induced on the
    subset, like the cycle walk's), so for a uniform ``pi`` the result is a uniform
    random ``B``-subset in uniformly random order. Unlike the cycle walk, which
    re-applies the network to all ``B`` lanes until the slowest lands (about
    ``log2(B) + 1.3`` passes), it evaluates ``pi`` on about ``B / p`` inputs in one
    pass (see :func:`_chunk_size`), 2.5-3x less work.
    """
    num_bits = (num_records - 1).bit_length()
    chunk = _chunk_size(num_records, batch_size, num_bits)
    round_keys = _round_keys(rng_key, num_rounds)
    n = np.uint32(num_records)

    def one_pass(state, unroll=False):
        out, count, start = state
        i = start + lax.iota(jnp.uint32, chunk)
        y = _feistel(i, round_keys, num_bits, unroll)
        hit = y < n  # an input past the domain keeps its bits above b, so its image is too (no hit)
        hits_so_far = jnp.cumsum(hit, dtype=jnp.int32)
        slot = jnp.where(hit, count + hits_so_far - 1, batch_size)  # misses and overflow are dropped
        # y < N < 2**31: its int32 bits are its value; the pass's hit count is the running count's last
        # entry (a separate sum compiled a reduction of its own)
        out = out.at[slot].set(lax.bitcast_convert_type(y, jnp.int32), mode="drop")
        return out, jnp.minimum(count + hits_so_far[-1], batch_size), start + chunk

    def walk(out, count, start, first_pass_outside: bool):
        state = (out, count, start)
        if first_pass_outside:  # the pass almost always needed, without waiting for the host
            state = one_pass(state, unroll=True)
        return lax.while_loop(lambda s: s[1] < batch_size, one_pass, state)[0]

    # On a GPU each check of a data-dependent loop waits for the host and each round of a rolled
    # loop is a kernel launch: there the first pass runs before the loop, its rounds unrolled (the
    # same bits; on a CPU the rolled form compiles in a fraction of the time)
    state = (jnp.zeros(batch_size, jnp.int32), jnp.int32(0), jnp.uint32(0))
    return by_backend(partial(walk, first_pass_outside=False), partial(walk, first_pass_outside=True), *state)


def _sorted_head(rng_key: jax.Array, num_records: int, batch_size: int) -> jax.Array:
    # Sorting 64-bit random keys orders [0, N) uniformly unless two keys tie, which
    # happens with probability at most C(N, 2) / 2**64 < 2e-15 for N <= 256.
    hi, lo = jax.random.bits(rng_key, (2, num_records), jnp.uint32)
    *_, order = lax.sort((hi, lo, lax.iota(jnp.int32, num_records)), num_keys=2)
    return order[:batch_size]


_WALKS = {"rank": _feistel_rank_walk, "cycle": _feistel_walk}


@partial(jax.jit, static_argnums=(1, 2, 3))
def _random_subset(
    rng_key: jax.Array, num_records: int, batch_size: int, walk: str = "rank"
) -> jax.Array:
    if num_records <= _SORT_MAX_RECORDS:
        return _sorted_head(rng_key, num_records, batch_size)
    return _WALKS[walk](rng_key, num_records, batch_size, _FEISTEL_ROUNDS)


def feistel_indices(
    rng_key: jax.Array, num_records: int, batch_size: int, *, walk: Literal["rank", "cycle"] = "rank"
) -> jax.Array:
    """A uniform random ``batch_size``-subset of ``range(num_records)``, in random order.

    Evaluates a keyed Feistel-network permutation of ``[0, 2**b)``,
    ``b = ceil(log2(num_records))``, and keeps the first ``B`` images of
    ``0, 1, 2, ...`` that land in ``[0, N)``: like the cycle walk of seed 003
    (section 4.3), this restricts the permutation of ``[0, 2**b)`` to a bijection of
    ``[0, N)``, so the result is a uniform ``B``-subset without replacement for a
    pseudo-random permutation; ``O(B)`` work, no sort and no full permutation, so the
    cost does not depend on ``N``. Round keys come from ``rng_key`` (any JAX key, e.g.
    :func:`d3pext.prng.secure_key`); the round function is Threefry-2x32, with 16
    rounds. The order is random too: every prefix of the result is a uniform random
    subset of its length.

    Cost: a value lands in ``[0, N)`` with probability ``p = N / 2**b > 1/2``. The
    cycle walk from ``0, ..., B-1`` needs ``max L`` passes over all ``B`` values, where
    one walk's length has ``P(L > l) = (1 - p)**l`` (seed 003, eqs. 9-13): about
    ``log2(B) + 1.3`` passes when ``p`` is close to 1/2. Here one pass over about
    ``B / p + 4 sd`` inputs suffices except with probability about ``3e-5`` (then a
    second pass follows): 2.5-6x faster than the cycle walk (``bench_minibatch.py``).

    No Feistel network mixes on a handful of values without very many rounds, so
    for ``N <= 256`` the subset is instead the head of a random sort of ``[0, N)``
    (64-bit sort keys): exact, and ``O(1)`` for bounded ``N``.

    Args:
        rng_key: a JAX PRNG key (typed or raw).
        num_records: ``N``, the data set size, ``1 <= N < 2**31`` (static).
        batch_size: ``B``, ``1 <= B <= N`` (static).
        walk: ``"rank"`` (default, one pass as above) or ``"cycle"`` (seed 003's cycle
            walk from ``0, ..., B-1``; a different, equally uniform subset for the same key).

    Returns:
        ``int32[B]``: distinct indices in ``[0, N)``.

    >>> import jax
    >>> idx = feistel_indices(jax.random.key(0), 1000, 5)
    >>> idx.shape, bool((idx < 1000).all()), len(set(idx.tolist()))
    ((5,), True, 5)
    """
    num_records = _check_int("num_records", num_records, 1, _MAX_RECORDS)
    batch_size = _check_int("batch_size", batch_size, 1, num_records)
    if walk not in _WALKS:
        raise ValueError(f"walk must be one of {tuple(_WALKS)}, got {walk!r}")
    return _random_subset(rng_key, num_records, batch_size, walk)


def _check_rate(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must lie in (0, 1], got {value}")
    return value


def _check_extra_delta_args(epsilon: float, num_steps: int) -> tuple[float, int]:
    epsilon = float(epsilon)
    if not (math.isfinite(epsilon) and epsilon >= 0.0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    return epsilon, _check_int("num_steps", num_steps, 0, 2**63 - 1)


@dataclasses.dataclass(frozen=True)
class FixedSizeSampler:
    """Uniform random batches of exactly ``batch_size`` records, without replacement.

    Realises the sampling that the accountant's ``Relation.SUBSTITUTE`` (fixed-size
    batches, substitute-one neighbours) assumes, with ``q = B / N``. Hashable, so it
    can be a static argument of jitted functions.

    Args:
        num_records: ``N``, ``1 <= N < 2**31``.
        batch_size: ``B``, ``1 <= B <= N``.

    >>> import jax
    >>> sampler = FixedSizeSampler(num_records=1000, batch_size=10)
    >>> idx, mask = jax.jit(sampler)(jax.random.key(0))
    >>> idx.shape, bool(mask.all()), sampler.q, sampler.extra_delta(1.0, 1000)
    ((10,), True, 0.01, 0.0)
    """

    num_records: int
    batch_size: int
    relation: ClassVar[Relation] = Relation.SUBSTITUTE

    def __post_init__(self) -> None:
        n = _check_int("num_records", self.num_records, 1, _MAX_RECORDS)
        object.__setattr__(self, "num_records", n)
        object.__setattr__(self, "batch_size", _check_int("batch_size", self.batch_size, 1, n))

    @property
    def q(self) -> float:
        """The sampling ratio ``B / N``."""
        return self.batch_size / self.num_records

    @property
    def padded_size(self) -> int:
        """The static length of the returned index and mask arrays: ``B``."""
        return self.batch_size

    def __call__(self, rng_key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draw a batch: ``(indices int32[B], mask bool[B])``, the mask all ``True``."""
        indices = _random_subset(rng_key, self.num_records, self.batch_size)
        return indices, jnp.ones(self.batch_size, bool)

    def extra_delta(self, epsilon: float, num_steps: int) -> float:
        """Extra delta beyond the accountant's. Up to ``N = 256`` a batch is the head of a sort on
        64-bit random keys, uniform unless two keys tie (probability at most ``C(N, 2) / 2**64``, below
        ``1.8e-15``): ``(1 + e**epsilon) * num_steps`` times that. Above, none (the Feistel walk's
        permutations are as uniform as its hash is random, the computational guarantee of the keys).

        >>> FixedSizeSampler(100, 10).extra_delta(1.0, 1000) < 1e-9
        True
        """
        epsilon, num_steps = _check_extra_delta_args(epsilon, num_steps)
        if self.num_records > _SORT_MAX_RECORDS or self.num_records < 2:
            return 0.0
        if epsilon > 700.0:  # e^epsilon overflows: no meaningful delta is left
            return math.inf
        tie = self.num_records * (self.num_records - 1) / 2 * 2.0**-64
        return (1.0 + math.exp(epsilon)) * num_steps * tie


def _count_thresholds(num_records: int, rate: float, max_size: int) -> tuple[int, np.ndarray]:
    """Inverse-CDF table for ``K ~ Binomial(N, q)`` at 64-bit resolution.

    Returns ``(offset, thresholds)`` with ``thresholds[j] = round(2**64 F(offset + j))``
    (``F`` the binomial CDF; from the survival function where ``F > 1/2``, to keep the
    tail's relative precision) as ``uint32[2, m]`` (high and low words), for those
    ``k = offset + j <= max_size`` whose threshold lies strictly inside
    ``(0, 2**64)``. For ``U`` uniform on ``[0, 2**64)``,
    ``offset + #{j : U >= thresholds[j]}`` is ``K`` when ``K <= max_size`` and
    ``max_size + 1`` otherwise.
    """
    dist = _binomial(num_records, rate)
    # sizes below `start` have thresholds 0: skip them (they matter when N q is large)
    start = min(max_size, max(0, int(np.nan_to_num(dist.ppf(2.0**-80)))))
    while start > 0 and np.ldexp(dist.cdf(start - 1), 64) >= 1.0:
        start -= 1
    ks = np.arange(start, max_size + 1)
    thresholds = [
        int(np.ldexp(c, 64)) if c <= 0.5 else (1 << 64) - math.ceil(np.ldexp(s, 64))
        for c, s in zip(dist.cdf(ks), dist.sf(ks))
    ]
    # thresholds never decrease in k: zeros (always passed), then those inside, then
    # those at 2**64 (never passed)
    offset = start + sum(t == 0 for t in thresholds)
    kept = [t for t in thresholds if 0 < t < 1 << 64]
    table = np.array([[t >> 32 for t in kept], [t & 0xFFFFFFFF for t in kept]], np.uint32)
    return offset, table.reshape(2, len(kept))


@dataclasses.dataclass(frozen=True)
class PoissonSampler:
    """Poisson subsampling: every record joins independently with probability ``q``.

    Realises the sampling that the accountant's ``Relation.ADD_REMOVE`` assumes, up to
    a static maximum batch size ``B_max`` (for ``jit``). The batch size is
    ``K ~ Binomial(N, q)``, drawn by inversion of the binomial CDF at 64-bit resolution
    (scipy's float64 CDF, relative error below 1e-12, rather than float32 sampling,
    whose errors would add to delta at every step); the batch is the first
    ``K`` of a uniform random ``B_max``-subset in random order (from
    :func:`feistel_indices`), which is a uniform random ``K``-subset, exactly as
    Poisson sampling gives. Indices past ``K`` are valid, distinct indices marked
    ``False`` in the mask.

    Truncation: when ``K > B_max`` (probability :attr:`tail_probability`) the batch
    is cut to a uniform random ``B_max``-subset (``oversized="truncate"``) or left
    empty (``"suppress"``). Either way one step is within total variation
    ``p_tail`` of exact Poisson sampling, and ``T`` steps within ``T * p_tail``, so a
    run that the accountant finds ``(eps, delta)``-DP is
    ``(eps, delta + p_tail + e**eps p_tail')`` per step, where ``p_tail'`` is the neighbour's: add
    :meth:`extra_delta`, which takes the larger of the two for both. By default ``B_max`` is the smallest
    size with ``p_tail <= tail_bound`` (``1e-12``), so every neighbour's own default meets the bound and
    ``tail_bound`` is accounted: a public number, where the exact tail would be a function of ``N``, which
    add/remove neighbours keep private. A given ``B_max`` is accounted at the tail of ``N + 1`` records
    (the larger neighbour's, up to 25% above ``N``'s).

    Args:
        num_records: ``N``, ``1 <= N < 2**31``.
        sampling_rate: ``q`` in ``(0, 1]``.
        max_batch_size: ``B_max`` in ``[1, N]``; ``None`` for the default above.
        tail_bound: the target for ``p_tail`` when ``max_batch_size`` is ``None``,
            in ``(0, 1)``.
        oversized: ``"truncate"`` or ``"suppress"``.

    >>> import jax
    >>> sampler = PoissonSampler(num_records=10_000, sampling_rate=0.01)
    >>> idx, mask = jax.jit(sampler)(jax.random.key(0))
    >>> idx.shape == mask.shape == (sampler.max_batch_size,), sampler.tail_probability <= 1e-12
    (True, True)
    """

    num_records: int
    sampling_rate: float
    max_batch_size: int | None = None
    tail_bound: float = 1e-12
    oversized: Literal["truncate", "suppress"] = "truncate"
    tail_probability: float = dataclasses.field(init=False)
    #: the tail probability :meth:`extra_delta` accounts: ``tail_bound`` for the default ``B_max``, else
    #: the tail of ``N + 1`` records (the neighbour whose tail is the larger)
    accounted_tail_probability: float = dataclasses.field(init=False, compare=False)
    _count_offset: int = dataclasses.field(init=False, repr=False)
    _count_table: np.ndarray = dataclasses.field(init=False, repr=False, compare=False)
    relation: ClassVar[Relation] = Relation.ADD_REMOVE

    def __post_init__(self) -> None:
        n = _check_int("num_records", self.num_records, 1, _MAX_RECORDS)
        q = _check_rate("sampling_rate", self.sampling_rate)
        tail_bound = float(self.tail_bound)
        if not 0.0 < tail_bound < 1.0:
            raise ValueError(f"tail_bound must lie in (0, 1), got {tail_bound}")
        if self.oversized not in ("truncate", "suppress"):
            raise ValueError(f"oversized must be 'truncate' or 'suppress', got {self.oversized!r}")
        dist = _binomial(n, q)
        default_size = self.max_batch_size is None
        if default_size:
            size = int(dist.isf(tail_bound))
            # isf is a float search: settle on the smallest size whose tail is small enough
            while size < n and dist.sf(size) > tail_bound:
                size += 1
            while size > 0 and dist.sf(size - 1) <= tail_bound:
                size -= 1
            size = max(size, 1)
        else:
            size = _check_int("max_batch_size", self.max_batch_size, 1, n)
        offset, table = _count_thresholds(n, q, size)
        table.setflags(write=False)
        for name, value in [
            ("num_records", n), ("sampling_rate", q), ("max_batch_size", size),
            ("tail_bound", tail_bound), ("tail_probability", float(dist.sf(size))),
            ("accounted_tail_probability",
             (0.0 if q == 1.0 else tail_bound) if default_size else float(_binomial(n + 1, q).sf(size))),
            ("_count_offset", offset), ("_count_table", table),
        ]:
            object.__setattr__(self, name, value)

    @property
    def q(self) -> float:
        """The sampling rate ``q``."""
        return self.sampling_rate

    @property
    def padded_size(self) -> int:
        """The static length of the returned index and mask arrays: ``B_max``."""
        return self.max_batch_size

    def _draw_count(self, rng_key: jax.Array) -> jax.Array:
        """``min(K, B_max + 1)`` for ``K ~ Binomial(N, q)``, as int32."""
        hi, lo = jax.random.bits(rng_key, (2,), jnp.uint32)
        t_hi, t_lo = jnp.asarray(self._count_table)
        above = (hi > t_hi) | ((hi == t_hi) & (lo >= t_lo))
        return self._count_offset + jnp.sum(above, dtype=jnp.int32)

    def __call__(self, rng_key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Draw a batch: ``(indices int32[B_max], mask bool[B_max])``."""
        return _poisson_batch(self, rng_key)

    def extra_delta(self, epsilon: float, num_steps: int) -> float:
        """``(1 + e**epsilon) * num_steps * accounted_tail_probability``, to add to delta.

        >>> PoissonSampler(1000, 0.5, max_batch_size=1000).extra_delta(1.0, 10**4) < 1e-290
        True
        """
        epsilon, num_steps = _check_extra_delta_args(epsilon, num_steps)
        tail = self.accounted_tail_probability
        if tail == 0.0:
            return 0.0
        if epsilon > 700.0:  # e^epsilon overflows: no meaningful delta is left
            return math.inf
        return (1.0 + math.exp(epsilon)) * num_steps * tail


@partial(jax.jit, static_argnums=0)
def _poisson_batch(sampler: PoissonSampler, rng_key: jax.Array) -> tuple[jax.Array, jax.Array]:
    count_key, subset_key = jax.random.split(rng_key)
    count = sampler._draw_count(count_key)
    if sampler.oversized == "suppress":
        count = jnp.where(count > sampler.max_batch_size, 0, count)
    indices = _random_subset(subset_key, sampler.num_records, sampler.max_batch_size)
    return indices, lax.iota(jnp.int32, sampler.max_batch_size) < count


def _check_dataset(dataset: Sequence[jax.typing.ArrayLike]) -> tuple[tuple[jax.Array, ...], int]:
    if not isinstance(dataset, (tuple, list)) or not dataset:
        raise ValueError("dataset must be a non-empty tuple of arrays of equal length")
    arrays = tuple(jnp.asarray(a) for a in dataset)
    if any(a.ndim == 0 for a in arrays):
        raise ValueError("every array in dataset needs a leading record axis")
    lengths = {a.shape[0] for a in arrays}
    if len(lengths) != 1:
        raise ValueError(f"all arrays in dataset must have the same length, got {sorted(lengths)}")
    return arrays, lengths.pop()


@partial(jax.jit, static_argnums=(0, 4))
def _fetch(
    sampler: FixedSizeSampler | PoissonSampler,
    i: jax.Array,
    rng_key: jax.Array,
    arrays: tuple[jax.Array, ...],
    zero_padding: bool,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    indices, mask = sampler(jax.random.fold_in(rng_key, i))
    batch = tuple(jnp.take(a, indices, axis=0, unique_indices=True) for a in arrays)
    if zero_padding:
        batch = tuple(
            jnp.where(mask.reshape((-1,) + (1,) * (b.ndim - 1)), b, jnp.zeros((), b.dtype))
            for b in batch
        )
    return batch, mask


def _batchify(
    sampler: FixedSizeSampler | PoissonSampler,
    arrays: tuple[jax.Array, ...],
    num_batches: int,
    return_mask: bool,
) -> tuple[Callable, Callable]:
    def init(rng_key: jax.Array) -> tuple[int, jax.Array]:
        return num_batches, rng_key

    def get_batch(i: int | jax.Array, batchifier_state: jax.Array):
        batch, mask = _fetch(sampler, i, batchifier_state, arrays, return_mask)
        return (batch, mask) if return_mask else batch

    get_batch.sampler = sampler
    return init, get_batch


def subsample_batchify_data(
    dataset: Sequence[jax.typing.ArrayLike],
    batch_size: int | None = None,
    q: float | None = None,
    with_replacement: bool = False,
    return_mask: bool = False,
) -> tuple[Callable, Callable]:
    """d3p's fixed-size subsampling batchifier, on :class:`FixedSizeSampler`.

    Args:
        dataset: a tuple of arrays with a common leading (record) axis.
        batch_size: the batch size; exclusive with ``q``.
        q: the batch size as a fraction of the records (``int(q * N)``).
        with_replacement: must be ``False``: no accountant here covers sampling with
            replacement.
        return_mask: if ``True``, ``get_batch`` also returns the (all-``True``) mask.

    Returns:
        ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)`` with
        ``num_batches = N // batch_size`` (one epoch); ``get_batch(i, state)`` returns
        the batch (a tuple of arrays), or ``(batch, mask)``, drawn with
        ``fold_in(rng_key, i)``. ``get_batch.sampler`` is the sampler, for accounting.

    >>> import jax, jax.numpy as jnp
    >>> init, get_batch = subsample_batchify_data((jnp.arange(100.0),), batch_size=10)
    >>> num_batches, state = init(jax.random.key(0))
    >>> num_batches, get_batch(0, state)[0].shape
    (10, (10,))
    """
    if with_replacement:
        raise ValueError(
            "with_replacement=True is not supported: sampling with replacement matches "
            "neither neighbouring relation of the accountants"
        )
    if (batch_size is None) == (q is None):
        raise ValueError("give exactly one of batch_size and q")
    arrays, num_records = _check_dataset(dataset)
    if batch_size is None:
        batch_size = int(num_records * _check_rate("q", q))
        if batch_size < 1:
            raise ValueError(f"q * N = {q} * {num_records} gives an empty batch")
    sampler = FixedSizeSampler(num_records, batch_size)
    return _batchify(sampler, arrays, num_records // sampler.batch_size, return_mask)


def poisson_batchify_data(
    dataset: Sequence[jax.typing.ArrayLike],
    q: float,
    max_batch_size: int | float | None = None,
    handle_oversized_batch: Literal["truncate", "suppress"] = "truncate",
) -> tuple[Callable, Callable]:
    """d3p's Poisson-sampling batchifier, on :class:`PoissonSampler`.

    Unlike d3p, an oversized batch is truncated to a uniform random subset (d3p kept
    the highest indices), and the truncation is accounted for:
    ``get_batch.sampler.extra_delta(eps, num_steps)`` must be added to delta.

    Args:
        dataset: a tuple of arrays with a common leading (record) axis.
        q: the sampling rate, in ``(0, 1]``.
        max_batch_size: ``B_max``, an int in ``[1, N]``; or a float in ``(0, 1)``: the
            quantile of ``Binomial(N, q)`` to use as ``B_max`` (the tail beyond it then
            costs delta: mind :meth:`PoissonSampler.extra_delta`); ``None``: the
            smallest size with a tail probability of at most ``1e-12``.
        handle_oversized_batch: ``"truncate"`` or ``"suppress"`` (empty batch).

    Returns:
        ``(init, get_batch)``: ``init(rng_key) -> (num_batches, state)`` with
        ``num_batches = N // max(1, int(q * N))`` (one epoch in expectation);
        ``get_batch(i, state) -> (batch, mask)``, batch rows past the mask zeroed.
        ``get_batch.sampler`` is the :class:`PoissonSampler`.

    >>> import jax, jax.numpy as jnp
    >>> init, get_batch = poisson_batchify_data((jnp.ones((1000, 2)),), q=0.01)
    >>> num_batches, state = init(jax.random.key(0))
    >>> (batch,), mask = get_batch(0, state)
    >>> num_batches, batch.shape == (get_batch.sampler.max_batch_size, 2)
    (100, True)
    """
    arrays, num_records = _check_dataset(dataset)
    q = _check_rate("q", q)
    if isinstance(max_batch_size, (float, np.floating)):
        quantile = float(max_batch_size)
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"a float max_batch_size is a quantile in (0, 1), got {quantile}")
        max_batch_size = max(1, int(_binomial(num_records, q).ppf(quantile)))
    sampler = PoissonSampler(
        num_records, q, max_batch_size=max_batch_size, oversized=handle_oversized_batch
    )
    num_batches = num_records // max(1, int(q * num_records))
    return _batchify(sampler, arrays, num_batches, return_mask=True)


def split_batchify_data(*args: object, **kwargs: object) -> None:
    """d3p's shuffle-then-split batchifier: refused, with what to use instead.

    Shuffling once per epoch and cutting the permutation into batches makes the steps of an epoch
    dependent (each record is in exactly one batch), which neither relation of the accountants
    models; its privacy would be reported wrongly.

    >>> split_batchify_data((None,), batch_size=10)
    Traceback (most recent call last):
    ...
    NotImplementedError: split_batchify_data (shuffle, then split each epoch) has no accountant here ...
    """
    raise NotImplementedError(
        "split_batchify_data (shuffle, then split each epoch) has no accountant here that matches it, so its privacy "
        "would be reported wrongly. Use subsample_batchify_data (uniform fixed-size batches, substitute relation), "
        "poisson_batchify_data (Poisson batches with a mask, add/remove relation), or plate mode, where DPSVI draws "
        "the batches itself."
    )
