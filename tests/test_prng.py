"""Tests for d3pext.prng: ChaCha20 block function (RFC 8439) and the JAX PRNG built on it."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import stats

from d3pext.prng import CHACHA20, chacha20_block, chacha_key, secure_key, threefry_key

RFC_KEY = bytes(range(32))


def words(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<u4").astype(np.uint32)


def block_bytes(key: bytes, counter: int, nonce: bytes) -> bytes:
    out = chacha20_block(words(key), np.uint32(counter), words(nonce))
    return np.asarray(out).astype("<u4").tobytes()


def test_block_function_rfc8439_2_3_2():
    nonce = bytes.fromhex("000000090000004a00000000")
    out = chacha20_block(words(RFC_KEY), np.uint32(1), words(nonce))
    expected = [
        0xE4E7F110, 0x15593BD1, 0x1FDD0F50, 0xC47120A3,
        0xC7F4D1C7, 0x0368C033, 0x9AAA2204, 0x4E6CD4C3,
        0x466482D2, 0x09AA9F07, 0x05D7C214, 0xA2028BD9,
        0xD19C12B5, 0xB94E16DE, 0xE883D0CB, 0x4E3C50A2,
    ]  # fmt: skip
    np.testing.assert_array_equal(np.asarray(out), np.array(expected, np.uint32))


def test_encryption_keystream_rfc8439_2_4_2():
    nonce = bytes.fromhex("000000000000004a00000000")
    plaintext = (
        b"Ladies and Gentlemen of the class of '99: If I could offer you only one tip "
        b"for the future, sunscreen would be it."
    )
    ciphertext = bytes.fromhex(
        "6e2e359a2568f98041ba0728dd0d6981e97e7aec1d4360c20a27afccfd9fae0b"
        "f91b65c5524733ab8f593dabcd62b3571639d624e65152ab8f530c359f0861d8"
        "07ca0dbf500d6a6156a38e088a22b65e52bc514d16ccf806818ce91ab7793736"
        "5af90bbf74a35be6b40b8eedf2785e42874d"
    )
    # both blocks in one vectorised call
    out = chacha20_block(words(RFC_KEY), np.array([1, 2], np.uint32), words(nonce))
    keystream = np.asarray(out).astype("<u4").tobytes()[: len(plaintext)]
    assert bytes(a ^ b for a, b in zip(plaintext, keystream)) == ciphertext


A1_VECTORS = [  # RFC 8439 appendix A.1: (key, counter, nonce, keystream block)
    (bytes(32), 0, bytes(12),
     "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
     "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"),
    (bytes(32), 1, bytes(12),
     "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
     "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"),
    (bytes(31) + b"\x01", 1, bytes(12),
     "3aeb5224ecf849929b9d828db1ced4dd832025e8018b8160b82284f3c949aa5a"
     "8eca00bbb4a73bdad192b5c42f73f2fd4e273644c8b36125a64addeb006c13a0"),
    (b"\x00\xff" + bytes(30), 2, bytes(12),
     "72d54dfbf12ec44b362692df94137f328fea8da73990265ec1bbbea1ae9af0ca"
     "13b25aa26cb4a648cb9b9d1be65b2c0924a66c54d545ec1b7374f4872e99f096"),
    (bytes(32), 0, bytes(11) + b"\x02",
     "c2c64d378cd536374ae204b9ef933fcd1a8b2288b3dfa49672ab765b54ee27c7"
     "8a970e0e955c14f3a88e741b97c286f75f8fc299e8148362fa198a39531bed6d"),
]  # fmt: skip


@pytest.mark.parametrize("key,counter,nonce,expected", A1_VECTORS)
def test_block_function_rfc8439_a1(key, counter, nonce, expected):
    assert block_bytes(key, counter, nonce).hex() == expected


def test_random_bits_is_rfc_keystream():
    # random_bits of a raw 32-byte key is the RFC keystream with a zero nonce from
    # counter 0: vectors A.1 #1 and #2 back to back.
    key = chacha_key(bytes(32))
    out = np.asarray(jax.random.bits(key, (128,), jnp.uint8)).tobytes()
    assert out.hex() == A1_VECTORS[0][3] + A1_VECTORS[1][3]


@pytest.mark.parametrize("dtype,n", [(jnp.uint8, 203), (jnp.uint16, 77), (jnp.uint32, 1000)])
def test_random_bits_match_independent_implementation(dtype, n):
    # OpenSSL's ChaCha20 through `cryptography`: little-endian keystream bytes
    algorithms = pytest.importorskip("cryptography.hazmat.primitives.ciphers.algorithms")
    ciphers = pytest.importorskip("cryptography.hazmat.primitives.ciphers")
    raw = bytes(range(100, 132))
    encryptor = ciphers.Cipher(algorithms.ChaCha20(raw, bytes(16)), mode=None).encryptor()
    expected = encryptor.update(bytes(n * np.dtype(dtype).itemsize))
    out = jax.jit(lambda k: jax.random.bits(k, (n,), dtype))(chacha_key(raw))
    assert np.asarray(out).astype(np.dtype(dtype).newbyteorder("<")).tobytes() == expected


def test_random_bits_64_and_shapes():
    key = chacha_key(5)

    @jax.jit
    def draws(key):
        return (
            jax.random.bits(key, (8,), jnp.uint32),
            jax.random.bits(key, (0, 3), jnp.uint8),
            jax.random.bits(key, (7,), jnp.uint8),
            jax.random.bits(key, (2, 8), jnp.uint8),
        )

    w32, empty, short, long = (np.asarray(x) for x in draws(key))
    with jax.enable_x64(True):
        w64 = np.asarray(jax.random.bits(key, (2, 2), jnp.uint64)).ravel()
        assert jax.random.normal(key, (3,), jnp.float64).dtype == jnp.float64
    w32 = w32.astype(np.uint64)
    np.testing.assert_array_equal(w64, w32[0::2] | (w32[1::2] << np.uint64(32)))
    assert empty.shape == (0, 3)
    # shorter requests are prefixes of longer ones
    np.testing.assert_array_equal(short, long.ravel()[:7])


def test_seeds():
    for seed in [0, 1, -1, 2**31 - 1, -(2**31)]:
        np.testing.assert_array_equal(
            jax.random.key_data(chacha_key(seed)),
            jax.random.key_data(jax.random.key(seed, impl=CHACHA20)),
        )
    with jax.enable_x64(True):
        for seed in [2**40 + 3, -(2**40)]:
            np.testing.assert_array_equal(
                jax.random.key_data(chacha_key(seed)),
                jax.random.key_data(jax.random.key(seed, impl=CHACHA20)),
            )
    assert jax.random.key_impl(chacha_key(2**64 - 1)) == CHACHA20
    # -1 and 2**64 - 1 are the same seed mod 2**64; 0 and 2**32 are not
    np.testing.assert_array_equal(
        jax.random.key_data(chacha_key(-1)), jax.random.key_data(chacha_key(2**64 - 1))
    )
    assert not np.array_equal(
        jax.random.key_data(chacha_key(0)), jax.random.key_data(chacha_key(2**32))
    )
    np.testing.assert_array_equal(jax.random.key_data(chacha_key(RFC_KEY)), words(RFC_KEY))


@pytest.mark.parametrize(
    "seed,error",
    [(b"short", ValueError), (2**64, ValueError), (-(2**63) - 1, ValueError),
     (1.5, TypeError), (True, TypeError), ("0", TypeError)],
)  # fmt: skip
def test_chacha_key_validation(seed, error):
    with pytest.raises(error, match="seed"):
        chacha_key(seed)


def test_block_validation():
    with pytest.raises(ValueError, match="key"):
        chacha20_block(np.zeros(7, np.uint32), np.uint32(0), np.zeros(3, np.uint32))
    with pytest.raises(ValueError, match="nonce"):
        chacha20_block(np.zeros(8, np.uint32), np.uint32(0), np.zeros(2, np.uint32))


def test_secure_key():
    a, b = secure_key(), secure_key()
    assert jax.random.key_impl(a) == CHACHA20
    assert not np.array_equal(jax.random.key_data(a), jax.random.key_data(b))


def test_split_and_fold_in_give_distinct_streams():
    key = chacha_key(123)

    @jax.jit
    def derive(key):
        children = jax.random.split(key, 1000)
        folded = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(1000))
        seeded = jax.vmap(lambda s: jax.random.key(s, impl=CHACHA20))(jnp.arange(1000, 2000))
        keys = [jax.random.key_data(k).reshape(-1, 8) for k in (key, children, folded, seeded)]
        streams = [
            jax.random.bits(key, (1, 8), jnp.uint32),
            jax.vmap(lambda k: jax.random.bits(k, (8,), jnp.uint32))(children),
        ]
        return jnp.concatenate(keys), jnp.concatenate(streams), children

    keys, streams, children = derive(key)
    assert len({row.tobytes() for row in np.asarray(keys)}) == len(keys)
    # the parent's own stream shares nothing with its children's
    assert len({row.tobytes() for row in np.asarray(streams)}) == len(streams)
    # split is deterministic, prefix-consistent and shape-aware
    np.testing.assert_array_equal(
        jax.random.key_data(jax.random.split(key, 3)), jax.random.key_data(children[:3])
    )
    assert jax.random.split(key, (2, 3)).shape == (2, 3)


def test_jax_random_under_jit_and_vmap():
    keys = jax.random.split(chacha_key(7), 3)

    def draws(k):
        k1, k2 = jax.random.split(k)
        return {
            "normal": jax.random.normal(k1, (3,)),
            "uniform": jax.random.uniform(jax.random.fold_in(k, 9), (3,)),
            "bits": jax.random.bits(k2, (2,)),
            "choice": jax.random.choice(k, 10, (4,), replace=False),
            "permutation": jax.random.permutation(k, 6),
            "bernoulli": jax.random.bernoulli(k, 0.3, (5,)),
            "categorical": jax.random.categorical(k, jnp.zeros(5), shape=(3,)),
            "randint": jax.random.randint(k, (3,), 0, 7),
            "laplace": jax.random.laplace(k, (2,)),
        }

    batched = jax.jit(jax.vmap(draws))(keys)
    single = jax.jit(draws)
    for i in range(len(keys)):
        for name, value in single(keys[i]).items():
            np.testing.assert_allclose(batched[name][i], value, rtol=1e-6, err_msg=name)
    assert np.all(np.sort(batched["permutation"], axis=1) == np.arange(6))
    assert all(len(set(row.tolist())) == 4 for row in batched["choice"])


def test_numpyro_distributions_under_jit_and_vmap():
    keys = jax.random.split(chacha_key(11), 3)
    dists = [
        dist.Normal(0.0, 1.0), dist.Gamma(2.0, 1.0), dist.Binomial(10, 0.3),
        dist.Categorical(jnp.ones(4) / 4), dist.MultivariateNormal(jnp.zeros(2), jnp.eye(2)),
        dist.Laplace(0.0, 1.0),
    ]  # fmt: skip
    out = jax.jit(jax.vmap(lambda k: [d.sample(k, (2,)) for d in dists]))(keys)
    for d, samples in zip(dists, out):
        assert samples.shape == (3, 2) + d.event_shape
        assert np.all(np.isfinite(samples))
        assert np.all(np.asarray(d.support(samples)))

    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        numpyro.sample("x", dist.Normal(mu, 1.0), sample_shape=(3,))

    trace = numpyro.handlers.trace(numpyro.handlers.seed(model, keys[0])).get_trace()
    assert trace["x"]["value"].shape == (3,)


def test_threefry_key():
    key = chacha_key(3)
    derived = threefry_key(key)
    assert jax.random.key_impl(derived) == jax.random.key_impl(jax.random.key(0))
    np.testing.assert_array_equal(
        jax.random.key_data(derived), jax.random.key_data(threefry_key(key))
    )
    batched = jax.jit(jax.vmap(threefry_key))(jax.random.split(key, 3))
    assert batched.shape == (3,)
    # jax.random.poisson only supports threefry keys; threefry_key bridges to it
    with pytest.raises(NotImplementedError):
        dist.Poisson(3.0).sample(key)
    assert dist.Poisson(3.0).sample(derived, (4,)).shape == (4,)


def test_uniformity():
    @jax.jit
    def draw(key):
        return (
            jax.random.uniform(key, (100_000,)),
            jax.random.bits(jax.random.fold_in(key, 1), (2**20,), jnp.uint8),
            jax.random.bits(jax.random.fold_in(key, 2), (2**16,), jnp.uint32),
        )

    u, b, w = (np.asarray(x) for x in draw(chacha_key(2024)))
    # KS test of 1e5 uniforms; p-value threshold 1e-3 with a fixed seed
    assert stats.kstest(u, "uniform").pvalue > 1e-3
    # byte values: chi-square over 256 cells, 2**20 bytes (4096 per cell)
    assert stats.chisquare(np.bincount(b, minlength=256)).pvalue > 1e-3
    # every bit position of 32-bit words: binomial z-scores, |z| < 4 for each of 32
    ones = ((w[:, None] >> np.arange(32, dtype=np.uint32)) & 1).sum(0)
    z = (ones - w.size / 2) / np.sqrt(w.size / 4)
    assert np.all(np.abs(z) < 4)
    # consecutive words are uncorrelated: |r| < 4 / sqrt(n)
    r = np.corrcoef(w[:-1].astype(float), w[1:].astype(float))[0, 1]
    assert abs(r) < 4 / np.sqrt(w.size)
