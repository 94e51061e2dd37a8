"""Data-parallel DPSVI: per-device work, communication and step time at D = 1, 2, 4 devices.

    python benchmarks/bench_data_parallel.py [--quick] [--devices 1,2,4] [--json PATH]
    python benchmarks/bench_data_parallel.py --estimate PATH [--q 1e-4] [--epochs 10]   # paper estimate, no run

``DPSVI(..., mesh=Mesh(devices[:D], ("data",)))`` splits each batch's records over D devices
(:mod:`d3pext.training.parallel`); the data is sharded by rows over the same axis. For each model and D,
side by side in one run, with "none" (plain DPSVI, no mesh, data on one device) as the baseline:

- per-device flops (XLA's ``cost_analysis`` of the compiled SPMD program, which is one device's) of the
  per-record part (the clipped sum, :func:`~d3pext.training.parallel.data_parallel_clipped_sum`) and of the
  whole step (sampler, noise, global terms and optimizer included, which are not split);
- bytes each device exchanges per step, by collective, read from the compiled step's HLO
  (:func:`~d3pext.training.parallel.communication`);
- wall time per step (median over repeats of a compiled ``lax.scan`` of steps, after a warm-up run);
- the largest difference of the parameters from the baseline's after the same steps from the same key
  (the same fit whatever D, up to float rounding).

Without a multi-device machine the D devices are *forced CPU devices*
(``XLA_FLAGS=--xla_force_host_platform_device_count``, set here before JAX starts): they share the
machine's cores, so wall times show the overhead of the split, not a speed-up; the flop counts show the
work per device that real devices would each do.

Models: logistic regression (N=10^4, d=10, B=100, materialized clipping) and a VAE (784 binary inputs,
hidden 400, latent 10, B=128, ghost clipping; ``--quick``: hidden 100, B=64).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _force_devices(count: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
        os.environ["JAX_PLATFORMS"] = "cpu"


# Stated assumptions of the paper estimate (docs/guides/scaling.md): H100 SXM figures from NVIDIA's data
# sheet, a utilisation typical of mid-sized matrix products, and a cloud price; change them here.
ASSUME = dict(
    peak_flops=67e12,  # FP32 (non-tensor-core) peak of one H100 SXM, flop/s
    utilisation=0.3,  # fraction of the peak the per-record products reach
    hbm_bytes_per_s=3.35e12,  # HBM3 bandwidth of one H100 SXM (the non-split work is memory-bound)
    nvlink_bytes_per_s=450e9,  # NVLink 4 per GPU and direction (8 GPUs of one node, D = 8)
    infiniband_bytes_per_s=50e9,  # 400 Gb/s NDR per GPU and direction (8 nodes of 8 GPUs, D = 64)
    latency_s=5e-6,  # per step of a ring collective (2 (D - 1) steps for an all-reduce)
    usd_per_gpu_hour=3.0,
)


def estimate(figures: dict, model: str = "vae", num_records: float = 1e9, q: float = 1e-4, epochs: float = 10,
             devices: tuple[int, ...] = (8, 64)) -> list[dict]:
    """Paper estimate of step time, run time and cost for ``num_records`` records at sampling rate ``q``
    for ``epochs`` epochs on ``devices`` H100s, from the measured per-record flops, parameter bytes,
    row bytes and non-split flops of ``model`` in ``figures`` (this script's ``--json`` output)."""
    m = figures["models"][model]
    a = ASSUME
    batch = q * num_records
    one = m["rows"]["1"]
    serial_flops = one["step_flops"] - one["per_record_flops"]  # sampler, noise, global terms, optimizer
    out = []
    for d in devices:
        bandwidth = a["nvlink_bytes_per_s"] if d <= 8 else a["infiniband_bytes_per_s"]
        ring = 2 * (d - 1) / d
        compute = batch / d * m["per_record_flops"] / (a["peak_flops"] * a["utilisation"])
        # the non-split part touches each parameter a few times: memory-bound
        serial = max(serial_flops / (a["peak_flops"] * a["utilisation"]), 16 * m["param_bytes"] / a["hbm_bytes_per_s"])
        grads = ring * m["param_bytes"] / bandwidth + a["latency_s"] * 2 * (d - 1)
        rows_allreduce = ring * batch * m["row_bytes"] / bandwidth  # rows sharded, gathered as now (all-reduce)
        rows_scatter = (d - 1) / d * batch * m["row_bytes"] / bandwidth  # the same as a reduce-scatter
        rows_all_to_all = (d - 1) / d * batch / d * m["row_bytes"] / bandwidth  # each device receives its B/D rows
        steps = epochs / q
        row = dict(devices=d, batch=batch, steps=steps, compute_s=compute, serial_s=serial, grads_s=grads,
                   rows_allreduce_s=rows_allreduce, rows_reduce_scatter_s=rows_scatter, rows_all_to_all_s=rows_all_to_all)
        for name, rows in (("own_rows", 0.0), ("sharded", rows_allreduce), ("reduce_scatter", rows_scatter),
                           ("all_to_all", rows_all_to_all)):
            step = compute + serial + grads + rows
            row[f"step_s_{name}"] = step
            row[f"run_h_{name}"] = step * steps / 3600
            row[f"usd_{name}"] = step * steps / 3600 * d * a["usd_per_gpu_hour"]
        out.append(row)
    return out


def print_estimate(path: str, model: str, q: float, epochs: float) -> None:
    with open(path) as f:
        figures = json.load(f)
    m = figures["models"][model]
    print(f"# paper estimate for {m['label']}: N = 1e9, q = {q:g} (B = {q * 1e9:.0f}), {epochs:g} epochs")
    print(f"# measured: {m['per_record_flops']:.4g} flops per record, {m['param_bytes']} parameter bytes, "
          f"{m['row_bytes']} bytes per row; assumptions {ASSUME}")
    for r in estimate(figures, model, q=q, epochs=epochs):
        print(f"D={r['devices']}: compute {r['compute_s'] * 1e3:.3f} ms, non-split {r['serial_s'] * 1e3:.3f} ms, "
              f"gradient all-reduce {r['grads_s'] * 1e3:.3f} ms, batch rows: all-reduce {r['rows_allreduce_s'] * 1e3:.3f} / "
              f"reduce-scatter {r['rows_reduce_scatter_s'] * 1e3:.3f} / all-to-all {r['rows_all_to_all_s'] * 1e3:.3f} ms")
        for name in ("own_rows", "sharded", "reduce_scatter", "all_to_all"):
            print(f"    rows {name:>14}: step {r[f'step_s_{name}'] * 1e3:8.3f} ms, epoch {r[f'step_s_{name}'] / q:8.1f} s, "
                  f"run {r[f'run_h_{name}']:7.3f} h, {r[f'run_h_{name}'] * r['devices']:8.2f} GPU-h, ${r[f'usd_{name}']:9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller VAE and fewer repeats")
    parser.add_argument("--devices", default="1,2,4", help="device counts D to compare")
    parser.add_argument("--models", default="logreg,vae")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    parser.add_argument("--estimate", default=None, metavar="JSON",
                        help="print the paper estimate for 1e9 records on 8 and 64 H100s from a --json file; no run")
    parser.add_argument("--q", type=float, default=1e-4, help="sampling rate of the estimate")
    parser.add_argument("--epochs", type=float, default=10, help="epochs of the estimate")
    args = parser.parse_args()
    if args.estimate:
        print_estimate(args.estimate, args.models.split(",")[-1], args.q, args.epochs)
        return
    counts = [int(d) for d in args.devices.split(",")]
    _force_devices(max(counts))

    import jax
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from numpyro.infer import Trace_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal

    from d3pext import DPSVI
    from d3pext.models.vae import simulate_binary_images, vae_guide, vae_model
    from d3pext.training.clipping import CLIPPED_SUMS
    from d3pext.training.parallel import communication, data_parallel_clipped_sum

    devices = jax.devices()
    if len(devices) < max(counts):
        sys.exit(f"{len(devices)} devices, {max(counts)} asked for")
    repeats, steps = (3, 20) if args.quick else (5, 50)

    def logreg_setup():
        n, d, b = 10_000, 10, 100

        def model(x, y):
            w = numpyro.sample("w", dist.Normal(0.0, 4.0).expand([d]).to_event(1))
            with numpyro.plate("data", n, subsample_size=b):
                xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
                numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)

        x = jax.random.normal(jax.random.key(0), (n, d))
        y = (x @ jnp.linspace(-1, 1, d) + 0.3 * jax.random.normal(jax.random.key(1), (n,)) > 0) * 1.0
        return dict(model=model, guide=AutoDiagonalNormal(model), data=(x, y), kwargs={}, clipping="materialize",
                    batch=b, label=f"logistic regression N={n} d={d} B={b}")

    def vae_setup():
        hidden, b, n = (100, 64, 1024) if args.quick else (400, 128, 4096)
        x = simulate_binary_images(jax.random.key(0), n, dim=784)
        kw = dict(batch_size=b, hidden_dim=hidden, latent_dim=10)
        return dict(model=vae_model, guide=vae_guide, data=(x,), kwargs=kw, clipping="ghost", batch=b,
                    label=f"VAE 784-{hidden}-10 N={n} B={b} (ghost)")

    setups = {"logreg": logreg_setup, "vae": vae_setup}
    results = {"devices": f"{len(devices)} x {devices[0].platform} ({devices[0].device_kind})",
               "cpu_cores": os.cpu_count(), "models": {}}
    print(f"# {results['devices']}, {os.cpu_count()} cores shared by all forced devices")
    for name in args.models.split(","):
        setup = setups[name]()
        print(f"\n{setup['label']}")
        print(f"{'D':>5} {'per-record flops/dev':>21} {'ratio':>6} {'step flops/dev':>15} {'ratio':>6} "
              f"{'comm bytes/step/dev':>28} {'ms/step':>8} {'max |dparams|':>14}")
        rows, base = {}, None
        for d in ["none"] + counts:
            mesh = None if d == "none" else Mesh(np.array(devices[:d]), ("data",))
            data = setup["data"] if mesh is None else tuple(
                jax.device_put(a, NamedSharding(mesh, P("data"))) for a in setup["data"])
            kw = setup["kwargs"]
            svi = DPSVI(setup["model"], setup["guide"], numpyro.optim.Adam(1e-3), Trace_ELBO(), clipping_threshold=1.0,
                        dp_scale=1.0, clipping=setup["clipping"], mesh=mesh)
            state = svi.init(jax.random.key(1), *data, **kw)
            params = svi.optim.get_params(state.optim_state)
            b = setup["batch"]
            records, mask = (jnp.arange(b), jnp.arange(b)), jnp.ones(b, bool)
            part_mesh = Mesh(np.array(devices[:1]), ("data",)) if mesh is None else mesh
            dyn = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
            part = jax.jit(lambda p, k, a, recs, m: data_parallel_clipped_sum(
                CLIPPED_SUMS[setup["clipping"]], svi._record_loss, p, k, a, {**kw, **dyn}, recs, m, 1.0, True, True,
                mesh=part_mesh, axis="data"))
            part_flops = part.lower(params, jax.random.key(3), data, records, mask).compile().cost_analysis()["flops"]
            step = jax.jit(lambda s, *a: svi.update(s, *a, **kw)).lower(state, *data).compile()
            step_flops = step.cost_analysis()["flops"]
            comm = communication(step.as_text())
            run = lambda: svi.run(jax.random.key(2), steps, *data, init_state=state, progress_bar=False, **kw)
            jax.block_until_ready(run().params)  # compile
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                fit = jax.block_until_ready(run().params)
                times.append((time.perf_counter() - start) / steps * 1e3)
            if base is None:
                base = dict(part=part_flops, step=step_flops, fit=fit)
            diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(fit), jax.tree.leaves(base["fit"])))
            row = dict(per_record_flops=part_flops, per_record_ratio=part_flops / base["part"], step_flops=step_flops,
                       step_ratio=step_flops / base["step"], comm_bytes=comm, ms_per_step=statistics.median(times),
                       ms_per_step_min=min(times), max_param_diff=diff)
            rows[str(d)] = row
            comm_text = ", ".join(f"{k} {v}" for k, v in comm.items()) or "-"
            print(f"{d!s:>5} {part_flops:>21.4g} {row['per_record_ratio']:>6.3f} {step_flops:>15.4g} "
                  f"{row['step_ratio']:>6.3f} {comm_text:>28} {row['ms_per_step']:>8.3f} {diff:>14.3g}")
        params_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
        b = setup["batch"]
        row_bytes = sum(a[0].size * a.dtype.itemsize for a in setup["data"])
        per_record = base["part"] / b
        top = rows[str(max(counts))]["comm_bytes"]
        print(f"parameters: {params_bytes} bytes; batch rows: {b} x {row_bytes} = {b * row_bytes} bytes; "
              f"per-record flops (D=1 part / B): {per_record:.4g}")
        gathered = top.get("all-gather", 0)
        print(f"at D={max(counts)}: all-gather {gathered} bytes per step "
              f"({'no' if gathered < b * row_bytes else 'an'} all-gather of the {b * row_bytes} bytes of batch rows); "
              f"all-reduce {top.get('all-reduce', 0)} = parameters {params_bytes} + {top.get('all-reduce', 0) - params_bytes}")
        results["models"][name] = dict(label=setup["label"], param_bytes=params_bytes, batch=b, row_bytes=row_bytes,
                                       per_record_flops=per_record, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
