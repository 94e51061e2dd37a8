"""Benchmark of d3pext.accountants against plain fourier-accountant calls and dp-accounting's PLD.

Run ``python benchmarks/bench_accountant.py`` (several minutes on two cores; ``--grid`` runs only the
approximate_sigma grid below, ``--q 1e-4,1e-3`` picks its sampling rates, ``--before`` adds the
previous implementation side by side, ``--against FILE`` another copy of ``fourier.py``, for instance
``git show HEAD:accountants/fourier.py > /tmp/fourier_head.py``). For each setting it prints the
runtime of d3pext, of fourier-accountant at its defaults (nx = 1e6, L = 20) and of dp-accounting's
PLD accountant at its default grid (value_discretization_interval = 1e-4), their ratios, and each
result's relative error against dp-accounting on a fine grid (1e-5 for epsilon below 1, 1e-4 below
10, 1e-3 above: a few 1e-5 of the value at most; where that grid is dp-accounting's default, its own
error is not shown). For approximate_sigma the reference is the sigma on which all tight accountants
agree to 0.02%.

Last, approximate_sigma over the issue's grid (epsilon 0.01-100, 1-1e6 steps, q = 1e-5 to 0.1, both
relations), each call with cold caches: the worst wall-clock and CPU time per sampling rate, and with
``--cells`` every cell (milliseconds and number of accountant evaluations). ``--before`` times the
previous implementation on the same cells in the same run (one grid of fine step over the whole
window of one step, every bracketing point checked by refinement; kept here only): it falls back to
dp-accounting at q = 1e-5 (minutes per cell), so it is capped at ``--before-cap`` seconds per cell.
``--against`` times the given copy of the module on each cell next to the current one (the same
machine state for both; which goes first alternates from cell to cell): the worst cell per sampling
rate of each, by CPU time, and the sum over the grid with the number of cells above 100 ms.
"""

from __future__ import annotations

import importlib.util
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
GRID_STEPS = (1, 10, 100, 1000, 10_000, 100_000, 1_000_000)
GRID_QS = (1e-5, 1e-4, 1e-3, 1e-2, 0.1)


def _legacy_searched_sigma(relation, target, target_delta, q, num_steps, tol):
    """The previous ``fourier._searched_sigma`` (before the bulk/tail split), for side-by-side timing only."""
    F = fourier
    evaluations = 0
    steps = np.array([num_steps])
    dx, checked_at = None, math.nan

    def excess(log_sigma, checked=False):
        nonlocal evaluations, dx, checked_at
        evaluations += 1
        sigma = math.exp(log_sigma)
        if not 1e-100 < sigma < 1e100:
            raise AccountingError("the search left the range of sigma")
        try:
            if dx is None or (checked and abs(log_sigma - checked_at) > math.log(1.2)):
                level = lambda h: np.array(F._epsilon_level(relation, sigma, q, (num_steps,), target_delta, h))
                (eps,), dx = F._fourier_values(F._cached_plan(relation, sigma, q, num_steps, target_delta), level, F._EPS_ATOL)
                checked_at = log_sigma
            else:
                (eps,) = F._epsilon_level(relation, sigma, q, (num_steps,), target_delta, dx)
        except F._OutOfWindow:
            return math.inf
        except F._Untrusted:
            eps = float(F._composed_epsilon(relation, sigma, q, steps, target_delta)[0][0])
        return math.log(max(eps, 1e-300) / target)

    guess = lambda t: math.log(F._sigma_guess(relation, t, target_delta, q, num_steps))
    width_tol = math.log1p(tol)
    first = guess(target)
    points = [(first, excess(first, checked=True))]
    f_first = points[0][1]
    direction = 1.0 if f_first > 0.0 else -1.0
    factor = math.exp(-min(f_first, math.log(4.0))) if f_first > 0.0 else math.exp(min(-f_first, math.log(4.0)))
    step = max(direction * (guess(target * factor) - points[0][0]), 0.0) + 0.5 * width_tol
    while True:
        point = points[-1][0] + direction * step
        points.append((point, excess(point, checked=True)))
        (p0, f0), (p1, f1) = points[-2:]
        if (f1 > 0.0) != (f_first > 0.0):
            break
        if math.isfinite(f0) and math.isfinite(f1) and (f1 - f0) * direction < 0.0:
            secant = -f1 * (p1 - p0) / (f1 - f0)
            step = min(max(1.1 * direction * secant + 0.5 * width_tol, 0.5 * width_tol), max(4.0 * step, 1.0))
        else:
            step *= 2.0
    (lo, f_lo), (hi, f_hi) = sorted(points[-2:])
    lo, f_lo, hi, f_hi = F._shrink_bracket(excess, points, lo, f_lo, hi, f_hi, width_tol)
    if not math.isfinite(f_lo):
        raise AccountingError("out of the window")
    sigma, eps, checks = F._confirmed(relation, math.exp(hi), q, num_steps, target, target_delta, tol)
    return F.SigmaResult(sigma, eps, evaluations + checks)


class _CellTimeout(Exception):
    pass


def legacy_approximate_sigma(target, delta, q, num_steps, relation, cap):
    """The previous approximate_sigma: one grid over one step's window (no split), all bracket points checked."""
    import signal

    def alarm(signum, frame):
        raise _CellTimeout

    saved = fourier._SPLIT_MIN_STDS
    fourier._SPLIT_MIN_STDS = math.inf
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, cap)
    try:
        if q == 1.0 or num_steps == 1:  # unchanged closed forms
            return approximate_sigma(target, delta, q, num_steps, relation)
        return _legacy_searched_sigma(Relation(relation), target, delta, q, num_steps, 1e-3)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        fourier._SPLIT_MIN_STDS = saved


def load_module(path):
    """A copy of fourier.py, imported from ``path`` as a module of its own."""
    spec = importlib.util.spec_from_file_location("fourier_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _time_cell(call, module=fourier):
    module._clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        result = call()
        note = f"({result.num_evaluations})"
    except (AccountingError, module.AccountingError):
        note = "(refused)"
    except _CellTimeout:
        note = "(cap)"
    return time.perf_counter() - wall, time.process_time() - cpu, note


def sigma_grid(qs=GRID_QS, before=False, cap=30.0, cells=False, against=None):
    """approximate_sigma's worst wall and CPU time per q over the grid, cold caches; returns the worst wall time."""
    approximate_sigma(1.0, DELTA, 0.01, 1000)  # imports and first calls
    if before:
        legacy_approximate_sigma(1.0, DELTA, 0.01, 1000, R, cap)
    other = load_module(against) if against else None
    if other is not None:
        other.approximate_sigma(1.0, DELTA, 0.01, 1000)
    print(f"\napproximate_sigma, delta = {DELTA}, epsilon {GRID_EPSILONS}, steps {GRID_STEPS}, both relations; "
          "caches cleared before each call")
    if cells:
        print(f"{'relation':<11} {'q':>7} {'steps':>9}" + "".join(f"{f'eps={e:g}':>15}" for e in GRID_EPSILONS))
    summary = []
    for q in qs:
        worst = {"after": (0.0, 0.0, ""), "before": (0.0, 0.0, ""), "against": (0.0, 0.0, ""), "after_cpu": (0.0, 0.0, "")}
        refused, cell_index = 0, 0
        totals, over = {"after": 0.0, "against": 0.0}, {"after": 0, "against": 0}
        for relation in (R, S):
            for steps in GRID_STEPS:
                row_cells = []
                for target in GRID_EPSILONS:
                    this = lambda: _time_cell(lambda: approximate_sigma(target, DELTA, q, steps, relation))
                    that = lambda: _time_cell(lambda: other.approximate_sigma(target, DELTA, q, steps, relation.value), other)
                    # (the two versions alternate which goes first, cell by cell)
                    first_this = other is None or cell_index % 2 == 0
                    cell_index += 1
                    if not first_this:
                        wall_a, cpu_a, note_a = that()
                    wall, cpu, note = this()
                    refused += note == "(refused)"
                    where = f"{relation.value} T={steps:g} eps={target:g}"
                    if wall > worst["after"][0]:
                        worst["after"] = (wall, cpu, where)
                    if cpu > worst["after_cpu"][1]:
                        worst["after_cpu"] = (wall, cpu, where)
                    totals["after"] += wall
                    over["after"] += wall > 0.1
                    row_cells.append(f"{1e3 * wall:8.1f} {note:<6}")
                    if other is not None:
                        if first_this:
                            wall_a, cpu_a, note_a = that()
                        if cpu_a > worst["against"][1]:
                            worst["against"] = (wall_a, cpu_a, where)
                        totals["against"] += wall_a
                        over["against"] += wall_a > 0.1
                        row_cells[-1] += f" | {1e3 * wall_a:6.1f} {note_a:<5}"
                    if before:
                        wall_b, cpu_b, note_b = _time_cell(
                            lambda: legacy_approximate_sigma(target, DELTA, q, steps, relation, cap))
                        if wall_b > worst["before"][0]:
                            worst["before"] = (wall_b, cpu_b, where + (" (capped)" if note_b == "(cap)" else ""))
                if cells:
                    print(f"{relation.value:<11} {q:>7g} {steps:>9g}" + "".join(f"{c:>15}" for c in row_cells), flush=True)
        summary.append((q, worst, refused))
        (w, c, where), (wb, cb, whereb) = worst["after"], worst["before"]
        line = f"q={q:<7g} worst after {1e3 * w:8.1f} ms wall {1e3 * c:8.1f} ms CPU ({where})"
        if before:
            line += f" | before {1e3 * wb:8.1f} ms wall {1e3 * cb:8.1f} ms CPU ({whereb}) | ratio {wb / w:6.1f}x"
        print(line + (f"; {refused} cells refused (no noise needed: q T <= delta)" if refused else ""), flush=True)
        if other is not None:
            (w, c, where), (wa, ca, wherea) = worst["after_cpu"], worst["against"]
            print(f"q={q:<7g} worst by CPU: this {1e3 * c:8.1f} ms CPU {1e3 * w:8.1f} ms wall ({where}) | against "
                  f"{1e3 * ca:8.1f} ms CPU {1e3 * wa:8.1f} ms wall ({wherea})", flush=True)
            print(f"q={q:<7g} sum over the grid: this {1e3 * totals['after']:8.1f} ms ({over['after']} cells > 100 ms) | "
                  f"against {1e3 * totals['against']:8.1f} ms ({over['against']} cells > 100 ms)", flush=True)
        else:
            print(f"q={q:<7g} sum over the grid: {1e3 * totals['after']:8.1f} ms ({over['after']} cells > 100 ms)", flush=True)
    worst_wall = max(w["after"][0] for _, w, _ in summary)
    print(f"worst over the grid: {1e3 * worst_wall:.1f} ms")
    return worst_wall


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
    parser.add_argument("--q", default=",".join(f"{q:g}" for q in GRID_QS), help="sampling rates of the grid, comma-separated")
    parser.add_argument("--before", action="store_true", help="time the previous implementation side by side")
    parser.add_argument("--before-cap", type=float, default=30.0, help="seconds per cell for --before (default 30)")
    parser.add_argument("--cells", action="store_true", help="print every cell of the grid")
    parser.add_argument("--against", metavar="FILE", help="a copy of fourier.py to time on each cell as well")
    args = parser.parse_args()
    if not args.grid:
        main()
    sigma_grid(tuple(float(q) for q in args.q.split(",")), args.before, args.before_cap, args.cells, args.against)
