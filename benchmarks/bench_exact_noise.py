"""Exact integer noise vs float noise, side by side in one run.

    python benchmarks/bench_exact_noise.py [--sizes 1000,100000,1000000] [--key chacha|threefry|both]

For n in {1e3, 1e5, 1e6} values:

- ``exact DLap``: :func:`d3pext.releases.exact.discrete_laplace` (scale 3/2), numpy rounds of
  rejection over integer words drawn from the key; vs ``float Laplace``:
  ``1.5 * jax.random.laplace(key, (n,))`` (jitted, float32);
- ``exact DGauss``: :func:`~d3pext.releases.exact.discrete_gaussian`
  (sigma2 = 21/2); vs ``float normal``: ``sqrt(10.5) * jax.random.normal(key, (n,))``.

The exact samplers return host numpy arrays; the float draws are timed to
``block_until_ready`` (device arrays). Medians over repeats after a warm-up call (compilation
excluded), the minimum in parentheses. ChaCha20 keys (``d3pext.prng.chacha_key``) are what a
release uses; Threefry for comparison.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from fractions import Fraction

import jax

from d3pext.prng import chacha_key
from d3pext.releases.exact import KeyBits, discrete_gaussian, discrete_laplace

SCALE = Fraction(3, 2)
SIGMA2 = Fraction(21, 2)


def timings(fn: Callable[[], object], min_repeats: int = 3, budget_s: float = 2.0) -> tuple[float, float]:
    """(median, min) seconds per call of ``fn`` after one warm-up call."""
    jax.block_until_ready(fn())
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < 100):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def fmt(t: tuple[float, float]) -> str:
    med, low = t
    unit, f = ("ms", 1e3) if med < 1 else ("s", 1.0)
    return f"{med * f:8.2f} {unit} ({low * f:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,100000,1000000")
    parser.add_argument("--key", choices=("chacha", "threefry", "both"), default="both")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    keys = {"chacha": chacha_key(0), "threefry": jax.random.key(0)}
    if args.key != "both":
        keys = {args.key: keys[args.key]}

    laplace = jax.jit(lambda k, n: float(SCALE) * jax.random.laplace(k, (n,)), static_argnums=1)
    normal = jax.jit(lambda k, n: math.sqrt(SIGMA2) * jax.random.normal(k, (n,)), static_argnums=1)

    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"# discrete Laplace scale {SCALE}, discrete Gaussian sigma2 {SIGMA2}; median (min)")
    header = (f"{'key':9} {'n':>9} | {'exact DLap':>20} {'float Laplace':>20} {'ratio':>7} | "
              f"{'exact DGauss':>20} {'float normal':>20} {'ratio':>7}")
    print(header)
    print("-" * len(header))
    for name, key in keys.items():
        for n in sizes:
            t_dl = timings(lambda: discrete_laplace(KeyBits(key), SCALE, (n,)))
            t_fl = timings(lambda: laplace(key, n))
            t_dg = timings(lambda: discrete_gaussian(KeyBits(key), SIGMA2, (n,)))
            t_fn = timings(lambda: normal(key, n))
            print(f"{name:9} {n:>9} | {fmt(t_dl):>20} {fmt(t_fl):>20} {t_dl[0] / t_fl[0]:6.0f}x | "
                  f"{fmt(t_dg):>20} {fmt(t_fn):>20} {t_dg[0] / t_fn[0]:6.0f}x", flush=True)


if __name__ == "__main__":
    main()
