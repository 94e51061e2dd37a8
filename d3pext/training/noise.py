"""The Gaussian noise of private steps: standard normals whose tails reach 11.3 sigma.

``jax.random.normal`` turns one 32-bit word into a float32 normal through the inverse error function
of a uniform on a grid of spacing ``2**-23``: its draws never leave ``[-5.42, 5.22]``, and the
Gaussian's mass beyond that range sits on the extreme grid points, about ``1.2e-7`` each. A noisy
coordinate at the top point, pushed up by the differing record's gradient, is beyond anything the
neighbouring data set can produce and reveals which one was used. That happens with probability
about ``1.2e-7`` per coordinate of every step that holds the record, which the accountant, assuming
exact Gaussian noise, does not count: ``T q d 1.2e-7`` over ``T`` steps at sampling rate ``q`` with
``d`` parameters, 7e-4 for 200 steps at ``q = 0.5`` with 62 parameters, against a delta of 1e-5.

:func:`standard_normal` builds each draw from three words instead: a sign bit and a uniform
``u = (r + 1/2) 2**-96`` in ``(0, 1/2]`` from the other 95 bits ``r`` (so ``u >= 2**-97``), mapped
through the normal quantile ``-ndtri(u)``, which float32 evaluates to a relative error below ``4e-7`` down
to ``u = 2**-97``. The draws reach ``|z| = 11.30``; the mass left beyond that is
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

__all__ = ["TAIL_MASS", "WORDS_PER_DRAW", "noise_tail_delta", "standard_normal"]

WORDS_PER_DRAW = 3
"""32-bit words of the key's stream per draw: the sign bit and 95 bits of the uniform."""

TAIL_MASS = 2.0**-96
"""The Gaussian's mass beyond the draws' range, ``P(|Z| > 11.30)``, per draw: ``2 * 2**-97``."""


def _from_words(words: jax.Array, dtype) -> jax.Array:
    """Standard normals from ``uint32[3, ...]`` words (word 0's top bit is the sign)."""
    compute = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    top = lax.convert_element_type(words[0] & np.uint32(0x7FFFFFFF), compute)
    middle = lax.convert_element_type(words[1], compute)
    low = lax.convert_element_type(words[2], compute)
    # u = (top 2**64 + middle 2**32 + low + 1/2) 2**-96 in (0, 1/2]: no draw is 0 and the smallest
    # 2**-97 is a normal float32, so the quantile is finite and accurate
    u = top * compute(2.0**-32) + middle * compute(2.0**-64) + (low + compute(0.5)) * compute(2.0**-96)
    magnitude = -jax.scipy.special.ndtri(u)
    z = jnp.where(words[0] >> np.uint32(31) == np.uint32(1), magnitude, -magnitude)
    return z.astype(dtype)


def standard_normal(rng_key: jax.Array, shape: tuple[int, ...] = (), dtype=jnp.float32) -> jax.Array:
    """Standard normal draws of ``shape``, with tails to ``|z| = 11.3`` (see the module doc).

    A drop-in for ``jax.random.normal(rng_key, shape, dtype)`` where the draws are privacy noise:
    any key (a Threefry key or :func:`d3pext.prng.secure_key`), under ``jit`` and ``vmap``. It reads
    three words of the key's stream per draw where ``jax.random.normal`` reads one, so the two give
    different numbers for the same key. Half-precision dtypes are drawn in float32 and rounded.

    >>> import jax
    >>> z = standard_normal(jax.random.key(0), (100_000,))
    >>> z.dtype, bool(abs(z.mean()) < 0.02), bool(abs(z.std() - 1) < 0.02)
    (dtype('float32'), True, True)
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"standard_normal draws floating-point numbers, got dtype {dtype}")
    shape = tuple(int(s) for s in shape)
    words = random.bits(rng_key, (WORDS_PER_DRAW, *shape), jnp.uint32)
    return _from_words(words, dtype)


def noise_tail_delta(epsilon: float, num_steps: int, num_coordinates: int) -> float:
    """What the noise's finite range adds to delta: ``(1 + e**epsilon) T d TAIL_MASS``.

    Each draw differs from an exact Gaussian one only with probability :data:`TAIL_MASS`, so ``T``
    steps of ``d`` noisy coordinates are within total variation ``T d TAIL_MASS`` of exact Gaussian
    noise, and a run the accountant finds ``(eps, delta)``-DP is ``(eps, delta + (1 + e**eps) T d
    TAIL_MASS)``-DP (as for the truncation of Poisson batches,
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
