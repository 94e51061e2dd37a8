"""Kazan & Reiter bounded-Gaussian Gibbs sampler: d3pext vs a single-chain NumPy chain, per CPU-second.

One run, side by side, on the paper's Example 1 (constrained analysis, flat prior, the release
of ``set.seed(6)``), all rates in chain-iterations per CPU-second (``time.process_time``, all
threads of this process; the machine may be shared, so wall time is not used; on a GPU the d3pext
rows are wall time, the NumPy reference stays CPU time of its one thread):

- a plain NumPy/SciPy single chain (the R code of seed 001 Appendix L, line by line, truncated
  gammas by ``scipy.special.gammaincinv``/``gammainccinv``): the reference;
- d3pext's ``private_posterior`` (``KazanReiterGibbs``, ``chain_method="vectorized"``, float64)
  at 1, 10, 100 and 1000 chains: the second ``mcmc.run`` of the same ``MCMC`` object, as a
  ratio to the reference measured just before it (the machine may be shared: each row has its
  own reference), with the compile time (first run's CPU time minus the second's) and the
  number of XLA compilations the second run triggered (0: ``CachedMCMC`` reuses the sampler);
- ``sample_releases`` (many releases x chains in one compiled ``vmap``), and the time the
  paper's Figure 2 study (168 settings x 10,000 data sets x 20,000 iterations, 10-20 hours per
  setting on a cluster core) would take at that rate.

    python benchmarks/bench_bounded.py            # full size
    python benchmarks/bench_bounded.py --small    # a few minutes of CPU (mostly compilation)
    python benchmarks/bench_bounded.py --small --chains 100 --skip kernel releases
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import numpy as np
from scipy import special as sps

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402

import d3pext.inference.bounded  # noqa: E402,F401
from d3pext.inference.bounded import FlatPrior  # noqa: E402
from d3pext.handlers import private_posterior, sample_releases  # noqa: E402
from d3pext.handlers.posterior import RELEASES_KWARG  # noqa: E402
from d3pext.models.bounded_gaussian import BLOOD_LEAD, private_bounded_gaussian  # noqa: E402

FIGURE2_CHAIN_ITERATIONS = 168 * 10_000 * 20_000


def _numpy_truncated_gamma(rng, shape, rate, low, high):
    """Gamma(shape, rate) on [low, high] by inversion (P below the median, Q above)."""
    lo, hi = low * rate, high * rate
    u = rng.random()
    if lo > shape:
        q_lo, q_hi = sps.gammaincc(shape, lo), sps.gammaincc(shape, hi)
        return sps.gammainccinv(shape, q_lo - u * (q_lo - q_hi)) / rate
    p_lo, p_hi = sps.gammainc(shape, lo), sps.gammainc(shape, hi)
    return sps.gammaincinv(shape, p_lo + u * (p_hi - p_lo)) / rate


def _numpy_tgm(rng, alpha, beta, lam, tau, upper):
    cut = min(max(tau, 0.0), upper)
    r1, r2 = beta - lam, beta + lam
    with np.errstate(divide="ignore"):
        lw1 = -lam * tau - alpha * math.log(r1) + np.log(sps.gammainc(alpha, r1 * cut))
        lw2 = lam * tau - alpha * math.log(r2) + np.log(
            sps.gammaincc(alpha, r2 * cut) - sps.gammaincc(alpha, r2 * upper)
        )
    if rng.random() < 1 / (1 + math.exp(lw2 - lw1)):
        return _numpy_truncated_gamma(rng, alpha, r1, 0.0, cut)
    return _numpy_truncated_gamma(rng, alpha, r2, cut, upper)


def _numpy_truncated_normal(rng, loc, sd, low, high):
    a, b = sps.ndtr((low - loc) / sd), sps.ndtr((high - loc) / sd)
    return loc + sd * sps.ndtri(a + rng.random() * (b - a))


def numpy_chain(num_iter, n, ym, yv, eps1, eps2, seed=0):
    """The paper's sampler (flat prior, constrained), one chain, [0, 1] scale."""
    rng = np.random.default_rng(seed)
    sigma2 = s2 = min(max(yv, 1e-4), 0.25 * (1 - 1e-6))
    ybar = min(max(ym, 1e-6), 1 - 1e-6)
    omega_inv = eps1**2 * n**2 / 2
    out = np.empty((num_iter, 2))
    for t in range(num_iter):
        half = math.sqrt(max(0.25 - sigma2, 0.0))
        sd = math.sqrt(sigma2 / n)
        mu = _numpy_truncated_normal(rng, ybar, sd, 0.5 - half, 0.5 + half)
        floor = max(1 / (mu * (1 - mu)), 2 * eps2 * n / (n - 1))
        rate = ((n - 1) * s2 + n * (ybar - mu) ** 2) / 2
        sigma2 = 1 / _numpy_truncated_gamma(rng, (n - 2) / 2, rate, floor, math.inf)
        prec = omega_inv + n / sigma2
        loc = (ym * omega_inv + n * mu / sigma2) / prec
        half, sd = math.sqrt(max(0.25 - (n - 1) / n * s2, 0.0)), math.sqrt(1 / prec)
        ybar = _numpy_truncated_normal(rng, loc, sd, 0.5 - half, 0.5 + half)
        gap = abs(ym - ybar)
        omega_inv = rng.wald(eps1 * n / gap, eps1**2 * n**2) if gap > 0 else 1 / rng.wald(1.0, 1.0)
        s2 = _numpy_tgm(rng, (n - 1) / 2, (n - 1) / (2 * sigma2), eps2 * n, yv, n / (n - 1) * ybar * (1 - ybar))
        out[t] = mu, sigma2
    return out


def _cpu_time(fn):
    """CPU seconds of ``fn()`` (all threads of this process) and its result."""
    t = time.process_time()
    out = jax.block_until_ready(fn())
    return time.process_time() - t, out


def _wall_time(fn):
    """Wall seconds of ``fn()`` and its result: on an accelerator the host's CPU time says nothing."""
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - t, out


def _jax_time(fn):
    """CPU seconds on the CPU backend (the machine may be shared), wall seconds on an accelerator."""
    return (_cpu_time if jax.default_backend() == "cpu" else _wall_time)(fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--chains", default="1,10,100,1000", help="comma-separated chain counts")
    parser.add_argument("--skip", nargs="*", default=(), choices=("kernel", "releases"),
                        help="leave out the kernel-alone rows or the sample_releases row")
    args = parser.parse_args()
    chain_counts = [int(c) for c in args.chains.split(",")]
    e = BLOOD_LEAD
    n, eps = e["n"], e["epsilon1"]
    ym, yv = 0.343027, 0.222480
    numpy_iter = 1000 if args.small else 5000
    budget = 40_000 if args.small else 400_000  # chain-iterations per MCMC run
    sets, chains, iters = (4, 64, 200) if args.small else (10, 100, 1000)

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name) if name.endswith("backend_compile_duration") else None
    )

    numpy_chain(20, n, ym, yv, eps, eps)  # warm the imports

    def reference(seed=0):
        cpu, draws = _cpu_time(lambda: numpy_chain(numpy_iter, n, ym, yv, eps, eps, seed))
        return numpy_iter / cpu, draws

    numpy_rate, draws = reference()

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"JAX {jax.__version__} on {jax.default_backend()}, float64; rates in chain-iterations "
          + ("per CPU-second" if jax.default_backend() == "cpu" else
             f"per second: d3pext wall time on {jax.devices()[0].device_kind}, NumPy CPU time"))
    print(f"NumPy single chain (reference): {numpy_rate:10.0f}   "
          f"(posterior mean of mu {100 * draws[numpy_iter // 5:, 0].mean():.1f})")
    model = private_bounded_gaussian(eps, eps, e["bounds"], FlatPrior(), constrained=True)
    print(f"{'chains':>7} {'iterations':>10} {'d3pext rate':>12} {'NumPy rate':>10} {'/ NumPy':>8} "
          f"{'compile CPU-s':>13} {'2nd-run compiles':>17} {'mean of mu':>10}")
    for num_chains in chain_counts:
        num_iter = max(200, budget // num_chains)
        mcmc = private_posterior(
            model, e["release"], num_warmup=num_iter // 5, num_samples=num_iter - num_iter // 5,
            num_chains=num_chains, chain_method="vectorized", progress_bar=False,
        )
        first, _ = _jax_time(lambda: (mcmc.run(jax.random.key(0), n), mcmc.get_samples())[1])
        compiles.clear()
        second, out = _jax_time(lambda: (mcmc.run(jax.random.key(1), n), mcmc.get_samples())[1])
        rate = num_chains * num_iter / second
        numpy_rate = (numpy_rate + reference(num_chains)[0]) / 2  # the reference around this row
        print(f"{num_chains:7d} {num_iter:10d} {rate:12.0f} {numpy_rate:10.0f} {rate / numpy_rate:8.2f} "
              f"{first - second:13.1f} {len(compiles):17d} {float(out['mu'].mean()):10.1f}")
        numpy_rate = reference(num_chains + 1)[0]

    if "kernel" not in args.skip:
        _kernel_alone(mcmc, e, n, budget, chain_counts, reference)
    if "releases" not in args.skip:
        _releases(model, e, n, sets, chains, iters, reference)


def _kernel_alone(mcmc, e, n, budget, chain_counts, reference):
    # the kernel alone, compiled once: jit(scan(vmap(sweep))), reused for a second call
    print("kernel alone (KazanReiterGibbs.sample under vmap and lax.scan, compiled once):")
    inner = mcmc.sampler.inner
    state0 = inner.init(jax.random.key(0), 0, None, (n,), {RELEASES_KWARG: dict(e["release"])})
    for num_chains in chain_counts:
        num_iter = max(200, budget // num_chains)
        states = jax.vmap(lambda k: state0._replace(rng_key=k))(jax.random.split(jax.random.key(1), num_chains))

        @jax.jit
        def sweeps(s):
            def body(s, _):
                s = jax.vmap(lambda st: inner.sample(st, (n,), {}))(s)
                return s, s.z["mu"]

            return jax.lax.scan(body, s, None, length=num_iter)[1]

        first, _ = _jax_time(lambda: sweeps(states))
        numpy_rate = reference(num_chains)[0]
        second, mu = _jax_time(lambda: sweeps(states))
        rate = num_chains * num_iter / second
        print(f"{num_chains:7d} {num_iter:10d} {rate:12.0f} {numpy_rate:10.0f} {rate / numpy_rate:8.2f} "
              f"{first - second:13.1f} {'-':>17} {100 * float(mu.mean()):10.1f}")


def _releases(model, e, n, sets, chains, iters, reference):
    releases = {k: jnp.full((sets,), v) for k, v in e["release"].items()}
    run = lambda key: sample_releases(  # noqa: E731
        model, releases, key, n, num_warmup=iters // 5, num_samples=iters - iters // 5, num_chains=chains
    )
    compile_s, _ = _jax_time(lambda: run(jax.random.key(0)))
    numpy_rate = reference(7)[0]
    cpu, out = _jax_time(lambda: run(jax.random.key(1)))
    d3p_rate = sets * chains * iters / cpu
    print(f"sample_releases {sets} x {chains} chains: {d3p_rate:10.0f}   NumPy {numpy_rate:.0f}   ratio "
          f"{d3p_rate / numpy_rate:.2f} (first call {compile_s:.1f} CPU-s; posterior mean of mu "
          f"{float(out['mu'].mean()):.1f})")
    hours = FIGURE2_CHAIN_ITERATIONS / d3p_rate / 3600
    print(f"Figure 2 study ({FIGURE2_CHAIN_ITERATIONS:.2e} chain-iterations): {hours:,.0f} CPU-hours at "
          f"the sample_releases rate; one NumPy chain per core: "
          f"{FIGURE2_CHAIN_ITERATIONS / numpy_rate / 3600:,.0f} core-hours "
          "(the paper: 168 settings x 10-20 h = 1,700-3,400 core-hours)")


if __name__ == "__main__":
    main()
