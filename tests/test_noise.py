"""DPSVI's Gaussian noise: exact standard normals whose tails reach 11.3 sigma (d3pext.training.noise)."""

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats

import jax
import jax.numpy as jnp
from jax import lax

from d3pext.prng import chacha_key
from d3pext.training.noise import TAIL_MASS, _from_words, noise_tail_delta, standard_normal


def _reference(words: np.ndarray) -> np.ndarray:
    """The same map in float64 (exact integer grids, scipy's quantile)."""
    w0, w1, w2 = (words[i].astype(np.float64) for i in range(3))
    top = w0 % 2**31
    u = np.where(top > 0, (top * 2.0**32 + w1 + 0.5) * 2.0**-64, (w1 * 2.0**32 + w2 + 0.5) * 2.0**-96)
    magnitude = -scipy.special.ndtri(u)
    return np.where(words[0] >> 31 == 1, magnitude, -magnitude)


def test_jax_normal_stops_at_5_4_sigma():
    """The reason for the module: float32 jax.random.normal has no draw beyond [-5.42, 5.22]."""
    lo, hi = np.nextafter(np.float32(-1), np.float32(0)), np.float32(1)
    f = jnp.array([0.0, 1 - 2.0**-23], jnp.float32)  # the smallest and largest of its 23-bit grid
    u = jnp.maximum(lo, f * (hi - lo) + lo)  # jax.random.uniform(..., minval=lo, maxval=1)
    z = np.sqrt(np.float32(2)) * np.asarray(lax.erf_inv(u))
    assert -5.43 < z[0] < -5.41 and 5.21 < z[1] < 5.23
    # each extreme point carries the Gaussian's mass beyond it, ~1e-7, which the accountant does not count
    assert scipy.stats.norm.sf(5.22) > 8e-8


def test_map_matches_the_float64_quantile_over_the_whole_range():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(3, 20_000), dtype=np.uint64).astype(np.uint32)
    # also the deep tail: the top word 0 or 1 (u < 2**-63), the top two words 0 (u < 2**-95)
    words[0, :5000] &= np.uint32(0x80000001)
    words[1, :2000] = 0
    words[0, :2000] &= np.uint32(0x80000000)
    z = np.asarray(_from_words(*jnp.asarray(words), jnp.float32), np.float64)
    ref = _reference(words)
    assert np.all(np.isfinite(z))
    np.testing.assert_allclose(z, ref, rtol=1e-6, atol=1e-7)
    assert np.abs(z).max() > 10.0  # the deep-tail words reach beyond 10 sigma


def test_extreme_words_reach_11_3_sigma_both_ways_and_zero_is_not_a_lump():
    words = np.array([[0x80000000, 0x00000000, 0x7FFFFFFF, 0xFFFFFFFF],
                      [0, 0, 0xFFFFFFFF, 0xFFFFFFFF],
                      [0, 0, 0xFFFFFFFF, 0xFFFFFFFF]], np.uint32)  # fmt: skip
    z = np.asarray(_from_words(*jnp.asarray(words), jnp.float32))
    assert z[0] == pytest.approx(11.3034, abs=1e-3) and z[1] == pytest.approx(-11.3034, abs=1e-3)
    assert abs(z[2]) < 1e-6 and abs(z[3]) < 1e-6  # u = 1/2: the median
    # the mass beyond the range is what TAIL_MASS says: twice the smallest u
    assert TAIL_MASS == pytest.approx(2 * scipy.stats.norm.sf(-scipy.special.ndtri(2.0**-97)), rel=1e-12)


def test_draws_are_standard_normal():
    z = np.asarray(standard_normal(jax.random.key(1), (400_000,)), np.float64)
    assert scipy.stats.kstest(z, "norm").pvalue > 1e-3
    # symmetric and with the right tails: counts beyond 3 and 4 sigma against their Poisson laws
    for t in (3.0, 4.0):
        expected = len(z) * 2 * scipy.stats.norm.sf(t)
        count = int(np.sum(np.abs(z) > t))
        assert scipy.stats.poisson.cdf(count, expected) > 1e-4 and scipy.stats.poisson.sf(count - 1, expected) > 1e-4
    assert scipy.stats.binomtest(int(np.sum(z > 0)), len(z)).pvalue > 1e-3


def test_deep_tail_is_the_gaussian_tail():
    """Conditioned on a top word of 0 (probability 2**-31), |z| follows the normal tail beyond 6.1:
    Phi(-|z|) is uniform on (0, 2**-32)."""
    rng = np.random.default_rng(2)
    words = rng.integers(0, 2**32, size=(3, 50_000), dtype=np.uint64).astype(np.uint32)
    words[0] &= np.uint32(0x80000000)  # keep the sign, clear the top word's 31 bits
    z = np.asarray(_from_words(*jnp.asarray(words), jnp.float32), np.float64)
    assert np.abs(z).min() > 6.1
    p = scipy.stats.norm.sf(np.abs(z)) * 2.0**32
    assert scipy.stats.kstest(p, "uniform").pvalue > 1e-3


def test_threefry_words_are_both_outputs_of_each_hash():
    """For a Threefry key the pair is what JAX draws with partitionable Threefry off: one hash per draw."""
    from d3pext.training.noise import _word_pair

    key = jax.random.key(5)
    first, second = _word_pair(key, (3, 4))
    with jax.threefry_partitionable(False):
        expected = jax.random.bits(key, (24,), jnp.uint32)
    np.testing.assert_array_equal(np.concatenate([np.ravel(first), np.ravel(second)]), expected)


def test_any_key_jit_vmap_and_dtypes():
    key = chacha_key(3)
    z = jax.jit(standard_normal, static_argnums=(1, 2))(key, (4, 5), jnp.float32)
    assert z.shape == (4, 5) and z.dtype == jnp.float32
    np.testing.assert_allclose(z, standard_normal(key, (4, 5)), rtol=1e-6)
    batch = jax.vmap(lambda k: standard_normal(k, (3,)))(jax.random.split(jax.random.key(0), 6))
    assert batch.shape == (6, 3)
    assert standard_normal(jax.random.key(0), (7,), jnp.bfloat16).dtype == jnp.bfloat16
    assert standard_normal(jax.random.key(0), (), jnp.float16).shape == ()
    assert standard_normal(chacha_key(1), (0,)).shape == (0,)
    if not jax.config.jax_enable_x64:  # float64 is float32 there, as for jax.random.normal
        assert standard_normal(jax.random.key(0), (2,), jnp.float64).dtype == jnp.float32
    with pytest.raises(TypeError, match="floating-point"):
        standard_normal(jax.random.key(0), (2,), jnp.int32)


def test_noise_tail_delta():
    assert noise_tail_delta(1.0, 1000, 100) == pytest.approx((1 + math.e) * 1000 * 100 * 2.0**-96)
    assert noise_tail_delta(0.0, 0, 10) == 0.0
    assert noise_tail_delta(800.0, 1, 1) == math.inf
    with pytest.raises(ValueError, match="epsilon"):
        noise_tail_delta(float("nan"), 1, 1)
    with pytest.raises(ValueError, match="num_steps"):
        noise_tail_delta(1.0, -1, 1)


def test_cpu_and_accelerator_forms_draw_the_same(monkeypatch):
    """The CPU form reads the third words only when some draw needs them, the accelerator form always:
    the same numbers either way (up to float rounding), the rare draws included (words forced here where a key would need
    about 2**31 draws to show one)."""
    from d3pext._backend import forced_form
    from d3pext.training import noise

    def pair(rare):
        def word_pair(key, shape):
            w = jnp.arange(2 * shape[0], dtype=jnp.uint32) * np.uint32(2654435761) + np.uint32(12345)
            if rare:
                w = w.at[0].set(np.uint32(0x80000000)).at[3].set(np.uint32(0))
            return w[: shape[0]], w[shape[0]:]
        return word_pair

    for rare in (True, False):
        monkeypatch.setattr(noise, "_word_pair", pair(rare))
        draws = {}
        for form in ("cpu", "accelerator"):
            with forced_form(form):
                draws[form] = np.asarray(standard_normal(jax.random.key(0), (8,)))
        np.testing.assert_allclose(draws["cpu"], draws["accelerator"], rtol=1e-6)  # fused differently
        assert (np.abs(draws["cpu"][[0, 3]]).min() > 6.2) == rare


def test_dpsvi_draws_this_noise_and_counts_its_tail():
    import numpyro
    import numpyro.distributions as dist
    from numpyro.infer import Trace_ELBO

    from d3pext import DPSVI
    from d3pext.training.svi import _standard_normals

    key = jax.random.key(4)
    np.testing.assert_array_equal(_standard_normals(key, [jnp.zeros((2, 3))])[0], standard_normal(key, (6,)).reshape(2, 3))

    def model(x):
        loc = numpyro.param("loc", jnp.zeros(3))
        with numpyro.plate("data", x.shape[0], subsample_size=10):
            numpyro.sample("x", dist.Normal(loc, 1.0).to_event(1), obs=numpyro.subsample(x, event_dim=1))

    svi = DPSVI(model, lambda x: None, numpyro.optim.SGD(0.1), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    svi.init(jax.random.key(0), jnp.zeros((100, 3)))
    # 3 noised parameters; N = 100 records are sampled by a sort on 64-bit keys, whose ties count too
    assert svi._extra_delta(2.0, 500) == noise_tail_delta(2.0, 500, 3) + svi.sampler.extra_delta(2.0, 500)
    assert svi.sampler.extra_delta(2.0, 500) == pytest.approx((1 + np.exp(2.0)) * 500 * 100 * 99 / 2 / 2**64)
