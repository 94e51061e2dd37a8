"""Time to first result: compilation of DPSVI against NumPyro's SVI, first against repeated runs.

    python benchmarks/bench_compile.py [--repeats 3] [--no-demo] [--paired N] [--ir] [--json PATH]

Every figure comes from a fresh Python process (nothing compiled in an earlier measurement is reused,
the persistent compilation cache is off unless a row says otherwise), and the rows of one table are
taken side by side in one run, alternating, so machine load affects them alike. Reported as medians
over ``--repeats`` processes and as ratios:

- ``init``: ``SVI.init`` against ``DPSVI.init`` (DPSVI also traces its structure, calibrates sigma
  and runs its two privacy checks), same model, guide, data and optimizer;
- ``first step``: the first ``update`` after ``init`` (compilation plus one step): ``jax.jit(svi.update)``
  against ``dpsvi.update`` (which jits itself; its batch sampler and noise draw are a program of their own,
  compiled in ``init``), also as the ratio of each pair of processes run one after the other; ``init and
  first step``: the two together, the wait for a first result;
  ``init_full_gc``, ``first_step_full_gc``: seconds of CPython's full (generation 2) collections
  within each (``gc.callbacks``), and the first step's ratio without them;
- ``run``: ``run(key, 200 steps)`` on a new object, then again on the same object with a new key, then
  on a second object with the same structure (SVI compiles every ``run``; DPSVI keeps its compiled
  loop per object and model structure);
- ``demo``: ``d3pext demo`` as a newcomer runs it (three private runs with keys from OS entropy, which
  the steps' program holds as ChaCha20 keys) and ``d3pext demo --repeats 1 --seed 0`` (Threefry keys:
  a smaller program), each in a fresh process with an empty compilation-cache directory, then again
  with the cache that the first one filled (``enable_compile_cache``);
- ``--paired N``: instead, in one process, XLA's compilation alone of the two first-step programs
  (``jax.jit(svi.update)`` and DPSVI's step, each lowered once), alternately ``N`` times each: CPU
  seconds per compile and the paired ratio. Fresh processes differ by 10-20% on a shared machine;
  back-to-back compiles in one process share its state, so small changes show;
- ``--ir``: instead (or with ``--paired``), the kernels and bytes of optimized LLVM IR of the same two
  programs, from XLA's dump: the same on every run, where compile times on a shared machine vary by
  10-20%; LLVM's passes and code generation are about half of the step's compile.

The model is the demo's: logistic regression with an intercept on the Breast Cancer data (455 records,
31 weights), batch 200 (``d3pext.models.logistic_regression`` in plate mode).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import gc, json, sys, time
t0 = time.perf_counter()
full_gc = {"phase": None, "start": 0.0}  # seconds of CPython's full (generation 2) collections, by phase

def on_gc(stage, info):
    if info["generation"] != 2 or full_gc["phase"] is None:
        return
    if stage == "start":
        full_gc["start"] = time.perf_counter()
    else:
        key = full_gc["phase"] + "_full_gc"
        full_gc[key] = full_gc.get(key, 0.0) + time.perf_counter() - full_gc["start"]

gc.callbacks.append(on_gc)
import jax, jax.numpy as jnp, numpy as np, numpyro
from numpyro.infer import SVI, Trace_ELBO
from d3pext import DPSVI
from d3pext.datasets import load_breast_cancer
from d3pext.models import logistic_guide, logistic_regression

kind = sys.argv[1]
data = load_breast_cancer()
x = jnp.asarray(np.hstack([data.x_train, np.ones((len(data.x_train), 1), np.float32)]))
y = jnp.asarray(data.y_train, jnp.float32)
optim = numpyro.optim.Adam(0.1)

def make():
    if kind == "svi":
        return SVI(logistic_regression, logistic_guide, optim, Trace_ELBO())
    return DPSVI(logistic_regression, logistic_guide, optim, Trace_ELBO(), clipping_threshold=1.0,
                 epsilon=1.0, num_steps=200)

def block(tree):
    jax.block_until_ready(tree)
    return time.perf_counter()

out = {}
key = jax.random.key(0)
svi = make()
full_gc["phase"] = "init"
start = time.perf_counter()
state = svi.init(key, x, y, batch_size=200)
out["init"] = block(state) - start
update = jax.jit(svi.update, static_argnames=("batch_size",)) if kind == "svi" else svi.update
full_gc["phase"] = "first_step"
start = time.perf_counter()
state, loss = update(state, x, y, batch_size=200)
out["first_step"] = block(loss) - start
full_gc["phase"] = None
out["init_full_gc"] = full_gc.get("init_full_gc", 0.0)
out["first_step_full_gc"] = full_gc.get("first_step_full_gc", 0.0)
out["init_and_first_step"] = out["init"] + out["first_step"]
start = time.perf_counter()
state, loss = update(state, x, y, batch_size=200)
out["second_step"] = block(loss) - start

runner = make()
start = time.perf_counter()
result = runner.run(jax.random.key(1), 200, x, y, batch_size=200, progress_bar=False)
out["run_first"] = block(result.params) - start
start = time.perf_counter()
result = runner.run(jax.random.key(2), 200, x, y, batch_size=200, progress_bar=False)
out["run_again"] = block(result.params) - start
other = make()
start = time.perf_counter()
result = other.run(jax.random.key(3), 200, x, y, batch_size=200, progress_bar=False)
out["run_new_object"] = block(result.params) - start
print(json.dumps(out))
"""


PAIRED = r"""
import json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np, numpyro
from jax._src import compiler, xla_bridge
from jax._src.lib import xla_client
from numpyro.infer import SVI, Trace_ELBO
from d3pext import DPSVI
from d3pext.datasets import load_breast_cancer
from d3pext.models import logistic_guide, logistic_regression
from d3pext.training.svi import _split_kwargs

data = load_breast_cancer()
x = jnp.asarray(np.hstack([data.x_train, np.ones((len(data.x_train), 1), np.float32)]))
y = jnp.asarray(data.y_train, jnp.float32)
optim = numpyro.optim.Adam(0.1)
svi = SVI(logistic_regression, logistic_guide, optim, Trace_ELBO())
state = svi.init(jax.random.key(0), x, y, batch_size=200)
lowered = {"svi": jax.jit(svi.update, static_argnames=("batch_size",)).trace(state, x, y, batch_size=200).lower()}
dpsvi = DPSVI(logistic_regression, logistic_guide, optim, Trace_ELBO(), clipping_threshold=1.0, epsilon=1.0,
              num_steps=200)
dstate = dpsvi.init(jax.random.key(0), x, y, batch_size=200)
dyn, static = _split_kwargs({"batch_size": 200})
draws = dpsvi._update_draws(dstate)  # compiled in init: the step takes them
lowered["dpsvi"] = dpsvi._jitted_step(static, False).trace(dstate, (x, y), dyn, None, dpsvi._settings(), draws).lower()
backend = xla_bridge.get_backend("cpu")
devices = xla_client.DeviceList(tuple(backend.devices()[:1]))
options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
out = {kind: [] for kind in lowered}
for _ in range(int(sys.argv[1])):
    for kind, low in lowered.items():
        module = low.compiler_ir("stablehlo")
        wall, cpu = time.perf_counter(), time.process_time()
        compiler.backend_compile_and_load(backend, module, devices, options, [])
        out[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
print(json.dumps(out))
"""


def _paired(repeats: int) -> dict:
    env = {**os.environ, "D3PEXT_NO_COMPILE_CACHE": "1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", PAIRED, str(repeats)], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    times = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"compile of the first-step programs, {repeats} alternating compiles each in one process:")
    for i, clock in enumerate(("wall", "CPU")):
        svi, dpsvi = ([t[i] for t in times[kind]] for kind in ("svi", "dpsvi"))
        ratios = [d / s for s, d in zip(svi, dpsvi)]
        print(f"  {clock:4s} s: SVI median {statistics.median(svi):.2f} (min {min(svi):.2f}), DPSVI median "
              f"{statistics.median(dpsvi):.2f} (min {min(dpsvi):.2f}), DPSVI/SVI paired median "
              f"{statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})")
    return {"paired": times}


def _ir_sizes() -> dict:
    """Kernels and bytes of optimized LLVM IR of the two first-step programs (XLA's dump, one compile each):
    deterministic, unlike compile times on a shared machine, and LLVM is about half of the compile."""
    with tempfile.TemporaryDirectory() as dump:
        env = {**os.environ, "D3PEXT_NO_COMPILE_CACHE": "1", "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()}
        subprocess.run([sys.executable, "-c", PAIRED, "1"], env=env, capture_output=True, text=True, check=True)
        modules: dict[str, list[int]] = {}
        for name in os.listdir(dump):
            found = re.match(r"module_(\d+)\.(jit_update|jit__step)\..*ir-with-opt\.ll$", name)
            if found:
                modules.setdefault(f"{found[2]} {found[1]}", []).append(os.path.getsize(os.path.join(dump, name)))
    sizes = {}
    for program, kind in (("jit_update", "svi"), ("jit__step", "dpsvi")):
        files = max((v for k, v in modules.items() if k.startswith(program + " ")), key=sum)
        sizes[kind] = {"kernels": len(files), "ir_bytes": sum(files)}
    print("optimized LLVM IR of the first-step programs:")
    for kind, label in (("svi", "SVI"), ("dpsvi", "DPSVI")):
        print(f"  {label:5s} {sizes[kind]['kernels']:4d} kernels, {sizes[kind]['ir_bytes'] / 1e3:7.0f} kB")
    print(f"  DPSVI/SVI {sizes['dpsvi']['ir_bytes'] / sizes['svi']['ir_bytes']:.2f}x")
    return {"ir": sizes}


def _child(kind: str) -> dict:
    env = {**os.environ, "D3PEXT_NO_COMPILE_CACHE": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, "-c", CHILD, kind], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


DEMOS = {"d3pext demo": [], "d3pext demo --repeats 1 --seed 0": ["--repeats", "1", "--seed", "0"]}


def _demo(cache_dir: str, options: list) -> float:
    env = {**os.environ, "D3PEXT_CACHE_DIR": cache_dir, "D3PEXT_NO_COMPILE_CACHE": "0"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "d3pext", "demo", *options], env=env, capture_output=True, text=True,
                   check=True)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per row (default 3)")
    parser.add_argument("--no-demo", action="store_true", help="skip the d3pext demo rows")
    parser.add_argument("--json", default=None, metavar="PATH", help="write all figures as JSON")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="only the compile of the two first-step programs, N alternating times in one process")
    parser.add_argument("--ir", action="store_true",
                        help="only the size of the two first-step programs' optimized LLVM IR (deterministic)")
    args = parser.parse_args()
    if args.paired or args.ir:
        figures = _paired(args.paired) if args.paired else {}
        if args.ir:
            figures.update(_ir_sizes())
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(figures, fh, indent=1)
        return

    rows: dict[str, list[dict]] = {"svi": [], "dpsvi": []}
    for _ in range(args.repeats):  # alternate, so that load drifts affect both alike
        for kind in rows:
            rows[kind].append(_child(kind))
    med = {kind: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for kind, runs in rows.items()}
    print(f"load average {os.getloadavg()[0]:.1f}, {args.repeats} fresh processes per figure (medians, seconds)")
    print(f"{'':28s} {'SVI':>8s} {'DPSVI':>8s} {'DPSVI/SVI':>10s}")
    for k in med["svi"]:
        s, d = med["svi"][k], med["dpsvi"][k]
        print(f"{k:28s} {s:8.2f} {d:8.2f} {f'{d / s:9.2f}x' if s else '':>10s}")
    pairs = sorted(d["first_step"] / s["first_step"] for s, d in zip(rows["svi"], rows["dpsvi"]))
    print(f"first_step DPSVI/SVI per pair of processes: {', '.join(f'{r:.2f}x' for r in pairs)}")
    # CPython (3.11-3.13) runs a full collection at the 11th collection of its middle generation since the
    # last full one (one per ~7,000 net allocations of tracked objects, imports included), whatever is alive
    # then: it falls where the process's allocations put it, here in DPSVI's first step and just after SVI's
    pairs = sorted((d["first_step"] - d["first_step_full_gc"]) / (s["first_step"] - s["first_step_full_gc"])
                   for s, d in zip(rows["svi"], rows["dpsvi"]))
    print(f"first_step less full GCs, DPSVI/SVI per pair: {', '.join(f'{r:.2f}x' for r in pairs)}")
    for kind in rows:
        m = med[kind]
        print(f"{kind}: second run / first run {m['run_again'] / m['run_first']:.2f}x, "
              f"new object / first run {m['run_new_object'] / m['run_first']:.2f}x")
    figures = {"median": med, "raw": rows}

    if not args.no_demo:
        times = {name: ([], []) for name in DEMOS}
        for _ in range(args.repeats):  # alternating, each pair with an empty cache directory
            for name, options in DEMOS.items():
                with tempfile.TemporaryDirectory() as cache:
                    times[name][0].append(_demo(cache, options))
                    times[name][1].append(_demo(cache, options))
        for name, (first, second) in times.items():
            ratios = ", ".join(f"{b / a:.2f}" for a, b in zip(first, second))
            print(f"{name}: first {statistics.median(first):.1f} s, second (warm compile cache) "
                  f"{statistics.median(second):.1f} s, ratio per pair {ratios} (target <= 0.35x)")
        figures["demo"] = {name: {"first": first, "second": second} for name, (first, second) in times.items()}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1)


if __name__ == "__main__":
    main()
