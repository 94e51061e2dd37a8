"""Constrained simple linear regression (Bernstein & Sheldon with Kazan & Reiter's constraints):
vectorised d3pext vs a single-chain NumPy chain.

One run, side by side, on the synthetic Brownlee-like release (n = 46, epsilon = 1.1 split
6/11 : 5/11, the prior of seed 001 Appendix L.5, constrained analysis): chain-iterations per
second of

- a plain NumPy single chain written here (the same conditionals: Gaussian product of the CLT
  normal and the Laplace scale mixture, rejection into the feasible statistics; the
  normal-inverse-gamma draw with joint rejection; ``numpy.random.Generator.wald`` for the
  inverse-Gaussian precisions), and
- d3pext's ``BernsteinSheldonRegression`` under ``sample_releases`` (releases x chains in one
  compiled ``vmap``), float64,

with both posterior means of (beta0, beta1, sigma2), which must agree within Monte Carlo error.

    python benchmarks/bench_regression.py            # full size
    python benchmarks/bench_regression.py --small    # seconds
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import d3pext.inference.regression as R  # noqa: E402  (registers the backend)
from d3pext.handlers import make_release, sample_releases  # noqa: E402
from d3pext.models.constrained_regression import (  # noqa: E402
    BROWNLEE_LIKE,
    private_constrained_regression,
    simulate_drinking_cirrhosis,
)


def _np_moments(theta, s2, m):
    """Mean and covariance of t = (u, u^2, v, uv, v^2), written out by hand."""
    t0, t1 = theta
    m1, m2, m3, m4 = m
    L = np.array([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [t1, 0, 1, 0, 0], [t0, t1, 0, 1, 0],
                  [2 * t0 * t1, t1 * t1, 2 * t0, 2 * t1, 1]], float)
    c = np.array([0, 0, t0, 0, t0 * t0])
    cov_phi = np.zeros((5, 5))
    cov_phi[:2, :2] = [[m2 - m1 * m1, m3 - m1 * m2], [m3 - m1 * m2, m4 - m2 * m2]]
    cov_phi[2:4, 2:4] = s2 * np.array([[1, m1], [m1, m2]])
    cov_phi[4, 4] = 2 * s2 * s2
    return c + L @ np.array([m1, m2, 0, 0, s2]), L @ cov_phi @ L.T


def _np_feasible(s, n):
    sx, sxx, sy, sxy, syy = s
    cxx, cyy, cxy = sxx - sx * sx / n, syy - sy * sy / n, sxy - sx * sy / n
    return (0 <= sx <= n and 0 <= sxx <= sx and 0 <= sy <= n and 0 <= syy <= sy
            and max(0, sx + sy - n) <= sxy <= min(sx, sy) and cxx >= 0 and cyy >= 0
            and cxy * cxy <= cxx * cyy)


def numpy_chain(num_iter, n, z, sums, scale, prior, seed=0):
    """Single constrained chain on the unit scale; rows (theta0, theta1, sigma_u^2)."""
    rng = np.random.default_rng(seed)
    m = (n * np.asarray(R.project_moments(sums / n)) + 1 / np.arange(2.0, 6.0)) / (n + 1)  # as the kernel
    s = np.asarray(R.project_statistics(z, n, True))
    mu0, lam0 = np.asarray(prior.mu0), np.asarray(prior.Lambda0)
    theta, s2 = mu0.copy(), 0.05
    omega2 = np.full(5, 2 * scale**2)
    out = np.empty((num_iter, 3))
    for it in range(num_iter):
        mu, cov = _np_moments(theta, s2, m)
        w, v = np.linalg.eigh(n * cov)
        P = (v * np.clip(w, 0, None)) @ v.T
        gain = np.linalg.solve(P + np.diag(omega2), P).T
        mean = n * mu + gain @ (z - n * mu)
        chol = np.linalg.cholesky(P - gain @ P + 1e-12 * np.eye(5))
        while True:
            s = mean + chol @ rng.standard_normal(5)
            if _np_feasible(s, n):
                break
        X = np.array([[n, s[0]], [s[0], s[1]]])
        lam_n = X + lam0
        r = np.array([s[2], s[3]]) + lam0 @ mu0
        mu_n = np.linalg.solve(lam_n, r)
        a_n, b_n = prior.a0 + n / 2, prior.b0 + (s[4] + mu0 @ lam0 @ mu0 - mu_n @ r) / 2
        c = np.linalg.cholesky(np.linalg.inv(lam_n))
        while True:
            prec = rng.gamma(a_n, 1 / b_n)
            theta = mu_n + c @ rng.standard_normal(2) / math.sqrt(prec)
            if prec >= 4 and 0 <= theta[0] <= 1 and 0 <= theta.sum() <= 1:
                break
        s2 = 1 / prec
        gap = np.maximum(np.abs(z - s), 1e-300)
        omega2 = 1 / rng.wald(1 / (scale * gap), 1 / scale**2)
        out[it] = theta[0], theta[1], s2
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    e = BROWNLEE_LIKE
    n, bx, by = e["n"], e["bounds_x"], e["bounds_y"]
    model = private_constrained_regression(n, e["epsilon"], bx, by, e["prior"])
    records = simulate_drinking_cirrhosis(jax.random.key(0), n)
    release = make_release(model, records=records, rng_key=1)  # seeded: a benchmark, not a release
    z = np.asarray(release["records_dp"])
    sums = np.asarray(release["records_moments_dp"])
    scale = 5 / (e["epsilon"] * (1 - e["x_moment_share"]))
    numpy_iter = 500 if args.small else 5000
    sets, chains, iters = (2, 50, 400) if args.small else (10, 100, 2000)

    numpy_chain(20, n, z, sums, scale, e["prior"])  # warm up
    t = time.perf_counter()
    draws = numpy_chain(numpy_iter, n, z, sums, scale, e["prior"])
    numpy_rate = numpy_iter / (time.perf_counter() - t)
    np_means = R.to_original_scale(bx, by, *draws[numpy_iter // 5:].mean(0))

    releases = {k: jnp.stack([v] * sets) for k, v in release.items()}
    warm = iters // 5

    def run(key):
        return sample_releases(model, releases, key, num_warmup=warm, num_samples=iters - warm, num_chains=chains)

    t = time.perf_counter()
    jax.block_until_ready(run(jax.random.key(0)))
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    out = jax.block_until_ready(run(jax.random.key(1)))
    d3p_rate = sets * chains * iters / (time.perf_counter() - t)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"JAX {jax.__version__} on {jax.default_backend()}, float64")
    fmt = lambda v: ", ".join(f"{float(x):.3g}" for x in v)  # noqa: E731
    print(f"NumPy single chain          : {numpy_rate:10.0f} chain-iterations/s "
          f"(posterior means beta0, beta1, sigma2: {fmt(np_means)})")
    d3p_means = [out[k].mean() for k in ("beta0", "beta1", "sigma2")]
    print(f"d3pext {sets} x {chains} chains vmapped: {d3p_rate:10.0f} chain-iterations/s "
          f"(compile {compile_s:.1f} s; posterior means: {fmt(d3p_means)})")
    print(f"ratio d3pext / NumPy        : {d3p_rate / numpy_rate:10.2f}")


if __name__ == "__main__":
    main()
