"""Data-parallel DPSVI: per-device work, communication and step time at D = 1, 2, 4 devices.

    python benchmarks/bench_data_parallel.py [--quick] [--devices 1,2,4] [--json PATH]

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller VAE and fewer repeats")
    parser.add_argument("--devices", default="1,2,4", help="device counts D to compare")
    parser.add_argument("--models", default="logreg,vae")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args()
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
        print(f"parameters: {params_bytes} bytes")
        results["models"][name] = dict(label=setup["label"], param_bytes=params_bytes, rows=rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
