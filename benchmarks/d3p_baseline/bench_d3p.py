"""The d3p 0.2.0 baseline: DPSVI step time, minibatch sampler time, sampler uniformity. Prints JSON.

Runs INSIDE the d3p environment (``bash benchmarks/d3p_baseline/setup.sh`` creates it):

    benchmarks/.d3p-env/bin/python benchmarks/d3p_baseline/bench_d3p.py [--quick] [--out PATH]

What it measures (all jit-compiled, timed after a warm-up call, ``block_until_ready``, median over repeats):

- ``logreg``: d3p's ``DPSVI.update`` on logistic regression (seed 003 listing 2 model and guide; N=1e4,
  d=10, B=100 by default), on pre-drawn batches (the same batches as ``benchmarks/bench_dpsvi.py``: both
  draw them with NumPy from fixed seeds, see ``common.py``), and with d3p's own sampler
  (``subsample_batchify_data`` fetch fused into the step). Each as a single jitted call per step
  (Python loop: includes dispatch) and as many steps inside one jitted ``lax.scan`` (per-step compute).
  For reference also NumPyro's non-private ``SVI.update`` in the same (old) environment.
- ``vae`` (``--vae``): the same for a one-hidden-layer VAE (784 inputs, B=128).
- ``sampler``: d3p's Feistel sampler (``d3p.util.sample_from_array`` with a fresh ``fold_in`` key per batch:
  indices only) and the full ``subsample_batchify_data`` fetch of B records of an (N, 10) float32 array, for
  N in {1e4, 1e6, 1e7}, B=100; single calls and a jitted ``fori_loop`` of calls.
- ``uniformity``: with d3p's sampler at N=10, B=3, draws many batches (200k by default) from one base key
  (``fold_in`` per batch, as ``get_batch`` does) and tests single-index inclusion frequencies and the
  frequencies of the 120 possible batches against uniform (chi-square); a NumPy exactly-uniform control
  goes through the same test.

Threads: jax-chacha-prng's CPU kernel uses OpenMP; on a small, busy machine its thread synchronisation
costs milliseconds per call (measured here: 30 random words with 2 OpenMP threads ~5-15 ms, with 1 thread
~0.06 ms). By default this script sets ``OMP_NUM_THREADS=1`` before importing d3p, which gives d3p its
best figures; ``--omp-threads default`` leaves the variable alone. The setting is recorded in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and draws (harness check)")
    p.add_argument("--n", type=int, default=10_000, help="records for logistic regression")
    p.add_argument("--d", type=int, default=10, help="features for logistic regression")
    p.add_argument("--batch", type=int, default=100, help="batch size for logistic regression")
    p.add_argument("--seed", type=int, default=0, help="NumPy seed of the data (batches use seed + 1)")
    p.add_argument("--scan-steps", type=int, default=200, help="steps per jitted scan (and pre-drawn batches)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=50, help="calls per repeat in the single-call timings")
    p.add_argument("--vae", action="store_true",
                   help="also time the VAE (very slow on CPU: minutes to compile, seconds per step)")
    p.add_argument("--vae-n", type=int, default=2_000, help="records of synthetic binary data for the VAE")
    p.add_argument("--vae-batch", type=int, default=128)
    p.add_argument("--vae-hidden", type=int, default=400)
    p.add_argument("--vae-latent", type=int, default=10)
    p.add_argument("--vae-scan-steps", type=int, default=2)
    p.add_argument("--sampler-sizes", default="1e4,1e6,1e7", help="comma-separated N for the sampler")
    p.add_argument("--sampler-batch", default="100", help="comma-separated batch sizes B for the sampler")
    p.add_argument("--sampler-loop", type=int, default=1000, help="calls inside the jitted sampler loop")
    p.add_argument("--no-fetch", action="store_true", help="skip the (N, 10) record fetch timing")
    p.add_argument("--uniformity-draws", type=int, default=200_000)
    p.add_argument("--uniformity-n", type=int, default=10)
    p.add_argument("--uniformity-b", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: logreg,sampler,uniformity")
    p.add_argument("--omp-threads", default="1", help="OMP_NUM_THREADS for jax-chacha-prng ('default': unset)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.inner, args.scan_steps = 3, 20, 50
        args.sampler_loop, args.uniformity_draws = 200, 50_000
    return args


ARGS = parse_args()
if ARGS.omp_threads != "default":
    os.environ["OMP_NUM_THREADS"] = ARGS.omp_threads  # before libgomp (jax-chacha-prng) is loaded

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.optim import Adam  # noqa: E402

import d3p.random as strong_rng  # noqa: E402
from d3p.minibatch import subsample_batchify_data  # noqa: E402
from d3p.svi import DPSVI  # noqa: E402
from d3p.util import sample_from_array  # noqa: E402

import common  # noqa: E402


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def ms(seconds):
    return round(seconds * 1e3, 6)


def timing(median_s, times):
    return {"median_ms": ms(median_s), "min_ms": ms(min(times)), "repeats_ms": [ms(t) for t in times]}


def versions():
    from importlib.metadata import version

    out = {}
    for name in ("d3p", "jax", "jaxlib", "numpyro", "jax-chacha-prng", "numpy", "fourier-accountant"):
        try:
            out[name] = version(name)
        except Exception:  # pragma: no cover
            out[name] = None
    return out


# ------------------------------------------------------------------------------------- DP-VI steps


def bench_svi_family(name, models, full_args, batches, n_total, args, scan_steps, inner, with_svi=True):
    """Time d3p DPSVI (pre-drawn batches; d3p's sampler fused) and NumPyro SVI (pre-drawn) for one model.

    ``full_args``: tuple of full data arrays; ``batches``: tuple of stacked pre-drawn batches, each
    (S, B, ...), S >= scan_steps.
    """
    model, guide = models["batch"]
    res = {}
    first = tuple(jnp.asarray(b[0]) for b in batches)
    batch_list = [tuple(jnp.asarray(b[k]) for b in batches) for k in range(batches[0].shape[0])]
    stacked = tuple(jnp.asarray(b[:scan_steps]) for b in batches)
    S = len(batch_list)

    def block(c):
        return jax.block_until_ready(c)

    # ---- d3p DPSVI, pre-drawn batches
    dpsvi = DPSVI(model, guide, Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, N=n_total)
    state0 = dpsvi.init(strong_rng.PRNGKey(args.seed), *first)
    state0 = jax.tree_util.tree_map(jnp.asarray, state0)
    upd = jax.jit(dpsvi.update)
    carry0 = (state0, jnp.zeros((), jnp.float32))

    def one(carry, k):
        return upd(carry[0], *batch_list[k % S])

    t0 = time.perf_counter()
    med, times, _ = common.time_loop(one, carry0, inner, args.repeats, block)
    res["dpsvi_predrawn_single"] = timing(med, times)
    log(f"[d3p] {name} DPSVI single jitted update (pre-drawn batch): {med * 1e3:.4f} ms "
        f"(incl. compile {time.perf_counter() - t0:.1f}s)")

    @jax.jit
    def run_scan(carry, xs):
        def body(c, b):
            return upd(c[0], *b), None

        return lax.scan(body, carry, xs)[0]

    med, times, _ = common.time_compiled_loop(lambda c: run_scan(c, stacked), carry0, scan_steps, args.repeats, block)
    res["dpsvi_predrawn_scan"] = timing(med, times)
    log(f"[d3p] {name} DPSVI update in lax.scan (pre-drawn batches): {med * 1e3:.4f} ms/step")

    # ---- d3p DPSVI with d3p's sampler (subsample_batchify_data) fused into the jitted step
    batch_init, get_batch = subsample_batchify_data(tuple(jnp.asarray(a) for a in full_args), batch_size=first[0].shape[0])
    _, bstate = batch_init(strong_rng.PRNGKey(args.seed + 7))

    @jax.jit
    def fused(carry):
        st, _, i = carry
        st, loss = dpsvi.update(st, *get_batch(i, bstate))
        return st, loss, i + 1

    carry_i = (state0, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    med, times, _ = common.time_loop(lambda c, k: fused(c), carry_i, inner, args.repeats, block)
    res["dpsvi_sampler_single"] = timing(med, times)
    log(f"[d3p] {name} DPSVI single jitted get_batch + update: {med * 1e3:.4f} ms")

    @jax.jit
    def run_fused(carry):
        return lax.fori_loop(0, scan_steps, lambda _, c: fused(c), carry)

    med, times, _ = common.time_compiled_loop(run_fused, carry_i, scan_steps, args.repeats, block)
    res["dpsvi_sampler_scan"] = timing(med, times)
    log(f"[d3p] {name} DPSVI get_batch + update in fori_loop: {med * 1e3:.4f} ms/step")

    # ---- NumPyro SVI (non-private) in the same environment, pre-drawn batches
    if with_svi:
        svi = SVI(model, guide, Adam(1e-3), Trace_ELBO(), N=n_total)
        sstate0 = svi.init(jax.random.PRNGKey(args.seed), *first)
        supd = jax.jit(svi.update)
        scarry0 = (sstate0, jnp.zeros((), jnp.float32))
        med, times, _ = common.time_loop(lambda c, k: supd(c[0], *batch_list[k % S]), scarry0, inner, args.repeats, block)
        res["svi_predrawn_single"] = timing(med, times)
        log(f"[d3p env] {name} NumPyro SVI single jitted update: {med * 1e3:.4f} ms")

        @jax.jit
        def srun(carry, xs):
            return lax.scan(lambda c, b: (supd(c[0], *b), None), carry, xs)[0]

        med, times, _ = common.time_compiled_loop(lambda c: srun(c, stacked), scarry0, scan_steps, args.repeats, block)
        res["svi_predrawn_scan"] = timing(med, times)
        log(f"[d3p env] {name} NumPyro SVI update in lax.scan: {med * 1e3:.4f} ms/step")
    return res


def bench_logreg(args):
    models = common.logistic_models(numpyro, jax)
    x, y = common.logistic_data(args.n, args.d, args.seed)
    idx = common.batch_indices(args.n, args.batch, max(args.scan_steps, args.inner), args.seed + 1)
    out = {"config": {"N": args.n, "d": args.d, "B": args.batch, "scan_steps": args.scan_steps,
                      "model": "seed 003 listing 2 (prior Normal(0, 4), mean-field Normal guide)",
                      "optimizer": "Adam(1e-3)", "clipping_threshold": 1.0, "dp_scale": 1.0}}
    out.update(bench_svi_family("logreg", models, (x, y), (x[idx], y[idx]), args.n, args, args.scan_steps, args.inner))
    return out


def bench_vae(args):
    models = common.vae_models(numpyro, jax, hidden=args.vae_hidden, latent=args.vae_latent)
    x = common.binary_image_data(args.vae_n, 784, args.seed)
    steps = args.vae_scan_steps
    idx = common.batch_indices(args.vae_n, args.vae_batch, max(steps, 5), args.seed + 1)
    out = {"config": {"N": args.vae_n, "dim": 784, "B": args.vae_batch, "hidden": args.vae_hidden,
                      "latent": args.vae_latent, "num_params": common.vae_num_params(784, args.vae_hidden, args.vae_latent),
                      "scan_steps": steps}}
    sub = argparse.Namespace(**{**vars(args), "repeats": 2})
    out.update(bench_svi_family("vae", models, (x,), (x[idx],), args.vae_n, sub, steps, inner=1))
    return out


# ------------------------------------------------------------------------------------------ sampler


def bench_sampler(args):
    sizes = [int(float(s)) for s in args.sampler_sizes.split(",") if s]
    batch_sizes = [int(float(b)) for b in str(args.sampler_batch).split(",") if b]
    L = args.sampler_loop
    base = strong_rng.PRNGKey(args.seed)
    rows = []
    for n, B in [(n, B) for B in batch_sizes for n in sizes]:
        row = {"N": n, "B": B}

        def indices(key, i, n=n, B=B):
            # exactly what get_batch does for a data set of indices, without a data constant in the program
            return sample_from_array(strong_rng.fold_in(key, i), jnp.arange(n), B, 0)

        f = jax.jit(indices)
        counter = iter(range(1, 10**9))
        t0 = time.perf_counter()
        med, times = common.median_call(lambda: f(base, next(counter)), args.repeats * args.inner // 5, jax.block_until_ready)
        row["indices_single"] = timing(med, times)

        @jax.jit
        def loop(key):
            return lax.fori_loop(0, L, lambda i, acc: acc + jnp.sum(indices(key, i)), jnp.zeros((), jnp.int32))

        med, times = common.median_call(lambda: loop(base), args.repeats, jax.block_until_ready)
        row["indices_loop"] = timing(med / L, [t / L for t in times])
        log(f"[d3p] sampler N={n:.0e} B={B}: single {row['indices_single']['median_ms']:.4f} ms, "
            f"in loop {row['indices_loop']['median_ms']:.4f} ms/batch (incl. compile {time.perf_counter() - t0:.1f}s)")

        if not args.no_fetch:
            data = jnp.asarray(np.random.default_rng(args.seed).standard_normal((n, 10), dtype=np.float32))
            init, get_batch = subsample_batchify_data((data,), batch_size=B)
            _, st = init(base)
            med, times = common.median_call(lambda: get_batch(next(counter), st), args.repeats * args.inner // 5,
                                            jax.block_until_ready)
            row["fetch_single"] = timing(med, times)
            log(f"[d3p] subsample_batchify_data fetch (N={n:.0e}, B={B}, 10 features): {med * 1e3:.4f} ms")
            del data, get_batch
        rows.append(row)
    return {"note": "indices: d3p.util.sample_from_array(fold_in(key, i), arange(N), B) (d3p's Feistel sampler, "
                    "ChaCha20 round constants); fetch: subsample_batchify_data get_batch of B rows of an (N, 10) "
                    "float32 array (single jitted call).",
            "rows": rows}


def bench_uniformity(args):
    from math import comb
    from scipy import stats

    n, b, draws = args.uniformity_n, args.uniformity_b, args.uniformity_draws
    init, get_batch = subsample_batchify_data((jnp.arange(n, dtype=jnp.int32),), batch_size=b)
    _, st = init(strong_rng.PRNGKey(args.seed))
    draw = jax.jit(jax.vmap(lambda i: get_batch(i, st)[0]))
    chunk = 50_000
    t0 = time.perf_counter()
    batches = np.concatenate([np.asarray(draw(jnp.arange(s, min(s + chunk, draws), dtype=jnp.int32)))
                              for s in range(0, draws, chunk)])
    elapsed = time.perf_counter() - t0
    assert batches.shape == (draws, b)
    distinct = bool(np.all(np.sort(batches, 1)[:, 1:] != np.sort(batches, 1)[:, :-1]))

    def analyse(bs):
        counts = np.bincount(bs.ravel(), minlength=n)
        stat, dof = common.inclusion_chi2(counts, len(bs), n, b)
        sstat, sdof, seen, possible = common.subset_chi2(bs, n)
        freq = counts / len(bs)
        return {
            "inclusion_counts": counts.tolist(),
            "inclusion_freq": [round(float(f), 6) for f in freq],
            "expected_freq": b / n,
            "max_abs_dev_freq": float(np.max(np.abs(freq - b / n))),
            "inclusion_chi2": stat, "inclusion_dof": dof, "inclusion_p": float(stats.chi2.sf(stat, dof)),
            "subset_chi2": sstat, "subset_dof": sdof, "subset_p": float(stats.chi2.sf(sstat, sdof)),
            "subsets_seen": seen, "subsets_possible": possible,
        }

    d3p_res = analyse(batches)
    d3p_res["all_batches_distinct_indices"] = distinct
    d3p_res["draw_seconds"] = round(elapsed, 3)
    rng = np.random.default_rng(args.seed + 99)
    control = np.argsort(rng.random((draws, n)), axis=1)[:, :b]
    res = {
        "N": n, "B": b, "draws": draws, "base_key_seed": args.seed,
        "method": "d3p subsample_batchify_data((arange(N),), B).get_batch(i, state) for i = 0..draws-1 (one base key)",
        "test": "inclusion: Pearson chi2 of single-index counts times (N-1)/(N-B) ~ chi2(N-1) under uniform "
                "fixed-size batches; subset: Pearson chi2 of the C(N, B) batch frequencies ~ chi2(C(N,B)-1)",
        "d3p": d3p_res,
        "control_uniform_numpy": analyse(control),
    }
    assert res["d3p"]["subsets_possible"] == comb(n, b)
    log(f"[d3p] uniformity N={n} B={b}, {draws} batches: inclusion chi2={d3p_res['inclusion_chi2']:.1f} "
        f"(dof {d3p_res['inclusion_dof']}, p={d3p_res['inclusion_p']:.3g}); subset chi2={d3p_res['subset_chi2']:.1f} "
        f"(dof {d3p_res['subset_dof']}, p={d3p_res['subset_p']:.3g}); control p={res['control_uniform_numpy']['inclusion_p']:.3g}"
        f"/{res['control_uniform_numpy']['subset_p']:.3g}")
    return res


def main(args):
    warnings.simplefilter("ignore", DeprecationWarning)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    t_start = time.perf_counter()
    out = {
        "tool": "benchmarks/d3p_baseline/bench_d3p.py",
        "versions": versions(),
        "machine": common.machine_info(jax),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "args": vars(args),
        "units": "milliseconds per step / per batch; median over repeats",
    }
    sections = {}
    for part, fn, wanted in (("logreg", bench_logreg, "logreg" not in skip), ("vae", bench_vae, args.vae),
                             ("sampler", bench_sampler, "sampler" not in skip),
                             ("uniformity", bench_uniformity, "uniformity" not in skip)):
        if wanted:
            t0 = time.perf_counter()
            out[part] = fn(args)
            sections[part] = round(time.perf_counter() - t0, 2)
    out["section_seconds"] = sections
    out["total_seconds"] = round(time.perf_counter() - t_start, 2)
    text = json.dumps(out, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main(ARGS)
