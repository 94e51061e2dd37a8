"""Minibatch sampling and PRNG throughput, side by side in one run.

    python benchmarks/bench_minibatch.py [--json PATH]

Batch of B distinct indices out of N (B = 100 and 1000; N = 1e4, 1e6, 1e7):

- ``feistel``: ``d3pext.training.minibatch.feistel_indices`` (jitted), O(B);
- ``choice``: ``jax.random.choice(key, N, (B,), replace=False)`` (jitted; a full shuffle,
  so timed once per N, with a single call for N >= 1e6);
- ``permutation``: ``jax.random.permutation(key, N)[:B]`` (jitted; likewise);
- ``numpy``: ``numpy.random.default_rng().choice(N, B, replace=False)`` on the host;
- ``feistel in scan``: per step of a jitted ``lax.scan`` over 100 batches, the way a
  training loop runs it (no per-call dispatch).

Then ``jax.random.normal`` of 1e6 float32 with ChaCha20 (``d3pext.prng``) vs Threefry keys.
Timings are medians over repeats after a warm-up call (compilation), with
``block_until_ready``; ratios are against ``feistel``. About two minutes on two CPU cores,
most of it in the full shuffles of 1e7 values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from d3pext.training.minibatch import PoissonSampler, feistel_indices
from d3pext.prng import chacha_key

SIZES = (10**4, 10**6, 10**7)
BATCHES = (100, 1000)
SCAN_STEPS = 100


def median_time(fn: Callable[[], object], min_repeats: int = 3, budget_s: float = 0.5) -> float:
    """Median seconds per call of ``fn`` (already warmed up) over repeats within a budget."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_jit(fn: Callable, *args, min_repeats: int = 3) -> float:
    compiled = jax.jit(fn).lower(*args).compile()
    if min_repeats > 1:
        jax.block_until_ready(compiled(*args))  # warm-up run (caches, allocator)
    return median_time(lambda: compiled(*args), min_repeats)


def expected_passes(num_records: int, batch_size: int) -> tuple[float, float]:
    """``p = N / 2**b`` and the mean number of cycle-walk passes, ``E[max of B Geometric(p)]``."""
    p = num_records / 2 ** (num_records - 1).bit_length()
    tail = lambda l: 1.0 - (1.0 - (1.0 - p) ** l) ** batch_size  # P(max > l)
    return p, 1.0 + sum(tail(l) for l in range(1, 200))


def bench_batches() -> list[dict]:
    key = jax.random.key(0)
    rng = np.random.default_rng(0)
    rows = []
    for n in SIZES:
        # both shuffle all N values whatever B is: timed once per N, one call for N >= 1e6
        repeats = 3 if n < 10**6 else 1
        choice = timed_jit(
            lambda k, n=n: jax.random.choice(k, n, (BATCHES[0],), replace=False), key,
            min_repeats=repeats,
        )  # fmt: skip
        permutation = timed_jit(
            lambda k, n=n: jax.random.permutation(k, n)[: BATCHES[0]], key, min_repeats=repeats
        )
        for b in BATCHES:
            row = {"N": n, "B": b, "choice": choice, "permutation": permutation}
            row["p"], row["passes"] = expected_passes(n, b)
            row["feistel"] = timed_jit(lambda k, n=n, b=b: feistel_indices(k, n, b), key)

            def scan(k, n=n, b=b):
                step = lambda c, t: (c, feistel_indices(jax.random.fold_in(k, t), n, b))
                return jax.lax.scan(step, 0, jnp.arange(SCAN_STEPS))[1]

            row["feistel in scan"] = timed_jit(scan, key) / SCAN_STEPS
            row["numpy"] = median_time(lambda n=n, b=b: rng.choice(n, b, replace=False))
            rows.append(row)
        print(f"  done N={n:.0e}", flush=True)
    return rows


def bench_poisson() -> list[dict]:
    rows = []
    for n in SIZES:
        sampler = PoissonSampler(n, 100 / n)
        rows.append(
            {"N": n, "q": 100 / n, "max_batch_size": sampler.max_batch_size,
             "poisson": timed_jit(sampler, jax.random.key(0))}
        )  # fmt: skip
    return rows


def bench_prng(size: int = 10**6) -> dict:
    normal = lambda k: jax.random.normal(k, (size,))
    return {
        "size": size,
        "chacha20": timed_jit(normal, chacha_key(0)),
        "threefry": timed_jit(normal, jax.random.key(0)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = parser.parse_args()
    print(f"JAX {jax.__version__} on {jax.devices()[0].platform}")
    batches, poisson, prng = bench_batches(), bench_poisson(), bench_prng()

    methods = ["feistel", "feistel in scan", "choice", "permutation", "numpy"]
    print("\nB distinct indices out of N: median ms per batch (ratio to feistel)")
    print(f"{'N':>6} {'B':>5} " + " ".join(f"{m:>22}" for m in methods))
    for row in batches:
        cells = [f"{row[m] * 1e3:10.3f} ({row[m] / row['feistel']:7.2f}x)" for m in methods]
        print(f"{row['N']:6.0e} {row['B']:5d} " + " ".join(f"{c:>22}" for c in cells))
    print("\nFeistel cost against N: it depends on N only through p = N / 2**b in (1/2, 1],")
    print("via the number of cycle-walk passes (mean of the maximum over the batch, eq. 13)")
    print(f"{'N':>6} {'B':>5} {'p':>6} {'passes':>7} {'ms/step in scan':>16} {'us/pass':>8}")
    for row in batches:
        step = row["feistel in scan"]
        print(f"{row['N']:6.0e} {row['B']:5d} {row['p']:6.3f} {row['passes']:7.2f} "
              f"{step * 1e3:16.3f} {step / row['passes'] * 1e6:8.1f}")  # fmt: skip

    print("\nPoisson subsampling (q = 100/N, padded to max_batch_size): median ms per batch")
    for row in poisson:
        print(f"  N={row['N']:.0e} B_max={row['max_batch_size']}: {row['poisson'] * 1e3:.3f}")

    print(f"\njax.random.normal, {prng['size']:.0e} float32: median ms")
    print(f"  chacha20 {prng['chacha20'] * 1e3:.2f}, threefry {prng['threefry'] * 1e3:.2f}, "
          f"ratio {prng['chacha20'] / prng['threefry']:.2f}x")  # fmt: skip

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"batches": batches, "poisson": poisson, "prng": prng}, f, indent=2)


if __name__ == "__main__":
    main()
