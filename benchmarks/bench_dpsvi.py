"""DP-VI step time, side by side in one run: NumPyro ``SVI`` vs ``d3pext.DPSVI`` vs d3p 0.2.0.

    python benchmarks/bench_dpsvi.py [--quick] [--json PATH] [--no-d3p] [--no-vae] [--d3p-vae]

Models (``benchmarks/d3p_baseline/common.py``; the same code runs in the d3p environment):

- logistic regression, seed 003 listing 2 (prior Normal(0, 4), mean-field Normal guide), N=1e4, d=10, B=100;
- a VAE, 784 binary inputs, one ReLU hidden layer of 400 units in encoder and decoder, latent 10, B=128,
  on synthetic binary data; with ``--models-vae`` also ``d3pext.models.vae`` (stax, softplus) in plate mode.

Each model in two forms, timed for both ``SVI`` and ``DPSVI`` (Adam(1e-3), C=1, sigma=1):

- *plate*: the model gets ALL records and declares ``plate("data", N, subsample_size=B)``; NumPyro's plate
  draws its own subsample (on CPU an O(N) partial Fisher-Yates), d3pext's DPSVI draws a Feistel batch;
- *batch* (d3p style, "same batches"): the model gets one pre-drawn batch and declares
  ``plate("batch", N, B)``; SVI, DPSVI and d3p see the SAME batches (NumPy, fixed seeds), so the sampler
  cost is separated from the step cost.

Each as *single*: one jitted ``update`` per Python call (``jax.jit(svi.update)``; includes dispatch, which
dominates tiny models), and *scan*: many steps inside one jitted ``lax.scan`` (per-step compute). Timings are
medians over repeats after a warm-up call (compilation), with ``block_until_ready``.

d3p runs in its own environment (``bash benchmarks/d3p_baseline/setup.sh``) through a subprocess
(``benchmarks/d3p_baseline/bench_d3p.py``); skipped with a message when the environment is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import statistics
import time
import warnings
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
BASELINE = os.path.join(HERE, "d3p_baseline")
D3P_PYTHON = os.path.join(HERE, ".d3p-env", "bin", "python")
sys.path.insert(0, BASELINE)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.optim import Adam  # noqa: E402

import common  # noqa: E402  (benchmarks/d3p_baseline/common.py)

# Targets (project brief). Printed next to the measured ratios.
TARGET_D3P_OVER_DPSVI = 5.0  # DPSVI at least 5x faster per step than d3p
TARGET_DPSVI_OVER_SVI_CPU_LOGREG = 3.0  # DPSVI / SVI at most 3x on CPU, logistic regression
TARGET_DPSVI_OVER_SVI_GPU_VAE = 1.5  # DPSVI / SVI at most 1.5x on a GPU, VAE
D3P_REFERENCE_MS = 0.3  # d3p's step time measured earlier on this machine (project brief)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats/steps: checks the harness, noisy figures")
    p.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    p.add_argument("--n", type=int, default=10_000)
    p.add_argument("--d", type=int, default=10)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=50, help="calls per repeat in single-call timings")
    p.add_argument("--no-vae", action="store_true")
    p.add_argument("--vae-n", type=int, default=2_000)
    p.add_argument("--vae-batch", type=int, default=128)
    p.add_argument("--vae-hidden", type=int, default=400)
    p.add_argument("--vae-latent", type=int, default=10)
    p.add_argument("--vae-scan-steps", type=int, default=50, help="at most this many steps per scan (adaptive)")
    p.add_argument("--vae-inner", type=int, default=20, help="at most this many calls per repeat (adaptive)")
    p.add_argument("--models-vae", action="store_true", help="add a row for d3pext.models.vae (plate mode)")
    p.add_argument("--vae-materialize", action="store_true",
                   help="VAE: also time DPSVI(clipping='materialize') (per-record gradients kept; slow on CPU) against the default (ghost clipping)")
    p.add_argument("--no-d3p", action="store_true", help="skip the d3p baseline")
    p.add_argument("--d3p-vae", action="store_true", help="also time the VAE in d3p (slow)")
    p.add_argument("--d3p-full", action="store_true", help="d3p: also sampler timings and uniformity test")
    p.add_argument("--d3p-timeout", type=float, default=600.0)
    p.add_argument("--report", default=None, metavar="PATH", help="only print the table of a saved --json file")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.inner, args.scan_steps = 3, 20, 50
        args.vae_scan_steps, args.vae_inner = 20, 10
    return args


def block(x):
    return jax.block_until_ready(x)


def ms(s):
    return round(s * 1e3, 6)


def timing(med, times):
    return {"median_ms": ms(med), "min_ms": ms(min(times)), "repeats_ms": [ms(t) for t in times]}


def versions():
    from importlib.metadata import version

    out = {}
    for name in ("d3pext", "jax", "jaxlib", "numpyro", "optax", "numpy"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = None
    return out


# --------------------------------------------------------------------------------------------- timing


class Contender:
    """One inference object (SVI or DPSVI) on one model form, compiled and ready to be timed."""

    def __init__(self, kind, make, data_single, data_scan):
        self.kind = kind
        svi, state0 = make()
        self.upd = jax.jit(svi.update)
        self.data_single, (self.xs, self.body_data) = data_single, data_scan
        self.carry0 = (state0, jnp.zeros((), jnp.float32))
        t0 = time.perf_counter()
        self.carry = block(self.upd(state0, *data_single(0)))  # compile
        self.compile_single = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.carry = block(self.upd(self.carry[0], *data_single(1)))
        self.probe = max(time.perf_counter() - t1, 1e-6)
        self.k = 2

    def compile_scan(self, scan_steps):
        self.scan_steps = scan_steps
        xs = None if self.xs is None else tuple(a[:scan_steps] for a in self.xs)
        upd, body_data = self.upd, self.body_data

        @jax.jit
        def run(carry, xs):
            return lax.scan(lambda c, x: (upd(c[0], *body_data(x)), None), carry, xs, length=scan_steps)[0]

        self.run = lambda c: run(c, xs)
        t0 = time.perf_counter()
        self.scan_carry = block(self.run(self.carry0))
        self.compile_scan_s = time.perf_counter() - t0

    def time_single(self, inner):
        t0 = time.perf_counter()
        c = self.carry
        for _ in range(inner):
            c = self.upd(c[0], *self.data_single(self.k))
            self.k += 1
        self.carry = block(c)
        return (time.perf_counter() - t0) / inner

    def time_scan(self):
        t0 = time.perf_counter()
        self.scan_carry = block(self.run(self.scan_carry))
        return (time.perf_counter() - t0) / self.scan_steps


def time_row(label, makers, max_scan, max_inner, repeats, budget_s=0.3):
    """Time SVI and DPSVI on one model form, INTERLEAVED: every repeat times each contender in turn
    (single calls, then scans), so that both see the same load on a shared machine; the per-repeat
    ratio DPSVI/SVI is recorded as well as the medians.

    ``makers``: {kind: (make, data_single, data_scan)} with ``make() -> (svi, state)``,
    ``data_single(k)`` the positional data of call k, ``data_scan = (xs or None, body_data)``.
    Calls per repeat and steps per scan adapt to the slowest contender's step time (about ``budget_s``
    per repeat, at most ``max_inner`` / ``max_scan``): a slow step (a VAE under DP on CPU) keeps the run
    short, a fast one (logistic regression, anything on a GPU) is timed over many steps. Both contenders
    use the same counts, hence the same batches.
    """
    t0 = time.perf_counter()
    cs = {kind: Contender(kind, *m) for kind, m in makers.items()}
    probe = max(c.probe for c in cs.values())
    inner = int(min(max_inner, max(1, budget_s // probe)))
    scan_steps = int(min(max_scan, max(2, budget_s // probe)))
    reps = int(min(repeats, max(2, 10.0 // (probe * (inner + scan_steps)))))
    for c in cs.values():
        c.compile_scan(scan_steps)
    single = {k: [] for k in cs}
    scan = {k: [] for k in cs}
    for _ in range(reps):
        for k, c in cs.items():
            single[k].append(c.time_single(inner))
        for k, c in cs.items():
            scan[k].append(c.time_scan())
    res = {}
    for k, c in cs.items():
        res[k] = {"single": timing(statistics.median(single[k]), single[k]),
                  "scan": timing(statistics.median(scan[k]), scan[k]),
                  "compile_seconds": {"single": round(c.compile_single, 2), "scan": round(c.compile_scan_s, 2)}}
    res["calls_per_repeat"], res["scan_steps"], res["repeats"] = inner, scan_steps, reps
    if "SVI" in cs and "DPSVI" in cs:
        res["paired_ratio_dpsvi_over_svi"] = {
            t: round(statistics.median([a / b for a, b in zip(d["DPSVI"], d["SVI"])]), 4)
            for t, d in (("single", single), ("scan", scan))}
    if "DPSVI-mat" in cs and "DPSVI" in cs:
        res["paired_ratio_materialize_over_default"] = {
            t: round(statistics.median([a / b for a, b in zip(d["DPSVI-mat"], d["DPSVI"])]), 4)
            for t, d in (("single", single), ("scan", scan))}
        log(f"  {label:<30s} DPSVI(clipping='materialize') / DPSVI(default): {res['paired_ratio_materialize_over_default']}")
    for k in cs:
        log(f"  {label:<30s} {k:<6s} single {res[k]['single']['median_ms']:10.4f} ms   "
            f"scan {res[k]['scan']['median_ms']:10.4f} ms/step")
    log(f"  {'':<30s} [{inner} calls, {scan_steps} scan steps, {reps} repeats, interleaved; "
        f"{time.perf_counter() - t0:.1f}s incl. compile]")
    return res


def svi_cls(optim):
    return lambda m, g, **kw: SVI(m, g, optim, Trace_ELBO(), **kw)


def dpsvi_cls(optim, **options):
    from d3pext import DPSVI

    return lambda m, g, **kw: DPSVI(m, g, optim, Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0, **options, **kw)


def bench_model(name, models, full, batches, n_total, batch_size, args, max_scan, max_inner, extra=None):
    """SVI and DPSVI, plate and batch forms, for one model. ``full``: tuple of full data arrays (NumPy);
    ``batches``: tuple of stacked pre-drawn batches (S, B, ...) (NumPy)."""
    full = tuple(jnp.asarray(a) for a in full)
    stacked = tuple(jnp.asarray(b) for b in batches)
    S = stacked[0].shape[0]
    batch_list = [tuple(jnp.asarray(np.asarray(b[k])) for b in batches) for k in range(S)]  # own buffers
    key = jax.random.PRNGKey(args.seed)
    optim = Adam(1e-3)
    classes = {"SVI": svi_cls(optim), "DPSVI": dpsvi_cls(optim)}
    classes.update({k: make(optim) for k, make in (extra or {}).items()})
    mp, gp = models["plate"]
    mb, gb = models["batch"]

    def make_plate(cls):
        s = cls(mp, gp, batch_size=batch_size)
        return s, s.init(key, *full)

    def make_batch(cls):
        s = cls(mb, gb, N=n_total)
        return s, s.init(key, *batch_list[0])

    res = {}
    res["plate"] = time_row(f"{name} plate (own sampler)",
                            {k: (partial(make_plate, c), lambda k: full, (None, lambda _: full))
                             for k, c in classes.items()}, max_scan, max_inner, args.repeats)
    res["batch"] = time_row(f"{name} batch (pre-drawn)",
                            {k: (partial(make_batch, c), lambda k: batch_list[k % S], (stacked, lambda x: x))
                             for k, c in classes.items()}, min(max_scan, S), max_inner, args.repeats)
    return res


def bench_models_vae(args, x, max_scan, max_inner):
    """d3pext.models.vae (plate mode only), SVI vs DPSVI, if the module exists."""
    try:
        from d3pext.models.vae import vae_guide, vae_model
    except Exception as e:  # not written yet / import error
        log(f"  d3pext.models.vae not available ({type(e).__name__}: {e}); row skipped")
        return None
    full = (jnp.asarray(x),)
    key = jax.random.PRNGKey(args.seed)
    kw = dict(batch_size=args.vae_batch, hidden_dim=args.vae_hidden, latent_dim=args.vae_latent)
    optim = Adam(1e-3)

    def make(cls):
        s = cls(vae_model, vae_guide, **kw)
        return s, s.init(key, *full)

    return time_row("vae d3pext.models.vae plate",
                    {k: (partial(make, c), lambda k: full, (None, lambda _: full))
                     for k, c in (("SVI", svi_cls(optim)), ("DPSVI", dpsvi_cls(optim)))},
                    max_scan, max_inner, args.repeats)


# ------------------------------------------------------------------------------------------------ d3p


def run_d3p(args):
    script = os.path.join(BASELINE, "bench_d3p.py")
    if not os.path.exists(D3P_PYTHON):
        msg = f"d3p environment not found at {D3P_PYTHON}; run `bash benchmarks/d3p_baseline/setup.sh` (skipped)"
        log(msg)
        return {"skipped": msg}
    cmd = [D3P_PYTHON, script, "--n", str(args.n), "--d", str(args.d), "--batch", str(args.batch),
           "--seed", str(args.seed), "--scan-steps", str(args.scan_steps), "--repeats", str(args.repeats),
           "--inner", str(args.inner)]
    if args.quick:
        cmd.append("--quick")
    if not args.d3p_full:
        cmd += ["--skip", "sampler,uniformity"]
    if args.d3p_vae and not args.no_vae:
        cmd += ["--vae", "--vae-n", str(args.vae_n), "--vae-batch", str(args.vae_batch), "--vae-hidden",
                str(args.vae_hidden), "--vae-latent", str(args.vae_latent), "--vae-scan-steps", "2"]
    log("d3p 0.2.0 (subprocess): " + " ".join(os.path.relpath(c) if c.startswith("/") else c for c in cmd))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.d3p_timeout)
    except subprocess.TimeoutExpired:
        msg = f"d3p benchmark timed out after {args.d3p_timeout:.0f}s"
        log(msg)
        return {"error": msg}
    for line in proc.stderr.splitlines():
        if line.startswith("[d3p"):
            log("  " + line)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        log(f"d3p benchmark failed (exit {proc.returncode}):\n{tail}")
        return {"error": f"exit {proc.returncode}", "stderr_tail": tail}
    out = json.loads(proc.stdout)
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return out


# ---------------------------------------------------------------------------------------------- report


def med(d, *path):
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d.get("median_ms") if isinstance(d, dict) else None


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def fmt_ms(x):
    return "      -" if x is None else f"{x:9.4f}"


def fmt_ratio(x):
    return "     -" if x is None else f"{x:6.2f}x"


def check(value, target, at_most):
    if value is None:
        return "n/a"
    ok = value <= target if at_most else value >= target
    return f"{'PASS' if ok else 'MISS'} (target {'<=' if at_most else '>='} {target:g}x)"


# d3p figure comparable to each (form, timing) cell: d3p's own sampler fused into the step for "plate".
D3P_KEYS = {("plate", "single"): "dpsvi_sampler_single", ("plate", "scan"): "dpsvi_sampler_scan",
            ("batch", "single"): "dpsvi_predrawn_single", ("batch", "scan"): "dpsvi_predrawn_scan"}


def report(out):
    on_gpu = out["machine"]["jax_backend"] == "gpu"
    lines = []
    m = out["machine"]
    lines.append("")
    lines.append(f"device: {', '.join(m['jax_devices'])}   CPU: {m['cpu_model']} ({m['cpu_count']} cores)   "
                 f"load avg at start: {', '.join(f'{x:.2f}' for x in m['load_average'] or [])}")
    v = out["versions"]
    lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    d3p = out.get("d3p", {})
    if "versions" in d3p:
        dv = d3p["versions"]
        lines.append(f"d3p env: d3p {dv.get('d3p')}, jax {dv.get('jax')}, jaxlib {dv.get('jaxlib')}, numpyro "
                     f"{dv.get('numpyro')}, jax-chacha-prng {dv.get('jax-chacha-prng')} (OMP_NUM_THREADS="
                     f"{d3p.get('omp_num_threads')})")
    lines.append("")
    hdr = (f"{'model':<11s}{'form':<22s}{'timing':<8s}{'SVI ms':>11s}{'DPSVI ms':>11s}{'d3p ms':>11s}"
           f"{'DPSVI/SVI':>11s}{'(paired)':>10s}{'d3p/DPSVI':>11s}")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    targets = {}
    for model in ("logreg", "vae", "vae_models"):
        if model not in out or out[model] is None:
            continue
        forms = [("plate", "plate (own sampler)"), ("batch", "batch (same batches)")]
        if model == "vae_models":
            forms = [(None, "d3pext.models.vae")]
        for form, label in forms:
            for t in ("single", "scan"):
                base = out[model][form] if form else out[model]
                s, dps = med(base, "SVI", t), med(base, "DPSVI", t)
                dkey = D3P_KEYS.get((form, t))
                d3p_model = d3p.get(model) if isinstance(d3p, dict) else None
                dd = med(d3p_model, dkey) if d3p_model and dkey else None
                r1, r2 = ratio(dps, s), ratio(dd, dps)
                paired = (base.get("paired_ratio_dpsvi_over_svi") or {}).get(t)
                lines.append(f"{model:<11s}{label:<22s}{t:<8s}{fmt_ms(s):>11s}{fmt_ms(dps):>11s}{fmt_ms(dd):>11s}"
                             f"{fmt_ratio(r1):>11s}{fmt_ratio(paired):>10s}{fmt_ratio(r2):>11s}")
                targets.setdefault(model, {})[f"{form or 'plate'}_{t}"] = {
                    "svi_ms": s, "dpsvi_ms": dps, "d3p_ms": dd, "dpsvi_over_svi": r1,
                    "dpsvi_over_svi_paired": paired, "d3p_over_dpsvi": r2}
    lines.append("")
    lines.append("plate: each method draws its own batch (NumPyro plate: O(N) partial Fisher-Yates on CPU; DPSVI: "
                 "Feistel; d3p: subsample_batchify_data fused into the jitted step).")
    lines.append("batch: the same pre-drawn batches for all three (sampler cost excluded). single: one jitted call "
                 "per step from Python (dispatch included); scan: steps inside one jitted lax.scan.")
    lines.append("SVI and DPSVI repeats are interleaved; (paired) is the median over repeats of the per-repeat ratio. "
                 "d3p runs afterwards in its own process, so d3p/DPSVI is a ratio of medians taken at different times.")
    lines.append("")
    lines.append("targets:")
    lr = targets.get("logreg", {})
    for key in ("batch_scan", "batch_single", "plate_scan", "plate_single"):
        row = lr.get(key)
        if row:
            r = row["dpsvi_over_svi_paired"] or row["dpsvi_over_svi"]
            cpu_check = check(r, TARGET_DPSVI_OVER_SVI_CPU_LOGREG, True) if not on_gpu else "(CPU target; on GPU)"
            lines.append(f"  logreg {key:<13s} DPSVI/SVI {fmt_ratio(r)} (paired)  {cpu_check}"
                         f"   d3p/DPSVI {fmt_ratio(row['d3p_over_dpsvi'])}  "
                         f"{check(row['d3p_over_dpsvi'], TARGET_D3P_OVER_DPSVI, False)}")
    for model in ("vae", "vae_models"):
        for key, row in targets.get(model, {}).items():
            r = row["dpsvi_over_svi_paired"] or row["dpsvi_over_svi"]
            tgt = check(r, TARGET_DPSVI_OVER_SVI_GPU_VAE, True) if on_gpu else \
                f"(GPU target <= {TARGET_DPSVI_OVER_SVI_GPU_VAE:g}x; this is a CPU run)"
            extra = ""
            if row["d3p_over_dpsvi"] is not None:
                extra = (f"   d3p/DPSVI {fmt_ratio(row['d3p_over_dpsvi'])}  "
                         f"{check(row['d3p_over_dpsvi'], TARGET_D3P_OVER_DPSVI, False)}")
            lines.append(f"  {model} {key:<13s} DPSVI/SVI {fmt_ratio(r)} (paired)  {tgt}{extra}")
    if isinstance(d3p, dict) and "logreg" in d3p:
        lines.append(f"  (d3p reference from the brief: about {D3P_REFERENCE_MS} ms/step on this machine; "
                     f"measured here: single {fmt_ms(med(d3p, 'logreg', 'dpsvi_predrawn_single')).strip()} ms, "
                     f"scan {fmt_ms(med(d3p, 'logreg', 'dpsvi_predrawn_scan')).strip()} ms/step)")
    elif d3p:
        lines.append(f"  d3p: {d3p.get('skipped') or d3p.get('error')}")
    out["summary"] = targets
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.report:
        with open(args.report) as f:
            saved = json.load(f)
        print(report(saved))
        return saved
    warnings.simplefilter("ignore", DeprecationWarning)
    t_start = time.perf_counter()
    out = {"tool": "benchmarks/bench_dpsvi.py", "versions": versions(), "machine": common.machine_info(jax),
           "args": vars(args), "units": "milliseconds per step, median over repeats",
           "targets": {"d3p_over_dpsvi_at_least": TARGET_D3P_OVER_DPSVI,
                       "dpsvi_over_svi_cpu_logreg_at_most": TARGET_DPSVI_OVER_SVI_CPU_LOGREG,
                       "dpsvi_over_svi_gpu_vae_at_most": TARGET_DPSVI_OVER_SVI_GPU_VAE}}
    log(f"devices: {jax.devices()}  CPU: {out['machine']['cpu_model']}")

    log(f"logistic regression N={args.n} d={args.d} B={args.batch}:")
    models = common.logistic_models(numpyro, jax)
    x, y = common.logistic_data(args.n, args.d, args.seed)
    idx = common.batch_indices(args.n, args.batch, max(args.scan_steps, args.inner), args.seed + 1)
    out["logreg"] = bench_model("logreg", models, (x, y), (x[idx], y[idx]), args.n, args.batch, args,
                                args.scan_steps, args.inner)
    out["logreg"]["config"] = {"N": args.n, "d": args.d, "B": args.batch, "scan_steps": args.scan_steps}

    if not args.no_vae:
        log(f"VAE N={args.vae_n} dim=784 hidden={args.vae_hidden} latent={args.vae_latent} B={args.vae_batch} "
            f"({common.vae_num_params(784, args.vae_hidden, args.vae_latent)} parameters):")
        vmodels = common.vae_models(numpyro, jax, hidden=args.vae_hidden, latent=args.vae_latent)
        xv = common.binary_image_data(args.vae_n, 784, args.seed)
        steps = args.vae_scan_steps
        vidx = common.batch_indices(args.vae_n, args.vae_batch, max(steps, args.vae_inner), args.seed + 1)
        extra = {"DPSVI-mat": partial(dpsvi_cls, clipping="materialize")} if args.vae_materialize else None
        out["vae"] = bench_model("vae", vmodels, (xv,), (xv[vidx],), args.vae_n, args.vae_batch, args, steps,
                                 args.vae_inner, extra)
        out["vae"]["config"] = {"N": args.vae_n, "dim": 784, "B": args.vae_batch, "hidden": args.vae_hidden,
                                "latent": args.vae_latent, "scan_steps": steps,
                                "num_params": common.vae_num_params(784, args.vae_hidden, args.vae_latent)}
        if args.models_vae:
            out["vae_models"] = bench_models_vae(args, xv, steps, args.vae_inner)

    if not args.no_d3p:
        out["d3p"] = run_d3p(args)

    out["total_seconds"] = round(time.perf_counter() - t_start, 1)
    text = report(out)
    print(text)
    print(f"\ntotal {out['total_seconds']:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        log(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
