"""The privacy ledger for releases: what was released, at what cost, and what is left.

A curator records every release in a :class:`PrivacyLedger` before its noise is drawn; the
ledger composes the costs, refuses a release that would exceed the budget, and persists itself
as append-only JSON, so that a budget once spent is never forgotten.

Composition rule (used by :func:`compose` and :meth:`PrivacyLedger.spent`), for releases about
the same data under one neighbouring relation:

* pure-DP releases (``delta == 0``): epsilons add;
* Gaussian releases (``noise_multiplier = sigma / sensitivity`` set): composed exactly, as one
  Gaussian mechanism with ``1 / z**2 = sum_i 1 / z_i**2`` (a composition of Gaussian mechanisms
  is again Gaussian, i.e. mu-GDP with ``mu**2 = sum_i mu_i**2``), converted to (epsilon, delta)
  at the ledger's delta with the analytic Gaussian formula of Balle & Wang (2018);
* any other (epsilon, delta) release: epsilons and deltas add;
* the three groups are combined by basic composition (epsilons add, deltas add).

The ledger's delta is ``budget_delta`` when set (what the other groups leave of it goes to the
Gaussian group); without one, the Gaussian group is reported at the sum of its releases' deltas,
which is never looser than adding their (epsilon, delta) pairs.
"""

from dataclasses import dataclass, field
from datetime import datetime, timezone
import json
import math
import os
from pathlib import Path
import tempfile
from typing import Any, Iterable, Mapping, Optional, Union

from scipy.optimize import brentq
from scipy.special import log_ndtr

__all__ = [
    "LedgerEntry",
    "NEIGHBOURING_RELATIONS",
    "PrivacyBudgetExceeded",
    "PrivacyCost",
    "PrivacyLedger",
    "analytic_gaussian_delta",
    "analytic_gaussian_epsilon",
    "analytic_gaussian_noise_multiplier",
    "compose",
]

NEIGHBOURING_RELATIONS = ("substitute", "add_remove")
"""``substitute``: replace one record; ``add_remove``: add or remove one record."""

_FORMAT = "d3pext-privacy-ledger"
_VERSION = 1
_BUDGET_RTOL = 1e-9  # floating-point slack in budget comparisons (0.1 + 0.2 > 0.3)


class PrivacyBudgetExceeded(RuntimeError):
    """A release would take the ledger past its privacy budget."""


def _check_epsilon(name: str, value: Any, *, allow_zero: bool = False) -> float:
    try:
        value = float(value)
    except TypeError as e:
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from e
    ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def _check_delta(name: str, value: Any, *, allow_zero: bool = True) -> float:
    try:
        value = float(value)
    except TypeError as e:
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from e
    lower_ok = value >= 0 if allow_zero else value > 0
    if not (lower_ok and value < 1):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"{name} must lie in {interval}, got {value}")
    return value


def _check_neighbouring(value: Any) -> str:
    if value not in NEIGHBOURING_RELATIONS:
        raise ValueError(f"neighbouring must be one of {NEIGHBOURING_RELATIONS}, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# The analytic Gaussian mechanism (Balle & Wang 2018, Theorem 8)
# ---------------------------------------------------------------------------------------------


def _log_gaussian_delta(epsilon: float, mu: float) -> float:
    # log( Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) ), without cancellation in the tails.
    log_a = log_ndtr(mu / 2 - epsilon / mu)
    log_b = epsilon + log_ndtr(-mu / 2 - epsilon / mu)
    return log_a + math.log1p(-math.exp(log_b - log_a)) if log_b < log_a else -math.inf


def analytic_gaussian_delta(epsilon: float, noise_multiplier: float) -> float:
    r"""Smallest delta for which the Gaussian mechanism is (epsilon, delta)-DP.

    With ``noise_multiplier`` :math:`z = \sigma / \Delta_2` and :math:`\mu = 1/z`,
    :math:`\delta(\epsilon) = \Phi(\mu/2 - \epsilon/\mu) - e^{\epsilon} \Phi(-\mu/2 - \epsilon/\mu)`
    (Balle & Wang 2018, Theorem 8); this is tight.

    >>> from d3pext.accountants.ledger import analytic_gaussian_delta
    >>> round(analytic_gaussian_delta(1.0, 1.0), 6)
    0.126937
    """
    epsilon = _check_epsilon("epsilon", epsilon, allow_zero=True)
    mu = 1.0 / _check_epsilon("noise_multiplier", noise_multiplier)
    return math.exp(_log_gaussian_delta(epsilon, mu))


def analytic_gaussian_epsilon(delta: float, noise_multiplier: float) -> float:
    """Smallest epsilon for which the Gaussian mechanism is (epsilon, delta)-DP.

    Solves :func:`analytic_gaussian_delta` ``= delta`` for epsilon (0 if even epsilon = 0
    suffices); rounded up, so that the returned epsilon always satisfies the bound.

    >>> from d3pext.accountants.ledger import analytic_gaussian_epsilon
    >>> round(analytic_gaussian_epsilon(1e-5, 1.0), 4)
    4.3772
    """
    delta = _check_delta("delta", delta, allow_zero=False)
    mu = 1.0 / _check_epsilon("noise_multiplier", noise_multiplier)
    log_delta = math.log(delta)
    f = lambda eps: _log_gaussian_delta(eps, mu) - log_delta  # noqa: E731 (decreasing in eps)
    if math.exp(_log_gaussian_delta(0.0, mu)) <= delta:
        return 0.0
    hi = mu * mu / 2 + 2 * mu * math.sqrt(2 * math.log(2 / delta)) + 1.0
    while f(hi) > 0:
        hi *= 2
    eps = brentq(f, 0.0, hi, xtol=1e-15, rtol=4 * 2.0**-52)
    while math.exp(_log_gaussian_delta(eps, mu)) > delta:  # round up onto the safe side
        eps = math.nextafter(eps, math.inf) * (1 + 1e-15)
    return eps


def analytic_gaussian_noise_multiplier(epsilon: float, delta: float) -> float:
    """Smallest ``sigma / sensitivity`` for which the Gaussian mechanism is (epsilon, delta)-DP.

    The analytic Gaussian mechanism (Balle & Wang 2018, Algorithm 1) computed by root-finding
    on the exact delta; rounded up, so that the result always satisfies the bound.

    >>> from d3pext.accountants.ledger import analytic_gaussian_noise_multiplier
    >>> round(analytic_gaussian_noise_multiplier(1.0, 1e-5), 4)
    3.7306
    """
    epsilon = _check_epsilon("epsilon", epsilon)
    delta = _check_delta("delta", delta, allow_zero=False)
    log_delta = math.log(delta)
    f = lambda log_z: _log_gaussian_delta(epsilon, math.exp(-log_z)) - log_delta  # noqa: E731
    lo, hi = -1.0, 1.0  # f is decreasing in log z
    while f(lo) < 0:
        lo -= 1.0
    while f(hi) > 0:
        hi += 1.0
    z = math.exp(brentq(f, lo, hi, xtol=1e-15, rtol=4 * 2.0**-52))
    while math.exp(_log_gaussian_delta(epsilon, 1.0 / z)) > delta:  # round up onto the safe side
        z = math.nextafter(z, math.inf) * (1 + 1e-15)
    return z


# ---------------------------------------------------------------------------------------------
# Costs, entries and composition
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrivacyCost:
    """The privacy cost of one release, as a mechanism reports it and the ledger records it.

    :param mechanism: the mechanism's kind, e.g. ``"laplace"``, ``"gaussian"``.
    :param epsilon: epsilon of the release (> 0).
    :param delta: delta of the release, in [0, 1); 0 for pure DP.
    :param neighbouring: the relation the guarantee refers to (:data:`NEIGHBOURING_RELATIONS`).
    :param noise_multiplier: for Gaussian releases, ``sigma / L2 sensitivity``; set, the ledger
        composes this release exactly with the other Gaussian releases.
    :param parameters: the mechanism's parameters (JSON numbers or strings), for the record.

    >>> from d3pext.accountants.ledger import PrivacyCost
    >>> PrivacyCost("laplace", 0.5, parameters={"scale": 2.0}).delta
    0.0
    """

    mechanism: str
    epsilon: float
    delta: float = 0.0
    neighbouring: str = "substitute"
    noise_multiplier: Optional[float] = None
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.mechanism, str) or not self.mechanism:
            raise TypeError("mechanism must be a non-empty string")
        object.__setattr__(self, "epsilon", _check_epsilon("epsilon", self.epsilon))
        object.__setattr__(self, "delta", _check_delta("delta", self.delta))
        _check_neighbouring(self.neighbouring)
        if self.noise_multiplier is not None:
            z = _check_epsilon("noise_multiplier", self.noise_multiplier)
            if self.delta == 0:
                raise ValueError("a Gaussian cost (noise_multiplier set) needs delta in (0, 1)")
            if analytic_gaussian_delta(self.epsilon, z) > self.delta * (1 + _BUDGET_RTOL):
                raise ValueError(
                    f"noise_multiplier {z} does not give ({self.epsilon}, {self.delta})-DP"
                )
            object.__setattr__(self, "noise_multiplier", z)
        object.__setattr__(self, "parameters", dict(self.parameters))

    def to_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "neighbouring": self.neighbouring,
            "noise_multiplier": self.noise_multiplier,
            "parameters": dict(self.parameters),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PrivacyCost":
        return cls(**data)


@dataclass(frozen=True)
class LedgerEntry:
    """One recorded release: its name, cost, UTC timestamp (ISO 8601) and a free-text note."""

    name: str
    cost: PrivacyCost
    timestamp: str
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "timestamp": self.timestamp,
            "note": self.note,
            **self.cost.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LedgerEntry":
        data = dict(data)
        name, timestamp, note = data.pop("name"), data.pop("timestamp"), data.pop("note", "")
        return cls(name, PrivacyCost.from_dict(data), timestamp, note)


def compose(
    costs: Iterable[PrivacyCost], delta: Optional[float] = None
) -> tuple[float, float]:
    """Total (epsilon, delta) of a sequence of releases, by the rule in the module docstring.

    :param costs: the releases' costs, all under one neighbouring relation.
    :param delta: the total delta at which to report; ``None``: the sum of the releases'
        deltas. Returns ``(inf, delta)`` when the non-Gaussian releases alone need more delta.

    >>> from d3pext.accountants.ledger import PrivacyCost, compose
    >>> compose([PrivacyCost("laplace", 0.5), PrivacyCost("laplace", 0.25)])
    (0.75, 0.0)
    >>> g = PrivacyCost("gaussian", 4.3772, 1e-5, noise_multiplier=1.0)
    >>> eps, d = compose([g, g], delta=1e-5)  # exactly one Gaussian with z = 1/sqrt(2)
    >>> round(eps, 3), d
    (6.573, 1e-05)
    """
    costs = list(costs)
    relations = {c.neighbouring for c in costs}
    if len(relations) > 1:
        raise ValueError(f"cannot compose costs under different neighbouring relations {relations}")
    gaussian = [c for c in costs if c.noise_multiplier is not None]
    pure = [c for c in costs if c.noise_multiplier is None and c.delta == 0]
    other = [c for c in costs if c.noise_multiplier is None and c.delta > 0]
    epsilon = math.fsum(c.epsilon for c in pure + other)
    delta_other = math.fsum(c.delta for c in other)
    if not gaussian:
        return epsilon, delta_other
    if delta is None:
        delta_gauss = math.fsum(c.delta for c in gaussian)
    else:
        delta_gauss = _check_delta("delta", delta) - delta_other
        if delta_gauss <= 0:
            return math.inf, delta_other
    z = 1.0 / math.sqrt(math.fsum(1.0 / c.noise_multiplier**2 for c in gaussian))
    return epsilon + analytic_gaussian_epsilon(delta_gauss, z), delta_other + delta_gauss


# ---------------------------------------------------------------------------------------------
# The ledger
# ---------------------------------------------------------------------------------------------


class PrivacyLedger:
    """Records releases, composes their costs and enforces a privacy budget.

    Call :meth:`check` (or :meth:`record`, which checks) BEFORE drawing a release's noise;
    :meth:`release` does check, record and draw in that order. With a ``path``, every record is
    written to that JSON file at once (append-only: a ledger file is never overwritten by one
    with fewer or different entries). The composition rule is in the module docstring.

    :param budget_epsilon: total epsilon allowed (``None``: unlimited).
    :param budget_delta: total delta allowed, in [0, 1) (``None``: unlimited); also the delta
        at which Gaussian releases are reported.
    :param neighbouring: the relation of every recorded cost (``None``: that of the first).
    :param path: JSON file to persist to after each record; must not exist yet (use
        :meth:`load` to continue a ledger).

    >>> from d3pext.accountants.ledger import PrivacyCost, PrivacyLedger, PrivacyBudgetExceeded
    >>> ledger = PrivacyLedger(budget_epsilon=1.0)
    >>> _ = ledger.record("mean", PrivacyCost("laplace", 0.6))
    >>> ledger.spent()
    (0.6, 0.0)
    >>> try:
    ...     ledger.check(PrivacyCost("laplace", 0.5))
    ... except PrivacyBudgetExceeded:
    ...     print("refused")
    refused
    """

    def __init__(
        self,
        budget_epsilon: Optional[float] = None,
        budget_delta: Optional[float] = None,
        *,
        neighbouring: Optional[str] = None,
        path: Union[str, os.PathLike, None] = None,
    ) -> None:
        self.budget_epsilon = (
            None if budget_epsilon is None else _check_epsilon("budget_epsilon", budget_epsilon)
        )
        self.budget_delta = (
            None if budget_delta is None else _check_delta("budget_delta", budget_delta)
        )
        self.neighbouring = None if neighbouring is None else _check_neighbouring(neighbouring)
        self._entries: list[LedgerEntry] = []
        self.path: Optional[Path] = None
        if path is not None:
            path = Path(path)
            if path.exists():
                raise FileExistsError(
                    f"a ledger already exists at {path}; continue it with PrivacyLedger.load"
                )
            self.path = path
            self.save(path)

    @property
    def entries(self) -> tuple[LedgerEntry, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def _costs(self) -> list[PrivacyCost]:
        return [e.cost for e in self._entries]

    def spent(self) -> tuple[float, float]:
        """Total (epsilon, delta) spent so far, at the ledger's delta (see the module docstring)."""
        return compose(self._costs(), self.budget_delta)

    def remaining(self) -> float:
        """Epsilon left at the ledger's delta (``inf`` without an epsilon budget)."""
        if self.budget_epsilon is None:
            return math.inf
        return max(self.budget_epsilon - self.spent()[0], 0.0)

    def check(self, cost: PrivacyCost, *more: PrivacyCost) -> tuple[float, float]:
        """The (epsilon, delta) spent after ``cost`` (and ``more``, all together); raises if they
        break a rule or the budget.

        :raises PrivacyBudgetExceeded: if the releases would exceed the budget.
        :raises ValueError: if a neighbouring relation differs from the ledger's.
        """
        costs = [cost, *more]
        relation = self.neighbouring
        for c in costs:
            if not isinstance(c, PrivacyCost):
                raise TypeError(f"cost must be a PrivacyCost, got {type(c).__name__}")
            relation = relation or c.neighbouring
            if c.neighbouring != relation:
                raise ValueError(
                    f"this ledger records {relation!r} costs; got {c.neighbouring!r}"
                    " (state both under one relation)"
                )
            if self.budget_delta is not None and c.delta > 0 and self.budget_delta == 0:
                raise PrivacyBudgetExceeded("the budget allows pure DP only (budget_delta = 0)")
        eps, delta = compose(self._costs() + costs, self.budget_delta)
        if self.budget_delta is not None and delta > self.budget_delta * (1 + _BUDGET_RTOL):
            raise PrivacyBudgetExceeded(
                f"release would spend delta {delta:.6g} in total, budget {self.budget_delta:.6g}"
            )
        if self.budget_epsilon is not None and eps > self.budget_epsilon * (1 + _BUDGET_RTOL):
            raise PrivacyBudgetExceeded(
                f"release would spend epsilon {eps:.6g} in total, budget {self.budget_epsilon:.6g}"
            )
        return eps, delta

    def record(self, name: str, cost: PrivacyCost, note: str = "") -> LedgerEntry:
        """Check ``cost`` against the budget, then append it (and save, with a ``path``).

        :raises PrivacyBudgetExceeded: if the release would exceed the budget (nothing recorded).
        """
        return self.record_many([(name, cost)], note)[0]

    def record_many(self, items: Iterable[tuple[str, PrivacyCost]], note: str = "") -> list[LedgerEntry]:
        """Check the costs of several releases against the budget together, then append them all
        (and save once): all or nothing, before any of their noise is drawn.

        >>> ledger = PrivacyLedger(budget_epsilon=1.0)
        >>> ledger.record_many([("a", PrivacyCost("laplace", 0.6)), ("b", PrivacyCost("laplace", 0.6))])
        Traceback (most recent call last):
        ...
        d3pext.accountants.ledger.PrivacyBudgetExceeded: release would spend epsilon 1.2 in total, budget 1
        >>> len(ledger)
        0
        """
        items = list(items)
        if not items:
            return []
        for name, _ in items:
            if not isinstance(name, str):
                raise TypeError(f"name must be a string, got {type(name).__name__}")
            if not name:
                raise ValueError("name must not be empty")
        if not isinstance(note, str):
            raise TypeError("note must be a string")
        self.check(*(cost for _, cost in items))
        now = datetime.now(timezone.utc).isoformat()
        entries = [LedgerEntry(name, cost, now, note) for name, cost in items]
        self._entries.extend(entries)
        if self.neighbouring is None:
            self.neighbouring = entries[0].cost.neighbouring
        if self.path is not None:
            try:
                self.save(self.path)
            except BaseException:
                del self._entries[-len(entries):]
                raise
        return entries

    def release(
        self, name: str, mechanism: Any, value: Any, rng_key: Any = None, note: str = ""
    ) -> Any:
        """Record ``mechanism.cost()``, then draw ``mechanism.release(rng_key, value)``.

        The cost is recorded (and saved) before any noise is drawn, so a release that fails
        afterwards is still counted. ``rng_key=None`` draws the noise from OS entropy.

        >>> from d3pext.accountants.ledger import PrivacyLedger
        >>> from d3pext.releases.mechanisms import LaplaceMechanism
        >>> ledger = PrivacyLedger(budget_epsilon=1.0)
        >>> noisy = ledger.release("total", LaplaceMechanism(0.5, sensitivity=1.0), 42.0)
        >>> ledger.spent()
        (0.5, 0.0)
        """
        self.record(name, mechanism.cost(), note)
        return mechanism.release(rng_key, value)

    # -- persistence ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "budget_epsilon": self.budget_epsilon,
            "budget_delta": self.budget_delta,
            "neighbouring": self.neighbouring,
            "entries": [e.to_dict() for e in self._entries],
        }

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the ledger to ``path`` as JSON (atomically).

        :raises ValueError: if ``path`` holds a ledger whose entries are not a prefix of this
            ledger's entries (fewer or different entries would forget spent budget).
        """
        path = Path(path)
        data = self.to_dict()
        if path.exists():
            existing = _read(path)["entries"]
            if existing != data["entries"][: len(existing)] or len(existing) > len(self._entries):
                raise ValueError(
                    f"{path} holds a ledger with {len(existing)} entries that this ledger"
                    f" ({len(self._entries)} entries) does not extend; refusing to overwrite it"
                )
        text = json.dumps(data, indent=2, allow_nan=False)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "PrivacyLedger":
        """Read a ledger written by :meth:`save`; later records are saved back to ``path``."""
        path = Path(path)
        data = _read(path)
        ledger = cls(
            data["budget_epsilon"], data["budget_delta"], neighbouring=data["neighbouring"]
        )
        ledger._entries = [LedgerEntry.from_dict(e) for e in data["entries"]]
        compose(ledger._costs())  # validates that the relations agree
        ledger.path = path
        return ledger

    # -- display ----------------------------------------------------------------------------

    def summary(self) -> str:
        """A readable table of the entries, the total spent and the budget."""

        def fmt(x: Optional[float]) -> str:
            return "-" if x is None else f"{x:.6g}"

        header = ("#", "name", "mechanism", "epsilon", "delta", "time (UTC)", "note")
        rows = [
            (str(i + 1), e.name, e.cost.mechanism, fmt(e.cost.epsilon), fmt(e.cost.delta),
             e.timestamp[:19], e.note)
            for i, e in enumerate(self._entries)
        ]
        widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        eps, delta = self.spent()
        lines = [
            f"Privacy ledger ({self.neighbouring or 'no'} neighbouring relation; budget epsilon="
            f"{fmt(self.budget_epsilon)}, delta={fmt(self.budget_delta)})",
            line(header),
            *(line(r) for r in rows),
            f"spent: epsilon={eps:.6g}, delta={delta:.6g}  (pure-DP epsilons add; Gaussian "
            "releases composed exactly as one Gaussian mechanism; others add)",
        ]
        if self.budget_epsilon is not None:
            lines.append(f"remaining: epsilon={self.remaining():.6g}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        eps, delta = self.spent()
        return (
            f"PrivacyLedger({len(self)} entries, spent=({eps:.6g}, {delta:.6g}), "
            f"budget=({self.budget_epsilon}, {self.budget_delta}))"
        )


def _read(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"{path} is not a d3pext privacy ledger")
    if data.get("version") != _VERSION:
        raise ValueError(f"{path}: unsupported ledger version {data.get('version')!r}")
    return data
