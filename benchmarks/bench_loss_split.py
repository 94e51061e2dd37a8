"""Should the data-independent ELBO terms (prior, entropy) go through clipping and noise?

d3pext keeps them out: only each record's likelihood term (and its local latent terms) is clipped and
noised; the global prior and the guide's entropy are differentiated exactly, once per step. d3p instead
clips every record's whole ELBO, with the global terms divided by N. This script measures both on logistic
regression with the same batches, noise and variational samples:

- the root-mean-square error of the private gradient against the exact full-data ELBO gradient, at the
  initial parameters and near the optimum, for several clipping thresholds;
- the test accuracy and the ELBO after a full private run at epsilon = 1, over several seeds.

Run: ``python benchmarks/bench_loss_split.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

from d3pext import DPSVI


class ClipEverythingDPSVI(DPSVI):
    """d3p's split: each record's term carries 1/N of the global prior and entropy, and all of it is clipped."""

    def _elbo_terms(self, params, rng_key, args, kwargs, record_key, indices):
        local, global_ = super()._elbo_terms(params, rng_key, args, kwargs, record_key, indices)
        return local + global_ / self.structure.num_records, 0.0 * global_


def model(x, y, batch_size=100):
    w = numpyro.sample("w", dist.Normal(0, 2).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
        xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)


def simulate(key, n, d):
    kw, kx, ky = jax.random.split(key, 3)
    w = jax.random.normal(kw, (d,))
    x = jax.random.normal(kx, (n, d))
    y = jax.random.bernoulli(ky, jax.nn.sigmoid(x @ w)).astype(jnp.float32)
    return x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)

    n, d, steps = 10_000, 10, 2000
    x, y = simulate(jax.random.key(0), n + 5000, d)
    x_train, y_train, x_test, y_test = x[:n], y[:n], x[n:], y[n:]
    guide = AutoDiagonalNormal(model)
    figures = {"setting": dict(n=n, d=d, batch=100, steps=steps, epsilon=1.0, delta=1e-5)}

    # gradient error against the exact full-data gradient, same keys for both splits
    svi_ref = DPSVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=1.0, dp_scale=1.0)
    state = svi_ref.init(jax.random.key(0), x_train, y_train)
    init_params = svi_ref.optim.get_params(state.optim_state)
    fit = SVI(model, guide, numpyro.optim.Adam(0.02), Trace_ELBO()).run(jax.random.key(1), 3000, x_train, y_train, progress_bar=False)
    opt_params = {"auto_loc": fit.params["auto_loc"], "auto_scale": jnp.log(fit.params["auto_scale"])}

    def exact_grad(params, key):
        svi_full = DPSVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=1e9, dp_scale=1e-12)
        svi_full.init(jax.random.key(0), x_train, y_train, batch_size=n)
        keys = jax.random.split(key, 200)
        g = jax.jit(jax.vmap(lambda k: svi_full._private_grad(params, k, (x_train, y_train), {"batch_size": n}, False)[1]))(keys)
        return jax.tree.map(lambda a: a.mean(0), g)

    rows = []
    for where, params in (("initial", init_params), ("optimum", opt_params)):
        exact = exact_grad(params, jax.random.key(9))
        for clip in (0.1, 1.0, 5.0):
            for name, cls in (("d3pext", DPSVI), ("clip-everything (d3p)", ClipEverythingDPSVI)):
                svi = cls(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=clip, dp_scale=1.0)
                svi.init(jax.random.key(0), x_train, y_train)
                keys = jax.random.split(jax.random.key(1), 400)
                g = jax.jit(jax.vmap(lambda k: svi._private_grad(params, k, (x_train, y_train), {}, False)[1]))(keys)
                err = sum(float(jnp.sum((g[k] - exact[k]) ** 2)) for k in g) / 400
                bias = sum(float(jnp.sum((g[k].mean(0) - exact[k]) ** 2)) for k in g)
                rows.append(dict(at=where, clip=clip, split=name, rmse=err**0.5, bias=bias**0.5))
    figures["gradient_error"] = rows
    print(f"{'at':8} {'C':>5} {'split':24} {'RMSE':>10} {'|bias|':>10}")
    for r in rows:
        print(f"{r['at']:8} {r['clip']:5} {r['split']:24} {r['rmse']:10.2f} {r['bias']:10.2f}")

    # end to end at epsilon = 1
    results = {}
    for name, cls in (("d3pext", DPSVI), ("clip-everything (d3p)", ClipEverythingDPSVI)):
        accs = []
        t0 = time.perf_counter()
        for seed in range(args.seeds):
            svi = cls(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO(), clipping_threshold=1.0,
                      epsilon=1.0, delta=1e-5, num_steps=steps)
            res = svi.run(jax.random.key(100 + seed), steps, x_train, y_train, progress_bar=False)
            w = res.params["auto_loc"]
            accs.append(float(jnp.mean(((x_test @ w) > 0) == (y_test > 0.5))))
        results[name] = dict(accuracy_mean=float(np.mean(accs)), accuracy_sd=float(np.std(accs)),
                             seconds=time.perf_counter() - t0)
    w = fit.params["auto_loc"]
    results["non-private SVI"] = dict(accuracy_mean=float(jnp.mean(((x_test @ w) > 0) == (y_test > 0.5))))
    figures["end_to_end"] = results
    print("\nend to end, epsilon = 1, delta = 1e-5, test accuracy over", args.seeds, "seeds")
    for name, r in results.items():
        sd = r.get("accuracy_sd")
        print(f"  {name:24} {r['accuracy_mean']:.4f}" + (f" +- {sd:.4f}" if sd is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
