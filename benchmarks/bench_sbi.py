"""Time to fit SPPE / SPLE on the linear-regression example of seed 000, split into
proposal / simulation / training, and the RQMC-vs-MC RMSE slopes of the inner integral.

    python benchmarks/bench_sbi.py                      # paper size: 10 rounds x 1000 sims, M = 32
    python benchmarks/bench_sbi.py --rounds 2 --sims 1000 --num-points 8 --layers 4 --width 32
    python benchmarks/bench_sbi.py --profile --num-points 32      # per-step costs, extrapolated
    python benchmarks/bench_sbi.py --refit                        # first vs repeated fits (compiling)

Prints one table row per method (seconds, and the share spent training) and the slopes. With
``--profile`` it prints instead the compiled cost of one training step of each loss (maximum
likelihood, atomic APT, SPLE), of one validation pass over the fixed-capacity buffer with and
without skipping the batches of padding, and a lower bound on the time of ``rounds`` rounds
(every round at least ``patience + 1`` epochs over all simulations so far). With ``--refit`` it
times, at the SPPE/SPLE notebook's small size, a first SPPE fit and ``sample``, then fits of the
same model on another release, with another seed and by SPLE, and a second SPLE ``sample``, as ratios
to the first: what compiling costs each (run it in a fresh process).
"""

from __future__ import annotations

import argparse
import os
import time

import jax
from jax import random
import jax.numpy as jnp

import d3pext.simulation.sbi  # noqa: F401  (registers sppe / sple)
from d3pext.simulation import rqmc
from d3pext.handlers import private_posterior
from d3pext.releases.mechanisms import BinomialMechanism, LaplaceMechanism
from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression


def fit(method: str, args) -> dict:
    model = private_linear_regression(100, 10.0, sensitivity=0.13)
    post = private_posterior(
        model, {"records_dp": jnp.array(PAPER_S_DP)}, method=method, rounds=args.rounds,
        simulations_per_round=args.sims, num_points=args.num_points, max_epochs=args.max_epochs,
        flow_kwargs=dict(layers=args.layers, width=args.width), progress_bar=False,
        num_warmup=200, num_chains=4,
    )
    t0 = time.perf_counter()
    post.run(random.key(0), 100)
    total = time.perf_counter() - t0
    draws = post.sample(random.key(1), 2000)["beta"]
    d = post.diagnostics
    return {
        "method": method, "total_s": total,
        "propose_s": sum(r["propose_s"] for r in d), "simulate_s": sum(r["simulate_s"] for r in d),
        "train_s": sum(r["train_s"] for r in d), "epochs": sum(r["epochs"] for r in d),
        "mean": [round(float(v), 2) for v in draws.mean(0)],
    }


def refit() -> None:
    """First against repeated fits of one model, at the notebook's small size."""
    model = private_linear_regression(100, 10.0, sensitivity=0.13)
    small = dict(rounds=1, simulations_per_round=400, num_points=4, max_epochs=20, learning_rate=5e-3,
                 patience=10, flow_kwargs=dict(layers=2, width=16, knots=6), progress_bar=False,
                 num_warmup=100, num_chains=4)
    other = [0.9 * v for v in PAPER_S_DP]
    print("(the notebook's small size: 1 round x 400 simulations, M = 4, flow 2 layers x 16)")
    rows = []
    for label, method, release, seed in (("first SPPE fit", "sppe", PAPER_S_DP, 0),
                                         ("SPPE, another release", "sppe", other, 0),
                                         ("SPPE, another seed", "sppe", PAPER_S_DP, 1),
                                         ("SPLE, same model", "sple", PAPER_S_DP, 0),
                                         ("SPLE, another release", "sple", other, 0)):
        post = private_posterior(model, {"records_dp": jnp.array(release)}, method=method, **small)
        t0 = time.perf_counter()
        post.run(random.key(seed), 100)
        t1 = time.perf_counter()
        jax.block_until_ready(post.sample(random.key(2), 300))
        rows.append((label, t1 - t0, time.perf_counter() - t1))
    first_fit, first_sample = rows[0][1], rows[0][2]
    for label, fit_s, sample_s in rows:
        print(f"{label:24s} fit {fit_s:6.2f} s ({fit_s / first_fit:5.2f}x the first SPPE fit), "
              f"sample {sample_s:5.2f} s")
    print(f"SPLE's sample, first / second object: {rows[3][2]:.2f} / {rows[4][2]:.2f} s "
          f"({rows[4][2] / rows[3][2]:.2f}x); SPPE's first sample {first_sample:.2f} s")


def _timed(fn, *args, repeat: int = 3) -> tuple[float, float]:
    """(first call incl. compilation, mean of ``repeat`` further calls), seconds."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return first, (time.perf_counter() - t0) / repeat


def profile(args) -> None:
    """Per-step cost of each loss at this size, and what it implies for a full run."""
    import equinox as eqx
    import paramax

    from d3pext.simulation.flows import _partition, conditional_spline_flow
    from d3pext.simulation.sbi import _make_atomic_loss, _sple_loss, _sppe_mle_loss

    B, M, d, r, atoms = 100, args.num_points, 3, 9, 10
    k1, k2, k3 = random.split(random.key(0), 3)
    batch = {"z": random.normal(k1, (B, d)), "s": random.normal(k2, (B, M, r)),
             "logp": random.normal(k3, (B,))}
    valid_cap = args.rounds * round(0.05 * args.sims)
    num_train = args.sims - round(0.05 * args.sims)
    steps = sum((i * num_train) // B for i in range(1, args.rounds + 1))
    print(f"batch {B}, M = {M}, {atoms} atoms; flow evaluations per step: MLE {B * M}, "
          f"atomic {B * M * atoms}")
    cost = {}
    for name, loss, dim, cond in (("sppe-mle", _sppe_mle_loss, d, r),
                                  ("sppe-atomic", _make_atomic_loss(atoms), d, r),
                                  ("sple", _sple_loss, r, d)):
        flow = conditional_spline_flow(random.key(1), dim, cond, layers=args.layers, width=args.width)
        params, static = _partition(flow)

        def mean_loss(p, b, key, loss=loss, static=static):
            return jnp.mean(loss(paramax.unwrap(eqx.combine(p, static)), b, key))

        compile_s, step_s = _timed(jax.jit(jax.value_and_grad(mean_loss)), params, batch, k1)
        _, fwd_s = _timed(jax.jit(mean_loss), params, batch, k1)
        cost[name] = step_s
        # validation: one forward pass per batch of the buffer, or only per filled batch
        full, first = -(-valid_cap // B) * fwd_s, -(-round(0.05 * args.sims) // B) * fwd_s
        print(f"{name:12s} step (loss + gradient) {step_s:6.3f} s, forward {fwd_s:6.3f} s, first "
              f"call {compile_s:5.1f} s; round-1 validation {full:5.2f} s -> {first:5.2f} s "
              f"({full / first:.0f}x, padding batches skipped)")
    epochs = 21  # patience 20: at least 21 epochs per round
    sppe = cost["sppe-mle"] * (num_train // B) + cost["sppe-atomic"] * (steps - num_train // B)
    print(f"{args.rounds} rounds x {args.sims}: {steps} steps per epoch-sweep; at >= {epochs} epochs "
          f"per round, training alone takes >= {epochs * sppe / 60:.0f} min (SPPE), "
          f">= {epochs * cost['sple'] * steps / 60:.0f} min (SPLE)")


def slopes() -> dict:
    s_tilde = jnp.array([-0.3742, -0.0629, 0.0299, 0.2499, 0.0938, -0.1270, 0.0180, -0.0094, 0.0280])
    lap = LaplaceMechanism(10.0, sensitivity=0.13)
    binom = BinomialMechanism.from_pseudo_count(1000, 1000.0, 10**6, sensitivity=10.0)
    counts = jnp.array([1.0, 3e4, 6e5, 2.6e5, 1.2e5, 4.7e4, 1.8e4, 9e3, 5e3, 3e3])
    ms = (8, 32, 128, 512)
    out = {}
    for name, mech, value, g in (
        ("laplace", lap, s_tilde, lambda s: jnp.tanh(10 * jnp.sum(s * jnp.linspace(-1, 1, 9), -1))),
        ("binomial", binom, counts, lambda s: jnp.log1p(jnp.sum(s * jnp.linspace(0.1, 1, 10), -1) / 100)),
    ):
        c = rqmc.convergence_study(g, mech, value, ms, random.key(0), 100, 2**14)
        out[name] = (c["slope_mc"], c["slope_rqmc"], c["rmse_mc"][-1] / c["rmse_rqmc"][-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--sims", type=int, default=1000)
    p.add_argument("--num-points", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=50)
    p.add_argument("--max-epochs", type=int, default=1000)
    p.add_argument("--methods", default="sple,sppe")
    p.add_argument("--skip-slopes", action="store_true")
    p.add_argument("--profile", action="store_true", help="per-step costs only (see above)")
    p.add_argument("--refit", action="store_true", help="first vs repeated fits only (see above)")
    args = p.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cores, load "
          f"{load:.1f}); {args.rounds} rounds x {args.sims} sims, M={args.num_points}, flow "
          f"{args.layers} layers x {args.width}")
    if args.profile:
        profile(args)
        return
    if args.refit:
        refit()
        return
    if not args.skip_slopes:
        for name, (mc, q, ratio) in slopes().items():
            print(f"RQMC vs MC ({name}): slope MC {mc:.2f}, RQMC {q:.2f}; MC/RQMC RMSE at M=512: {ratio:.1f}x")
    for method in args.methods.split(","):
        r = fit(method, args)
        print(f"{r['method']}: total {r['total_s']:.0f} s = propose {r['propose_s']:.0f} + simulate "
              f"{r['simulate_s']:.0f} + train {r['train_s']:.0f} ({r['epochs']} epochs; "
              f"{100 * r['train_s'] / r['total_s']:.0f}% training); posterior mean {r['mean']}")


if __name__ == "__main__":
    main()
