"""The privacy ledger for releases: what was released, at what cost, and what is left.

A curator records every release in a :class:`PrivacyLedger` before its noise is drawn; the
ledger composes the costs, refuses a release that would exceed the budget, and persists itself
in an append-only JSON Lines file, so that a budget once spent is never forgotten.

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

The ledger file (``path``), safe for several processes spending from it at once:

* format (version 2): JSON Lines, a header line ``{"format": "d3pext-privacy-ledger",
  "version": 2, "budget_epsilon", "budget_delta", "neighbouring"}``, then one line per entry,
  appended and never rewritten. A version-1 file (one JSON document with an ``"entries"``
  list, as earlier releases wrote it) loads, and is rewritten as version 2 by the first write;
* the path is resolved (symlinks followed) once, when a ledger is created, loaded or saved:
  every name of one file, symlinks included, is one ledger, and its lock, temporary files and
  writes are those of the real file;
* every read, budget check and append holds an ``flock`` on the sidecar file ``<path>.lock``
  (``msvcrt`` on Windows) and, where ``flock`` exists, on the ledger file itself, so that
  processes reaching one file through different hard links exclude each other too (without
  ``flock``, a ledger file with several hard links is refused for writing). The ledger is read
  and written through the locked descriptor. The budget is checked against the file's contents
  under the lock, never against another process's in-memory copy; temporary files of the
  ledger left by a crash are removed under it;
* an append is one ``write`` of its lines at the end of what was read, then ``fsync``; if the
  file's size changed since it was read under the lock (a writer that ignores the lock), the
  append is refused with :class:`LedgerError`, never written over another entry.
  :meth:`PrivacyLedger.record` returns (the spend is acknowledged) only after the ``fsync``,
  and a failed write is cut back off. A new file is written to a temporary file, fsynced,
  renamed into place, and its directory fsynced;
* a final line without a newline that is not valid JSON is a write cut off by a crash, never
  acknowledged: it is ignored with a :class:`LedgerWarning` and removed by the next write. A
  complete final line without a newline is kept (counted). Any other damage raises
  :class:`LedgerError` naming the file, the line and the last good entry: a damaged ledger may
  have lost spent budget, so it is never used. A crash in the middle of a
  :meth:`~PrivacyLedger.record_many` cut off by power loss may leave some of its entries
  recorded (counted but not acknowledged): on the safe side.

The lock file is never deleted (deleting it would race). Versions of d3pext before the lock
(version-1 files) do not take it: do not let them write to a ledger that newer ones share. A
version-1 file with several hard links is not migrated (the rename would split it into two
ledgers): remove its other links first.
"""

import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timezone
import errno
import json
import math
import os
from pathlib import Path
import re
import tempfile
import threading
from typing import Any, Iterable, Iterator, Mapping, Optional, Union
import warnings

try:
    import fcntl
except ImportError:  # pragma: no cover (not POSIX)
    fcntl = None
try:
    import msvcrt
except ImportError:
    msvcrt = None

import numpy as np
from scipy.special import log_ndtr

__all__ = [
    "LedgerEntry",
    "LedgerError",
    "LedgerWarning",
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
_VERSION = 2  # of the file format; load() also reads version 1
_BUDGET_RTOL = 1e-9  # floating-point slack in budget comparisons (0.1 + 0.2 > 0.3)


class PrivacyBudgetExceeded(RuntimeError):
    """A release would take the ledger past its privacy budget."""


class LedgerError(ValueError):
    """A ledger file is damaged or foreign, or no longer extends what a ledger read from it."""


class LedgerWarning(UserWarning):
    """A ledger file ended in an incomplete line (a write cut off by a crash): it was ignored."""


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
    from scipy.optimize import brentq  # here: importing it takes 0.1 s
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
    from scipy.optimize import brentq  # here: importing it takes 0.1 s
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
        object.__setattr__(self, "parameters", _as_read_back(self.parameters))

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


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _as_read_back(parameters: Mapping[str, Any]) -> dict[str, Any]:
    """``parameters`` as a ledger file gives them back (tuples as lists, numpy numbers as Python
    ones): a file-backed ledger compares what it holds with what it reads."""
    try:
        return json.loads(json.dumps(dict(parameters), allow_nan=False, default=_plain))
    except (TypeError, ValueError) as error:
        raise ValueError(f"parameters must be finite JSON numbers, strings, lists or dicts: {error}") from None


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
    :meth:`release` does check, record and draw in that order. The composition rule is in the
    module docstring.

    With a ``path``, the ledger lives in that file (format and guarantees in the module
    docstring): every :meth:`record` takes the file's lock, re-reads the file, checks the budget
    against what the file holds (whatever other processes recorded), appends and fsyncs, and only
    then returns. :meth:`check` and :meth:`refresh` also re-read the file; :meth:`spent`,
    :attr:`entries` and ``len()`` show what this object read last.

    :param budget_epsilon: total epsilon allowed (``None``: unlimited).
    :param budget_delta: total delta allowed, in [0, 1) (``None``: unlimited); also the delta
        at which Gaussian releases are reported.
    :param neighbouring: the relation of every recorded cost (``None``: that of the first).
    :param path: ledger file to create and record to; must not exist yet (use :meth:`load` to
        continue a ledger, from this process or any other). Resolved: a symlink's target.

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

    A file-backed ledger shared by two curators (two processes, or as here two objects):

    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "survey.ledger")
    >>> alice = PrivacyLedger(budget_epsilon=1.0, path=path)
    >>> bob = PrivacyLedger.load(path)
    >>> _ = alice.record("mean", PrivacyCost("laplace", 0.6))
    >>> len(bob)  # bob's view is from when he loaded ...
    0
    >>> bob.record("count", PrivacyCost("laplace", 0.6))  # ... but record re-reads the file
    Traceback (most recent call last):
    ...
    d3pext.accountants.ledger.PrivacyBudgetExceeded: release would spend epsilon 1.2 in total, budget 1
    >>> len(bob), len(open(path).read().splitlines())  # one header line, one line per entry
    (1, 2)
    >>> import shutil; shutil.rmtree(os.path.dirname(path))
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
        # check and record as one step for the threads of a process (the file lock serves processes)
        self._lock = threading.RLock()
        self.path: Optional[Path] = None
        if path is not None:
            path = _resolve(path)
            exists = FileExistsError(
                f"a ledger already exists at {path}; continue it with PrivacyLedger.load"
            )
            if path.exists():
                raise exists
            with _locked(path) as held:
                if held.fd is not None:
                    raise exists
                _remove_orphans(path)
                _write_new(held, self._header(), [])
            self.path = path

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
        break a rule or the budget. With a ``path``, re-reads the file first (:meth:`refresh`).

        Only :meth:`record` reserves the budget: another process may spend it between a
        ``check`` and a ``record``.

        :raises PrivacyBudgetExceeded: if the releases would exceed the budget.
        :raises ValueError: if a neighbouring relation differs from the ledger's.
        """
        costs = [cost, *more]
        for c in costs:
            if not isinstance(c, PrivacyCost):
                raise TypeError(f"cost must be a PrivacyCost, got {type(c).__name__}")
        with self._lock:
            self.refresh()
            return self._check(costs)

    def _check(self, costs: list[PrivacyCost]) -> tuple[float, float]:
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

        With a ``path``, the check is against the file's contents under its lock, and the entry
        is on disk (fsynced) when this returns.

        :raises PrivacyBudgetExceeded: if the release would exceed the budget (nothing recorded).
        :raises LedgerError: if the file is damaged, or no longer holds what this ledger read.
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
        for name, cost in items:
            if not isinstance(name, str):
                raise TypeError(f"name must be a string, got {type(name).__name__}")
            if not name:
                raise ValueError("name must not be empty")
            if not isinstance(cost, PrivacyCost):
                raise TypeError(f"cost must be a PrivacyCost, got {type(cost).__name__}")
        if not isinstance(note, str):
            raise TypeError("note must be a string")
        costs = [cost for _, cost in items]
        with self._lock:
            if self.path is None:
                self._check(costs)
                entries = self._new_entries(items, note)
            else:
                with _locked(self.path) as held:
                    _remove_orphans(self.path)
                    state = _read_state(held)
                    self._adopt(state)  # the file, not this object, says what has been spent
                    self._check(costs)
                    entries = self._new_entries(items, note)
                    _append(held, state, entries)  # written and fsynced, or nothing written
            self._entries.extend(entries)
            if self.neighbouring is None:
                self.neighbouring = entries[0].cost.neighbouring
        return entries

    @staticmethod
    def _new_entries(items: list[tuple[str, PrivacyCost]], note: str) -> list[LedgerEntry]:
        now = datetime.now(timezone.utc).isoformat()
        return [LedgerEntry(name, cost, now, note) for name, cost in items]

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

    def _header(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "budget_epsilon": self.budget_epsilon,
            "budget_delta": self.budget_delta,
            "neighbouring": self.neighbouring,
        }

    def to_dict(self) -> dict[str, Any]:
        """The whole ledger as one JSON-able document (the version-1 file layout, which
        :meth:`load` reads too)."""
        return {
            "format": _FORMAT,
            "version": 1,
            "budget_epsilon": self.budget_epsilon,
            "budget_delta": self.budget_delta,
            "neighbouring": self.neighbouring,
            "entries": [e.to_dict() for e in self._entries],
        }

    def _adopt(self, state: "_LedgerState") -> None:
        """Take the file's entries as the truth, after checking that they extend ours."""
        mine = (self.budget_epsilon, self.budget_delta)
        theirs = (state.budget_epsilon, state.budget_delta)
        if mine != theirs:
            raise LedgerError(
                f"{state.path} has budget (epsilon, delta) = {theirs}, this ledger {mine};"
                " refusing to record under a budget that differs from the file's"
            )
        if not _extends(state.entries, self._entries):
            raise LedgerError(
                f"{state.path} holds {len(state.entries)} entries that do not extend the"
                f" {len(self._entries)} this ledger read from it (was the file replaced or rolled"
                " back?); refusing to go on"
            )
        self._entries = list(state.entries)
        self.neighbouring = state.neighbouring

    def refresh(self) -> "PrivacyLedger":
        """Re-read the ledger's file (a no-op without a ``path``): what other processes
        recorded since this object last read it. Returns the ledger.

        :raises LedgerError: if the file is damaged, or no longer extends what this ledger read.
        """
        if self.path is not None:
            with self._lock:
                with _locked(self.path, exclusive=False) as held:
                    state = _read_state(held)
                _warn_torn(state, "ignoring it")
                self._adopt(state)
        return self

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write the ledger to ``path``: create the file, or append the entries it lacks.

        Takes the file's lock; a version-1 file (one JSON document) is rewritten as version 2
        (atomically). ``path`` need not be this ledger's own ``path``; a symlink is followed.

        :raises LedgerError: (a ``ValueError``) if ``path`` holds a ledger whose entries are not
            a prefix of this ledger's entries (fewer or different entries would forget spent
            budget), or one with a different budget.
        """
        path = _resolve(path)
        with _locked(path) as held:
            _remove_orphans(path)
            if held.fd is None:
                _write_new(held, self._header(), self._entries)
                return
            state = _read_state(held)
            existing = state.entries
            if len(existing) > len(self._entries) or not _extends(self._entries, existing):
                raise LedgerError(
                    f"{path} holds a ledger with {len(existing)} entries that this ledger"
                    f" ({len(self._entries)} entries) does not extend; refusing to overwrite it"
                )
            theirs = (state.budget_epsilon, state.budget_delta)
            mine = (self.budget_epsilon, self.budget_delta)
            if theirs != mine:
                raise LedgerError(
                    f"{path} holds a ledger with budget (epsilon, delta) = {theirs}, this ledger"
                    f" {mine}; refusing to overwrite it"
                )
            _append(held, state, self._entries[len(existing):])

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> "PrivacyLedger":
        """Read a ledger file (version 2, or a version-1 JSON document); later records go to it.

        An incomplete final line (a write cut off by a crash, so never acknowledged) is ignored
        with a :class:`LedgerWarning`; any other damage raises :class:`LedgerError`. A symlink
        is followed once: the ledger's ``path`` is the file it names now.
        """
        path = _resolve(path)
        if not path.exists():
            raise FileNotFoundError(f"no ledger at {path}")
        with _locked(path, exclusive=False) as held:
            state = _read_state(held)
        _warn_torn(state, "ignoring it")
        ledger = cls(state.budget_epsilon, state.budget_delta, neighbouring=state.neighbouring)
        ledger._entries = list(state.entries)
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


# ---------------------------------------------------------------------------------------------
# The ledger file: lock, journal, parsing
# ---------------------------------------------------------------------------------------------


def _extends(longer: list[LedgerEntry], prefix: list[LedgerEntry]) -> bool:
    return len(longer) >= len(prefix) and all(
        a.to_dict() == b.to_dict() for a, b in zip(longer, prefix)
    )


def _resolve(path: Union[str, os.PathLike]) -> Path:
    """``path`` absolute, with every symlink in it followed: a ledger's lock, temporary files and
    writes must not depend on the name by which a process reached the file."""
    return Path(os.path.realpath(os.fspath(path)))


class _LedgerFile:
    """The ledger file as :func:`_locked` holds it: ``fd`` is open on it (for reading and
    writing under the exclusive lock); ``None`` where there is no file."""

    def __init__(self, path: Path, fd: Optional[int]) -> None:
        self.path, self.fd = path, fd

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, *, exclusive: bool = True) -> Iterator[_LedgerFile]:
    """Hold the lock of the ledger at ``path`` (resolved, see :func:`_resolve`); yields the
    ledger file, open.

    The lock is an ``flock`` on the sidecar file ``<path>.lock`` (never deleted), which serves
    a file that does not exist yet and the atomic rename that migrates a version-1 file, and,
    where ``flock`` exists, one on the ledger file itself, which serves processes reaching the
    file through another hard link (another name, so another sidecar). Reads and writes go
    through the yielded descriptor: on NFS ``flock`` is emulated by ``fcntl`` locks, which
    closing any other descriptor of the file would drop. The OS releases both locks when their
    holder dies (``kill -9`` included), so a crash never leaves a stale lock.
    """
    with _sidecar_locked(path, exclusive):
        held = _LedgerFile(path, _open_locked(path, exclusive))
        try:
            yield held
        finally:
            held.close()


def _open_locked(path: Path, exclusive: bool) -> Optional[int]:
    """Open the ledger file and lock it (where ``flock`` exists); ``None`` if there is none."""
    flags = (os.O_RDWR if exclusive else os.O_RDONLY) | getattr(os, "O_BINARY", 0)
    while True:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            return None
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            st = os.fstat(fd)
            try:
                current = os.path.samestat(st, os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                if fcntl is None and exclusive and st.st_nlink > 1:  # pragma: no cover (Windows)
                    raise LedgerError(
                        f"{path} has {st.st_nlink} hard links; on this platform the ledger's lock"
                        " is per name, so processes using the other names would not be excluded:"
                        " remove the other hard links (a symlink to the file is safe)"
                    )
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # renamed or removed while we waited for the lock: open what it names now


@contextlib.contextmanager
def _sidecar_locked(path: Path, exclusive: bool) -> Iterator[None]:
    """``flock`` on ``<path>.lock``; without ``fcntl`` (Windows) ``msvcrt.locking``, always
    exclusive. A shared (reading) lock in a directory that nobody may write is skipped."""
    lock_path = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        if exclusive or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        try:
            fd = os.open(lock_path, os.O_RDONLY)
        except OSError:
            fd = None  # read-only place and no lock file: nobody can be writing there
    if fd is None:
        yield
        return
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        elif msvcrt is not None:  # pragma: no cover (Windows)
            while True:
                try:
                    msvcrt.locking(fd, msvcrt.LK_LOCK, 1)  # gives up after about 10 s: retry
                    break
                except OSError:
                    pass
        else:  # pragma: no cover
            raise OSError("no file locking on this platform (need fcntl or msvcrt)")
        try:
            yield
        finally:
            if fcntl is None and msvcrt is not None:  # pragma: no cover (Windows)
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
    finally:
        os.close(fd)  # releases an flock


def _temp_pattern(path: Path) -> "re.Pattern[str]":
    # tempfile.mkstemp(prefix=path.name, suffix=".tmp"): 8 characters from [a-z0-9_] between.
    return re.compile(re.escape(path.name) + r"[a-z0-9_]{8}\.tmp")


def _remove_orphans(path: Path) -> None:
    """Remove temporary files of this ledger left by a crash (call under the exclusive lock:
    writers only make temporary files under it, so none is in use)."""
    pattern = _temp_pattern(path)
    with os.scandir(path.parent) as it:
        for item in it:
            if pattern.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                try:
                    os.remove(item.path)
                except FileNotFoundError:
                    pass


def _fsync_dir(directory: Path) -> None:
    if os.name == "nt":  # pragma: no cover (directories cannot be opened, nor need fsync)
        return
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _line(data: Mapping[str, Any]) -> bytes:
    return (json.dumps(data, allow_nan=False, ensure_ascii=False) + "\n").encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _write_new(held: _LedgerFile, header: Mapping[str, Any], entries: list[LedgerEntry]) -> None:
    """Write a complete version-2 file atomically: temporary file, fsync, rename, fsync dir."""
    path = held.path
    payload = _line(header) + b"".join(_line(e.to_dict()) for e in entries)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        try:
            _write_all(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)
        held.close()  # Windows cannot rename over an open file; elsewhere it would be stale
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_dir(path.parent)


def _append(held: _LedgerFile, state: "_LedgerState", entries: list[LedgerEntry]) -> None:
    """Append ``entries`` to the file read as ``state`` (under the exclusive lock), fsynced.

    Drops an incomplete final line first (with a warning); a version-1 file is rewritten as
    version 2. On any failure the file is cut back to what it held: nothing is half-recorded.
    Refuses if the file changed since it was read: it is never written over.
    """
    path, fd = held.path, held.fd
    if state.version == 2 and not entries and state.torn is None and not state.unterminated:
        return
    st = os.fstat(fd)
    if st.st_size != state.size:
        raise LedgerError(
            f"{path} changed while this process held its lock ({state.size} bytes when read,"
            f" {st.st_size} now): another process wrote to it without the lock (an older d3pext,"
            " or another program); nothing was recorded. Let only this version of d3pext write"
            " to the ledger, then load it again"
        )
    if state.version == 1:
        if st.st_nlink > 1:
            raise LedgerError(
                f"{path} is a version-1 ledger with {st.st_nlink} hard links: migrating it to"
                " version 2 renames a new file into place, which would split its names into"
                " separate ledgers. Remove its other hard links (a symlink to it is safe), then"
                " record again"
            )
        header = {
            "format": _FORMAT, "version": _VERSION, "budget_epsilon": state.budget_epsilon,
            "budget_delta": state.budget_delta, "neighbouring": state.neighbouring,
        }
        _write_new(held, header, state.entries + entries)
        return
    _warn_torn(state, "removing it")
    payload = (b"\n" if state.unterminated else b"") + b"".join(
        _line(e.to_dict()) for e in entries
    )
    try:
        if state.torn is not None:
            os.ftruncate(fd, state.good_size)
        os.lseek(fd, state.good_size, os.SEEK_SET)
        _write_all(fd, payload)
        os.fsync(fd)
    except BaseException:
        os.ftruncate(fd, state.good_size)  # never acknowledged: leave no trace
        os.fsync(fd)
        raise


@dataclass
class _LedgerState:
    """What a ledger file holds, as read under its lock."""

    path: Path
    version: int
    budget_epsilon: Optional[float]
    budget_delta: Optional[float]
    neighbouring: Optional[str]
    entries: list[LedgerEntry]
    size: int = 0  # bytes read: the file's size when it was read under the lock
    good_size: int = 0  # bytes up to the end of the last good line
    unterminated: bool = False  # the last good line has no newline (add one before appending)
    torn: Optional[str] = None  # an incomplete final line after good_size: what to say about it


def _warn_torn(state: _LedgerState, action: str) -> None:
    if state.torn is not None:
        warnings.warn(f"{state.torn}; {action}", LedgerWarning, stacklevel=3)


def _last_good(entries: list[LedgerEntry], lineno: Optional[int]) -> str:
    if not entries:
        return "there is no good entry before it"
    e = entries[-1]
    where = "" if lineno is None else f" (line {lineno})"
    return f"the last good entry is #{len(entries)} {e.name!r} of {e.timestamp}{where}"


def _header_fields(path: Path, head: Mapping[str, Any], where: str) -> tuple:
    try:
        eps, delta, relation = head["budget_epsilon"], head["budget_delta"], head["neighbouring"]
        return (
            None if eps is None else _check_epsilon("budget_epsilon", eps),
            None if delta is None else _check_delta("budget_delta", delta),
            None if relation is None else _check_neighbouring(relation),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise LedgerError(f"{path}{where}: bad ledger header ({type(e).__name__}: {e})") from e


def _check_format(path: Path, head: Any) -> int:
    if not isinstance(head, dict) or head.get("format") != _FORMAT:
        raise LedgerError(f"{path} is not a d3pext privacy ledger")
    version = head.get("version")
    if version not in (1, _VERSION):
        raise LedgerError(f"{path}: unsupported ledger version {version!r}")
    return version


def _entry(data: Any) -> LedgerEntry:
    if not isinstance(data, dict):
        raise TypeError(f"an entry must be a JSON object, got {type(data).__name__}")
    return LedgerEntry.from_dict(data)


def _relation(path: Path, relation: Optional[str], entry: LedgerEntry, where: str, entries) -> str:
    if relation is not None and entry.cost.neighbouring != relation:
        raise LedgerError(
            f"{path}{where}: entry {entry.name!r} is under the {entry.cost.neighbouring!r}"
            f" relation, the ledger's is {relation!r}; {_last_good(entries, None)}"
        )
    return entry.cost.neighbouring


def _read_state(held: _LedgerFile) -> _LedgerState:
    if held.fd is None:
        raise FileNotFoundError(f"no ledger at {held.path} (removed or renamed?)")
    os.lseek(held.fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(held.fd, 1 << 20):
        chunks.append(chunk)
    data = b"".join(chunks)
    state = _parse(held.path, data)
    state.size = len(data)
    return state


def _parse(path: Path, data: bytes) -> _LedgerState:
    if not data.strip():
        raise LedgerError(f"{path} is empty: not a d3pext privacy ledger (no header line)")
    lines = data.split(b"\n")
    terminated = lines[-1] == b""
    if terminated:
        lines.pop()
    try:
        head = json.loads(lines[0].decode("utf-8"))
    except ValueError:
        head = None
    if head is None or (isinstance(head, dict) and head.get("version") == 1):
        return _parse_v1(path, data)
    _check_format(path, head)
    eps, delta, relation = _header_fields(path, head, ", line 1")
    state = _LedgerState(path, _VERSION, eps, delta, relation, [])
    state.good_size = len(lines[0]) + (1 if len(lines) > 1 or terminated else 0)
    state.unterminated = len(lines) == 1 and not terminated
    last_lineno = None
    for index in range(1, len(lines)):
        lineno, raw = index + 1, lines[index]
        final_unterminated = index == len(lines) - 1 and not terminated
        if raw.strip():
            try:
                data_ = json.loads(raw.decode("utf-8"))
            except ValueError as e:  # UnicodeDecodeError is a ValueError too
                if final_unterminated:
                    state.torn = (
                        f"{path}, line {lineno}: incomplete final line (no newline: a write cut"
                        " off by a crash, never acknowledged); "
                        + _last_good(state.entries, last_lineno)
                    )
                    break
                raise LedgerError(
                    f"{path}, line {lineno}: not valid JSON ({e}); "
                    f"{_last_good(state.entries, last_lineno)}. {_DAMAGED}"
                ) from e
            try:
                entry = _entry(data_)
            except (KeyError, TypeError, ValueError) as e:
                raise LedgerError(
                    f"{path}, line {lineno}: not a ledger entry ({type(e).__name__}: {e}); "
                    f"{_last_good(state.entries, last_lineno)}. {_DAMAGED}"
                ) from e
            relation = _relation(path, relation, entry, f", line {lineno}", state.entries)
            state.entries.append(entry)
            last_lineno = lineno
        state.good_size += len(raw) + (0 if final_unterminated else 1)
        state.unterminated = final_unterminated
    state.neighbouring = relation
    return state


def _parse_v1(path: Path, data: bytes) -> _LedgerState:
    """A version-1 file: one JSON document ``{"format", "version": 1, budgets, "entries"}``."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError as e:
        if b"\n" not in data.rstrip(b"\n"):
            raise LedgerError(f"{path} is not a d3pext privacy ledger (line 1: {e})") from e
        raise LedgerError(
            f"{path} is neither a version-2 ledger (line 1 is not a JSON header) nor a valid"
            f" version-1 JSON document ({e}). {_DAMAGED}"
        ) from e
    _check_format(path, doc)
    eps, delta, relation = _header_fields(path, doc, "")
    entries: list[LedgerEntry] = []
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise LedgerError(f"{path}: a version-1 ledger needs an 'entries' list. {_DAMAGED}")
    for k, raw in enumerate(raw_entries, start=1):
        try:
            entry = _entry(raw)
        except (KeyError, TypeError, ValueError) as e:
            raise LedgerError(
                f"{path}, entry #{k}: not a ledger entry ({type(e).__name__}: {e}); "
                f"{_last_good(entries, None)}. {_DAMAGED}"
            ) from e
        relation = _relation(path, relation, entry, f", entry #{k}", entries)
        entries.append(entry)
    return _LedgerState(path, 1, eps, delta, relation, entries, good_size=len(data))


_DAMAGED = (
    "The ledger is damaged and may have lost spent budget: refusing to use it (restore it from"
    " a backup)"
)
