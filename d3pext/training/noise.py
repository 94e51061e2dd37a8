"""The Gaussian noise of private steps: standard normals whose tails reach 11.3 sigma.

``jax.random.normal`` turns one 32-bit word into a float32 normal through the inverse error function
of a uniform on a grid of spacing ``2**-23``: its draws never leave ``[-5.42, 5.22]``, and the
Gaussian's mass beyond that range sits on the extreme grid points, about ``1.2e-7`` each. A noisy
coordinate at the top point, pushed up by the differing record's gradient, is beyond anything the
neighbouring data set can produce and reveals which one was used. That happens with probability
about ``1.2e-7`` per coordinate of every step that holds the record, which the accountant, assuming
exact Gaussian noise, does not count: ``T q d 1.2e-7`` over ``T`` steps at sampling rate ``q`` with
``d`` parameters, 7e-4 for 200 steps at ``q = 0.5`` with 62 parameters, against a delta of 1e-5.

:func:`standard_normal` builds each draw from a sign bit and a uniform ``u`` in ``(0, 1/2]`` on a grid
of ``2**-64`` that is refined to ``2**-96`` below ``2**-32`` (two 32-bit words per draw, a third for the
draws that fall there), mapped through the normal quantile ``-ndtri(u)``, which float32 evaluates to
a relative error below ``4e-7`` down to ``u = 2**-97``. The draws reach ``|z| = 11.30``; the mass left beyond that is
``2**-96`` per draw (:data:`TAIL_MASS`), and :func:`noise_tail_delta` bounds what it adds to delta.
DPSVI adds that term to its privacy reports and calibrates sigma with it subtracted.

The draws are floating-point numbers, so the low-order bits of a noisy gradient are not covered
by the guarantee (Mironov 2012); see the threat model in the docs.
"""

from __future__ import annotations

import math

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax, random
from jax.extend.random import threefry_2x32

from d3pext._backend import by_backend
from d3pext._threefry_cpu import (
    FLAT_MULTIPLE, is_threefry_key, key_words, random_bits_unrolled, threefry2x32_unrolled,
)

__all__ = ["TAIL_MASS", "noise_tail_delta", "standard_normal"]

TAIL_MASS = 2.0**-96
"""The Gaussian's mass beyond the draws' range, ``P(|Z| > 11.30)``, per draw: ``2 * 2**-97``."""


def _from_words(first: jax.Array, second: jax.Array, third: jax.Array | None, dtype) -> jax.Array:
    """Standard normals from three ``uint32`` words per draw: the first's top bit is the sign, its other
    31 bits ``t``, the second ``m`` and the third ``l`` make the uniform ``u`` in ``(0, 1/2]``:
    ``(t 2**32 + m + 1/2) 2**-64`` where ``t > 0``, ``(m 2**32 + l + 1/2) 2**-96`` where ``t = 0``
    (probability ``2**-31``; the third word is read only there). Every cell of the 95-bit grid below
    ``2**-32`` and of the 63-bit grid above has its exact mass; the smallest ``u``, ``2**-97``, is a
    normal float32, so the quantile is finite and accurate. ``third=None``: no draw has ``t = 0``."""
    compute = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    top_bits = first & np.uint32(0x7FFFFFFF)
    top, middle = (lax.convert_element_type(w, compute) for w in (top_bits, second))
    half = compute(0.5)
    u = top * compute(2.0**-32) + (middle + half) * compute(2.0**-64)
    if third is not None:
        fine = middle * compute(2.0**-64) + (lax.convert_element_type(third, compute) + half) * compute(2.0**-96)
        u = jnp.where(top_bits == np.uint32(0), fine, u)
    magnitude = -jax.scipy.special.ndtri(u)
    z = jnp.where(first >> np.uint32(31) == np.uint32(1), magnitude, -magnitude)
    return z.astype(dtype)


def standard_normal(rng_key: jax.Array, shape: tuple[int, ...] = (), dtype=jnp.float32) -> jax.Array:
    """Standard normal draws of ``shape``, with tails to ``|z| = 11.3`` (see the module doc).

    A drop-in for ``jax.random.normal(rng_key, shape, dtype)`` where the draws are privacy noise:
    any key (a Threefry key or :func:`d3pext.prng.secure_key`), under ``jit`` and ``vmap``. Each draw
    reads two words of the key's stream where ``jax.random.normal`` reads one, and a third in the
    rare draw (``2**-31``) that needs it: on a CPU the third words are drawn only in a call that has
    such a draw, on an accelerator always (the same numbers, up to float rounding). For a Threefry key both words of each
    hash are used, so it hashes once per draw like ``jax.random.normal``. The numbers differ from
    ``jax.random.normal``'s for the same key. Half-precision dtypes are drawn in float32 and rounded.

    >>> import jax
    >>> z = standard_normal(jax.random.key(0), (100_000,))
    >>> z.dtype, bool(abs(z.mean()) < 0.02), bool(abs(z.std() - 1) < 0.02)
    (dtype('float32'), True, True)
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"standard_normal draws floating-point numbers, got dtype {dtype}")
    dtype = jax.dtypes.canonicalize_dtype(dtype)  # float64 is float32 unless jax_enable_x64 is on
    shape = tuple(int(s) for s in shape)
    size = math.prod(shape)
    # Drawn flat over a multiple of the CPU hash's block: its words then need no slicing before
    # the branch below takes them (each slice was a kernel of its own); the extra draws are dropped.
    drawn = size if size < FLAT_MULTIPLE else -(-size // FLAT_MULTIPLE) * FLAT_MULTIPLE
    if is_threefry_key(rng_key) and 0 < drawn <= 2**30:
        # the words hash the counter pairs (i, n + i), the third ones (2n + i, 3n + i): no key split
        first, second = _word_pair(rng_key, (drawn,))
        words = key_words(rng_key)

        def third():  # one consumer (the transform): the written-out hash fuses into it
            counters = lax.iota(jnp.uint32, drawn)
            return threefry2x32_unrolled(words[0], words[1], counters + np.uint32(2 * drawn), counters + np.uint32(3 * drawn))[0]

    else:
        main_key, tail_key = random.split(rng_key)
        first, second = _word_pair(main_key, (drawn,))

        def third():
            return random_bits_unrolled(tail_key, (drawn,))

    def on_cpu(first, second):
        needed = jnp.any(first & np.uint32(0x7FFFFFFF) == np.uint32(0))
        return lax.cond(
            needed,
            lambda first, second: _from_words(first, second, third(), dtype),
            lambda first, second: _from_words(first, second, None, dtype),
            first, second,
        )

    # On a CPU a branch skips the third words unless some draw needs them, and its result is one
    # buffer (XLA's CPU fusion otherwise copies the quantile's polynomials into every consumer of the
    # noise); on an accelerator each branch would wait for the host to read its predicate.
    z = by_backend(on_cpu, lambda first, second: _from_words(first, second, third(), dtype), first, second)
    return (z if drawn == size else z[:size]).reshape(shape)


def _word_pair(rng_key: jax.Array, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Two independent ``uint32`` words per draw. For a Threefry key, the two output words of one hash
    per draw (``jax.random.bits`` hashes once per word and keeps the XOR of the two): the words JAX
    draws with ``jax_threefry_partitionable`` off. Other keys read two streams of split keys, each
    contiguous (one stream cut in halves made XLA's CPU code gather across ChaCha20's blocks, 2x slower)."""
    size = math.prod(shape)
    if is_threefry_key(rng_key) and size > 0:
        words = threefry_2x32(key_words(rng_key), lax.iota(jnp.uint32, 2 * size))
        return words[:size].reshape(shape), words[size:].reshape(shape)
    first_key, second_key = random.split(rng_key)
    return random.bits(first_key, shape, jnp.uint32), random.bits(second_key, shape, jnp.uint32)


def noise_tail_delta(epsilon: float, num_steps: int, num_coordinates: int) -> float:
    """What the noise's finite range adds to delta: ``(1 + e**epsilon) T d TAIL_MASS``.

    Up to the rounding of every draw to its grid (the floating-point caveat above), a draw differs
    from an exact Gaussian one only where that one lies beyond the draws' range, with probability
    :data:`TAIL_MASS`. So ``T`` steps of ``d`` noisy coordinates are within total variation ``T d
    TAIL_MASS`` of exact Gaussian noise, and a run the accountant finds ``(eps, delta)``-DP is
    ``(eps, delta + (1 + e**eps) T d TAIL_MASS)``-DP (as for the truncation of Poisson batches,
    :meth:`~d3pext.training.minibatch.PoissonSampler.extra_delta`).

    >>> noise_tail_delta(1.0, 10_000, 1_000_000) < 1e-15
    True
    """
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    if num_steps < 0 or num_coordinates < 0:
        raise ValueError(f"num_steps and num_coordinates must be >= 0, got {num_steps} and {num_coordinates}")
    if epsilon > 700.0:  # e^epsilon overflows: no meaningful delta is left
        return math.inf
    return (1.0 + math.exp(epsilon)) * num_steps * num_coordinates * TAIL_MASS
