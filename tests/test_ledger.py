"""Checks of d3pext.accountants.ledger: analytic Gaussian, composition, budgets, persistence."""

from datetime import datetime
import json
import math
import os
from pathlib import Path
import random
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
import pytest

import d3pext.accountants.ledger as L
from d3pext.accountants.ledger import (
    LedgerEntry,
    LedgerError,
    LedgerWarning,
    PrivacyBudgetExceeded,
    PrivacyCost,
    PrivacyLedger,
    analytic_gaussian_delta,
    analytic_gaussian_epsilon,
    analytic_gaussian_noise_multiplier,
    compose,
)


def pld_epsilon(noise_multipliers, delta):
    """Independent reference: dp-accounting's PLD accountant (sensitivity-1 Gaussian pairs)."""
    accountant = pld_privacy_accountant.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
    )
    for z in noise_multipliers:
        accountant.compose(dp_accounting.GaussianDpEvent(z))
    return accountant.get_epsilon(delta)


def gaussian_cost(z, delta=1e-5):
    return PrivacyCost("gaussian", analytic_gaussian_epsilon(delta, z), delta, noise_multiplier=z)


# ---------------------------------------------------------------------------------------------
# analytic Gaussian
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("z", [0.3, 1.0, 4.0, 50.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-5, 0.1])
def test_analytic_gaussian_round_trips(z, delta):
    eps = analytic_gaussian_epsilon(delta, z)
    if analytic_gaussian_delta(0.0, z) <= delta:  # so much noise that epsilon = 0 suffices
        assert eps == 0.0
        return
    assert eps > 0
    # Rounded onto the safe side, and tight.
    assert analytic_gaussian_delta(eps, z) <= delta
    assert analytic_gaussian_delta(eps, z) == pytest.approx(delta, rel=1e-9)
    z_back = analytic_gaussian_noise_multiplier(eps, delta)
    assert z_back >= z * (1 - 1e-12) and z_back == pytest.approx(z, rel=1e-9)
    assert analytic_gaussian_delta(eps, z_back) <= delta


def test_analytic_gaussian_matches_dp_accounting():
    for z, delta in [(0.5, 1e-5), (1.0, 1e-5), (3.7306, 1e-5), (20.0, 1e-8)]:
        reference = pld_epsilon([z], delta)
        assert analytic_gaussian_epsilon(delta, z) == pytest.approx(reference, rel=1e-6)


def test_analytic_gaussian_edge_cases_and_validation():
    # delta(0) = 2 Phi(1/(2z)) - 1: any delta above it needs no epsilon.
    assert analytic_gaussian_epsilon(0.5, 10.0) == 0.0
    delta_at_zero = math.erf(1 / (20 * math.sqrt(2)))
    assert analytic_gaussian_delta(0.0, 10.0) == pytest.approx(delta_at_zero, rel=1e-12)
    # Deep tails, where Phi(a) - e^eps Phi(b) cancels catastrophically in linear space.
    deltas = [analytic_gaussian_delta(eps, 0.05) for eps in range(0, 600, 20)]
    assert all(0 <= b <= a <= 1 for a, b in zip(deltas, deltas[1:])) and 0 < deltas[-1] < 1e-50
    for bad in (0.0, 1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="delta"):
            analytic_gaussian_epsilon(bad, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        analytic_gaussian_epsilon(1e-5, 0.0)
    with pytest.raises(ValueError, match="epsilon"):
        analytic_gaussian_noise_multiplier(math.inf, 1e-5)


# ---------------------------------------------------------------------------------------------
# costs and composition
# ---------------------------------------------------------------------------------------------


def test_privacy_cost_validation():
    with pytest.raises(ValueError, match="epsilon"):
        PrivacyCost("laplace", 0.0)
    with pytest.raises(ValueError, match="delta"):
        PrivacyCost("gaussian", 1.0, 1.0)
    with pytest.raises(ValueError, match="neighbouring"):
        PrivacyCost("laplace", 1.0, neighbouring="other")
    with pytest.raises(ValueError, match="needs delta"):
        PrivacyCost("gaussian", 1.0, 0.0, noise_multiplier=2.0)
    with pytest.raises(ValueError, match="does not give"):
        PrivacyCost("gaussian", 1.0, 1e-5, noise_multiplier=1.0)  # needs z >= 3.73
    with pytest.raises(TypeError):
        PrivacyCost("", 1.0)
    cost = PrivacyCost("laplace", 1, parameters={"scale": 2.0})
    assert cost.epsilon == 1.0 and isinstance(cost.epsilon, float)
    assert PrivacyCost.from_dict(cost.to_dict()) == cost


def test_pure_epsilons_add():
    kinds = [("laplace", 0.1), ("geometric", 0.2), ("binomial", 0.7)]
    costs = [PrivacyCost(kind, eps) for kind, eps in kinds]
    assert compose(costs) == (pytest.approx(1.0, abs=1e-15), 0.0)
    assert compose([]) == (0.0, 0.0)


def test_gaussian_releases_compose_exactly():
    zs = [1.0, 2.0, 5.0, 5.0]
    costs = [gaussian_cost(z) for z in zs]
    eps, delta = compose(costs, delta=1e-5)
    assert delta == 1e-5
    assert eps == pytest.approx(pld_epsilon(zs, 1e-5), rel=1e-6)
    # Far below adding the individual epsilons (basic composition).
    assert eps < 0.8 * sum(c.epsilon for c in costs)
    # Without a target delta: reported at the sum of the releases' deltas.
    eps_sum, delta_sum = compose(costs)
    assert delta_sum == pytest.approx(4e-5)
    assert eps_sum == pytest.approx(pld_epsilon(zs, 4e-5), rel=1e-6)
    assert eps_sum <= sum(c.epsilon for c in costs)


def test_mixed_composition_rule():
    g = gaussian_cost(2.0)
    other = PrivacyCost("custom", 0.3, 1e-6)
    lap = PrivacyCost("laplace", 0.5)
    eps, delta = compose([g, other, lap], delta=1e-5)
    # Pure epsilons add; the other (eps, delta) adds; the Gaussian gets the delta that is left.
    assert delta == pytest.approx(1e-5)
    assert eps == pytest.approx(0.5 + 0.3 + analytic_gaussian_epsilon(1e-5 - 1e-6, 2.0), rel=1e-12)
    # When the non-Gaussian deltas exceed the target there is nothing left for the Gaussian part.
    assert compose([g, PrivacyCost("custom", 0.3, 2e-5)], delta=1e-5) == (math.inf, 2e-5)
    with pytest.raises(ValueError, match="neighbouring"):
        compose([lap, PrivacyCost("laplace", 0.5, neighbouring="add_remove")])


# ---------------------------------------------------------------------------------------------
# the ledger
# ---------------------------------------------------------------------------------------------


def test_ledger_records_and_enforces_the_budget():
    ledger = PrivacyLedger(budget_epsilon=1.0)
    entry = ledger.record("mean", PrivacyCost("laplace", 0.6), note="age, clamped to [0, 100]")
    assert isinstance(entry, LedgerEntry) and entry.note.startswith("age")
    assert datetime.fromisoformat(entry.timestamp).utcoffset().total_seconds() == 0
    assert ledger.spent() == (0.6, 0.0)
    assert ledger.remaining() == pytest.approx(0.4)
    assert ledger.check(PrivacyCost("laplace", 0.4)) == (pytest.approx(1.0), 0.0)
    assert len(ledger) == 1  # check() records nothing
    with pytest.raises(PrivacyBudgetExceeded, match="epsilon"):
        ledger.record("variance", PrivacyCost("laplace", 0.5))
    assert len(ledger) == 1 and ledger.spent() == (0.6, 0.0)
    ledger.record("variance", PrivacyCost("laplace", 0.4))
    assert ledger.remaining() == 0.0
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.check(PrivacyCost("laplace", 1e-6))


def test_ledger_tolerates_float_rounding_only():
    ledger = PrivacyLedger(budget_epsilon=0.3)
    ledger.record("a", PrivacyCost("laplace", 0.1))
    ledger.record("b", PrivacyCost("laplace", 0.2))  # 0.1 + 0.2 = 0.30000000000000004
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.check(PrivacyCost("laplace", 1e-6))


def test_ledger_delta_budget_and_gaussian_releases():
    ledger = PrivacyLedger(budget_epsilon=3.0, budget_delta=1e-5)
    ledger.record("g1", gaussian_cost(3.0, 1e-6))
    ledger.record("g2", gaussian_cost(3.0, 1e-6))
    eps, delta = ledger.spent()
    assert delta == 1e-5  # reported at the ledger's delta
    assert eps == pytest.approx(pld_epsilon([3.0, 3.0], 1e-5), rel=1e-6)
    with pytest.raises(PrivacyBudgetExceeded, match="epsilon"):
        ledger.check(gaussian_cost(0.5))
    with pytest.raises(PrivacyBudgetExceeded, match="delta"):
        ledger.check(PrivacyCost("custom", 0.1, 2e-5))
    pure_only = PrivacyLedger(budget_delta=0.0)
    with pytest.raises(PrivacyBudgetExceeded, match="pure"):
        pure_only.check(gaussian_cost(10.0))
    pure_only.record("count", PrivacyCost("geometric", 5.0))


def test_ledger_neighbouring_relation_is_fixed():
    ledger = PrivacyLedger()
    ledger.record("a", PrivacyCost("laplace", 1.0, neighbouring="add_remove"))
    assert ledger.neighbouring == "add_remove"
    with pytest.raises(ValueError, match="add_remove"):
        ledger.record("b", PrivacyCost("laplace", 1.0))
    with pytest.raises(ValueError, match="neighbouring"):
        PrivacyLedger(neighbouring="neighbours")
    with pytest.raises(ValueError, match="budget_epsilon"):
        PrivacyLedger(budget_epsilon=-1.0)
    with pytest.raises(ValueError, match="budget_delta"):
        PrivacyLedger(budget_delta=1.0)
    with pytest.raises(ValueError, match="name"):
        ledger.record("", PrivacyCost("laplace", 1.0, neighbouring="add_remove"))
    with pytest.raises(TypeError, match="name"):
        ledger.record(None, PrivacyCost("laplace", 1.0, neighbouring="add_remove"))
    with pytest.raises(TypeError, match="PrivacyCost"):
        ledger.check((1.0, 0.0))


class _FakeMechanism:
    """Counts draws; its release can be made to fail."""

    def __init__(self, epsilon, fail=False):
        self.epsilon, self.fail, self.draws = epsilon, fail, 0

    def cost(self):
        return PrivacyCost("fake", self.epsilon)

    def release(self, rng_key, value):
        self.draws += 1
        if self.fail:
            raise RuntimeError("noise source failed")
        return value + 1.0


def test_release_checks_and_records_before_drawing():
    ledger = PrivacyLedger(budget_epsilon=1.0)
    ok = _FakeMechanism(0.7)
    assert ledger.release("a", ok, 1.0) == 2.0 and ok.draws == 1
    refused = _FakeMechanism(0.5)
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.release("b", refused, 1.0)
    assert refused.draws == 0 and len(ledger) == 1  # no noise drawn, nothing recorded
    broken = _FakeMechanism(0.2, fail=True)
    with pytest.raises(RuntimeError, match="noise source"):
        ledger.release("c", broken, 1.0)
    assert len(ledger) == 2 and ledger.spent()[0] == pytest.approx(0.9)  # counted anyway


def test_release_with_a_real_mechanism():
    from d3pext.releases.mechanisms import GaussianMechanism, LaplaceMechanism

    ledger = PrivacyLedger(budget_epsilon=2.0, budget_delta=1e-5)
    ledger.release("mean", LaplaceMechanism(0.5, sensitivity=0.01), 0.3)
    ledger.release("sum", GaussianMechanism(0.5, 1e-6, sensitivity=1.0), 10.0)
    assert [e.cost.mechanism for e in ledger.entries] == ["laplace", "gaussian"]
    eps, delta = ledger.spent()
    assert delta == 1e-5 and 0.5 < eps < 1.0  # the Gaussian part gains from delta 1e-6 -> 1e-5


# ---------------------------------------------------------------------------------------------
# persistence
# ---------------------------------------------------------------------------------------------


def test_save_load_round_trip_and_append_only(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = PrivacyLedger(budget_epsilon=2.0, budget_delta=1e-5)
    ledger.record("mean", PrivacyCost("laplace", 0.5, parameters={"scale": 2.0}), note="n = 100")
    ledger.record("sum", gaussian_cost(4.0, 1e-6))
    ledger.save(path)
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["format"] == "d3pext-privacy-ledger" and header["version"] == 2
    assert lines == [e.to_dict() for e in ledger.entries]

    loaded = PrivacyLedger.load(path)
    assert loaded.entries == ledger.entries
    assert loaded.spent() == ledger.spent()
    assert (loaded.budget_epsilon, loaded.budget_delta) == (2.0, 1e-5)
    # A loaded ledger saves every new record back to its file at once.
    loaded.record("count", PrivacyCost("geometric", 0.1))
    assert len(PrivacyLedger.load(path)) == 3
    # The stale in-memory ledger (2 entries) may not overwrite the file (3 entries) ...
    with pytest.raises(ValueError, match="refusing to overwrite"):
        ledger.save(path)
    # ... nor may a ledger with different entries.
    other = PrivacyLedger()
    for name in ("x", "y", "z", "w"):
        other.record(name, PrivacyCost("laplace", 0.1))
    with pytest.raises(ValueError, match="refusing to overwrite"):
        other.save(path)
    assert len(PrivacyLedger.load(path)) == 3
    # Loading then saving keeps every entry.
    PrivacyLedger.load(path).save(path)
    assert PrivacyLedger.load(path).entries == PrivacyLedger.load(path).entries
    assert len(PrivacyLedger.load(path)) == 3


def test_ledger_with_path_persists_each_record(tmp_path):
    path = tmp_path / "curator.json"
    ledger = PrivacyLedger(budget_epsilon=1.0, path=path)
    assert len(PrivacyLedger.load(path)) == 0
    ledger.record("a", PrivacyCost("laplace", 0.25))
    assert PrivacyLedger.load(path).spent() == (0.25, 0.0)
    with pytest.raises(FileExistsError, match="load"):
        PrivacyLedger(path=path)
    # A budget refusal leaves the file untouched.
    with pytest.raises(PrivacyBudgetExceeded):
        PrivacyLedger.load(path).record("b", PrivacyCost("laplace", 0.9))
    assert len(PrivacyLedger.load(path)) == 1


def test_load_rejects_foreign_files(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="not a d3pext privacy ledger"):
        PrivacyLedger.load(path)
    path.write_text(json.dumps({"format": "d3pext-privacy-ledger", "version": 99}))
    with pytest.raises(ValueError, match="version"):
        PrivacyLedger.load(path)


def test_summary_is_a_readable_table():
    ledger = PrivacyLedger(budget_epsilon=2.0, budget_delta=1e-5)
    ledger.record("mean age", PrivacyCost("laplace", 0.5), note="clamped")
    ledger.record("income sum", gaussian_cost(4.0, 1e-6))
    text = ledger.summary()
    lines = text.splitlines()
    assert "budget epsilon=2" in lines[0]
    assert lines[1].split()[:5] == ["#", "name", "mechanism", "epsilon", "delta"]
    assert "mean age" in lines[2] and "laplace" in lines[2] and "clamped" in lines[2]
    assert "income sum" in lines[3] and "gaussian" in lines[3]
    eps, delta = ledger.spent()
    assert f"spent: epsilon={eps:.6g}, delta={delta:.6g}" in text
    assert f"remaining: epsilon={2.0 - eps:.6g}" in text
    assert "spent=" in repr(ledger)


# ---------------------------------------------------------------------------------------------
# the ledger file: several processes, crashes, damage
# ---------------------------------------------------------------------------------------------

# A worker process, driven through its stdin. "load PATH": load a ledger; "go EPS T": at time T,
# record a spend of EPS from it, say whether it was acknowledged; "loop PATH NAME": record small
# spends forever, printing each name once record returned; "hold EPS PATH": record a spend of EPS
# at PATH, stopping under the lock after the budget check (saying "holding") until a "release"
# line; "unlock": disable the file lock (only for checking by hand that the race test can fail).
# Loading before "go" gives every worker the
# same stale in-memory view, which is what a budget check without the file's lock would trust.
_WORKER = r"""
import contextlib, sys, time
import d3pext.accountants.ledger as L
me = sys.argv[1]
print("ready", flush=True)
ledger = None
for line in sys.stdin:
    command, *args = line.split()
    if command == "unlock":
        L._locked = lambda *args, **kwargs: contextlib.nullcontext()
    elif command == "load":
        ledger = L.PrivacyLedger.load(args[0])
        print("loaded", flush=True)
    elif command == "go":
        time.sleep(max(float(args[1]) - time.time() - 0.005, 0))
        while time.time() < float(args[1]):  # start together (a few microseconds apart)
            pass
        try:
            ledger.record(me, L.PrivacyCost("laplace", float(args[0])))
        except L.PrivacyBudgetExceeded:
            print("refused", flush=True)
        else:
            print("ok", flush=True)
    elif command == "hold":
        append = L._append
        def held(*args, **kwargs):
            print("holding", flush=True)
            assert sys.stdin.readline() == "release\n"
            return append(*args, **kwargs)
        L._append = held
        try:
            L.PrivacyLedger.load(args[1]).record(me, L.PrivacyCost("laplace", float(args[0])))
        except L.PrivacyBudgetExceeded:
            print("refused", flush=True)
        except L.LedgerError:
            print("error", flush=True)
        else:
            print("ok", flush=True)
        finally:
            L._append = append
    elif command == "loop":
        ledger = L.PrivacyLedger.load(args[0])
        for i in range(10**9):
            ledger.record(f"{args[1]}-{i}", L.PrivacyCost("laplace", 1e-3))
            print(f"{args[1]}-{i}", flush=True)
"""


class _Workers:
    """Worker processes, started once per module (each needs a second or more to import)."""

    def __init__(self):
        self.procs, self.started = [], 0

    def take(self, n):
        while len(self.procs) < n:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", _WORKER, f"w{self.started}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            ))
            self.started += 1
        for proc in self.procs[:n]:
            if not getattr(proc, "ready", False):
                _expect(proc, "ready")
                proc.ready = True
        return self.procs[:n]

    def discard(self, procs):
        self.procs = [p for p in self.procs if p not in procs]
        _stop(procs)


def _expect(proc, line):
    got = proc.stdout.readline()
    assert got == line + "\n", f"worker said {got!r}, expected {line!r}"


def _stop(procs):
    for proc in procs:
        if proc.stdin and not proc.stdin.closed:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.fixture(scope="module")
def workers():
    pool = _Workers()
    pool.take(8)  # start them all at once: they import in parallel
    yield pool
    _stop(pool.procs)


def _race(procs, directory, trials, budget, epsilon_each):
    """Each trial: every worker spends its epsilon from one fresh ledger at once. Returns, per
    trial, the workers whose spend was acknowledged and the names in the file."""
    results = []
    for t in range(trials):
        path = Path(directory) / f"race{len(procs)}-{t}.ledger"
        PrivacyLedger(budget_epsilon=budget, path=path)
        for proc in procs:
            proc.stdin.write(f"load {path}\n")
        for proc in procs:
            _expect(proc, "loaded")
        start = time.time() + 0.05
        for proc in procs:
            proc.stdin.write(f"go {epsilon_each} {start!r}\n")
        answers = [proc.stdout.readline().strip() for proc in procs]
        assert set(answers) <= {"ok", "refused"}, answers
        names = [proc.args[3] for proc in procs]  # w0, w1, ...
        acknowledged = {name for name, a in zip(names, answers) if a == "ok"}
        results.append((acknowledged, [e.name for e in PrivacyLedger.load(path).entries]))
    return results


def test_processes_racing_on_one_ledger_never_overspend(tmp_path, workers):
    # Two processes each spending 0.6 of a budget of 1.0: exactly one is acknowledged.
    # (Without the lock, both were acknowledged in about half of the trials.)
    for acknowledged, in_file in _race(workers.take(2), tmp_path, 20, 1.0, 0.6):
        assert len(acknowledged) == 1
        assert sorted(in_file) == sorted(acknowledged)
    # Eight processes each spending 0.1 of 0.5: exactly five are acknowledged.
    for acknowledged, in_file in _race(workers.take(8), tmp_path, 10, 0.5, 0.1):
        assert len(acknowledged) == 5
        assert sorted(in_file) == sorted(acknowledged)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs kill -9")
def test_kill_9_while_recording_loses_no_acknowledged_spend(tmp_path, workers):
    path = tmp_path / "busy.ledger"
    PrivacyLedger(path=path)
    rng = random.Random(0)
    procs = workers.take(3)
    acknowledged = set()
    try:
        for i, proc in enumerate(procs):
            proc.stdin.write(f"loop {path} k{i}\n")
        for proc in procs:  # each is in its loop
            acknowledged.update(proc.stdout.readline().strip() for _ in range(2))
        for proc in procs:  # kill them one by one, in the middle of their work
            time.sleep(rng.uniform(0.02, 0.2))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            acknowledged.update(line.strip() for line in proc.stdout)
    finally:
        workers.discard(procs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and the file loads cleanly
        names = [e.name for e in PrivacyLedger.load(path).entries]
    assert "" not in acknowledged and acknowledged <= set(names)  # no acknowledged spend is lost
    assert len(names) == len(set(names))
    # at most one unacknowledged entry per killed process (written, killed before it printed)
    assert len(set(names) - acknowledged) <= 3
    # The dead processes left no stale lock.
    PrivacyLedger.load(path).record("after", PrivacyCost("laplace", 1e-3))
    assert PrivacyLedger.load(path).entries[-1].name == "after"


@pytest.mark.parametrize("other_name", ["symlink", "hard link"])
def test_processes_reaching_one_ledger_by_other_names_share_its_lock(other_name, tmp_path, workers):
    """A process reaching the file by another name once took another lock: while one process was
    between its budget check and its append, another (by the other name) had 0.6 of a budget of
    1.0 acknowledged too, and wrote its entry over the first (both acknowledged, 0.6 in the file)."""
    real, other = tmp_path / "survey.ledger", tmp_path / "current.ledger"
    PrivacyLedger(budget_epsilon=1.0, path=real)
    if other_name == "symlink":
        other.symlink_to(real)
    else:
        os.link(real, other)
    a, b = workers.take(2)
    b.stdin.write(f"load {other}\n")
    _expect(b, "loaded")
    a.stdin.write(f"hold 0.6 {real}\n")
    _expect(a, "holding")  # a has checked the budget under the lock, and not yet appended
    b.stdin.write("go 0.6 0\n")
    b_waited = not select.select([b.stdout], [], [], 0.5)[0]  # for a's lock
    a.stdin.write("release\n")
    answers = [a.stdout.readline().strip(), b.stdout.readline().strip()]
    assert answers == ["ok", "refused"] and b_waited
    assert [e.name for e in PrivacyLedger.load(other).entries] == [a.args[3]]


def test_append_never_writes_over_a_change_made_behind_the_lock(tmp_path, monkeypatch):
    """A writer that ignores the lock (an older d3pext, another program) appends between a record's
    read and its append: the append once wrote over that entry; now it is refused, file untouched."""
    path = tmp_path / "l.ledger"
    ledger = _file_ledger(path, names=("a",))
    read = L._read_state

    def read_then_foreign_append(*args, **kwargs):
        state = read(*args, **kwargs)
        with open(path, "ab") as f:
            f.write(_entry_line("foreign"))
        return state

    monkeypatch.setattr(L, "_read_state", read_then_foreign_append)
    with pytest.raises(LedgerError, match="changed while this process held its lock"):
        ledger.record("b", PrivacyCost("laplace", 0.25))
    monkeypatch.undo()
    assert [e.name for e in PrivacyLedger.load(path).entries] == ["a", "foreign"]


def test_a_ledger_reached_through_a_symlink_stays_one_file(tmp_path):
    """Migrating a version-1 file through a symlink once renamed the new file over the symlink: two
    ledgers, each under the full budget (0.6 + 0.6 acknowledged against 1.0)."""
    real, link = tmp_path / "survey.ledger", tmp_path / "current.ledger"
    real.write_text(json.dumps(PrivacyLedger(budget_epsilon=1.0).to_dict()))  # version 1
    link.symlink_to(real)
    ledger = PrivacyLedger.load(link)
    ledger.record("a", PrivacyCost("laplace", 0.6))
    with pytest.raises(PrivacyBudgetExceeded):
        PrivacyLedger.load(real).record("b", PrivacyCost("laplace", 0.6))
    assert link.is_symlink() and json.loads(real.read_text().splitlines()[0])["version"] == 2
    assert ledger.path == Path(os.path.realpath(real))
    PrivacyLedger.load(real).save(link)  # saving through the symlink appends to the real file
    assert link.is_symlink() and len(PrivacyLedger.load(real)) == 1
    # Creating a ledger through a dangling symlink creates its target.
    dangling = tmp_path / "next.ledger"
    dangling.symlink_to(tmp_path / "next-survey.ledger")
    PrivacyLedger(budget_epsilon=1.0, path=dangling).record("a", PrivacyCost("laplace", 0.6))
    assert dangling.is_symlink() and len(PrivacyLedger.load(tmp_path / "next-survey.ledger")) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")) == [
        "next-survey.ledger.lock", "survey.ledger.lock"
    ]


def test_a_version_1_file_with_hard_links_is_not_migrated(tmp_path):
    """Migration renames a new file into place: through one hard link it once split the names into
    two ledgers. Now it is refused until the other links are gone."""
    real, other = tmp_path / "survey.ledger", tmp_path / "current.ledger"
    real.write_text(json.dumps(PrivacyLedger(budget_epsilon=1.0).to_dict()))  # version 1
    os.link(real, other)
    old = real.read_bytes()
    with pytest.raises(LedgerError, match="version-1 ledger with 2 hard links.*Remove its other"):
        PrivacyLedger.load(other).record("a", PrivacyCost("laplace", 0.6))
    assert os.path.samefile(real, other) and real.read_bytes() == old
    other.unlink()
    PrivacyLedger.load(real).record("a", PrivacyCost("laplace", 0.6))
    assert len(PrivacyLedger.load(real)) == 1


def _file_ledger(path, names=("a", "b")):
    ledger = PrivacyLedger(budget_epsilon=1.0, path=path)
    for name in names:
        ledger.record(name, PrivacyCost("laplace", 0.25))
    return ledger


def _entry_line(name, epsilon=0.25):
    entry = LedgerEntry(name, PrivacyCost("laplace", epsilon), "2024-01-01T00:00:00+00:00")
    return (json.dumps(entry.to_dict()) + "\n").encode()


def test_torn_final_line_is_dropped_with_a_warning(tmp_path):
    path = tmp_path / "torn.ledger"
    _file_ledger(path)
    good = path.read_bytes()
    line = _entry_line("c")
    for cut in (1, len(line) // 2, len(line) - 2):  # the tail of a write cut off by a crash
        path.write_bytes(good + line[:cut])
        message = rf"{re.escape(str(path))}, line 4: incomplete final line.*last good entry is #2"
        with pytest.warns(LedgerWarning, match=message + " 'b'.*ignoring it"):
            ledger = PrivacyLedger.load(path)
        assert [e.name for e in ledger.entries] == ["a", "b"]
        with pytest.warns(LedgerWarning, match="removing it"):
            ledger.record("d", PrivacyCost("laplace", 0.25))
        assert path.read_bytes().startswith(good) and path.read_bytes().count(b"\n") == 4
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert [e.name for e in PrivacyLedger.load(path).entries] == ["a", "b", "d"]
    # A complete final line that only lacks its newline is kept (counted), and mended.
    path.write_bytes(good + line[:-1])
    ledger = PrivacyLedger.load(path)
    assert ledger.spent() == (0.75, 0.0)
    with pytest.raises(PrivacyBudgetExceeded):
        ledger.record("e", PrivacyCost("laplace", 0.5))
    ledger.record("e", PrivacyCost("laplace", 0.25))
    assert [e.name for e in PrivacyLedger.load(path).entries] == ["a", "b", "c", "e"]


def test_damaged_ledger_is_refused_with_the_place_of_the_damage(tmp_path):
    path = tmp_path / "damaged.ledger"
    stale = _file_ledger(path, names=("a", "b", "c"))
    header, a, b, c = path.read_bytes().splitlines(keepends=True)
    where = re.escape(str(path))
    cases = [
        (header + a + b[:20] + b"\n" + c, rf"{where}, line 3: not valid JSON.*#1 'a' .*line 2"),
        (header + a + b + c[:30] + b"\n", rf"{where}, line 4: not valid JSON.*#2 'b' .*line 3"),
        (header + b"\0" * 8 + b"\n" + a, rf"{where}, line 2: not valid JSON.*no good entry"),
        (header + a + b.replace(b'"epsilon": 0.25', b'"epsilon": -1'),
         rf"{where}, line 3: not a ledger entry.*epsilon.*#1 'a'"),
        (header + a + _entry_line("x").replace(b"substitute", b"add_remove"),
         rf"{where}, line 3: .*'add_remove'"),
        (b"", rf"{where} is empty"),
        (header[:25], rf"{where} is not a d3pext privacy ledger"),
        (b"[1, 2]\n", "not a d3pext privacy ledger"),
    ]
    for content, message in cases:
        path.write_bytes(content)
        with pytest.raises(LedgerError, match=message) as info:
            PrivacyLedger.load(path)
        assert isinstance(info.value, ValueError)
        with pytest.raises(LedgerError, match=message):  # nor is it written to
            stale.record("d", PrivacyCost("laplace", 0.1))
        assert path.read_bytes() == content
    # A file that no longer extends what a ledger read from it (replaced, rolled back).
    path.write_bytes(header + a)
    with pytest.raises(LedgerError, match="rolled back"):
        stale.record("d", PrivacyCost("laplace", 0.1))
    with pytest.raises(LedgerError, match="rolled back"):
        stale.check(PrivacyCost("laplace", 0.1))
    assert path.read_bytes() == header + a


def test_orphan_temporary_files_are_removed_under_the_lock(tmp_path):
    path = tmp_path / "l.ledger"
    ledger = _file_ledger(path, names=("a",))
    fd, orphan = tempfile.mkstemp(dir=tmp_path, prefix=path.name, suffix=".tmp")  # as a crash
    os.write(fd, b'{"format": "d3pext-privacy-ledger", "vers')  # of an earlier save left it
    os.close(fd)
    others = [tmp_path / n for n in ("l.ledger.tmp", "l.ledger.bak", "other.ledgerabcd1234.tmp",
                                      "l.ledger-abcd1234.tmp.json")]
    for other in others:
        other.write_text("not ours")
    assert len(PrivacyLedger.load(path)) == 1  # reading removes nothing
    assert os.path.exists(orphan)
    ledger.record("b", PrivacyCost("laplace", 0.25))
    assert not os.path.exists(orphan)
    assert all(other.read_text() == "not ours" for other in others)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, path.name + ".lock", *(o.name for o in others)]
    )


def test_version_1_file_loads_and_is_migrated_on_first_write(tmp_path):
    path = tmp_path / "old.json"
    entries = [LedgerEntry(n, PrivacyCost("laplace", 0.25), "2024-01-01T00:00:00+00:00")
               for n in ("a", "b")]
    old = {"format": "d3pext-privacy-ledger", "version": 1, "budget_epsilon": 1.0,
           "budget_delta": None, "neighbouring": "substitute",
           "entries": [e.to_dict() for e in entries]}
    path.write_text(json.dumps(old, indent=2) + "\n")  # as version 1 saved it
    fd, orphan = tempfile.mkstemp(dir=tmp_path, prefix=path.name, suffix=".tmp")
    os.close(fd)
    ledger = PrivacyLedger.load(path)
    assert ledger.entries == tuple(entries) and ledger.spent() == (0.5, 0.0)
    assert ledger.to_dict() == old
    with pytest.raises(PrivacyBudgetExceeded):
        PrivacyLedger.load(path).record("c", PrivacyCost("laplace", 0.6))
    assert json.loads(path.read_text()) == old  # a refusal writes nothing
    ledger.record("c", PrivacyCost("laplace", 0.5))
    header, *lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert header == {"format": "d3pext-privacy-ledger", "version": 2, "budget_epsilon": 1.0,
                      "budget_delta": None, "neighbouring": "substitute"}
    assert [line["name"] for line in lines] == ["a", "b", "c"]
    assert PrivacyLedger.load(path).entries == ledger.entries
    assert not os.path.exists(orphan)
    bad = dict(old, entries=[old["entries"][0], {"name": "b"}])
    path.write_text(json.dumps(bad, indent=2))
    with pytest.raises(LedgerError, match=r"entry #2: not a ledger entry.*#1 'a'"):
        PrivacyLedger.load(path)


def test_check_and_refresh_see_other_writers(tmp_path):
    path = tmp_path / "shared.ledger"
    mine = PrivacyLedger(budget_epsilon=1.0, budget_delta=1e-5, path=path)
    theirs = PrivacyLedger.load(path)
    theirs.record("theirs", PrivacyCost("laplace", 0.7))
    assert len(mine) == 0  # a view as of loading ...
    with pytest.raises(PrivacyBudgetExceeded):  # ... but check reads the file
        mine.check(PrivacyCost("laplace", 0.5))
    assert mine.refresh().spent() == (0.7, 0.0) and mine.remaining() == pytest.approx(0.3)
    mine.budget_epsilon = 2.0  # a budget is the file's, not an object's
    with pytest.raises(LedgerError, match="budget"):
        mine.record("mine", PrivacyCost("laplace", 0.5))
    with pytest.raises(LedgerError, match="refusing to overwrite"):
        mine.save(path)
    assert len(PrivacyLedger.load(path)) == 1


@pytest.mark.parametrize("backed", [False, True])
def test_threads_sharing_one_ledger_cannot_overspend_it(backed, tmp_path, monkeypatch):
    """Check and record are one step for the threads of a process: eight threads, each releasing 0.6 of a
    budget of 1 with a pause between the check and the record, get one release through (all eight did)."""
    import threading

    slow = PrivacyLedger._new_entries
    monkeypatch.setattr(PrivacyLedger, "_new_entries", staticmethod(lambda items, note: time.sleep(0.01) or slow(items, note)))
    ledger = PrivacyLedger(budget_epsilon=1.0, path=tmp_path / "ledger.jsonl" if backed else None)
    barrier, accepted = threading.Barrier(8), []

    def spend(i):
        barrier.wait()
        try:
            accepted.append(ledger.record(f"r{i}", PrivacyCost("laplace", 0.6)))
        except PrivacyBudgetExceeded:
            pass

    threads = [threading.Thread(target=spend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(accepted) == 1 and ledger.spent() == (0.6, 0.0)
    if backed:
        assert len(PrivacyLedger.load(tmp_path / "ledger.jsonl")) == 1
        ledger.record("next", PrivacyCost("laplace", 0.3))  # the object still agrees with its file


def test_cost_parameters_are_kept_as_the_file_gives_them_back(tmp_path):
    """A tuple parameter read back from the file as a list once made the ledger refuse its next record."""
    import numpy as np

    cost = PrivacyCost("custom", 0.5, parameters={"shape": (2, 3), "scale": np.float32(0.5)})
    assert cost.parameters == {"shape": [2, 3], "scale": 0.5}
    ledger = PrivacyLedger(budget_epsilon=10.0, path=tmp_path / "ledger.jsonl")
    ledger.record("a", cost)
    ledger.record("b", cost)
    assert len(PrivacyLedger.load(tmp_path / "ledger.jsonl")) == 2
    with pytest.raises(ValueError, match="JSON"):
        PrivacyCost("custom", 0.5, parameters={"scale": float("nan")})
