"""Exact sums for the curator: statistics of concrete records summed in float64, correctly rounded.

A sum in float32 (JAX's default) rounds by more than its sensitivity once ``n`` is large or the
records lie far from 0, and the float-safe mechanisms (:mod:`d3pext.releases.mechanisms`) keep only
one grid unit of slack for the float rounding of the statistic. :func:`exact_sum` returns the correctly
rounded float64 sum (integers exactly), bit for bit what ``math.fsum`` gives, at NumPy speed.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

__all__ = ["array_module", "exact_sum", "record_sums"]


def exact_sum(t: Any, batch_ndim: int) -> np.ndarray:
    """The sum of per-record statistics over the leading ``batch_ndim`` axes, exact for integers and
    correctly rounded in float64 for reals (bit for bit ``math.fsum``, but for the sign of a zero: a
    column of ``-0.0`` among other columns sums to ``+0.0``).

    >>> float(exact_sum(np.array([1e16, 1.0, -1e16]), 1))
    1.0

    A sum in float32 (JAX's default) rounds by more than its sensitivity once ``n`` is large or
    the records lie far from 0 (a mean of 1e7 birth years moved by 20x its sensitivity between
    neighbours); correctly rounded float64 stays within a grid unit of the release mechanisms
    (``d3pext.releases.mechanisms.to_grid_units``)."""
    t = np.asarray(t)
    stat_shape = t.shape[batch_ndim:]
    n, k = (int(np.prod(shape, dtype=np.int64)) for shape in (t.shape[:batch_ndim], stat_shape))
    rows = t.reshape(n, k)
    if t.dtype == np.bool_ or np.issubdtype(t.dtype, np.integer):
        return rows.astype(np.int64).sum(axis=0).reshape(stat_shape)
    return _column_sums(rows).reshape(stat_shape)


def array_module(records: Any) -> tuple[Any, Any]:
    """``(numpy, records in float64)`` for concrete records (the curator's), ``(jax.numpy, records)``
    for traced ones (the analyst's model): a statistic written with the returned module is computed
    in float64 where it is released.

    >>> xp, r = array_module([1, 2])
    >>> xp.__name__, r.dtype
    ('numpy', dtype('float64'))
    """
    if isinstance(records, jax.core.Tracer):
        return jnp, records
    return np, np.asarray(records, np.float64)


def record_sums(terms: Any) -> Any:
    """Sums over the records (axis ``-2``) of per-record terms ``(..., n, m)``: concrete terms (the
    curator's) with :func:`exact_sum`, correctly rounded in float64 (the float-safe releases keep one
    grid unit of slack for the rounding of the statistic, and a float32 sum of a million records
    rounds by far more); traced ones with ``jnp.sum``.

    >>> record_sums(np.array([[1e16], [1.0], [-1e16]])).tolist()
    [1.0]
    """
    if isinstance(terms, jax.core.Tracer):
        return terms.sum(-2)
    return exact_sum(np.moveaxis(np.asarray(terms, np.float64), -2, 0), 1)


# records per block of the exact float sums: their working memory is three float64 copies of a block
_EXACT_BLOCK = 1 << 20


def _column_sums(rows: np.ndarray) -> np.ndarray:
    """``math.fsum`` of each column of ``rows`` (records x coordinates), bit for bit, in NumPy.

    Each block of records is split exactly into a few vectors whose sums NumPy computes without
    rounding (:func:`_split_sums`); ``math.fsum`` of those few exact sums is the correctly rounded
    sum of the records, the value ``math.fsum`` of the records returns. Columns with a non-finite
    record, or records so large that a sum could overflow, go through :func:`_fsum` itself, which
    keeps its results and errors (``inf``, ``nan``, ``-inf + inf``, intermediate overflow)."""
    n, k = rows.shape
    if n and np.all(np.isfinite(rows)):
        peak = float(np.max(np.abs(rows), initial=0.0))
        if peak * n < 2.0**53 and np.array_equal(rows, np.trunc(rows)):
            # integer values (one-hot or count statistics) whose every partial sum is an integer below
            # 2**53: float64 adds them exactly, in any order
            return rows.sum(axis=0, dtype=np.float64)
    # |x| < 2**limit keeps the sum of n |x| below 2**1000: no partial sum (ours or fsum's) overflows
    limit = 1000 - n.bit_length()
    step = max(1, _EXACT_BLOCK // max(k, 1))
    fallback = np.zeros(k, bool)
    parts: list[np.ndarray] = []
    for start in range(0, n, step):
        block = np.array(rows[start:start + step].T, np.float64, order="C")  # a copy: coordinates x records
        parts += _split_sums(block, fallback, limit)
        if len(parts) > 64 or (len(parts) > 2 and len(parts) * k > 2 * _EXACT_BLOCK):
            # the partial sums split again, exactly, into a few: memory stays about that of two blocks
            # (the partials are below n 2**limit < 2**1000, so none is flagged)
            parts = _split_sums(np.stack(parts, axis=1), np.zeros(k, bool), 1010)
    exact = np.stack(parts, axis=1) if parts else np.zeros((k, 0))
    return np.array(
        [_fsum(rows[:, j]) if fallback[j] else math.fsum(exact[j].tolist()) for j in range(k)], np.float64
    )


def _split_sums(r: np.ndarray, fallback: np.ndarray, limit: int) -> list[np.ndarray]:
    """Exact sums (per row of ``r``) of the levels of Rump, Ogita & Oishi's ``ExtractVector``
    (Accurate floating-point summation I, SIAM J. Sci. Comput. 2008, Algorithm 3.2): their total
    is exactly that of ``r``. ``r`` (overwritten) has ``m`` records per row.

    With ``sigma = 2**(M + e)``, ``2**M >= m + 2`` and every ``|r| < 2**e``, ``q = (sigma + r) - sigma``
    is exact (Sterbenz), a multiple of ``ulp(sigma) / 2`` of magnitude at most ``sigma / 2**M``, so
    every partial sum of the ``q`` is such a multiple below ``sigma`` in magnitude: representable, the
    level's sum is exact in any order. ``r - q`` is the rounding error of ``sigma + r``, exact too,
    and at most ``ulp(sigma) / 2``: each level takes ``52 - M`` bits (31 for blocks of 2**20
    records) off the widest row, and skips empty ranges of exponents. Gradual underflow keeps
    subnormal sums exact. Rows with a record that is not finite or not below ``2**limit`` are
    zeroed and flagged in ``fallback``."""
    M = (r.shape[1] + 1).bit_length()
    q = np.empty_like(r)
    sums = []
    while True:
        mu = np.abs(r, out=q).max(axis=1)
        if not sums:
            bad = ~(mu < 2.0**limit)  # nan compares false
            if bad.any():
                fallback |= bad
                r[bad] = 0.0
                mu[bad] = 0.0
        if not mu.any():
            return sums
        sigma = np.ldexp(1.0, M + np.frexp(mu)[1])[:, None]
        np.add(r, sigma, out=q)
        q -= sigma
        r -= q
        sums.append(q.sum(axis=1))


def _fsum(values: np.ndarray, chunk: int = 1 << 18) -> float:
    """``math.fsum`` of a column, fed in chunks (memory stays that of one chunk)."""
    return math.fsum(
        itertools.chain.from_iterable(
            values[i:i + chunk].astype(np.float64).tolist() for i in range(0, values.shape[0], chunk)
        )
    )
