"""ChaCha20 (RFC 8439) as a JAX PRNG implementation.

Keys made here are ordinary typed JAX keys, so every ``jax.random`` function and
every NumPyro distribution works with them unchanged, under ``jit`` and ``vmap``.

Key layout: the key data is the 256-bit ChaCha20 key (eight ``uint32`` words, the
little-endian words of the 32 key bytes). Every output is ChaCha20 keystream
under that key, the 16-word input block being

    constants | key | counter_lo, counter_hi | domain, data

(in RFC 8439 terms: block counter ``counter_lo`` and nonce
``(counter_hi, domain, data)``). The domain word separates the four uses of a
key, so that no two of them ever share a ChaCha20 input block:

* ``random_bits``: domain 0, data 0, counter 0, 1, 2, ...: the RFC 8439
  keystream with an all-zero nonce. 8-, 16- and 64-bit values are the keystream
  bytes read little-endian.
* ``split``: domain 1; child key ``i`` is keystream words ``8i .. 8i+7``.
* ``fold_in``: domain 2, data = the folded-in ``uint32``; the new key is the
  first half of block 0.
* ``seed``: an integer seed ``s`` (mod 2^64) becomes the key
  ``(s_lo, s_hi, 0, ..., 0)``, whose domain-3 block 0 gives the first half as the
  key. Integer seeds are for reproducible experiments only.

New keys are thus fresh output of the ChaCha20 pseudo-random function keyed by
the parent key: they are computationally independent of each other and of the
parent's ``random_bits`` stream, and nothing about the parent can be inferred
from them. Keys for real releases should come from :func:`secure_key`.
"""

from __future__ import annotations

import math
import operator
import secrets
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import define_prng_impl

__all__ = ["CHACHA20", "chacha20_block", "chacha_key", "secure_key", "threefry_key"]

# "expand 32-byte k", RFC 8439 section 2.3.
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)
_DOMAIN_BITS, _DOMAIN_SPLIT, _DOMAIN_FOLD_IN, _DOMAIN_SEED = 0, 1, 2, 3
_KEY_WORDS = 8
_BLOCK_WORDS = 16
_UINT_DTYPES = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def _rotl(x: jax.Array, n: int) -> jax.Array:
    return lax.shift_left(x, np.uint32(n)) | lax.shift_right_logical(x, np.uint32(32 - n))


def _quarter_round(a: jax.Array, b: jax.Array, c: jax.Array, d: jax.Array) -> tuple:
    a = a + b
    d = _rotl(d ^ a, 16)
    c = c + d
    b = _rotl(b ^ c, 12)
    a = a + b
    d = _rotl(d ^ a, 8)
    c = c + d
    b = _rotl(b ^ c, 7)
    return a, b, c, d


def _double_round(_: int, rows: tuple) -> tuple:
    # The state as a 4x4 matrix of words, rows (a, b, c, d): the column round works
    # on whole rows; rotating rows b, c, d by 1, 2, 3 turns diagonals into columns.
    # Four row-wide operations instead of sixteen word-wide ones keep the XLA graph
    # (and its compile time) small.
    a, b, c, d = _quarter_round(*rows)
    b, c, d = jnp.roll(b, -1, 0), jnp.roll(c, -2, 0), jnp.roll(d, -3, 0)
    a, b, c, d = _quarter_round(a, b, c, d)
    return a, jnp.roll(b, 1, 0), jnp.roll(c, 2, 0), jnp.roll(d, 3, 0)


def _block(words: list) -> jax.Array:
    """ChaCha20 block function on 16 broadcast-compatible ``uint32`` input words.

    Returns the output words stacked on the leading axis, ``uint32[16, ...]``.
    """
    shape = jnp.broadcast_shapes(*(jnp.shape(w) for w in words))
    init = jnp.stack([jnp.broadcast_to(jnp.asarray(w, jnp.uint32), shape) for w in words])
    init = init.reshape(4, 4, *shape)
    # a rolled loop: unrolling all 20 rounds makes XLA's compile time explode
    rows = lax.fori_loop(0, 10, _double_round, tuple(init))
    return (jnp.stack(rows) + init).reshape(_BLOCK_WORDS, *shape)


@jax.jit
def chacha20_block(key: jax.Array, counter: jax.Array, nonce: jax.Array) -> jax.Array:
    """The ChaCha20 block function of RFC 8439, section 2.3.

    Vectorised over leading (broadcast) dimensions and jit-able.

    Args:
        key: ``uint32[..., 8]``, the little-endian words of the 256-bit key.
        counter: ``uint32[...]``, the 32-bit block counter.
        nonce: ``uint32[..., 3]``, the little-endian words of the 96-bit nonce.

    Returns:
        ``uint32[..., 16]``, the output state; its little-endian bytes are the
        keystream block.

    >>> import numpy as np
    >>> key = np.arange(32, dtype=np.uint8).view("<u4")
    >>> nonce = np.array([0x09000000, 0x4A000000, 0], dtype=np.uint32)
    >>> hex(int(chacha20_block(key, np.uint32(1), nonce)[0]))
    '0xe4e7f110'
    """
    key = jnp.asarray(key, jnp.uint32)
    nonce = jnp.asarray(nonce, jnp.uint32)
    counter = jnp.asarray(counter, jnp.uint32)
    if key.shape[-1:] != (_KEY_WORDS,):
        raise ValueError(f"key must have shape (..., 8), got {key.shape}")
    if nonce.shape[-1:] != (3,):
        raise ValueError(f"nonce must have shape (..., 3), got {nonce.shape}")
    words = [np.uint32(c) for c in _SIGMA]
    words += [key[..., i] for i in range(_KEY_WORDS)]
    words += [counter] + [nonce[..., i] for i in range(3)]
    return jnp.moveaxis(_block(words), 0, -1)


def _keystream(key: jax.Array, domain: int, num_words: int) -> jax.Array:
    """The first ``num_words`` words of the keystream of ``key`` in ``domain``."""
    num_blocks = -(-num_words // _BLOCK_WORDS)
    if num_blocks > 2**32:
        raise ValueError(
            f"a single ChaCha20 random_bits call is limited to 2**32 blocks "
            f"(256 GiB); {num_words} words were requested"
        )
    counter = lax.iota(jnp.uint32, num_blocks)
    words = [np.uint32(c) for c in _SIGMA]
    words += [key[i] for i in range(_KEY_WORDS)]
    words += [counter, np.uint32(0), np.uint32(domain), np.uint32(0)]
    return _block(words).T.reshape(-1)[:num_words]


def _first_half_block(key: jax.Array, domain: int, data: jax.Array) -> jax.Array:
    words = [np.uint32(c) for c in _SIGMA]
    words += [key[i] for i in range(_KEY_WORDS)]
    words += [np.uint32(0), np.uint32(0), np.uint32(domain), data]
    return _block(words)[:_KEY_WORDS]


@jax.jit
def _seed(seed: jax.Array) -> jax.Array:
    if seed.shape:
        raise TypeError(f"PRNG key seed must be a scalar; got shape {seed.shape}")
    if not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"PRNG key seed must be an integer; got dtype {seed.dtype}")
    lo = lax.convert_element_type(seed, jnp.uint32)
    if jnp.iinfo(seed.dtype).bits == 64:
        hi = lax.shift_right_arithmetic(seed, seed.dtype.type(32))
        hi = lax.convert_element_type(hi, jnp.uint32)
    elif jnp.issubdtype(seed.dtype, jnp.signedinteger):
        # sign-extend, so that a seed gives the same key with and without x64
        hi = lax.convert_element_type(
            lax.shift_right_arithmetic(lax.convert_element_type(seed, jnp.int32), np.int32(31)),
            jnp.uint32,
        )
    else:
        hi = np.uint32(0)
    return _seed_from_words(lo, hi)


@jax.jit
def _seed_from_words(lo: jax.Array, hi: jax.Array) -> jax.Array:
    seed_key = [lo, hi] + [np.uint32(0)] * (_KEY_WORDS - 2)
    return _first_half_block(seed_key, _DOMAIN_SEED, np.uint32(0))


@partial(jax.jit, static_argnums=1, inline=True)
def _split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    n = math.prod(shape)
    return _keystream(key, _DOMAIN_SPLIT, n * _KEY_WORDS).reshape(*shape, _KEY_WORDS)


@partial(jax.jit, inline=True)
def _fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    return _first_half_block(key, _DOMAIN_FOLD_IN, jnp.asarray(data, jnp.uint32))


@partial(jax.jit, static_argnums=(1, 2), inline=True)
def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    if bit_width not in _UINT_DTYPES:
        raise TypeError(f"bit_width must be 8, 16, 32 or 64, got {bit_width}")
    dtype = _UINT_DTYPES[bit_width]
    n = math.prod(shape)
    if n == 0:
        return jnp.zeros(shape, dtype)
    words = _keystream(key, _DOMAIN_BITS, -(-n * bit_width // 32))
    if bit_width == 64:
        pairs = words.reshape(-1, 2).astype(dtype)
        bits = pairs[:, 0] | lax.shift_left(pairs[:, 1], np.uint64(32))
    elif bit_width == 32:
        bits = words
    else:
        shifts = np.arange(0, 32, bit_width, dtype=np.uint32)
        bits = lax.shift_right_logical(words[:, None], shifts[None, :]).astype(dtype)
        bits = bits.reshape(-1)[:n]
    return bits.reshape(shape)


# The implementation's operations are plain module functions: a key type is pickled with its
# implementation, by reference, and only those find the same objects again (a jitted function pickles
# as a new one). d3pext's program store (d3pext.compile_cache) pickles the types of a program's keys.
def _impl_seed(seed: jax.Array) -> jax.Array:
    return _seed(seed)


def _impl_split(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return _split(key, shape)


def _impl_random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    return _random_bits(key, bit_width, shape)


def _impl_fold_in(key: jax.Array, data: jax.Array) -> jax.Array:
    return _fold_in(key, data)


CHACHA20 = define_prng_impl(
    key_shape=(_KEY_WORDS,),
    seed=_impl_seed,
    split=_impl_split,
    random_bits=_impl_random_bits,
    fold_in=_impl_fold_in,
    name="chacha20",
    tag="chacha20",
)
"""The ChaCha20 PRNG implementation, for ``jax.random.key(..., impl=CHACHA20)``."""


def chacha_key(seed: int | bytes) -> jax.Array:
    """A reproducible ChaCha20 key from an explicit seed. NOT for real releases.

    Use it for tests and experiments that must be repeatable; keys that protect a
    real release must be unpredictable: use :func:`secure_key`.

    Args:
        seed: an integer in ``[-2**63, 2**64)`` (taken mod 2**64; the key equals
            ``jax.random.key(seed, impl=CHACHA20)`` wherever JAX accepts that seed),
            or exactly 32 bytes, used verbatim as the ChaCha20 key.

    Returns:
        A scalar typed key of implementation :data:`CHACHA20`.

    >>> import jax
    >>> x = jax.random.normal(chacha_key(0), (3,))
    >>> bool((x == jax.random.normal(chacha_key(0), (3,))).all())
    True
    """
    if isinstance(seed, (bytes, bytearray)):
        if len(seed) != 4 * _KEY_WORDS:
            raise ValueError(f"a bytes seed must be exactly 32 bytes long, got {len(seed)}")
        data = np.frombuffer(bytes(seed), dtype="<u4").astype(np.uint32)
        # device_put, not jnp.asarray: in a fresh process that compiles a small program (secure_key's 30 ms)
        return jax.random.wrap_key_data(jax.device_put(data), impl=CHACHA20)
    if isinstance(seed, bool) or not hasattr(seed, "__index__"):
        raise TypeError(f"seed must be an int or 32 bytes, got {type(seed).__name__}")
    seed = operator.index(seed)
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"an integer seed must lie in [-2**63, 2**64), got {seed}")
    seed %= 2**64
    # through uint32 words, so that 64-bit seeds work without jax_enable_x64
    data = _seed_from_words(np.uint32(seed & 0xFFFFFFFF), np.uint32(seed >> 32))
    return jax.random.wrap_key_data(data, impl=CHACHA20)


def secure_key() -> jax.Array:
    """A fresh ChaCha20 key from 256 bits of OS entropy (``secrets.token_bytes``).

    The default for anything that is released: not reproducible by design.

    >>> import jax
    >>> key = secure_key()
    >>> jax.random.key_impl(key) == CHACHA20
    True
    >>> bool((jax.random.key_data(key) != jax.random.key_data(secure_key())).any())
    True
    """
    return chacha_key(secrets.token_bytes(4 * _KEY_WORDS))


def threefry_key(key: jax.Array) -> jax.Array:
    """A Threefry key drawn from any key, for JAX samplers tied to Threefry.

    ``jax.random.poisson`` (hence ``numpyro.distributions.Poisson``) accepts only
    Threefry keys, and ``jax.random.gamma`` (Gamma, Beta, Dirichlet, StudentT, ...)
    vectorises only for Threefry keys (others take a sequential ``lax.map``, about
    20x slower for 10^4 draws). The new key is 64 bits of the given key's stream:
    use it where that suffices, e.g. for inference on released data.

    >>> import jax
    >>> k = threefry_key(chacha_key(0))
    >>> jax.random.poisson(k, 3.0, (2,)).shape
    (2,)
    """
    return jax.random.wrap_key_data(
        jax.random.bits(key, (2,), jnp.uint32), impl="threefry2x32"
    )
