"""Threefry on a CPU, hashed over one flat axis: the same bits, a fraction of the compile time.

JAX up to at least 0.10 lowers its Threefry-2x32 hash on a CPU as a rolled loop (five passes of four
rounds, to keep programs small). Applied to a counter array of two or more dimensions, that loop
takes XLA's CPU backend seconds to compile: ``jax.random.bits(key, (2, 90, 15))`` 3.3 s against 0.3 s
for ``(2700,)``, on one core; ``normal`` 3.2 against 0.5 s, ``poisson`` 3.4 against 1.2 s. Nearly every
draw in a vectorised sampler has several dimensions (chains x cells x components), and each call
site pays it again (about 15% of a Poisson-factorization Gibbs sampler's compile).

:func:`install` registers a CPU lowering of ``threefry2x32_p`` that flattens the counters, runs the
same rolled hash over one axis (padded to a multiple of :data:`FLAT_MULTIPLE`) and restores the
shape: Threefry-2x32 with 20 rounds (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011), the rotation constants and key schedule of
the Random123 reference, so every key, split and draw is bit for bit what JAX computes (tested
against JAX's own lowering and the Random123 known answers). It changes nothing on other
platforms, leaves arrays with a sharded axis in their shape and arrays of more than
:data:`FLAT_MAX_SIZE` counters to JAX (there the flat loop ran slower), and is installed only where
the installed JAX still lowers the hash as a rolled loop on a CPU. ``D3PEXT_KEEP_JAX_THREEFRY=1``
keeps JAX's lowering.
"""

from __future__ import annotations

import math
import os

import numpy as np

import jax
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir

__all__ = [
    "FLAT_MAX_SIZE", "install", "installed", "is_threefry_key", "key_words", "random_bits_unrolled", "threefry2x32_20",
    "threefry2x32_unrolled",
]

OPT_OUT_ENV = "D3PEXT_KEEP_JAX_THREEFRY"

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # even passes, odd passes
_PARITY = np.uint32(0x1BD11BDA)  # the key schedule's parity constant (Skein / Threefish)
_PASSES = 5  # of four rounds each

_installed = False


# The hash is traced again at every call site of every program lowered (also where the compiled
# program then comes from the persistent cache): plain lax calls, not operators, keep that cheap.
def _rotate_left(x: jax.Array, r, complement) -> jax.Array:
    """``x`` rotated left by ``r`` bits; ``complement`` is ``32 - r``."""
    return lax.bitwise_or(lax.shift_left(x, r), lax.shift_right_logical(x, complement))


def _broadcast_to(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if np.shape(a) == shape:
        return a
    return lax.broadcast_in_dim(a, shape, tuple(range(len(shape) - np.ndim(a), len(shape))))


def _more_passes(state) -> jax.Array:
    return lax.lt(state[0], np.int32(_PASSES))


def _four_rounds(state):
    i, x1, x2, ka, kb, kc = state
    even = lax.eq(lax.bitwise_and(i, np.int32(1)), np.int32(0))
    for j in range(4):
        x1 = lax.add(x1, x2)
        r, odd_r = _ROTATIONS[0][j], _ROTATIONS[1][j]
        rotated = _rotate_left(
            x2, lax.select(even, np.uint32(r), np.uint32(odd_r)), lax.select(even, np.uint32(32 - r), np.uint32(32 - odd_r))
        )
        x2 = lax.bitwise_xor(x1, rotated)
    # key injection i + 1: the next two key words, and the injection's index
    i = lax.add(i, np.int32(1))
    return i, lax.add(x1, kb), lax.add(lax.add(x2, kc), lax.convert_element_type(i, np.uint32)), kb, kc, ka


def threefry2x32_20(k1, k2, x1, x2) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32-20 of the counters ``(x1, x2)`` under the key ``(k1, k2)`` (uint32, broadcast),
    as five rolled passes of four rounds over one flat axis.

    Traced once per call site of every program lowered: with ``jnp`` calls and ``fori_loop`` over a
    closure it took about 18 ms a site to trace and lower, about 4 ms now.

    >>> import numpy as np
    >>> [hex(int(v)) for v in threefry2x32_20(*np.zeros(4, np.uint32))]  # Random123 known answer
    ['0x6b200159', '0x99ba4efe']
    """
    k1, k2, x1, x2 = (lax.convert_element_type(a, np.uint32) for a in (k1, k2, x1, x2))
    shape = lax.broadcast_shapes(*(np.shape(a) for a in (k1, k2, x1, x2)))
    size = math.prod(shape)
    padded = size if size < FLAT_MULTIPLE else -(-size // FLAT_MULTIPLE) * FLAT_MULTIPLE

    def flat(a):
        a = lax.reshape(_broadcast_to(a, shape), (size,))
        return lax.pad(a, np.uint32(0), ((0, padded - size, 0),)) if padded != size else a

    if np.ndim(k1) or np.ndim(k2):
        k1, k2 = flat(k1), flat(k2)
    keys = (k1, k2, lax.bitwise_xor(lax.bitwise_xor(k1, k2), _PARITY))
    x1, x2 = lax.add(flat(x1), keys[0]), lax.add(flat(x2), keys[1])
    _, x1, x2, *_ = lax.while_loop(_more_passes, _four_rounds, (np.int32(0), x1, x2, *keys))
    if padded != size:
        x1, x2 = lax.slice(x1, (0,), (size,)), lax.slice(x2, (0,), (size,))
    return lax.reshape(x1, shape), lax.reshape(x2, shape)


def threefry2x32_unrolled(
    k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32-20 written out: 20 unrolled rounds of plain ``uint32`` ops, no loop.

    For hashes nested in a loop of their own (the Feistel rounds of
    :mod:`d3pext.training.minibatch`), where the rolled hash of the lowering, a loop inside
    the loop, made compilation several times slower, above all under ``vmap``. Traced as one pass
    of four rounds, unrolled five times when lowered (five calls of one function, which XLA
    inlines): the program XLA compiles is the written-out hash, the jaxpr a fifth of its size.

    >>> import numpy as np
    >>> [hex(int(v)) for v in threefry2x32_unrolled(*np.zeros(4, np.uint32))]  # Random123 known answer
    ['0x6b200159', '0x99ba4efe']
    """
    k0, k1, x0, x1 = (lax.convert_element_type(a, np.uint32) for a in (k0, k1, x0, x1))
    key_shape = lax.broadcast_shapes(np.shape(k0), np.shape(k1))
    k0, k1 = _broadcast_to(k0, key_shape), _broadcast_to(k1, key_shape)  # the passes rotate the key words
    k2 = lax.bitwise_xor(lax.bitwise_xor(k0, k1), _PARITY)
    x0, x1 = lax.add(x0, k0), lax.add(x1, k1)
    shape = lax.broadcast_shapes(np.shape(x0), np.shape(x1))
    state = (np.int32(0), _broadcast_to(x0, shape), _broadcast_to(x1, shape), k0, k1, k2)
    state = lax.fori_loop(0, _PASSES, lambda _, state: _four_rounds(state), state, unroll=True)
    return state[1], state[2]


def is_threefry_key(rng_key: jax.Array) -> bool:
    """Whether ``rng_key`` is a Threefry-2x32 key: a typed key of that implementation, or a raw ``uint32``
    key under JAX's default implementation.

    >>> is_threefry_key(jax.random.key(0)), is_threefry_key(jax.random.PRNGKey(0))
    (True, True)
    """
    typed = jax.dtypes.issubdtype(rng_key.dtype, jax.dtypes.prng_key)
    return (str(jax.random.key_impl(rng_key)) if typed else jax.config.jax_default_prng_impl) == "threefry2x32"


def key_words(rng_key: jax.Array) -> jax.Array:
    """The ``uint32`` words of a typed or raw key."""
    return jax.random.key_data(rng_key) if jax.dtypes.issubdtype(rng_key.dtype, jax.dtypes.prng_key) else rng_key


def random_bits_unrolled(rng_key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``jax.random.bits(rng_key, shape, jnp.uint32)``, from the hash written out for a Threefry key.

    For a small draw that has one consumer (a Feistel network's round keys, the noise's rare third
    words): XLA fuses the rounds into that consumer's kernel, where the lowering's hash is a loop of
    kernels of its own. The same bits (JAX's default partitionable counters: the flat index); other
    keys, and Threefry keys with ``jax_threefry_partitionable`` off, draw with ``jax.random.bits``.

    >>> key = jax.random.key(0)
    >>> bool((random_bits_unrolled(key, (3, 2)) == jax.random.bits(key, (3, 2), np.uint32)).all())
    True
    """
    size = math.prod(shape)
    if not is_threefry_key(rng_key) or not jax.config.jax_threefry_partitionable or size >= 2**32:
        return jax.random.bits(rng_key, shape, np.uint32)
    words = key_words(rng_key)
    counters = lax.iota(np.uint32, size)
    bits1, bits2 = threefry2x32_unrolled(words[0], words[1], lax.full_like(counters, 0), counters)
    return lax.reshape(lax.bitwise_xor(bits1, bits2), tuple(shape))


def _sharded(aval) -> bool:
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


_flat_rule = mlir.lower_fun(threefry2x32_20, multiple_results=True)


FLAT_MAX_SIZE = 2**14
"""Counter arrays up to this size are hashed flat; larger ones keep JAX's lowering. The flat loop
compiles in a fraction of the time at any size, but over large arrays it ran 10-30% slower (1M bits,
one core; 64 vectorised Gibbs chains: 0.85-0.88x the sweeps per second), where the run, not the
compile, is what the user waits for."""


FLAT_MULTIPLE = 16
"""The flat loop hashes a multiple of this many counters (zeros appended, their outputs dropped): LLVM
then vectorises the rounds without a scalar remainder loop, about half the code of a 31-counter draw.
Fewer counters (key splits, scalar draws) are hashed as they are: they have no vectorised loop to
spare, and a padded hash would count as 16 on every device of a mesh."""


def _lowering(ctx, k1, k2, x1, x2):
    size = math.prod(ctx.avals_out[0].shape)
    if size > FLAT_MAX_SIZE or any(_sharded(a) for a in ctx.avals_out):
        return _jax_cpu_rule(ctx, k1, k2, x1, x2)
    return _flat_rule(ctx, k1, k2, x1, x2)


def _jax_cpu_rule_of_this_version():
    """JAX's rolled CPU lowering of the hash, or ``None`` where this JAX does not have one."""
    try:
        from jax._src.random import threefry2x32 as jax_threefry
    except ImportError:
        return None
    return getattr(jax_threefry, "_threefry2x32_cpu_lowering_rule", None)


_jax_cpu_rule = _jax_cpu_rule_of_this_version()


def installed() -> bool:
    """Whether the flat CPU lowering is in use in this process."""
    return _installed


def install() -> bool:
    """Register the flat CPU lowering (once per process); returns whether it is in use.

    Not installed where ``D3PEXT_KEEP_JAX_THREEFRY`` is set, or where this JAX has no rolled CPU
    lowering to replace (newer versions lower the hash differently).
    """
    global _installed
    if _installed or _jax_cpu_rule is None:
        return _installed
    if (os.environ.get(OPT_OUT_ENV) or "").strip().lower() not in ("", "0", "false", "no", "off"):
        return False
    mlir.register_lowering(threefry2x32_p, _lowering, platform="cpu")
    _installed = True
    return True
