"""Throughput of the Bernstein & Sheldon beta-binomial Gibbs sampler, side by side in one run:

- NumPy, one chain, scalar draws from a ``numpy.random.Generator`` (a lean loop: three generator
  calls per iteration, rejection for ``0 <= s <= n``);
- NumPy, ``--numpy-chains`` chains vectorised over arrays;
- JAX (:func:`d3pext.handlers.sample_releases`), one release x one chain;
- JAX, ``--releases`` x ``--chains`` chains in one compiled call.

Every rate is in chain-iterations per second of wall-clock time and per second of CPU time of
this process. On a shared machine pin the process to one core (``--cpu 1``): unpinned, the
rates of all four samplers move by factors of two with the load of the other processes. The JAX samplers are compiled
by a first call (its time is printed) and timed on a second call (``sample_releases`` caches the
compiled sampler). The posterior mean and sd of ``theta`` for the same release are printed for
each sampler as a check that they run the same algorithm.

Run: ``python benchmarks/bench_expfam.py [--chains 32] [--releases 32] [--iters 2000] [--cpu 1]``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

import jax
from jax import random
import jax.numpy as jnp

from d3pext.handlers import sample_releases
from d3pext.models.expfam import private_beta_binomial

N, EPS, A, B = 1000, 0.01, 10.0, 10.0
Y = 412.0


def numpy_chain(y: float, num_iters: int, seed: int = 0) -> np.ndarray:
    """Algorithm 1 of Bernstein & Sheldon, one chain, NumPy scalars (rejection for 0 <= s <= n)."""
    rng = np.random.default_rng(seed)
    b = 1.0 / EPS
    s, var = float(np.clip(y, 0, N)), 2 * b**2
    out = np.empty(num_iters)
    for i in range(num_iters):
        theta = rng.beta(A + s, B + N - s)
        m1, v1 = N * theta, N * theta * (1 - theta)
        v = v1 * var / (v1 + var)
        m = v * (m1 / v1 + y / var)
        while True:
            s = rng.normal(m, np.sqrt(v))
            if 0 <= s <= N:
                break
        gap = abs(y - s)
        var = 1.0 / rng.wald(1.0 / (b * gap), 1.0 / b**2) if gap > 0 else var
        out[i] = theta
    return out


def numpy_chains(y: float, num_chains: int, num_iters: int, seed: int = 0) -> np.ndarray:
    """The same algorithm vectorised over ``num_chains`` chains (rejection redraws the invalid)."""
    rng = np.random.default_rng(seed)
    b = 1.0 / EPS
    s = np.full(num_chains, float(np.clip(y, 0, N)))
    var = np.full(num_chains, 2 * b**2)
    out = np.empty((num_iters, num_chains))
    for i in range(num_iters):
        theta = rng.beta(A + s, B + N - s)
        m1, v1 = N * theta, N * theta * (1 - theta)
        v = v1 * var / (v1 + var)
        m = v * (m1 / v1 + y / var)
        s = rng.normal(m, np.sqrt(v))
        bad = (s < 0) | (s > N)
        while bad.any():
            s[bad] = rng.normal(m[bad], np.sqrt(v[bad]))
            bad = (s < 0) | (s > N)
        gap = np.maximum(np.abs(y - s), 1e-300)
        var = 1.0 / rng.wald(1.0 / (b * gap), 1.0 / b**2)
        out[i] = theta
    return out.T


def timed(fn, *args, **kwargs):
    """``(result, wall seconds, CPU seconds)`` of ``fn(*args, **kwargs)`` (JAX results awaited)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chains", type=int, default=32)
    parser.add_argument("--releases", type=int, default=32)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--numpy-iters", type=int, default=20000)
    parser.add_argument("--numpy-chains", type=int, default=200)
    parser.add_argument("--cpu", type=int, default=None, help="pin the process to this core")
    args = parser.parse_args()
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    burn = 200
    rows = []  # (name, chain-iterations, wall s, cpu s, theta draws)

    draws, wall, cpu = timed(numpy_chain, Y, args.numpy_iters)
    rows.append(("numpy, 1 chain", args.numpy_iters, wall, cpu, draws[burn:]))
    iters = max(args.numpy_iters // 20, 2 * burn)
    draws, wall, cpu = timed(numpy_chains, Y, args.numpy_chains, iters)
    rows.append((f"numpy, {args.numpy_chains} chains", args.numpy_chains * iters, wall, cpu,
                 draws[:, burn:]))

    model = private_beta_binomial(EPS, concentration1=A, concentration0=B)
    compile_times = []
    for releases, chains in ((1, 1), (args.releases, args.chains)):
        values = {"x_dp": jnp.linspace(Y, Y + 100.0, releases)}  # release 0 is Y

        def run(key, values=values, chains=chains):
            return sample_releases(model, values, key, N, num_warmup=0, num_samples=args.iters,
                                   num_chains=chains)

        _, wall, cpu = timed(run, random.key(0))
        compile_times.append((releases, chains, wall, cpu))
        out, wall, cpu = timed(run, random.key(1))
        rows.append((f"jax, {releases} releases x {chains} chains", releases * chains * args.iters,
                     wall, cpu, np.asarray(out["theta"][0])[:, burn:]))

    pinned = "all cores" if args.cpu is None else f"pinned to core {args.cpu}"
    print(f"device: {jax.devices()[0]} ({pinned}), n = {N}, epsilon = {EPS}, "
          f"prior Beta({A:g}, {B:g}), release {Y}")
    for releases, chains, wall, cpu in compile_times:
        print(f"first call (compile + run), jax {releases} x {chains}: {wall:.1f} s wall, "
              f"{cpu:.1f} s CPU")
    base_wall = rows[0][1] / rows[0][2]
    base_cpu = rows[0][1] / rows[0][3]
    print(f"{'sampler':34s} {'chain-it/s wall':>16s} {'chain-it/s CPU':>16s} {'ratio wall':>11s} "
          f"{'ratio CPU':>10s}   theta mean / sd")
    for name, count, wall, cpu, theta in rows:
        rate_wall, rate_cpu = count / wall, count / cpu
        print(f"{name:34s} {rate_wall:16.0f} {rate_cpu:16.0f} {rate_wall / base_wall:10.1f}x "
              f"{rate_cpu / base_cpu:9.1f}x   {theta.mean():.4f} / {theta.std():.4f}")


if __name__ == "__main__":
    main()
