"""DP-VI on data larger than memory: peak memory and step time, streaming vs in memory.

    python benchmarks/bench_streaming.py [--sizes 100000,10000000] [--steps 200] [--json PATH]

Logistic regression (10 float32 features and a float32 label per record) fitted by ``DPSVI`` in
batch mode with Poisson batches of expected size 1000 (``q = 1000 / N``), at two sizes ``N`` that
differ 100x (by default 1e5 and 1e7 records: a 400 MB feature file at 1e7). Each measurement runs in a
fresh subprocess, which reports its peak resident memory (``VmHWM`` of ``/proc/self/status``):

- ``streaming``: ``d3pext.training.streaming.fit_streaming`` over ``MemmapBatches`` of the two
  ``.npy`` files (memory-mapped; only each step's rows are read, in file order, by a prefetch thread);
  also timed: the same steps without the prefetch thread (``prefetch_depth=0``: read, then
  step), and the batch reads alone (index draws and row gathers);
- ``in memory``: the arrays loaded whole (``np.load``), batches from ``poisson_batchify_data``
  (the same batches for the same key), one ``DPSVI.update`` per step.

Step times are medians per step over ``--steps`` steps after a warm-up (compilation excluded).
The files are written in chunks of 1e6 rows (the writer never holds them in memory) to a
temporary folder, deleted at the end. They were just written, so the reads come from the OS page
cache, not from the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

FEATURES = 10
EXPECTED_BATCH = 1000
CHUNK = 10**6


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def npy_header(f, shape: tuple[int, ...]) -> None:
    descr = np.lib.format.dtype_to_descr(np.dtype(np.float32))
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})


def write_data(folder: str, n: int) -> tuple[str, str]:
    """Features ``x`` (n, 10) and labels ``y`` (n,), float32 ``.npy`` files written chunk by chunk."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=FEATURES)
    px, py = os.path.join(folder, f"x{n}.npy"), os.path.join(folder, f"y{n}.npy")
    with open(px, "wb") as fx, open(py, "wb") as fy:
        npy_header(fx, (n, FEATURES))
        npy_header(fy, (n,))
        for start in range(0, n, CHUNK):
            x = rng.normal(size=(min(CHUNK, n - start), FEATURES)).astype(np.float32)
            y = (rng.random(len(x)) < 1 / (1 + np.exp(-(x @ w)))).astype(np.float32)
            fx.write(x.tobytes())
            fy.write(y.tobytes())
    return px, py


# ------------------------------------------------------------------ the child processes


def child(mode: str, n: int, px: str, py: str, steps: int) -> dict:
    import jax
    import numpyro
    import numpyro.distributions as dist
    import optax
    from numpyro.infer.autoguide import AutoDiagonalNormal

    from d3pext import DPSVI
    from d3pext.training.minibatch import PoissonSampler, poisson_batchify_data
    from d3pext.training.streaming import MemmapBatches, fit_streaming

    def model(x, y, num_obs_total=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
        with numpyro.plate("data", num_obs_total, subsample_size=x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    q = EXPECTED_BATCH / n
    batch_key, svi_key = jax.random.split(jax.random.key(0))
    out = {"mode": mode, "N": n, "rss_after_import_kib": status_kib("VmRSS")}
    warmup = 20

    def dpsvi(sampler):
        return DPSVI(model, AutoDiagonalNormal(model), optax.adam(0.01), clipping_threshold=1.0, dp_scale=1.0,
                     delta=1e-5, num_obs_total=n, sampler=sampler)

    if mode == "streaming":
        sampler = PoissonSampler(n, q)
        batches = MemmapBatches((px, py), sampler, rng_key=batch_key, dtype=np.float32)
        svi = dpsvi(sampler)
        result = fit_streaming(svi, batches, warmup, svi_key)  # compiles
        t0 = time.perf_counter()
        result = fit_streaming(svi, batches, steps, init_state=result.state)
        jax.block_until_ready(result.state)
        out["step_s"] = (time.perf_counter() - t0) / steps
        # without prefetch: read, then step, in one thread
        t0 = time.perf_counter()
        plain = fit_streaming(svi, batches, steps, init_state=result.state, prefetch_depth=0)
        jax.block_until_ready(plain.state)
        out["step_no_prefetch_s"] = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for i in range(steps):
            batches[i]  # indices (16 steps per sampler call) and rows
        out["read_s"] = (time.perf_counter() - t0) / steps
        out["padded_size"] = sampler.padded_size
        out["final_loss"] = float(result.losses[-20:].mean())
    else:
        x, y = np.load(px), np.load(py)
        init, get_batch = poisson_batchify_data((x, y), q)
        del x, y  # get_batch holds the device copies
        _, batch_state = init(batch_key)
        svi = dpsvi(get_batch.sampler)
        (xb, yb), mask = get_batch(0, batch_state)
        state = svi.init(svi_key, xb, yb, mask=mask)
        for i in range(warmup):
            (xb, yb), mask = get_batch(i, batch_state)
            state, loss = svi.update(state, xb, yb, mask=mask)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for i in range(warmup, warmup + steps):
            (xb, yb), mask = get_batch(i, batch_state)
            state, loss = svi.update(state, xb, yb, mask=mask)
        jax.block_until_ready(state)
        out["step_s"] = (time.perf_counter() - t0) / steps
        out["padded_size"] = get_batch.sampler.padded_size
    out["peak_rss_kib"] = status_kib("VmHWM")
    out["rss_anon_kib"] = status_kib("RssAnon")
    out["rss_file_kib"] = status_kib("RssFile")
    return out


def run_child(mode: str, n: int, px: str, py: str, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, str(n), px, py, "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{mode} N={n} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,10000000")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "N", "X", "Y"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, n, px, py = args.child
        print(json.dumps(child(mode, int(n), px, py, args.steps)))
        return

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    folder = tempfile.mkdtemp(prefix="bench_streaming_")
    rows = []
    try:
        for n in sizes:
            t0 = time.perf_counter()
            px, py = write_data(folder, n)
            print(f"N={n:.0e}: wrote {os.path.getsize(px) / 2**20:.0f} MiB + {os.path.getsize(py) / 2**20:.0f} MiB "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)
            for mode in ("streaming", "in memory"):
                rows.append(run_child(mode, n, px, py, args.steps))
                print(json.dumps(rows[-1]), flush=True)
            os.remove(px)
            os.remove(py)
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(f"\n{'mode':<10} {'N':>8} {'B_max':>6} {'peak RSS MiB':>13} {'anon MiB':>9} {'file MiB':>9} "
          f"{'step ms':>8} {'no-prefetch ms':>15} {'read ms':>8}")
    for r in rows:
        print(f"{r['mode']:<10} {r['N']:>8.0e} {r['padded_size']:>6} {r['peak_rss_kib'] / 1024:>13.0f} "
              f"{r['rss_anon_kib'] / 1024:>9.0f} {r['rss_file_kib'] / 1024:>9.0f} {r['step_s'] * 1e3:>8.2f} "
              f"{r.get('step_no_prefetch_s', float('nan')) * 1e3:>15.2f} {r.get('read_s', float('nan')) * 1e3:>8.2f}")
    by = {(r["mode"], r["N"]): r for r in rows}
    small, large = min(sizes), max(sizes)
    peak = lambda m, n: by[(m, n)]["peak_rss_kib"]
    step = lambda m, n: by[(m, n)]["step_s"]
    print(f"\nstreaming peak RSS, N={large:.0e} / N={small:.0e}: {peak('streaming', large) / peak('streaming', small):.3f}")
    print(f"in-memory peak RSS, N={large:.0e} / N={small:.0e}: {peak('in memory', large) / peak('in memory', small):.3f}")
    print(f"in-memory / streaming peak RSS at N={large:.0e}: {peak('in memory', large) / peak('streaming', large):.2f}")
    print(f"streaming step time, N={large:.0e} / N={small:.0e}: {step('streaming', large) / step('streaming', small):.2f}")
    print(f"streaming / in-memory step time at N={large:.0e}: {step('streaming', large) / step('in memory', large):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
