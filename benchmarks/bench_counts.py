"""Throughput of the locally private count samplers (seed 002), JAX vs plain NumPy, in one run.

- Bessel draws per second: :func:`d3pext.distributions.sample_bessel` (vectorised rejection,
  jitted) against a plain NumPy/Python sampler (inversion walking out from the mode, one draw
  at a time, as reference implementations do);
- Gibbs sweeps per second of the private samplers (count augmentation + non-private updates)
  for the topic model (90 x 15, K = 3) and the MMSB (20 actors, C = 5): the d3pext kernel
  (one chain, and 64 chains under ``vmap``) against a plain NumPy sweep written here.

- a Poisson-gamma model with 30 privatized cells (``rate ~ Gamma(2, 0.5)``): the whole
  ``private_posterior`` run (4 vectorized chains) with the conjugate gamma update of the rate
  against the same sampler with NUTS for the rate (``conjugate=False``), first run (compilation
  included) and second run (same shapes, new key; nothing compiled again), in CPU seconds
  (``time.process_time``: the machine may be shared).

Run: ``python benchmarks/bench_counts.py`` (add ``--quick`` for fewer repetitions, ``--only
poisson-gamma`` for the last part alone).
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import numpy as np

import jax
from jax import lax, random

import d3pext.inference.counts  # noqa: F401  (registers the count backends)
from d3pext.distributions import sample_bessel
from d3pext.handlers import make_release
from d3pext.inference.structure import RELEASES_KWARG
from d3pext.handlers.posterior import PrivatePosterior
from d3pext.models.poisson_factorization import (
    private_community_model,
    private_topic_model,
    simulate_network,
    simulate_topic_corpus,
)

# ---------------------------------------------------------------------------------------------
# plain NumPy reference
# ---------------------------------------------------------------------------------------------


def numpy_bessel(rng: np.random.Generator, nu: float, a: float) -> int:
    """One Bessel(nu, a) draw by inversion, walking out from the mode (pmf by ratios)."""
    mode = int(math.floor(a * a / (2 * (math.hypot(a, nu) + nu))))
    log_pm = (2 * mode + nu) * math.log(a / 2) - math.lgamma(mode + 1) - math.lgamma(mode + nu + 1)
    log_pm -= _log_iv(nu, a)
    p_mode = math.exp(log_pm)
    u = rng.random()
    # alternate right and left of the mode, subtracting probabilities until u is used up
    u -= p_mode
    if u <= 0:
        return mode
    q = a * a / 4
    lo, hi, p_lo, p_hi = mode, mode, p_mode, p_mode
    while True:
        p_hi *= q / ((hi + 1) * (hi + 1 + nu))
        hi += 1
        u -= p_hi
        if u <= 0:
            return hi
        if lo > 0:
            p_lo *= lo * (lo + nu) / q
            lo -= 1
            u -= p_lo
            if u <= 0:
                return lo
        if p_hi < 1e-300 and (lo == 0 or p_lo < 1e-300):
            return mode  # rounding left mass: take the mode


def _log_iv(nu: float, a: float) -> float:
    from scipy.special import ive

    v = ive(nu, a)
    if v > 0:
        return math.log(v) + a
    return nu * math.log(a / 2) - math.lgamma(nu + 1)  # small a: leading term of the series


def numpy_count_sweep(rng, y_t, mu, lam, alpha):
    """Eqs. 13-16 element by element, Bessel draws from :func:`numpy_bessel`."""
    y = np.empty_like(y_t)
    for idx in np.ndindex(y_t.shape):
        a = 2 * math.sqrt((lam[idx][0] + mu[idx]) * lam[idx][1])
        m = numpy_bessel(rng, abs(y_t[idx]), max(a, 1e-300))
        y_plus, g_minus = (m, m - y_t[idx]) if y_t[idx] <= 0 else (m + y_t[idx], m)
        y[idx] = rng.binomial(y_plus, mu[idx] / (mu[idx] + lam[idx][0]))
        lam[idx] = rng.gamma(1 + np.array([y_plus - y[idx], g_minus])) * alpha
    return y, lam


def numpy_topic_sweep(rng, y_t, theta, phi, lam, alpha, a0=0.1, b0=1.0):
    y, lam = numpy_count_sweep(rng, y_t, theta @ phi, lam, alpha)
    alloc = np.zeros(y.shape + (theta.shape[1],))
    rates = theta[:, None, :] * phi.T[None]
    for idx in np.ndindex(y.shape):
        if y[idx]:
            alloc[idx] = rng.multinomial(y[idx], rates[idx] / rates[idx].sum())
    theta = rng.gamma(a0 + alloc.sum(1)) / (b0 + phi.sum(1))
    phi = rng.gamma(a0 + alloc.sum(0).T) / (b0 + theta.sum(0))[:, None]
    return theta, phi, lam


def numpy_community_sweep(rng, y_t, theta, pi, lam, alpha, a0=0.1, b0=1.0):
    v, c = theta.shape
    off = 1 - np.eye(v)
    mu = np.einsum("ic,jd,cd->ij", theta, theta, pi) * off
    y, lam = numpy_count_sweep(rng, y_t, mu, lam, alpha)
    alloc = np.zeros((v, v, c, c))
    for i in range(v):
        for j in range(v):
            if i != j and y[i, j]:
                r = np.outer(theta[i], theta[j]) * pi
                alloc[i, j] = rng.multinomial(y[i, j], (r / r.sum()).ravel()).reshape(c, c)
    shape = a0 + alloc.sum((1, 3)) + alloc.sum((0, 2))
    total = theta.sum(0)
    sym = pi + pi.T
    for i in range(v):  # sequential over actors
        others = total - theta[i]
        theta[i] = rng.gamma(shape[i]) / (b0 + sym @ others)
        total = others + theta[i]
    pi = rng.gamma(a0 + alloc.sum((0, 1))) / (b0 + np.outer(total, total) - theta.T @ theta)
    return theta, pi, lam


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------


def _rate(fn, *args, reps=3):
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def bench_bessel(quick):
    rng = np.random.default_rng(0)
    cases = [(0.0, 1.0), (2.5, 10.0), (10.0, 100.0), (50.0, 2000.0)]
    n = 100_000 if quick else 1_000_000
    rows = []
    for nu, a in cases:
        f = jax.jit(lambda k: sample_bessel(k, nu, a, (n,))[0])
        jax_s = _rate(f, random.key(0))
        m = 2000 if quick else 10000
        t = time.perf_counter()
        for _ in range(m):
            numpy_bessel(rng, nu, a)
        np_s = time.perf_counter() - t
        rows.append((nu, a, n / jax_s, m / np_s))
    return rows


def bench_sweeps(quick):
    steps = 20 if quick else 100
    out = []
    setups = [
        ("topic model 90x15, K=3", private_topic_model(epsilon=1.0), simulate_topic_corpus(random.key(0)), (90, 15, 3)),
        ("MMSB 20 actors, C=5", private_community_model(epsilon=1.0), simulate_network(random.key(1), a0=0.3, b0=0.3), (20, 5)),
    ]
    for name, model, data, args in setups:
        release = make_release(model, *args, data.counts, rng_key=2)
        inner = PrivatePosterior(model, release, "gibbs").prepare(args, {})
        kw = {RELEASES_KWARG: release}
        init = jax.jit(lambda key: inner.init(key, 0, None, args, kw))
        run = jax.jit(lambda s: lax.fori_loop(0, steps, lambda i, s: inner.sample(s, args, kw), s))
        one = _rate(run, init(random.key(0))) / steps
        chains = 64
        states = jax.jit(jax.vmap(lambda key: inner.init(key, 0, None, args, kw)))(random.split(random.key(1), chains))
        run_v = jax.jit(lambda s: lax.fori_loop(0, steps, lambda i, s: jax.vmap(lambda s: inner.sample(s, args, kw))(s), s))
        many = _rate(run_v, states) / steps
        # NumPy: same sweep, one chain
        rng = np.random.default_rng(0)
        y_t = np.asarray(release["counts_dp"])
        alpha = float(np.exp(inner.blocks[0].log_alpha))
        lam = np.full(y_t.shape + (2,), alpha / (1 - alpha))
        k = args[-1]
        t = time.perf_counter()
        reps = 3 if quick else 10
        if name.startswith("topic"):
            theta, phi = rng.gamma(1.0, size=(args[0], k)), rng.gamma(1.0, size=(k, args[1]))
            for _ in range(reps):
                theta, phi, lam = numpy_topic_sweep(rng, y_t, theta, phi, lam, alpha)
        else:
            theta, pi = rng.gamma(1.0, size=(args[0], k)), rng.gamma(1.0, size=(k, k))
            for _ in range(reps):
                theta, pi, lam = numpy_community_sweep(rng, y_t, theta, pi, lam, alpha)
        np_rate = reps / (time.perf_counter() - t)
        out.append((name, 1 / one, chains / many, np_rate))
    return out


def bench_poisson_gamma(quick):
    """CPU seconds of the 30-cell Poisson-gamma posterior: conjugate update vs NUTS."""
    import numpyro
    import numpyro.distributions as dist
    from d3pext.handlers.privatize import privatize_counts
    from d3pext.inference.mcmc import CachedMCMC
    from d3pext.releases.mechanisms import GeometricMechanism

    def model(n, counts=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with numpyro.plate("cells", n):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    cells = 30
    private = privatize_counts(model, site="y", mechanism=GeometricMechanism.from_alpha(0.5))
    counts = random.poisson(random.key(0), 4.0, (cells,))
    release = make_release(private, cells, counts, rng_key=1, reproducible=True)
    warmup, samples = (500, 1000) if quick else (1000, 4000)
    rows = []
    for conjugate in (True, False):
        kernel = PrivatePosterior(private, release, "gibbs", conjugate=conjugate)
        mcmc = CachedMCMC(kernel, num_warmup=warmup, num_samples=samples, num_chains=4,
                    chain_method="vectorized", progress_bar=False)
        times = []
        for key in (2, 3):
            t = time.process_time()
            mcmc.run(random.key(key), cells)
            rate = jax.block_until_ready(mcmc.get_samples()["rate"])
            times.append(time.process_time() - t)
        rows.append(("conjugate gamma" if conjugate else "NUTS", *times, float(rate.mean()), float(rate.std())))
    return rows, (warmup, samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["poisson-gamma"], default=None)
    cli = parser.parse_args()
    quick = cli.quick
    print(f"# {platform.processor() or platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if cli.only != "poisson-gamma":
        _bessel_and_sweeps(quick)
    rows, (warmup, samples) = bench_poisson_gamma(quick)
    print(f"\nPoisson-gamma, 30 privatized cells, 4 chains x ({warmup} warmup + {samples} draws), CPU seconds")
    print(f"{'rate update':<16} {'1st run':>8} {'2nd run':>8} {'mean':>7} {'sd':>6}")
    for name, first, second, mean, sd in rows:
        print(f"{name:<16} {first:8.1f} {second:8.2f} {mean:7.3f} {sd:6.3f}")
    (_, c1, c2, *_), (_, n1, n2, *_) = rows
    # CachedMCMC: the second run reuses the compiled sampler (numpyro's MCMC would compile again)
    print(f"speed-up of the conjugate update: first run {n1 / c1:.1f}x, second run {n2 / c2:.1f}x")


def _bessel_and_sweeps(quick):
    print("\nBessel draws per second")
    print(f"{'nu':>6} {'a':>7} {'d3pext (JAX)':>14} {'NumPy loop':>12} {'ratio':>8}")
    for nu, a, j, n in bench_bessel(quick):
        print(f"{nu:6g} {a:7g} {j:14.3g} {n:12.3g} {j / n:8.1f}")
    print("\nGibbs sweeps per second (count augmentation + model updates)")
    print(f"{'model':<24} {'JAX 1 chain':>12} {'JAX 64 chains':>16} {'NumPy':>8} {'1-chain ratio':>14} {'64-chain ratio':>15}")
    for name, one, many, npr in bench_sweeps(quick):
        print(f"{name:<24} {one:12.1f} {many:16.1f} {npr:8.2f} {one / npr:14.1f} {many / npr:15.1f}")


if __name__ == "__main__":
    main()
