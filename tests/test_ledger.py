"""Checks of d3pext.accountants.ledger: analytic Gaussian, composition, budgets, persistence."""

from datetime import datetime
import json
import math

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
import pytest

from d3pext.accountants.ledger import (
    LedgerEntry,
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
    data = json.loads(path.read_text())
    assert data["format"] == "d3pext-privacy-ledger" and len(data["entries"]) == 2

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
