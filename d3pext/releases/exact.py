"""Exact integer noise for float-safe releases (Canonne, Kamath & Steinke 2020).

A release computed as ``value + scale * (E0 - E1)`` in floating point leaks the input through the
bits of its output (Mironov 2012): the outputs of one input lie on a lattice that a neighbouring
input's outputs never touch. The samplers here never use floating point. They draw integers from
the bits of a PRNG key (a ChaCha20 key from :func:`d3pext.prng.secure_key` for real releases):

- :func:`uniform_below`: uniform integers in ``[0, m)`` by rejection from the key's bit stream;
- :func:`bernoulli_exp`: ``Bernoulli(exp(-gamma))`` for rational ``gamma`` (their Algorithm 1);
- :func:`discrete_laplace`: ``P(k) ~ exp(-|k| / t)`` on the integers, rational ``t`` (Algorithm 2);
- :func:`discrete_gaussian`: ``P(k) ~ exp(-k^2 / (2 sigma2))``, rational ``sigma2`` (Algorithm 3);
- :func:`randomized_round`: ``floor(a) + Bernoulli(a - floor(a))`` for rational ``a``, so that
  real statistics enter the integer mechanisms unbiased and with a sensitivity that stays the
  bound on ``|a - a'|`` (for each fixed uniform ``U``, ``|floor(a + U) - floor(a' + U)| <=
  ceil(|a - a'|)``, and the law of the output is the mixture over ``U``).

All are vectorised over an array of draws: each round of rejection runs as numpy integer
arithmetic over the lanes still open; arbitrary precision (Python integers in object arrays) is
used only where a bound on ``int64`` cannot be guaranteed. Parameters are exact rationals
(:class:`fractions.Fraction`; a float is taken at its exact binary value).

>>> import numpy as np
>>> from d3pext.prng import chacha_key
>>> bits = KeyBits(chacha_key(0))
>>> k = discrete_laplace(bits, Fraction(3, 2), (5,))
>>> k.dtype, k.shape
(dtype('int64'), (5,))
"""

from __future__ import annotations

from fractions import Fraction
import math
from typing import Union

import numpy as np

import jax
import jax.numpy as jnp

__all__ = [
    "KeyBits",
    "bernoulli_exp",
    "bernoulli_exp_ratio",
    "discrete_gaussian",
    "discrete_gaussian_delta",
    "discrete_gaussian_log_pmf",
    "discrete_laplace",
    "discrete_laplace_log_pmf",
    "randomized_round",
    "uniform_below",
]

Rational = Union[int, float, Fraction]
_INT64_SAFE = 2**62  # products and sums of int64 lanes stay below 2^63 under this bound


def as_fraction(name: str, value: Rational) -> Fraction:
    """``value`` as an exact positive rational (floats at their exact binary value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, Fraction, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    frac = Fraction(value)
    if frac <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return frac


class KeyBits:
    """A stream of random 32-bit words from a JAX PRNG key, drawn in fixed-size blocks.

    Block ``i`` is ``jax.random.bits(fold_in(key, i), (BLOCK,))``: with a ChaCha20 key this is
    ChaCha20 output, computationally indistinguishable from uniform bits. Fixed blocks compile
    once, whatever sizes the samplers ask for.
    """

    BLOCK = 2**16

    def __init__(self, rng_key: jax.Array) -> None:
        self._key = rng_key
        self._block = 0
        self._buffer = np.zeros(0, dtype=np.int64)

    def words(self, n: int) -> np.ndarray:
        """``n`` fresh uniform ``uint32`` words (as ``int64``)."""
        n = int(n)
        while self._buffer.size < n:
            key = jax.random.fold_in(self._key, self._block)
            self._block += 1
            block = np.asarray(_block_bits(key), dtype=np.int64)
            self._buffer = np.concatenate([self._buffer, block])
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out


@jax.jit
def _block_bits(key: jax.Array) -> jax.Array:
    return jax.random.bits(key, (KeyBits.BLOCK,), jnp.uint32)


def _bits_below(bits: KeyBits, m: np.ndarray) -> np.ndarray:
    """One attempt per lane: ``bitlen(m - 1)`` random bits (a candidate, valid when ``< m``)."""
    if m.dtype == object:
        widths = [max(int(v - 1).bit_length(), 1) for v in m]
        words = bits.words(sum((w + 31) // 32 for w in widths))
        out, i = np.empty(len(m), dtype=object), 0
        for j, w in enumerate(widths):
            n = (w + 31) // 32
            value = 0
            for word in words[i : i + n]:
                value = (value << 32) | int(word)
            out[j], i = value >> (32 * n - w), i + n
        return out
    widths = np.zeros(m.shape, dtype=np.int64)  # bit length of m - 1, exactly
    rest = m - 1
    while np.any(rest > 0):
        widths += rest > 0
        rest = rest >> 1
    words = bits.words(2 * len(m)).reshape(2, -1)
    value = (words[0] << 30) ^ words[1]  # 62 random bits
    return value >> (62 - widths)


def uniform_below(bits: KeyBits, m) -> np.ndarray:
    """Uniform integers in ``[0, m)`` per lane (``m``: positive integers), exactly, by rejection
    from ``bitlen(m - 1)`` random bits (at least half of the attempts are accepted).

    >>> from d3pext.prng import chacha_key
    >>> u = uniform_below(KeyBits(chacha_key(0)), np.array([1, 2, 10**30], dtype=object))
    >>> int(u[0]), 0 <= int(u[2]) < 10**30
    (0, True)
    """
    m = np.asarray(m)
    if m.dtype != object and m.size and int(m.max()) >= _INT64_SAFE:
        m = m.astype(object)
    flat = m.reshape(-1)
    out = np.zeros(flat.shape, dtype=flat.dtype)
    todo = np.arange(flat.size)
    while todo.size:
        candidate = _bits_below(bits, flat[todo])
        ok = candidate < flat[todo]
        out[todo[ok]] = candidate[ok]
        todo = todo[~ok]
    return out.reshape(m.shape)


def _bernoulli_exp_fraction(bits: KeyBits, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``Bernoulli(exp(-num/den))`` per lane, ``0 <= num <= den`` (Algorithm 1): with ``K = 1, 2,
    ...`` draw ``A_K ~ Bernoulli(gamma / K)`` until one is 0; the result is ``K`` odd."""
    n = num.shape[0]
    k = np.ones(n, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    while not done.all():
        open_ = np.flatnonzero(~done)
        big = num.dtype == object or den.dtype == object or int(den[open_].max()) * int(k[open_].max()) >= _INT64_SAFE
        m = den[open_].astype(object) * k[open_].astype(object) if big else den[open_] * k[open_]
        a = uniform_below(bits, m) < num[open_]
        k[open_[a]] += 1
        done[open_[~a]] = True
    return (k % 2) == 1


def bernoulli_exp(bits: KeyBits, gamma) -> np.ndarray:
    """``Bernoulli(exp(-gamma))`` per lane for rational ``gamma >= 0`` (an array of Fractions or
    integers): ``floor(gamma)`` draws of ``Bernoulli(exp(-1))`` and one of the fractional part,
    all of which must succeed.

    >>> from d3pext.prng import chacha_key
    >>> x = bernoulli_exp(KeyBits(chacha_key(1)), np.full(4000, Fraction(1, 2), dtype=object))
    >>> bool(abs(x.mean() - math.exp(-0.5)) < 0.03)
    True
    """
    fracs = [Fraction(g) for g in np.asarray(gamma, dtype=object).reshape(-1)]
    num = np.array([f.numerator for f in fracs], dtype=object)
    den = np.array([f.denominator for f in fracs], dtype=object)
    return bernoulli_exp_ratio(bits, num, den)


def _int_array(values: np.ndarray) -> np.ndarray:
    """int64 when every entry fits with room for the samplers' products, else Python ints."""
    values = np.asarray(values)
    if values.size and values.dtype == object and max(abs(int(v)) for v in values.reshape(-1)) >= _INT64_SAFE:
        return values
    return values.astype(np.int64)


def bernoulli_exp_ratio(bits: KeyBits, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``Bernoulli(exp(-num / den))`` per lane for integer arrays ``num >= 0``, ``den > 0``
    (vectorised: no Fractions are formed).

    >>> from d3pext.prng import chacha_key
    >>> x = bernoulli_exp_ratio(KeyBits(chacha_key(1)), np.full(4000, 3), np.full(4000, 2))
    >>> bool(abs(x.mean() - math.exp(-1.5)) < 0.03)
    True
    """
    num, den = _int_array(num), _int_array(den)
    whole = _int_array(num // den)
    out = _bernoulli_exp_fraction(bits, _int_array(num % den), den)
    # floor(gamma) draws of Bernoulli(exp(-1)); lanes leave at their first failure
    alive = out.copy()
    trials = np.zeros(whole.shape, dtype=whole.dtype)
    while True:
        open_ = np.flatnonzero(alive & (trials < whole))
        if not open_.size:
            break
        ones = np.ones(open_.size, dtype=np.int64)
        ok = _bernoulli_exp_fraction(bits, ones, ones)
        trials[open_] += 1
        alive[open_[~ok]] = False
    return alive


def _geometric_exp_minus_one(bits: KeyBits, n: int) -> np.ndarray:
    """``V`` with ``P(V = v) = (1 - e^-1) e^(-v)``: count ``Bernoulli(exp(-1))`` successes."""
    v = np.zeros(n, dtype=np.int64)
    open_ = np.arange(n)
    while open_.size:
        ones = np.ones(open_.size, dtype=np.int64)
        ok = _bernoulli_exp_fraction(bits, ones, ones)
        v[open_[ok]] += 1
        open_ = open_[ok]
    return v


def discrete_laplace(bits: KeyBits, scale: Rational, shape: tuple[int, ...]) -> np.ndarray:
    """Integers with ``P(k) = (1 - e^(-1/t)) / (1 + e^(-1/t)) e^(-|k|/t)``, ``t = scale``
    (Algorithm 2 of Canonne, Kamath & Steinke, for ``t = num / den``).

    >>> from d3pext.prng import chacha_key
    >>> k = discrete_laplace(KeyBits(chacha_key(2)), 2, (20000,))
    >>> bool(abs(np.mean(np.abs(k)) - 2 * math.exp(-0.5) / (1 - math.exp(-1))) < 0.05)
    True
    """
    t = as_fraction("scale", scale)
    s_int, t_int = t.denominator, t.numerator  # scale t/s in the paper's notation
    n = math.prod(shape)
    out = np.zeros(n, dtype=np.int64)
    open_ = np.arange(n)
    while open_.size:
        m = open_.size
        big = t_int >= _INT64_SAFE
        u = uniform_below(bits, np.full(m, t_int, dtype=object if big else np.int64))
        d = _bernoulli_exp_fraction(bits, u, np.full(m, t_int, dtype=u.dtype))  # exp(-U/t), U < t
        v = _geometric_exp_minus_one(bits, m)
        if not big and t_int * (int(v.max()) + 1) < _INT64_SAFE:
            y = (u + t_int * v) // s_int
        else:
            y = np.array([(int(a) + t_int * int(b)) // s_int for a, b in zip(u, v)], dtype=np.int64)
        b = uniform_below(bits, np.full(m, 2, dtype=np.int64)) == 1
        ok = d & ~(b & (y == 0))
        out[open_[ok]] = np.where(b, -y, y)[ok]
        open_ = open_[~ok]
    return out.reshape(shape)


def discrete_gaussian(bits: KeyBits, sigma2: Rational, shape: tuple[int, ...]) -> np.ndarray:
    """Integers with ``P(k) ~ exp(-k^2 / (2 sigma2))`` (Algorithm 3 of Canonne, Kamath & Steinke):
    a discrete Laplace proposal of scale ``t = floor(sigma) + 1``, accepted with probability
    ``exp(-(|Y| - sigma2/t)^2 / (2 sigma2))``.

    >>> from d3pext.prng import chacha_key
    >>> k = discrete_gaussian(KeyBits(chacha_key(3)), 4, (20000,))
    >>> bool(abs(np.var(k) - 4.0) < 0.2)
    True
    """
    s2 = as_fraction("sigma2", sigma2)
    t = math.isqrt(s2.numerator // s2.denominator) + 1
    n = math.prod(shape)
    out = np.zeros(n, dtype=np.int64)
    open_ = np.arange(n)
    p, q = s2.numerator, s2.denominator
    while open_.size:
        y = discrete_laplace(bits, t, (open_.size,))
        # gamma = (|y| - sigma2 / t)^2 / (2 sigma2) = (q t |y| - p)^2 / (2 p q t^2), in integers
        absy = np.abs(y)
        if int(absy.max()) * q * t + p < 2**31:
            offset = absy * (q * t) - p
            num = offset * offset
        else:
            num = (absy.astype(object) * (q * t) - p) ** 2
        den = np.full(y.shape, 2 * p * q * t * t, dtype=object)
        ok = bernoulli_exp_ratio(bits, num, den)
        out[open_[ok]] = y[ok]
        open_ = open_[~ok]
    return out.reshape(shape)


def randomized_round(bits: KeyBits, values: np.ndarray) -> np.ndarray:
    """``floor(a) + Bernoulli(a - floor(a))`` per lane, exactly, for rationals ``a``."""
    flat = [Fraction(v) for v in np.asarray(values, dtype=object).reshape(-1)]
    floors = np.array([f.numerator // f.denominator for f in flat], dtype=object)
    rems = np.array([f.numerator % f.denominator for f in flat], dtype=object)
    dens = np.array([f.denominator for f in flat], dtype=object)
    up = uniform_below(bits, dens) < rems
    out = floors + up.astype(np.int64)
    return np.array([int(v) for v in out], dtype=np.int64).reshape(np.shape(values))


def discrete_laplace_log_pmf(k, scale: Rational) -> np.ndarray:
    """``log P(k)`` of :func:`discrete_laplace` (float64)."""
    t = float(as_fraction("scale", scale))
    return np.log(np.tanh(0.5 / t)) - np.abs(np.asarray(k, dtype=np.float64)) / t


def discrete_gaussian_log_pmf(k, sigma2: Rational) -> np.ndarray:
    """``log P(k)`` of :func:`discrete_gaussian` (float64; the normaliser summed to 1e-16)."""
    s2 = float(as_fraction("sigma2", sigma2))
    half = int(math.ceil(40 * math.sqrt(s2))) + 10
    support = np.arange(-half, half + 1, dtype=np.float64)
    log_norm = np.logaddexp.reduce(-(support**2) / (2 * s2))
    return -(np.asarray(k, dtype=np.float64) ** 2) / (2 * s2) - log_norm


def discrete_gaussian_delta(epsilon: float, sigma2: Rational, sensitivity: int) -> float:
    """Exact ``delta(epsilon)`` of the discrete Gaussian mechanism with integer sensitivity
    (Canonne, Kamath & Steinke 2020, Theorem 7): ``P[Y > e s2 / D - D / 2] - e^e P[Y > e s2 / D
    + D / 2]`` for ``Y`` discrete Gaussian of variance parameter ``s2``.

    >>> round(discrete_gaussian_delta(1.0, 16, 1), 6) > 0
    True
    """
    s2 = float(as_fraction("sigma2", sigma2))
    d = int(sensitivity)
    if d < 1 or d != sensitivity:
        raise ValueError(f"sensitivity must be a positive integer, got {sensitivity}")
    half = int(math.ceil(40 * math.sqrt(s2))) + 2 * d + 10
    k = np.arange(-half, half + 1, dtype=np.float64)
    log_p = discrete_gaussian_log_pmf(k, s2)

    def tail(x: float) -> float:  # P[Y > x], summed from the far end for accuracy
        terms = np.exp(log_p[k > x])[::-1]
        return float(np.sum(terms))

    center = epsilon * s2 / d
    return max(0.0, tail(center - d / 2) - math.exp(epsilon) * tail(center + d / 2))
