"""Benchmark of d3pext.accountants against plain fourier-accountant calls and dp-accounting's PLD.

Run ``python benchmarks/bench_accountant.py`` (about two minutes on two cores; ``--grid`` runs only the
approximate_sigma grid below, ``--q 1e-4,1e-3`` picks its sampling rates). For each setting it
prints the runtime of d3pext, of fourier-accountant at its defaults (nx = 1e6, L = 20) and of
dp-accounting's PLD accountant at its default grid (value_discretization_interval = 1e-4), their
ratios, and each result's relative error against dp-accounting on a fine grid (1e-5 for epsilon
below 1, 1e-4 below 10, 1e-3 above: a few 1e-5 of the value at most; where that grid is dp-accounting's
default, its own error is not shown). For approximate_sigma the reference is the sigma on which all
tight accountants agree to 0.02%.

Last, approximate_sigma over the issue's grid (epsilon 0.01-100, 1-1e6 steps, q = 0.01 and 0.1 by
default, both relations), each call with cold caches: wall-clock milliseconds per call and the
number of accountant evaluations.
"""

from __future__ import annotations

import math
import time

import fourier_accountant
import numpy as np
from dp_accounting import NeighboringRelation
from dp_accounting.pld import privacy_loss_distribution

from d3pext.accountants import AccountingError, Relation, approximate_sigma, epsilon
from d3pext.accountants import fourier

DELTA = 1e-5
R, S = Relation.ADD_REMOVE, Relation.SUBSTITUTE


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        value = fn(*args, **kwargs)
    except (ValueError, RuntimeError) as err:  # fourier-accountant raises ValueError when it fails
        value = f"error: {str(err)[:30]}"
    return value, time.perf_counter() - start


def dp_accounting_epsilon(sigma, q, steps, relation, interval=1e-4):
    neighbours = NeighboringRelation.ADD_OR_REMOVE_ONE if relation is R else NeighboringRelation.REPLACE_ONE
    one_step = privacy_loss_distribution.from_gaussian_mechanism(
        sigma, value_discretization_interval=interval, sampling_prob=q, neighboring_relation=neighbours
    )
    return np.array([one_step.self_compose(int(t)).get_epsilon_for_delta(DELTA) for t in np.atleast_1d(steps)])


def fine_interval(eps: float) -> float:
    return 1e-5 if eps < 1.0 else 1e-4 if eps < 10.0 else 1e-3


def fa_epsilon(sigma, q, steps, relation):
    get = fourier_accountant.get_epsilon_R if relation is R else fourier_accountant.get_epsilon_S
    return np.array([get(DELTA, sigma, q, int(t)) for t in np.atleast_1d(steps)])


def fa_sigma(target, q, steps, relation, lo=0.5, hi=10.0, evaluations=10):
    """Plain fourier-accountant use, as in d3p: 10 bisection steps on sigma, keeping the safe end."""
    for _ in range(evaluations):
        mid = math.sqrt(lo * hi)
        if fa_epsilon(mid, q, steps, relation)[0] > target:
            lo = mid
        else:
            hi = mid
    return hi


def relative_error(value, reference):
    if isinstance(value, str):
        return value
    return f"{np.max(np.abs(np.asarray(value) / reference - 1.0)):.1e}"


def row(name, ours, fa, dpa, reference, dpa_is_reference=False):
    (v_ours, t_ours), (v_fa, t_fa), (v_dpa, t_dpa) = ours, fa, dpa
    ratio = lambda t: "-" if t is None else f"{t / t_ours:7.1f}x"
    fmt_t = lambda t: "-" if t is None else f"{t:7.3f}"
    print(
        f"{name:<54} {fmt_t(t_ours):>8} {fmt_t(t_fa):>8} {ratio(t_fa):>8} {fmt_t(t_dpa):>8} {ratio(t_dpa):>8}"
        f"   {relative_error(v_ours, reference):>9} {relative_error(v_fa, reference) if t_fa else '-':>9}"
        f" {relative_error(v_dpa, reference) if t_dpa and not dpa_is_reference else '-':>9}",
        flush=True,
    )


GRID_EPSILONS = (0.01, 0.1, 1.0, 8.0, 30.0, 100.0)
GRID_STEPS = (1, 100, 10_000, 1_000_000)


def sigma_grid(qs=(0.01, 0.1)):
    """approximate_sigma's wall time (ms) and evaluations over the grid, cold caches; returns the worst time."""
    approximate_sigma(1.0, DELTA, 0.01, 1000)  # imports and first calls
    print(f"\napproximate_sigma, delta = {DELTA}: milliseconds per call (evaluations), caches cleared before each")
    print(f"{'relation':<11} {'q':>7} {'steps':>9}" + "".join(f"{f'eps={e:g}':>13}" for e in GRID_EPSILONS))
    worst = 0.0
    for relation in (R, S):
        for q in qs:
            for steps in GRID_STEPS:
                cells = []
                for target in GRID_EPSILONS:
                    fourier._clear_caches()
                    start = time.perf_counter()
                    try:
                        result = approximate_sigma(target, DELTA, q, steps, relation)
                        note = f"({result.num_evaluations})"
                    except AccountingError:
                        note = "(error)"
                    elapsed = time.perf_counter() - start
                    worst = max(worst, elapsed)
                    cells.append(f"{1e3 * elapsed:7.1f} {note:<5}")
                print(f"{relation.value:<11} {q:>7g} {steps:>9g}" + "".join(f"{c:>13}" for c in cells), flush=True)
    print(f"worst: {1e3 * worst:.1f} ms")
    return worst


def main():
    print(f"delta = {DELTA}; times in seconds; errors relative to dp-accounting on a fine grid\n")
    print(
        f"{'setting':<54} {'d3pext':>8} {'fa':>8} {'fa/d3p':>8} {'dp-acc':>8} {'dpa/d3p':>8}"
        f"   {'err d3p':>9} {'err fa':>9} {'err dpa':>9}"
    )
    epsilon_settings = [
        ("substitute q=0.01 sigma=1 T=1e3", S, 1.0, 0.01, 1000),
        ("add_remove q=0.01 sigma=2 T=1e4", R, 2.0, 0.01, 10_000),
        ("add_remove q=0.001 sigma=0.8 T=1e3 (fa grid)", R, 0.8, 0.001, 1000),
        ("add_remove q=0.1 sigma=1 T=1e4 (fa window)", R, 1.0, 0.1, 10_000),
        ("substitute q=0.01 sigma=1.5, 10 step counts", S, 1.5, 0.01, np.linspace(1000, 10_000, 10).astype(int)),
    ]
    for name, relation, sigma, q, steps in epsilon_settings:
        ours = timed(epsilon, sigma, q, steps, DELTA, relation)
        fa = timed(fa_epsilon, sigma, q, steps, relation)
        dpa = timed(dp_accounting_epsilon, sigma, q, steps, relation)
        interval = fine_interval(float(np.min(ours[0])))
        reference = dpa[0] if interval == 1e-4 else dp_accounting_epsilon(sigma, q, steps, relation, interval)
        row("epsilon  " + name, ours, fa, dpa, reference, dpa_is_reference=interval == 1e-4)

    # approximate_sigma at q = 0.01, T = 1e4; reference sigmas agreed on by all tight accountants.
    sigma_settings = [
        ("add_remove eps=1", R, 1.0, 3.8128),
        ("substitute eps=1", S, 1.0, 7.461),
        ("add_remove eps=8", R, 8.0, 0.8825),
    ]
    for name, relation, target, reference in sigma_settings:
        ours = timed(approximate_sigma, target, DELTA, 0.01, 10_000, relation)
        fa = timed(fa_sigma, target, 0.01, 10_000, relation)
        name = f"sigma    {name} ({ours[0].num_evaluations} evaluations)"
        row(name, (ours[0].sigma, ours[1]), fa, (None, None), reference)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="store_true", help="only the approximate_sigma grid")
    parser.add_argument("--q", default="0.01,0.1", help="sampling rates of the grid, comma-separated")
    args = parser.parse_args()
    if not args.grid:
        main()
    sigma_grid(tuple(float(q) for q in args.q.split(",")))
