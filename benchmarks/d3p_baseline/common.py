"""Shared pieces of the DP-VI benchmarks: data, pre-drawn batches, models, timing, machine info.

Imported by BOTH ``benchmarks/bench_dpsvi.py`` (main environment: current JAX / NumPyro, d3pext) and
``benchmarks/d3p_baseline/bench_d3p.py`` (the d3p 0.2.0 environment: JAX 0.4.25 / NumPyro 0.14). So this
module only uses NumPy, ``time``, ``platform`` and the parts of the JAX / NumPyro API that both versions
share, and it never imports d3pext or d3p. Data and batch indices come from NumPy generators with fixed
seeds, so both processes see bit-identical data and the same batches.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time

import numpy as np

# ----------------------------------------------------------------------------------------------- data


def logistic_data(n: int, d: int, seed: int = 0):
    """Synthetic logistic-regression data: ``x ~ N(0, I)``, ``y ~ Bernoulli(sigmoid(x @ w))``, float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    w = rng.standard_normal(d)
    y = (rng.random(n) < 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ w)))).astype(np.float32)
    return x, y


def binary_image_data(n: int, dim: int = 784, seed: int = 0):
    """Synthetic binary 'images' for the VAE: a few Bernoulli prototypes with pixel noise, float32 in {0, 1}."""
    rng = np.random.default_rng(seed)
    protos = rng.random((10, dim)) < 0.3
    labels = rng.integers(0, 10, n)
    flips = rng.random((n, dim)) < 0.05
    return (protos[labels] ^ flips).astype(np.float32)


def batch_indices(n: int, batch_size: int, num_batches: int, seed: int = 1):
    """``num_batches`` batches of ``batch_size`` distinct record indices (uniform without replacement), int32."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(n, batch_size, replace=False) for _ in range(num_batches)]).astype(np.int32)


# --------------------------------------------------------------------------------------------- models
#
# Built by functions that take the caller's ``numpyro`` and ``jax`` modules, so that the same code runs
# under both NumPyro versions. Two forms of each model:
#   "plate" form: receives ALL records and declares plate("data", N, subsample_size=B) with
#                 numpyro.subsample (d3pext DPSVI draws the batch itself; NumPyro SVI's plate draws its own);
#   "batch" form: receives one pre-drawn batch of B records and declares plate("batch", N, B)  (d3p style).


def logistic_models(numpyro, jax):
    """Seed 003, listing 2: logistic regression with prior ``Normal(0, 4)`` and a mean-field Gaussian guide."""
    import jax.numpy as jnp
    import numpyro.distributions as dist

    def model_batch(xs, ys, N):
        batch_size, d = xs.shape
        w = numpyro.sample("w", dist.Normal(0.0, 4.0), sample_shape=(d,))
        with numpyro.plate("batch", N, batch_size):
            theta = jax.nn.sigmoid(xs.dot(w))
            numpyro.sample("ys", dist.Bernoulli(theta), obs=ys)

    def guide_batch(xs, ys, N):
        d = jnp.shape(xs)[1]
        w_loc = numpyro.param("w_loc", jnp.zeros((d,)))
        w_scale = jnp.exp(numpyro.param("w_scale_log", jnp.zeros((d,))))
        numpyro.sample("w", dist.Normal(w_loc, w_scale))

    def model_plate(x, y, batch_size):
        n, d = x.shape
        w = numpyro.sample("w", dist.Normal(0.0, 4.0), sample_shape=(d,))
        with numpyro.plate("data", n, subsample_size=batch_size):
            xs = numpyro.subsample(x, event_dim=1)
            ys = numpyro.subsample(y, event_dim=0)
            theta = jax.nn.sigmoid(xs.dot(w))
            numpyro.sample("ys", dist.Bernoulli(theta), obs=ys)

    def guide_plate(x, y, batch_size):
        d = jnp.shape(x)[1]
        w_loc = numpyro.param("w_loc", jnp.zeros((d,)))
        w_scale = jnp.exp(numpyro.param("w_scale_log", jnp.zeros((d,))))
        numpyro.sample("w", dist.Normal(w_loc, w_scale))

    return {"batch": (model_batch, guide_batch), "plate": (model_plate, guide_plate)}


def vae_init_params(dim: int = 784, hidden: int = 400, latent: int = 10, seed: int = 2):
    """Glorot-uniform initial weights (NumPy, so identical in both environments)."""
    rng = np.random.default_rng(seed)

    def dense(n_in, n_out):
        lim = np.sqrt(6.0 / (n_in + n_out))
        return rng.uniform(-lim, lim, (n_in, n_out)).astype(np.float32), np.zeros(n_out, np.float32)

    p = {}
    p["enc_w1"], p["enc_b1"] = dense(dim, hidden)
    p["enc_wm"], p["enc_bm"] = dense(hidden, latent)
    p["enc_ws"], p["enc_bs"] = dense(hidden, latent)
    p["dec_w1"], p["dec_b1"] = dense(latent, hidden)
    p["dec_w2"], p["dec_b2"] = dense(hidden, dim)
    return p


def vae_num_params(dim: int = 784, hidden: int = 400, latent: int = 10) -> int:
    return sum(v.size for v in vae_init_params(dim, hidden, latent).values())


def vae_models(numpyro, jax, dim: int = 784, hidden: int = 400, latent: int = 10):
    """A VAE with one hidden layer (ReLU) in encoder and decoder, Bernoulli likelihood (Kingma and Welling).

    Decoder weights are parameters of the model, encoder weights of the guide (as in NumPyro's VAE example).
    """
    import jax.numpy as jnp
    import numpyro.distributions as dist

    init = {k: jnp.asarray(v) for k, v in vae_init_params(dim, hidden, latent).items()}

    def params(prefix):
        return {k: numpyro.param(k, init[k]) for k in init if k.startswith(prefix)}

    def decode(p, z):
        h = jax.nn.relu(z @ p["dec_w1"] + p["dec_b1"])
        return h @ p["dec_w2"] + p["dec_b2"]

    def encode(p, x):
        h = jax.nn.relu(x @ p["enc_w1"] + p["enc_b1"])
        return h @ p["enc_wm"] + p["enc_bm"], jnp.exp(0.5 * (h @ p["enc_ws"] + p["enc_bs"]))

    def model_plate(x, batch_size):
        # parameters are registered outside the plate (they are global)
        p = params("dec_")
        with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
            xs = numpyro.subsample(x, event_dim=1)
            z = numpyro.sample("z", dist.Normal(jnp.zeros(latent), 1.0).to_event(1))
            numpyro.sample("x", dist.Bernoulli(logits=decode(p, z)).to_event(1), obs=xs)

    def guide_plate(x, batch_size):
        p = params("enc_")
        with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
            xs = numpyro.subsample(x, event_dim=1)
            loc, scale = encode(p, xs)
            numpyro.sample("z", dist.Normal(loc, scale).to_event(1))

    def model_batch(xs, N):
        p = params("dec_")
        with numpyro.plate("batch", N, xs.shape[0]):
            z = numpyro.sample("z", dist.Normal(jnp.zeros(latent), 1.0).to_event(1))
            numpyro.sample("x", dist.Bernoulli(logits=decode(p, z)).to_event(1), obs=xs)

    def guide_batch(xs, N):
        p = params("enc_")
        with numpyro.plate("batch", N, xs.shape[0]):
            loc, scale = encode(p, xs)
            numpyro.sample("z", dist.Normal(loc, scale).to_event(1))

    return {"batch": (model_batch, guide_batch), "plate": (model_plate, guide_plate)}


# --------------------------------------------------------------------------------------------- timing


def time_loop(step, state, n_inner: int, repeats: int, block):
    """Median seconds per call of ``state = step(state, k)`` for k = 0, 1, ... (Python loop, one
    dispatch per call), after one warm-up call (compilation). ``block`` waits for a state to be ready.

    Returns ``(median_s, [per-repeat seconds per call], final state)``.
    """
    state = step(state, 0)
    block(state)
    times = []
    k = 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n_inner):
            state = step(state, k)
            k += 1
        block(state)
        times.append((time.perf_counter() - t0) / n_inner)
    return statistics.median(times), times, state


def time_compiled_loop(run, state, steps_per_call: int, repeats: int, block):
    """Median seconds per *step* of ``state = run(state)``, a jitted function doing ``steps_per_call``
    steps inside one ``lax.scan`` / ``fori_loop``; after one warm-up call (compilation)."""
    state = run(state)
    block(state)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = run(state)
        block(state)
        times.append((time.perf_counter() - t0) / steps_per_call)
    return statistics.median(times), times, state


def median_call(fn, repeats: int, block, warmup: int = 1):
    """Median seconds of ``fn()`` (after ``warmup`` calls), each call blocked on its result."""
    for _ in range(warmup):
        block(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        block(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


# ------------------------------------------------------------------------------------ machine / stats


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(jax) -> dict:
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "jax_devices": [str(d) for d in jax.devices()],
        "jax_backend": jax.default_backend(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def inclusion_chi2(counts, num_batches: int, n: int, b: int):
    """Chi-square test that single-index inclusion counts come from uniform size-``b`` batches without
    replacement out of ``n`` (``num_batches`` batches).

    Under uniformity the count vector has exactly ``(n - b) / (n - 1)`` times the covariance of a
    multinomial with ``b * num_batches`` draws, so Pearson's statistic divided by that factor is
    asymptotically chi-square with ``n - 1`` degrees of freedom. Returns ``(statistic, dof)``.
    """
    counts = np.asarray(counts, dtype=np.float64)
    expected = num_batches * b / n
    pearson = float(np.sum((counts - expected) ** 2 / expected))
    return pearson * (n - 1) / (n - b), n - 1


def subset_chi2(batches, n: int):
    """Pearson chi-square of the frequencies of the C(n, b) unordered batches against uniform.

    Returns ``(statistic, dof, number of distinct subsets seen, number possible)``.
    """
    from math import comb

    batches = np.sort(np.asarray(batches), axis=1).astype(np.int64)
    b = batches.shape[1]
    codes = np.zeros(len(batches), np.int64)
    for j in range(b):
        codes = codes * n + batches[:, j]
    _, counts = np.unique(codes, return_counts=True)
    k = comb(n, b)
    expected = len(batches) / k
    observed = np.zeros(k)
    observed[: len(counts)] = counts  # unseen subsets count 0
    stat = float(np.sum((observed - expected) ** 2 / expected))
    return stat, k - 1, int(len(counts)), k
