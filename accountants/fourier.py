"""Tight (epsilon, delta) accounting for the subsampled Gaussian mechanism of DP-SGD / DP-VI.

One step adds Gaussian noise of standard deviation ``sigma * C`` to the sum of per-example
gradients clipped to norm ``C``, on a batch drawn with sampling rate ``q``; ``num_steps`` such steps
are composed. Two neighbouring relations are supported (:class:`Relation`).

A single step (``num_steps = 1``) and full-batch steps (``q = 1``, the Gaussian mechanism) have
closed forms: the privacy loss increases in the Gaussian output ``t`` and its inverse is explicit
(Koskela, Jälkö & Honkela, 2020), so ``delta(epsilon)`` is a difference of Gaussian tails, evaluated
in log space for any epsilon.

Otherwise one step's privacy loss distribution (PLD) is discretised on a grid ``x_j = j dx`` by
"connecting the dots" (Doroshenko et al., 2022): the exact P- and Q-probabilities of every cell
``[x_j, x_j+1]`` (Gaussian tails at the explicit inverse of the loss) are split between the cell's two
ends so that both are preserved. The result dominates the true PLD, so every delta and epsilon it
gives is an upper bound, and halving ``dx`` can only lower it. The PLD is Fourier-transformed once and
raised to the power of each step count; many steps are composed in blocks of about ``sqrt(T)`` steps,
each block discretised again (by connecting the dots, still an upper bound) on a grid about
``T^(1/4)`` times coarser, where the blocks are composed, so that neither grid needs more than a few
``1e5`` points. For small sampling rates one step's loss is a spike of width ~q near 0 next to rare
values up to O(1): there the spike is discretised on the fine grid and the rare values on a coarse
one, and the composition is expanded in the number of rare values per block (:class:`_SplitPLD`),
so that no grid spans the rare values at the spike's resolution. A value is returned only after it
has been checked:

* the grid window holds the composed PLD: a Chernoff bound of the discretised PLD caps the mass
  that wraps around the circular convolution at ``1e-4 * delta`` (and is added to delta);
* the mass that one step puts beyond the window is counted as an infinite loss, and so is the
  rounding noise of the FFTs (twice their negative mass);
* halving the grid step changes the result by less than a relative ``1e-4``;
* epsilon comes from exact inversion of the piecewise-smooth ``delta(epsilon)`` of the composed
  discrete PLD, not from Newton's method.

If the checks cannot be passed within the grid budget, the value comes from dp-accounting's PLD
accountant (pessimistic, hence an upper bound), its discretisation refined until the value is
stable; if that fails as well, :class:`AccountingError` is raised.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np
import scipy.fft
import scipy.special

__all__ = [
    "AccountingError",
    "Relation",
    "SigmaResult",
    "approximate_sigma",
    "delta",
    "epsilon",
]


def _brentq(f: Callable[[float], float], a: float, b: float, **kwargs) -> float:
    """``scipy.optimize.brentq``, imported at its first use: importing ``scipy.optimize`` takes about
    0.1 s, which a process that finds no root (a release, a ledger, a fit at a given noise multiplier)
    need not pay."""
    from scipy.optimize import brentq as scipy_brentq

    return scipy_brentq(f, a, b, **kwargs)


def _bisect(f: Callable[[float], float], lo: float, hi: float, xtol: float) -> float:
    """A root of ``f`` in ``[lo, hi]`` within ``xtol``, for ``f(lo) < 0 < f(hi)``, by bisection: where a
    rough root is enough (a search's first guess), without importing ``scipy.optimize``."""
    while hi - lo > xtol:
        mid = 0.5 * (lo + hi)
        if f(mid) < 0.0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class Relation(str, enum.Enum):
    """Neighbouring relation, tied to the minibatch sampling scheme that it describes.

    * ``ADD_REMOVE``: Poisson subsampling (every example joins a batch independently with
      probability ``q``); neighbours differ by one added or removed example. fourier-accountant's
      ``R``: the pair ``(1-q) N(0, s^2) + q N(1, s^2)`` vs ``N(0, s^2)`` (the removal direction,
      which dominates the addition direction for the subsampled Gaussian).
    * ``SUBSTITUTE``: fixed-size batches of ``q * N`` examples drawn without replacement;
      neighbours differ by one substituted example. fourier-accountant's ``S``: the pair
      ``(1-q) N(0, s^2) + q N(1, s^2)`` vs ``(1-q) N(0, s^2) + q N(-1, s^2)``; at ``q = 1`` the
      Gaussian mechanism with sensitivity 2.
    """

    ADD_REMOVE = "add_remove"
    SUBSTITUTE = "substitute"


class AccountingError(RuntimeError):
    """No trustworthy privacy value could be computed for the requested parameters."""


class SigmaResult(NamedTuple):
    """Result of :func:`approximate_sigma`; unpacks as ``sigma, epsilon, num_evaluations``
    (``epsilon``: a certified upper bound at ``sigma``, at most the target; ``num_evaluations``: the
    sigmas at which epsilon was evaluated, on one grid or more)."""

    sigma: float
    epsilon: float
    num_evaluations: int


# Checks and budgets of the Fourier path.
_WRAP_FRACTION = 1e-4  # mass allowed to wrap around the window, relative to delta
_REFINE_RTOL = 1e-4  # allowed relative change of a result when the grid step is halved
_EPS_ATOL = 1e-7  # absolute floor of that tolerance for epsilon close to 0
_MAX_NX = 2**23  # points of each FFT grid (about 400 MB of working memory)
_MAX_NX_ONE_STEP = 2**21  # cells of one step's discretised PLD
_MAX_WINDOW = 600.0  # exp(x) must stay finite on the window
_DX_PER_STD = 2.0**-4  # first grid step, relative to the standard deviation of one step's loss
_DX_COARSEST = 2.0**-4  # and at most this
_DELTA_FLOOR = 1e-12  # delta() sizes its window for deltas down to this value
_SEARCH_COARSER = 2  # approximate_sigma's first grid: up to this many times coarser than the initial step
_SEARCH_CHEAPER = 2  # the search's points: this many grids coarser than its grid (not below the initial one)
_SCREEN_EXCESS = 0.01  # the first point's coarsest grid screens points if it is this close to the search's
_SCREEN_FAR = 0.02  # and a point is screened where its estimated log(epsilon / target) is beyond this
_LADDER_NEAR = 0.5  # the search's grids are chosen at the first point with log(epsilon / target) below this
# Bulk/tail split (small q).
_SPLIT_MIN_STDS = 1024.0  # split where one step's window spans more std of its loss than this
_SPLIT_BULK_STDS = 64.0  # first half-width of the finely gridded bulk, in std of one step's loss
_SPLIT_MAX_TERMS = 12  # most tail events per block composed exactly
_SPLIT_COARSE_POINTS = 2**14  # the first coarse grid spans the composed window with at most about this many
_SPLIT_FINE_LEVELS = 3  # the bulk's grid step is at least the initial step halved this many times
_SPLIT_BLOCK_QT = 0.15  # blocks of at least this many expected participations, over q (all steps if fewer)
_SPLIT_THIN_MIN = 8192  # the search's tails are thinned where one step's window spans more coarse points than this
_SPLIT_THIN_POINTS = 512  # and the thinned parts get a grid step of about this fraction of the window
_SPLIT_THIN_LOG_SHARE = math.log(1e-3)  # and the runs that reach past the thinning: this share of the wrap budget
# dp-accounting fallback.
_DPA_RTOL = 2e-3
_MAX_DPA_WINDOW = 1e4  # dp-accounting's grid spans the privacy loss, at 1e-2 (or finer) per point
_DPA_INTERVALS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)  # value_discretization_interval


# The largest epsilon the search asks of a grid (approximate_sigma sets it around its grid evaluations):
# _SplitPLD may then connect the far tails on a coarser partition (see _SplitPLD).
_EPS_BOUND: contextvars.ContextVar[float | None] = contextvars.ContextVar("_EPS_BOUND", default=None)


class _Untrusted(Exception):
    """The Fourier path cannot certify a value within its budget."""


class _OutOfWindow(_Untrusted):
    """The privacy loss of the run reaches beyond the largest window of the Fourier path."""


# ---------------------------------------------------------------------------------------------
# Validation.


def _as_relation(relation: Relation | str) -> Relation:
    if isinstance(relation, Relation):
        return relation
    if isinstance(relation, str):
        try:
            return Relation(relation.lower())
        except ValueError:
            pass
    allowed = ", ".join(repr(r.value) for r in Relation)
    raise ValueError(f"relation must be one of {allowed} or a Relation member, got {relation!r}")


def _as_float(name: str, value) -> float:
    if isinstance(value, (bool, str, bytes)) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None


def _check_positive(name: str, value) -> float:
    value = _as_float(name, value)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return value


def _check_sigma(sigma) -> float:
    """A noise multiplier whose privacy loss can be evaluated in floats (``sigma^2`` and ``1 / sigma^2``
    finite)."""
    sigma = _check_positive("sigma", sigma)
    if sigma < 1e-100:
        raise AccountingError(
            f"sigma={sigma!r} is too small to account: 1 / sigma^2 overflows, and the privacy loss is far beyond any "
            "meaningful guarantee (use a noise multiplier of order 1)"
        )
    if sigma > 1e100:
        raise AccountingError(
            f"sigma={sigma!r} is too large to account: sigma^2 overflows, and the privacy loss is far below any "
            "measurable epsilon (use a noise multiplier below 1e100)"
        )
    return sigma


def _check_q(q) -> float:
    q = _as_float("q", q)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"q must lie in (0, 1], got {q!r}")
    return q


def _check_delta(delta) -> float:
    delta = _as_float("delta", delta)
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    return delta


def _check_steps(num_steps) -> tuple[np.ndarray, bool]:
    """Step counts as an int64 array, and whether the input was a scalar."""
    arr = np.asarray(num_steps)
    if arr.dtype == bool or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"num_steps must be an integer or a sequence of integers, got {num_steps!r}")
    if arr.size == 0:
        raise ValueError("num_steps must not be empty")
    if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
        raise ValueError(f"num_steps must be whole numbers, got {num_steps!r}")
    if np.any(arr < 1):
        raise ValueError(f"num_steps must be >= 1, got {num_steps!r}")
    return arr.astype(np.int64), arr.ndim == 0


# ---------------------------------------------------------------------------------------------
# One step: privacy loss l(t) = log P(t) / Q(t) of the Gaussian output t, t ~ P.


def _log_p(sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    """log density of P = (1-q) N(0, sigma^2) + q N(1, sigma^2)."""
    s2 = 2.0 * sigma**2
    norm = -0.5 * math.log(2.0 * math.pi * sigma**2)
    first = math.log1p(-q) - t**2 / s2 if q < 1.0 else np.full_like(t, -np.inf)
    return norm + np.logaddexp(first, math.log(q) - (t - 1.0) ** 2 / s2)


def _privacy_loss(relation: Relation, sigma: float, q: float, t: np.ndarray) -> np.ndarray:
    s2 = 2.0 * sigma**2
    log_1mq = math.log1p(-q) if q < 1.0 else -math.inf
    if relation is Relation.ADD_REMOVE:
        return np.logaddexp(log_1mq, math.log(q) + (2.0 * t - 1.0) / s2)
    base = log_1mq - t**2 / s2
    return np.logaddexp(base, math.log(q) - (t - 1.0) ** 2 / s2) - np.logaddexp(
        base, math.log(q) - (t + 1.0) ** 2 / s2
    )


def _inverse_loss(relation: Relation, sigma: float, q: float, x: np.ndarray) -> np.ndarray:
    """The output t at which the loss l(t) = x (l increases in t); -inf for x <= log(1 - q) (add/remove).

    Add/remove: ``t = s^2 log((e^x - 1 + q) / q) + 1/2``. Substitute: with ``a = q exp(-1/(2 s^2))``,
    ``e^x = ((1-q) + a y) / ((1-q) + a / y)`` for ``y = exp(t / s^2)``, whose positive root is
    ``log y = x/2 + asinh((1-q) sinh(x/2) / a)``. Both are evaluated in log space for any x.
    """
    x = np.asarray(x, dtype=float)
    if x.ndim == 0:
        return _inverse_loss(relation, sigma, q, x.reshape(1)).reshape(())
    s2 = sigma**2
    # (in place where the expressions allow: fresh large temporaries cost page faults)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if relation is Relation.ADD_REMOVE:
            # log(e^x - (1 - q)) = x + log(1 - (1-q) e^-x), finite for x > log(1 - q).
            t = np.negative(x)
            np.exp(t, out=t)
            t *= -(1.0 - q)
            np.log1p(t, out=t)
            np.add(x, t, out=t)
            t -= math.log(q)
            t *= s2
            t += 0.5
            np.copyto(t, -np.inf, where=~(x > (math.log1p(-q) if q < 1.0 else -math.inf)))
            return t
        z = 0.5 * np.abs(x)
        log_a = math.log(q) - 0.5 / s2
        if q < 1.0:
            log_v = math.log1p(-q) + z
            sinh = np.multiply(z, -2.0)
            np.expm1(sinh, out=sinh)
            np.negative(sinh, out=sinh)
            np.log(sinh, out=sinh)
            log_v += sinh
            log_v -= math.log(2.0)
            log_v -= log_a
        else:
            log_v = np.full(x.shape, -np.inf)
        asinh_v = np.minimum(log_v, 20.0)
        np.exp(asinh_v, out=asinh_v)
        np.arcsinh(asinh_v, out=asinh_v)
        large = log_v > 20.0
        np.add(log_v, math.log(2.0), out=asinh_v, where=large)
        asinh_v += z
        asinh_v *= s2  # (sign(x) s2 asinh: the product's rounding is symmetric)
        return np.copysign(asinh_v, x, out=asinh_v)


def _gaussian_cells(mean: float, sigma: float, t: np.ndarray) -> tuple[np.ndarray, float, float]:
    """N(mean, sigma^2)-probabilities of the cells (t_k, t_k+1], of t <= t_0 and of t > t_-1,
    accurate in both tails (``t`` non-decreasing)."""
    z = t - mean
    z /= sigma
    # The points below the mean come first: from the lower tail Phi(z) there, from the upper one
    # Phi(-z) above (the smaller tail on each side, accurate). (Were t out of order by rounding near
    # the mean, the cells there would come from the other tail, as exact.)
    size, i0 = z.size, int(np.searchsorted(z, 0.0, side="right"))
    np.negative(z[i0:], out=z[i0:])
    tail = scipy.special.ndtr(z, out=z)
    # Phi(z_k+1) - Phi(z_k): tail_k+1 - tail_k below, tail_k - tail_k+1 above, 1 - tail_k+1 - tail_k across.
    cells = np.empty(size - 1)
    below_end = max(i0 - 1, 0)
    np.subtract(tail[1 : below_end + 1], tail[:below_end], out=cells[:below_end])
    np.subtract(tail[i0 : size - 1], tail[i0 + 1 :], out=cells[i0:])
    if 0 < i0 < size:
        cells[i0 - 1] = 1.0 - tail[i0] - tail[i0 - 1]
    np.maximum(cells, 0.0, out=cells)
    return cells, float(tail[0] if i0 > 0 else 1.0 - tail[0]), float(tail[-1] if i0 < size else 1.0 - tail[-1])


def _one_step_pmf(relation: Relation, sigma: float, q: float, dx: float, j_lo: int, j_hi: int) -> tuple[np.ndarray, float]:
    """One step's PLD on ``x_j = j dx``, ``j_lo <= j <= j_hi``, by connecting the dots; and the mass beyond.

    The loss of cell ``[x_j, x_j+1]`` has P-probability ``m`` and Q-probability ``n = E_P[e^-l]``;
    putting ``w1`` at ``x_j+1`` and ``m - w1`` at ``x_j`` with ``w1 e^-dx + (m - w1) = n e^{x_j}``
    keeps both, and as a mean-preserving spread of ``e^-l`` it raises ``E_P[(1 - e^{eps - l})_+]`` (a
    convex function of ``e^-l``) for every eps and every composition: the result dominates. Loss
    below ``x_j_lo`` is rounded up to it; loss above ``x_j_hi`` (returned) counts as infinite.
    """
    return _one_step_cells(relation, sigma, q, dx, np.arange(j_lo, j_hi + 1))


def _one_step_cells(relation: Relation, sigma: float, q: float, dx: float, points: np.ndarray) -> tuple[np.ndarray, float]:
    """:func:`_one_step_pmf` on the increasing grid indices ``points``, whose gaps may differ: each
    cell ``[x_i, x_i+1]`` between neighbouring points is connected to its own two ends."""
    grid = points * dx
    t = _inverse_loss(relation, sigma, q, grid)
    # P = (1-q) N(0) + q N(1); Q = N(0) (add/remove) or (1-q) N(0) + q N(-1) (substitute).
    (c0, b0, a0), (c1, b1, a1) = _gaussian_cells(0.0, sigma, t), _gaussian_cells(1.0, sigma, t)
    below, above = (1.0 - q) * b0 + q * b1, (1.0 - q) * a0 + q * a1
    m = np.multiply(c0, 1.0 - q)
    m += np.multiply(c1, q, out=c1)
    if relation is Relation.ADD_REMOVE:
        n = c0
    else:
        n = np.multiply(c0, 1.0 - q, out=c0)
        n += np.multiply(_gaussian_cells(-1.0, sigma, t)[0], q)
    # 1 - exp(-gap) per run of equal gaps (a few runs: the bulk's and the tails' spacings)
    gaps = np.diff(points)
    starts = np.concatenate([[0], np.flatnonzero(gaps[1:] != gaps[:-1]) + 1]) if gaps.size else np.zeros(0, dtype=int)
    ends = np.append(starts[1:], gaps.size)
    spreads = -np.expm1(-(grid[starts + 1] - grid[starts]))
    w1 = np.exp(grid[:-1])
    w1 *= n
    np.subtract(m, w1, out=w1)
    if starts.size <= 16:
        for start, end, spread in zip(starts.tolist(), ends.tolist(), spreads.tolist()):
            w1[start:end] /= spread
    else:
        w1 /= np.repeat(spreads, ends - starts)
    np.minimum(w1, m, out=w1)  # (clip to [0, m], m >= 0)
    np.maximum(w1, 0.0, out=w1)
    pmf = np.zeros(grid.size)
    np.subtract(m, w1, out=pmf[:-1])
    pmf[1:] += w1
    pmf[0] += below
    return pmf, above


class _Window(NamedTuple):
    """The privacy loss lies in ``[-below, above]`` up to a small tail mass on each side."""

    below: float
    above: float


def _one_step_window(relation: Relation, sigma: float, q: float, tail: float) -> _Window:
    """Window that holds one step's loss up to a mass ``tail`` on each side."""
    z = max(6.0, -float(scipy.special.ndtri(tail)))
    # Both mixture components put at most `tail` above 1 + z sigma and below -z sigma, and the loss
    # increases in t; the substitute loss is odd in t.
    above = float(_privacy_loss(relation, sigma, q, np.array(1.0 + z * sigma)))
    below = -float(_privacy_loss(relation, sigma, q, np.array(-z * sigma)))
    if relation is Relation.ADD_REMOVE:  # the loss is bounded below by log(1 - q)
        return _Window(min(below, -math.log1p(-q)), above)
    return _Window(below, above)


class _LossMGF:
    """Log moment generating function ``log E_P[exp(lam l(t))]`` of one step's loss, lam in both signs.

    It is integrated over t by the trapezoidal rule, spectrally accurate for these smooth
    Gaussian-tailed integrands. One step's loss has Gaussian tails of std ``1/sigma``, so the lam
    that matter are below ~8 sigma; as ``0 <= l'(t) <= 2 / sigma^2``, tilting by lam moves the mass
    of t by at most 2 lam, which the t-grid covers. The log-MGF is evaluated only at the lams that a
    Chernoff bound asks for (:meth:`tail_bounds`: a coarse sweep, then a finer one around its best lam),
    which keeps a plan cheap at small sigma, where the t-grid is long.
    """

    def __init__(self, relation: Relation, sigma: float, q: float):
        self.lam_max = 10.0 * sigma + 2.0
        reach = 2.0 * self.lam_max + 12.0 * sigma + 2.0
        step = min(sigma / 4.0, sigma**2 / 2.0)
        t = np.linspace(-reach, 1.0 + reach, int(np.clip((2.0 * reach + 1.0) / step, 512, 20001)))
        self._log_p = _log_p(sigma, q, t) + math.log(t[1] - t[0])
        self._loss = _privacy_loss(relation, sigma, q, t)
        p = np.exp(self._log_p)
        self.mean = float(np.sum(p * self._loss))  # KL(P || Q)
        self.std = math.sqrt(max(float(np.sum(p * (self._loss - self.mean) ** 2)), 0.0))

    def log_mgf(self, sign: float, lam: np.ndarray) -> np.ndarray:
        """``log E_P[exp(sign lam l)]`` at the lams ``lam``."""
        exponents = sign * lam[:, None] * self._loss + self._log_p
        peak = exponents.max(axis=1)
        return peak + np.log(np.sum(np.exp(exponents - peak[:, None]), axis=1))

    def tail_bounds(self, num_steps: int, log_tail: float) -> tuple[float, float]:
        """``(below, above)``: ``P(-S > below)`` and ``P(S > above)`` are at most ``exp(log_tail)`` for the sum
        ``S`` of ``num_steps`` losses (Chernoff; each side's lam from 16 log-spaced lams, then twice 8
        between the best one's neighbours; both sides in the same passes)."""
        signs = np.array([[1.0], [-1.0]])

        def bound(lams: np.ndarray) -> np.ndarray:  # rows: the lams of each side
            signed = (signs * lams).ravel()
            exponents = signed[:, None] * self._loss + self._log_p
            peak = exponents.max(axis=1)
            log_mgf = peak + np.log(np.sum(np.exp(exponents - peak[:, None]), axis=1))
            return ((num_steps * log_mgf).reshape(lams.shape) - log_tail) / lams

        lams = np.tile(1e-4 * (self.lam_max / 1e-4) ** (np.arange(16.0) / 15.0), (2, 1))
        values = bound(lams)
        best = np.argmin(values, axis=1)
        best_lam, best_value = lams[[0, 1], best], values[[0, 1], best]
        ratio = (self.lam_max / 1e-4) ** (1.0 / 15.0)
        for _ in range(2):
            lams = np.clip(best_lam[:, None] * ratio ** np.linspace(-1.0, 1.0, 10)[1:-1], 1e-4, self.lam_max)
            values = bound(lams)
            i = np.argmin(values, axis=1)
            better = values[[0, 1], i] < best_value
            best_lam = np.where(better, lams[[0, 1], i], best_lam)
            best_value = np.where(better, values[[0, 1], i], best_value)
            ratio **= 2.0 / 9.0
        return float(best_value[1]), float(best_value[0])


class _Plan(NamedTuple):
    """Windows of one step and of the composition of ``max_steps`` steps (the latter for planning)."""

    one_step: _Window
    composed: _Window
    mgf: _LossMGF
    max_steps: int
    log_tail: float


def _plan(relation: Relation, sigma: float, q: float, max_steps: int, delta_scale: float) -> _Plan:
    """Windows that lose at most ``_WRAP_FRACTION * delta_scale / 2`` of the mass on each side."""
    log_tail = math.log(_WRAP_FRACTION * delta_scale / 2.0)
    one_step = _one_step_window(relation, sigma, q, math.exp(log_tail) / max_steps)
    mgf = _LossMGF(relation, sigma, q)
    chernoff = _Window(*mgf.tail_bounds(max_steps, log_tail))
    # The composed loss lies within T times one step's window; Chernoff is tighter for large T.
    composed = _Window(*(min(max_steps * a, max(c, a)) for a, c in zip(one_step, chernoff)))
    return _Plan(one_step, composed, mgf, max_steps, log_tail)


# ---------------------------------------------------------------------------------------------
# A single step, exactly: delta(eps) = P(t > t*) - e^eps Q(t > t*) with l(t*) = eps.


def _single_step_log_delta(relation: Relation, sigma: float, q: float, eps: float) -> float:
    """log delta(eps) of one step, eps >= 0, from Gaussian tails in log space (any eps, any sigma)."""
    t = float(_inverse_loss(relation, sigma, q, np.array(eps)))
    log_q, log_ndtr = math.log(q), scipy.special.log_ndtr
    pos = log_q + float(log_ndtr((1.0 - t) / sigma))  # q P_1(t > t*): the mass that only P has
    if relation is Relation.ADD_REMOVE:
        # e^eps Q(t > t*) - (1-q) P_0(t > t*) = (e^eps - 1 + q) Phi(-t*/sigma)
        log_scale = eps + math.log1p(-(1.0 - q) * math.exp(-eps))
        neg = log_scale + float(log_ndtr(-t / sigma))
    else:
        # (e^eps - 1)(1-q) Phi(-t*/sigma) + e^eps q Phi(-(t*+1)/sigma)
        first = eps + math.log(-math.expm1(-eps)) + math.log1p(-q) if eps > 0.0 and q < 1.0 else -math.inf
        neg = np.logaddexp(first + float(log_ndtr(-t / sigma)), eps + log_q + float(log_ndtr(-(t + 1.0) / sigma)))
    if neg >= pos:
        return -math.inf
    return pos + math.log(-math.expm1(neg - pos))


def _log_delta_to_epsilon(log_delta: Callable[[float], float], target_delta: float) -> float:
    """Smallest eps >= 0 with delta(eps) <= target_delta, for a decreasing log delta(eps)."""
    log_target = math.log(target_delta)
    if log_delta(0.0) <= log_target:
        return 0.0
    hi = 1.0
    while log_delta(hi) > log_target:
        hi *= 2.0
    f = lambda e: max(log_delta(e), -1e4) - log_target
    eps = _brentq(f, 0.0 if hi == 1.0 else hi / 2.0, hi, xtol=1e-15, rtol=1e-15)
    step = 1e-15
    while f(eps) > 0.0:  # the root's upper side, where delta <= target
        eps, step = eps + max(eps, 1e-12) * step, 2.0 * step
    return eps


def _single_step_epsilon(relation: Relation, sigma: float, q: float, target_delta: float) -> float:
    if q == 1.0:
        return _gaussian_epsilon(_full_batch_mu(relation, sigma, 1), target_delta)
    return _log_delta_to_epsilon(lambda e: _single_step_log_delta(relation, sigma, q, e), target_delta)


# ---------------------------------------------------------------------------------------------
# The Fourier path.


class _Lattice(NamedTuple):
    """Probabilities ``pmf[i]`` of the loss ``(lo + i) h``."""

    pmf: np.ndarray
    lo: int
    h: float

    @property
    def hi(self) -> int:
        return self.lo + self.pmf.size - 1

    @classmethod
    def from_fft_order(cls, values: np.ndarray, n_neg: int, h: float) -> "_Lattice":
        return cls(np.concatenate([values[values.size - n_neg :], values[: values.size - n_neg]]), -n_neg, h)

    def in_fft_order(self, nx: int) -> np.ndarray:
        """Length-``nx`` array with the probability of ``i h`` at ``i mod nx`` (the support must fit)."""
        out = np.zeros(nx)
        start = self.lo % nx
        first = min(self.pmf.size, nx - start)  # (up to the end of the array, the rest from its start)
        out[start : start + first] = self.pmf[:first]
        out[: self.pmf.size - first] = self.pmf[first:]
        return out

    def log_mgf(self, lam: float) -> float:
        """log E[exp(lam X)]."""
        support = np.flatnonzero(self.pmf > 0.0)
        exponents = np.log(self.pmf[support]) + lam * (self.lo + support) * self.h
        peak = float(exponents.max())
        return peak + math.log(float(np.sum(np.exp(exponents - peak))))

    def folded(self, lo: int) -> "_Lattice":
        """The loss below ``lo h`` rounded up to it (pessimistic)."""
        if self.lo >= lo:
            return self
        cut = lo - self.lo
        pmf = self.pmf[cut:].copy()
        pmf[0] += np.sum(self.pmf[:cut])
        return _Lattice(pmf, lo, self.h)

    def coarsened(self, k: int) -> "_Lattice":
        """Connect the dots onto the grid of step ``k h``: P- and Q-probabilities kept, pessimistic.

        (Negative rounding noise of an FFT is dropped: added mass only raises delta.)
        """
        lo = self.lo // k
        start = self.lo - lo * k
        cells = np.zeros(-(-(start + self.pmf.size) // k) * k)
        cells[start : start + self.pmf.size] = np.maximum(self.pmf, 0.0)
        cells = cells.reshape(-1, k)  # row g: the points g k + j, j < k, between g k h and (g+1) k h
        up = -np.expm1(-np.arange(k) * self.h) / -math.expm1(-k * self.h)  # share that goes to (g+1) k h
        w1 = cells @ up
        pmf = np.zeros(cells.shape[0] + 1)
        pmf[:-1] = cells.sum(axis=1) - w1
        pmf[1:] += w1
        return _Lattice(pmf, lo, k * self.h)


def _chernoff_windows(unit: _Lattice, units: int, log_tail: float, newton: bool = False) -> tuple[float, float, float]:
    """``(above, lam, below)``: the sum of ``units`` draws of ``unit`` exceeds ``above`` (falls below
    ``-below``) with probability at most ``exp(log_tail)``; ``lam`` is the Chernoff parameter of ``above``.

    The log-MGF is evaluated on a copy of the lattice coarsened to at most 1024 cells (connecting the
    dots raises E[exp(lam X)] for lam > 0: the upper bound stays valid). ``newton``: the lams from
    :func:`_newton_chernoff` (fewer evaluations) instead of :func:`_point_chernoff`'s sweeps.
    """
    factor = 2 ** max(0, math.ceil(math.log2(unit.pmf.size / 1024)))
    small = unit.coarsened(factor) if factor > 1 else unit
    support = np.flatnonzero(small.pmf > 0.0)
    if newton:
        return _newton_chernoff((small.lo + support) * small.h, small.pmf[support], units, log_tail, small.h)[:3]
    return _point_chernoff((small.lo + support) * small.h, small.pmf[support], units, log_tail, small.h)


_LAM_SWEEP = 2.0 ** np.arange(-6.0, 7.0)  # _point_chernoff's coarse sweep, relative to the Gaussian lam
_LAM_SWEEP_WIDE = 10.0 ** np.linspace(-2.0, 3.0, 11)
_LAM_FINE = np.arange(1.0, 7.0) / 7.0  # its fine sweep: 6 lams between two of the coarse ones


def _point_chernoff(
    x: np.ndarray, p: np.ndarray, units: int, log_tail: float, std_floor: float = 1e-12, wide: bool = False
) -> tuple[float, float, float]:
    """:func:`_chernoff_windows` of the (sub-)probabilities ``p > 0`` at the losses ``x``, evaluated on
    lams around the one that is optimal for a Gaussian of the same variance: a coarse sweep, then a
    finer one between the neighbours of its best lam (every lam gives a valid bound)."""
    mean = float(np.sum(p * x) / np.sum(p))
    std = max(math.sqrt(float(np.sum(p * (x - mean) ** 2) / np.sum(p))), std_floor)
    base = math.sqrt(2.0 * abs(log_tail) / units) / std
    lams = base * _LAM_SWEEP
    if wide:  # heavy tails: the best lam may be far below the Gaussian one
        lams = np.unique(np.concatenate([lams, _LAM_SWEEP_WIDE]))
    log_p = np.log(p)

    def windows(sign: float, lam: np.ndarray) -> np.ndarray:
        exponents = log_p + sign * lam[:, None] * x
        peak = exponents.max(axis=1)
        return (units * (peak + np.log(np.sum(np.exp(exponents - peak[:, None]), axis=1))) - log_tail) / lam

    best = []
    for sign in (1.0, -1.0):
        coarse = windows(sign, lams)
        i = int(np.argmin(coarse))
        low, high = lams[max(i - 1, 0)], lams[min(i + 1, lams.size - 1)]
        fine_lams = low * (high / low) ** _LAM_FINE  # (np.geomspace costs more than the windows here)
        fine = windows(sign, fine_lams)
        j = int(np.argmin(fine))
        best.append((float(fine[j]), float(fine_lams[j])) if fine[j] < coarse[i] else (float(coarse[i]), float(lams[i])))
    return best[0][0], best[0][1], best[1][0]


def _newton_chernoff(
    x: np.ndarray, p: np.ndarray, units: int, log_tail: float, std_floor: float = 1e-12, wide: bool = False
) -> tuple[float, float, float, float]:
    """:func:`_point_chernoff` with each side's lam from Newton's method, and the log-MGF at the lam
    of ``above``: ``(above, lam, below, log E[exp(lam X)])``.

    With ``K`` the log-MGF of ``s X`` (``s = +-1``), the window ``g(lam) = (units K(lam) - log_tail) / lam``
    has ``lam^2 g'(lam) = units h(lam)``, ``h = lam K' - K + log_tail / units``, and ``h`` increases
    (``h' = lam K'' >= 0``): ``g`` falls to the root of ``h`` and rises beyond it. Newton's method on
    ``h`` in ``log lam`` (safeguarded by bisection, within :func:`_point_chernoff`'s range of lams, to
    1% in lam where Newton's steps do not settle first) finds it in a few evaluations of ``K``, ``K'``
    and ``K''`` (one pass of exponentials each), where the sweeps take about 20 (and their best lam is
    only known within about 20%). Every lam gives a valid bound; the best evaluated one is returned.
    """
    total = float(p.sum())
    mean = float(p @ x) / total
    std = max(math.sqrt(float(p @ ((x - mean) ** 2)) / total), std_floor)
    base = math.sqrt(2.0 * abs(log_tail) / units) / std
    lam_lo, lam_hi = base * _LAM_SWEEP[0], base * _LAM_SWEEP[-1]
    if wide:
        lam_lo, lam_hi = min(lam_lo, _LAM_SWEEP_WIDE[0]), max(lam_hi, _LAM_SWEEP_WIDE[-1])
    u_min, u_max = math.log(lam_lo), math.log(lam_hi)
    log_p = np.log(p)
    shift = log_tail / units
    exponents = np.empty_like(x)
    best = []
    for sign in (1.0, -1.0):
        y = x if sign > 0.0 else -x
        a, b = u_min, u_max  # the root of h in log lam lies in [a, b]
        u = min(max(math.log(base), u_min), u_max)
        found = (math.inf, 0.0, 0.0)  # (window, lam, K)
        bottom, top = math.inf, -math.inf  # the lowest and highest log lam evaluated
        for _ in range(60):
            lam = math.exp(u)
            np.multiply(y, lam, out=exponents)
            exponents += log_p
            peak = float(exponents.max())
            exponents -= peak
            w = np.exp(exponents, out=exponents)
            s0 = float(w.sum())
            m1 = float(w @ y) / s0
            log_mgf = peak + math.log(s0)
            window = (units * log_mgf - log_tail) / lam
            if window < found[0]:
                found = (window, lam, log_mgf)
            h = lam * m1 - log_mgf + shift
            if h < 0.0:
                a = u
            else:
                b = u
            if (h < 0.0 and u >= u_max) or (h >= 0.0 and u <= u_min) or b - a <= 1e-2:
                break  # at an end of the range, or lam known within 1%
            d = y - m1
            slope = lam * lam * float(w @ (d * d)) / s0  # dh / dlog lam = lam^2 K''
            new = min(max(u - h / slope, u - 2.0), u + 2.0) if slope > 0.0 else math.nan
            if not a < new < b:  # (also nan) an end of the range not evaluated yet, else bisection
                if h < 0.0 and b == u_max > top:
                    new = u_max
                elif h >= 0.0 and a == u_min < bottom:
                    new = u_min
                else:
                    new = 0.5 * (a + b)
            bottom, top = min(bottom, u), max(top, u)
            if abs(new - u) <= 1e-3:  # (the window is then within ~1e-6 of its least)
                break
            u = new
        best.append(found)
    return best[0][0], best[0][1], best[1][0], best[0][2]


def _power(spectrum: np.ndarray, n: int) -> np.ndarray:
    """``spectrum ** n`` by repeated squaring: a few complex products, much faster than ``exp(n log F)``
    (a complex log costs as much as hundreds of products) or NumPy's complex integer powers."""
    result, base = None, spectrum
    while n:
        if n & 1:
            result = base if result is None else result * base
        n >>= 1
        if n:
            base = base * base
    return np.ones_like(spectrum) if result is None else result


class _Composer:
    """Compositions of a lattice PLD by FFT on a circular grid of ``nx`` points, FFT order.

    The window holds up to ``max_units`` compositions but for ``exp(log_tail)`` on each side (Chernoff
    bounds), and at least ``min_neg`` and ``min_pos`` points on each side; what wraps around the upper
    end is bounded by :meth:`wrapped`, what wraps around the lower end lands among the largest losses
    (pessimistic).
    """

    def __init__(
        self,
        unit: _Lattice,
        max_units: int,
        log_tail: float,
        min_pos: int = 0,
        min_neg: int = 0,
        align: int = 1,
        newton: bool = False,
    ):
        h = unit.h
        above, self.lam, below = _chernoff_windows(unit, max_units, log_tail, newton)
        above, below = min(max_units * unit.hi * h, above), min(-max_units * unit.lo * h, below)
        if above > _MAX_WINDOW:
            raise _OutOfWindow(f"the composed privacy loss needs a window up to {above:.0f}")
        self.log_mgf = unit.log_mgf(self.lam)
        # The unit itself must fit (its lowest values would otherwise collide with the highest).
        self.n_neg = max(math.ceil(max(below, 0.0) / h), -unit.lo, min_neg) + 1
        n_pos = max(math.floor(above / h), unit.hi, min_pos) + 2
        if align > 1:  # (see aliased_run(): one more cell of `align` points below the window)
            self.n_neg = -(-(self.n_neg + align) // align) * align
            self.nx = align * scipy.fft.next_fast_len(-(-(self.n_neg + n_pos) // align), real=True)
        else:
            self.nx = scipy.fft.next_fast_len(self.n_neg + n_pos, real=True)
        if self.nx > _MAX_NX:
            raise _Untrusted(f"a grid step of {h:.2g} exceeds the grid budget")
        self.n_pos = self.nx - self.n_neg
        self.h, self.unit_hi = h, unit.hi
        self.spectrum = self.transform(unit)

    def transform(self, lattice: _Lattice) -> np.ndarray:
        return scipy.fft.rfft(lattice.folded(1 - self.n_neg).in_fft_order(self.nx), workers=-1)

    def composed(self, units: int, spectrum: np.ndarray | None = None) -> np.ndarray:
        """``units`` compositions (times the transform ``spectrum``), FFT order."""
        power = _power(self.spectrum, units)
        return scipy.fft.irfft(power if spectrum is None else power * spectrum, n=self.nx, workers=-1)

    def coarsening_spectrum(self, k: int) -> np.ndarray:
        """Transform of the kernel that, sampled at multiples of ``k``, connects the dots onto the grid of
        step ``k h`` (as :meth:`_Lattice.coarsened`): point ``g k + j`` gives ``up_j`` to ``g + 1``, the rest to ``g``."""
        up = -np.expm1(-np.arange(k) * self.h) / -math.expm1(-k * self.h)
        kernel = np.zeros(self.nx)
        kernel[(-np.arange(k)) % self.nx] = 1.0 - up
        kernel[k - np.arange(1, k)] = up[1:]
        return scipy.fft.rfft(kernel, workers=-1)

    def aliased_run(self, first: int, count: int, kernel: np.ndarray, k: int) -> list[_Lattice]:
        """``first``, ..., ``first + count - 1`` compositions connected onto the grid of step ``k h`` in the
        frequency domain (``kernel``: :meth:`coarsening_spectrum`; ``nx`` and ``n_neg`` multiples of ``k``):
        the sum of the ``k`` aliases of each spectrum is the transform of the coarse points on a circle of
        ``nx / k``, so no transform of the fine circle is inverted. That circle joins the top cell's share
        of its upper end to the lowest point: the whole lowest point is put at the upper end (its own mass
        lies beyond the window, ``n_neg`` having a cell to spare, and moving loss up is pessimistic).
        Lattices with their FFT rounding noise (negative values) kept."""
        m, half = self.nx // k, self.nx // 2
        c_neg = self.n_neg // k
        spectrum, out = _power(self.spectrum, first) * kernel, []
        for j in range(count):
            if k == 1:
                folded = spectrum
            else:
                # Aliases mu + a m: a < k/2 from the stored half spectrum, the others as conjugates.
                low = spectrum[:half].reshape(k // 2, m).sum(axis=0)[: m // 2 + 1]
                high = spectrum[1 : half + 1].reshape(k // 2, m).sum(axis=0)[::-1][: m // 2 + 1]
                folded = (low + np.conj(high)) / k
            coarse = scipy.fft.irfft(folded, n=m, workers=-1)
            pmf = np.concatenate([coarse[m - c_neg + 1 :], coarse[: m - c_neg], coarse[m - c_neg : m - c_neg + 1]])
            out.append(_Lattice(pmf, 1 - c_neg, k * self.h))
            if j + 1 < count:
                spectrum = spectrum * self.spectrum
        return out

    def wrapped(self, units: int, extra_log_mgf: float = 0.0, extra_hi: int = 0) -> float:
        """Bound on the mass that the upper end of ``units`` compositions (with a lattice of the given
        log-MGF at ``lam`` and top index) wraps around: it appears at a wrong place, counted in delta."""
        if units * self.unit_hi + extra_hi < self.n_pos:
            return 0.0
        return math.exp(units * self.log_mgf + extra_log_mgf - self.lam * self.n_pos * self.h)


@functools.lru_cache(maxsize=64)
def _block_size(max_steps: int, size: float | None = None) -> tuple[int, int]:
    """(B, k): compose blocks of B steps on the fine grid, the blocks on a grid k times coarser.

    The pessimistic discretisation adds at most ``dx^2 / 4`` to the variance of each composed unit,
    relative to its own variance: k ~ sqrt(B) makes that about equal on both grids, and B ~ sqrt(T)
    the sizes of both grids. B divides T where it can, which saves composing the remainder.
    (1, 1): one grid.
    """
    if max_steps < 512:
        return 1, 1
    root = math.sqrt(max_steps) if size is None else size
    divisors = [b for b in range(math.ceil(root / 2), math.floor(2 * root) + 1) if max_steps % b == 0]
    block = min(divisors, key=lambda b: abs(math.log(b / root))) if divisors else 2 ** round(math.log2(root))
    return block, 2 ** round(math.log2(math.sqrt(block)))


class _FourierPLD:
    """One step's discretised PLD, composed by FFT for up to ``plan.max_steps`` steps.

    Few steps are composed on the grid of step ``dx``. Many steps are composed in blocks of ``B``
    steps there, each block re-discretised (connect the dots again) on a grid ``k`` times coarser,
    where the blocks and the remaining steps are composed: both stages keep the result pessimistic.
    """

    def __init__(self, relation: Relation, sigma: float, q: float, dx: float, plan: _Plan):
        j_lo, j_hi = -math.ceil(plan.one_step.below / dx), math.ceil(plan.one_step.above / dx)
        if j_hi - j_lo > _MAX_NX_ONE_STEP:
            raise _Untrusted(f"a grid step of {dx:.2g} exceeds the grid budget")
        pmf, self.beyond = _one_step_pmf(relation, sigma, q, dx, j_lo, j_hi)
        one = _Lattice(pmf, j_lo, dx)
        self.block, self.k = _block_size(plan.max_steps)
        if self.block == 1:
            self.fine = _Composer(one, plan.max_steps, plan.log_tail)
            return
        # The wrap budget: half for the fine grid (per block), half for the coarse one.
        max_blocks = plan.max_steps // self.block
        log_tail_fine = plan.log_tail - math.log(2.0 * (max_blocks + 1))
        self.fine = _Composer(one, self.block, log_tail_fine)
        self.block_wrapped = self.fine.wrapped(self.block)
        block = self._coarse(self.block)
        # Room for the coarsened remainders, which lie within the fine window.
        min_pos, min_neg = -(-self.fine.n_pos // self.k) + 1, -(-self.fine.n_neg // self.k) + 1
        self.coarse = _Composer(block, max_blocks + 1, plan.log_tail - math.log(2.0), min_pos, min_neg)

    def _coarse(self, num_steps: int) -> _Lattice:
        return _Lattice.from_fft_order(self.fine.composed(num_steps), self.fine.n_neg, self.fine.h).coarsened(self.k)

    def composed(self, num_steps: int) -> tuple[np.ndarray, np.ndarray, float]:
        """``(x, p, missing)``: probabilities ``p`` of the composed loss at the grid points ``x > 0`` (the
        part that enters delta), and a bound on the delta that the grid does not show (mass lost to
        infinity or wrapped around)."""
        missing = -math.expm1(num_steps * math.log1p(-self.beyond))
        if self.block == 1 or num_steps < self.block:
            grid, values = self.fine, self.fine.composed(num_steps)
            missing += grid.wrapped(num_steps)
        else:
            grid = self.coarse
            blocks, rest = divmod(num_steps, self.block)
            missing += blocks * self.block_wrapped
            if rest:
                remainder = self._coarse(rest).folded(1 - grid.n_neg)
                missing += self.fine.wrapped(rest) + grid.wrapped(blocks, remainder.log_mgf(grid.lam), remainder.hi)
                values = grid.composed(blocks, grid.transform(remainder))
            else:
                missing += grid.wrapped(blocks)
                values = grid.composed(blocks)
        return np.arange(1, grid.n_pos) * grid.h, values[1 : grid.n_pos], missing


class _SplitPLD:
    """One step's PLD as a narrow bulk on a fine grid and rare tails on a grid ``k`` times coarser.

    For small ``q`` one step's loss is a spike of width ~q near 0 next to rare values up to O(1): a
    single grid fine enough for the spike would span the rare values with millions of points. Here
    the cells within ``+-c h`` (``h = k dx``) are connected to the fine grid (the bulk ``b``), those
    beyond to multiples of ``h`` (the tails ``u``): a partition into cells like any other, so the
    discretised PLD ``b + u`` still dominates. ``m`` steps are ``sum_i C(m, i) b^{*(m-i)} * u^{*i}``;
    connecting the dots onto the multiples of ``h`` commutes with shifts by multiples of ``h``, so the
    coarsened composition is ``sum_i C(m, i) coarse(b^{*(m-i)}) * u^{*i}``: the bulk is composed on a
    fine grid that spans only its own narrow range, the tails on the coarse grid. Terms with more
    than ``K`` tail events (a binomial tail) count as infinite loss. Blocks of ``B`` steps are then
    composed on the coarse grid as in :class:`_FourierPLD`.

    With ``eps_bound`` (epsilons up to it only, :data:`_EPS_BOUND`), the far tails are connected on a
    coarser partition, every ``n / 512``-th of the window's ``n`` coarse points (any partition
    dominates: still an upper bound), where the sum of the other steps' losses takes a loss from there
    to ``eps_bound`` or below (upper tail), or to above 0 (lower tail), only in runs of probability
    below ``exp(_SPLIT_THIN_LOG_SHARE)`` times the wrap budget (:func:`_thin_from`, with the
    discretisation's shifts as a margin). In all other runs the composed mass from those cells lies
    wholly above (below) every epsilon asked for, where delta depends only on its P- and Q-masses,
    which connecting the dots keeps: the epsilons are those of the full partition up to ~1e-10.
    ``eps_bound`` is kept as an attribute where that happened (else None): an epsilon above it must
    come from a grid without it.
    """

    def __init__(
        self, relation: Relation, sigma: float, q: float, dx: float, plan: _Plan, eps_bound: float | None = None
    ):
        max_steps = plan.max_steps
        self.block, k = _split_scales(max_steps, q)
        # k is set on the first grid of the refinement, so that halving dx halves h as well. Small
        # blocks: at most about _SPLIT_COARSE_POINTS coarse points on that grid (large blocks: the
        # balance of _split_scales; a larger k would spend the points on the bulk's grid).
        width = plan.composed.above + plan.composed.below
        if self.block < 512:
            k = max(k, 2 ** max(0, math.ceil(math.log2(width / (_initial_dx(plan) * _SPLIT_COARSE_POINTS)))))
        # Grids finer than _SPLIT_FINE_LEVELS halvings of the initial step refine only the coarse grid
        # (h halves, k with it): the bulk is resolved far below its spread by then (the variance that
        # connecting the dots adds to it is below 1e-4 of its own), and its grid spans B steps.
        floor = _initial_dx(plan) * 2.0**-_SPLIT_FINE_LEVELS
        if dx < floor and k > 1:
            m = min(k, 2 ** round(math.log2(floor / dx)))
            dx, k = dx * m, k // m
        self.k, self.h, self.dx = k, k * dx, dx
        j_lo, j_hi = -math.ceil(plan.one_step.below / dx), math.ceil(plan.one_step.above / dx)
        g_lo, g_hi = math.floor(j_lo / k), math.ceil(j_hi / k)
        max_blocks = max_steps // self.block
        # Each bound below gets a share of the wrap budget, per block.
        log_budget = plan.log_tail - math.log(4.0 * (max_blocks + 1))
        half = _SPLIT_BULK_STDS * plan.mgf.std
        # The thinned tails: coarse indices from thin_up up, from -thin_low down, every `thin_step`-th.
        thin_up = thin_low = math.inf
        self.eps_bound = None
        if eps_bound is not None and g_hi - g_lo > _SPLIT_THIN_MIN:
            # (the discretisation moves each step's loss by less than a cell: dx in the bulk, h in the
            # tails and per coarsened block; and the thinned cell itself by its width)
            thin_step = max(1, (g_hi - g_lo) // _SPLIT_THIN_POINTS)
            margin = (max_steps - 1) * dx + (max_blocks + 2) * self.h + (thin_step + 1) * self.h
            # (a side without tail cells beyond the bulk's first half-width has nothing to thin)
            reach = _SPLIT_BULK_STDS * plan.mgf.std + (thin_step + 1) * self.h
            up = low = math.inf
            if plan.one_step.above > reach:
                up = _thin_from(relation, sigma, q, plan, plan.one_step.above, eps_bound + margin, 1.0)
            if plan.one_step.below > reach:
                low = _thin_from(relation, sigma, q, plan, plan.one_step.below, margin, -1.0)
            thin_up, thin_low = (math.ceil(v / self.h) if math.isfinite(v) else math.inf for v in (up, low))
            if thin_up < g_hi - thin_step or thin_low < -g_lo - thin_step:
                self.eps_bound = eps_bound
        while True:
            c = max(1, math.ceil(half / self.h))  # the bulk: |j| <= c k
            if self.eps_bound is None:
                lower_g, upper_g = np.arange(g_lo, -c), np.arange(c + 1, g_hi + 1)
            else:
                lower_g = -_tail_indices(c + 1, -g_lo, thin_low, thin_step)[::-1]
                upper_g = _tail_indices(c + 1, g_hi, thin_up, thin_step)
            lower, upper = lower_g * k, upper_g * k
            f_lo, f_hi = max(j_lo, -c * k), min(j_hi, c * k)
            if f_hi - f_lo > _MAX_NX_ONE_STEP:
                raise _Untrusted(f"a grid step of {dx:.2g} exceeds the grid budget")
            points = np.concatenate([lower, np.arange(f_lo, f_hi + 1), upper])
            pmf, self.beyond = _one_step_cells(relation, sigma, q, dx, points)
            bulk = pmf[lower.size : lower.size + f_hi - f_lo + 1]
            tail_points = np.concatenate([lower_g, upper_g])
            tail = np.concatenate([pmf[: lower.size], pmf[lower.size + bulk.size :]])
            self.p_bulk, self.p_tail = float(np.sum(bulk)), float(np.sum(tail))
            if self.p_tail <= 0.0:
                self.terms = 0
                break
            # The mass of blocks with more than K tail events: (p_bulk + p_tail)^B bdtrc(K, B, r).
            total = self.p_bulk + self.p_tail
            dropped = total**self.block * scipy.special.bdtrc(np.arange(_SPLIT_MAX_TERMS + 1), self.block, self.p_tail / total)
            enough = np.flatnonzero(dropped <= math.exp(log_budget))
            if enough.size:
                self.terms = int(enough[0])
                break
            half *= 2.0  # a wider bulk leaves fewer tail events
        self.fine = _Composer(_Lattice(bulk / self.p_bulk, f_lo, dx), self.block, log_budget, align=k, newton=True)
        self.kernel = self.fine.coarsening_spectrum(k)
        # The circle of one block on the coarse grid: the Chernoff window of B steps of b + u (coarsening
        # moves loss up by less than h), the coarsened fine circle and one step's tails. The Chernoff
        # bound uses copies of both parts connected to at most 256 cells each: connecting the dots
        # raises E[exp(lam X)] for lam > 0, so the bound stays valid.
        parts = [_Lattice(bulk, f_lo, dx)]
        if self.p_tail > 0.0:
            dense_tail = np.zeros(int(tail_points.max() - tail_points.min()) + 1)
            dense_tail[tail_points - tail_points.min()] = tail  # (distinct points)
            parts.append(_Lattice(dense_tail, int(tail_points.min()), self.h))
        x_up, p_up = [], []
        for part in parts:
            factor = 2 ** max(0, math.ceil(math.log2(part.pmf.size / 256)))
            small = part.coarsened(factor) if factor > 1 else part
            support = np.flatnonzero(small.pmf > 0.0)
            x_up.append((small.lo + support) * small.h)
            p_up.append(small.pmf[support])
        x_up, p_up = np.concatenate(x_up), np.concatenate(p_up)
        above, self.lam, below, self.log_mgf = _newton_chernoff(x_up, p_up, self.block, log_budget, wide=True)
        if above > _MAX_WINDOW:
            raise _OutOfWindow(f"the composed privacy loss needs a window up to {above:.0f}")
        self.n_neg = max(math.ceil(max(below, 0.0) / self.h), -(-self.fine.n_neg // k), -g_lo) + 2
        n_pos = max(math.ceil(max(above, 0.0) / self.h) + 2, -(-self.fine.n_pos // k) + 2, g_hi + 2)
        self.nx = scipy.fft.next_fast_len(self.n_neg + n_pos, real=True)
        if self.nx > _MAX_NX:
            raise _Untrusted(f"a grid step of {self.h:.2g} exceeds the grid budget")
        self.n_pos = self.nx - self.n_neg
        if self.terms:
            tail_circle = np.zeros(self.nx)
            tail_circle[tail_points % self.nx] = tail / self.p_tail  # (distinct: the circle holds g_lo..g_hi)
            self.tail_spectrum = scipy.fft.rfft(tail_circle, workers=-1)
        self._blocks: dict[int, tuple[_Lattice, float]] = {}
        if max_steps > self.block:
            block = self._composed_block(self.block)[0]
            self.coarse = _Composer(
                block, max_blocks + 1, plan.log_tail - math.log(2.0), self.n_pos, self.n_neg, newton=True
            )

    def _composed_block(self, num_steps: int) -> tuple[_Lattice, float]:
        """``num_steps <= B`` steps on the coarse grid, and a bound on the mass that it misses."""
        if num_steps in self._blocks:
            return self._blocks[num_steps]
        terms = min(self.terms, num_steps)
        spectrum = np.zeros(self.nx // 2 + 1, dtype=complex)
        missing = 0.0
        # num_steps - terms, ..., num_steps steps of the bulk, coarsened
        bulk_run = self.fine.aliased_run(num_steps - terms, terms + 1, self.kernel, self.k)
        tail_power = None
        for i in range(terms + 1):
            log_weight = (
                float(scipy.special.gammaln(num_steps + 1) - scipy.special.gammaln(i + 1) - scipy.special.gammaln(num_steps - i + 1))
                + (num_steps - i) * math.log(self.p_bulk)
                + (i * math.log(self.p_tail) if i else 0.0)
            )
            weight = math.exp(log_weight)
            bulk = bulk_run[terms - i]
            missing += weight * _rounding_noise(bulk.pmf)  # dropped below
            bulk = _Lattice(np.maximum(bulk.pmf, 0.0), bulk.lo, bulk.h)
            term = scipy.fft.rfft(bulk.in_fft_order(self.nx), workers=-1)
            if i:
                tail_power = self.tail_spectrum if i == 1 else tail_power * self.tail_spectrum
            spectrum += weight * (term if i == 0 else term * tail_power)
            missing += weight * self.fine.wrapped(num_steps - i)
        if self.terms and num_steps > terms:
            total = self.p_bulk + self.p_tail
            missing += total**num_steps * float(scipy.special.bdtrc(terms, num_steps, self.p_tail / total))
        # What the circle wraps around its upper end (the lower end wraps onto the largest losses):
        # coarsening moves loss up by less than h, so Chernoff at (n_pos - 1) h bounds it.
        missing += math.exp(num_steps * self.log_mgf - self.lam * (self.n_pos - 1) * self.h)
        values = scipy.fft.irfft(spectrum, n=self.nx, workers=-1)
        missing += _rounding_noise(values)
        result = (_Lattice.from_fft_order(np.maximum(values, 0.0), self.n_neg, self.h), missing)
        self._blocks[num_steps] = result
        return result

    def composed(self, num_steps: int) -> tuple[np.ndarray, np.ndarray, float]:
        """As :meth:`_FourierPLD.composed`."""
        missing = -math.expm1(num_steps * math.log1p(-self.beyond))
        if num_steps <= self.block:
            block, block_missing = self._composed_block(num_steps)
            return np.arange(1, block.hi + 1) * self.h, block.pmf[1 - block.lo :], missing + block_missing
        grid = self.coarse
        blocks, rest = divmod(num_steps, self.block)
        missing += blocks * self._composed_block(self.block)[1]
        if rest:
            remainder, rest_missing = self._composed_block(rest)
            remainder = remainder.folded(1 - grid.n_neg)
            missing += rest_missing + grid.wrapped(blocks, remainder.log_mgf(grid.lam), remainder.hi)
            values = grid.composed(blocks, grid.transform(remainder))
        else:
            missing += grid.wrapped(blocks)
            values = grid.composed(blocks)
        return np.arange(1, grid.n_pos) * grid.h, values[1 : grid.n_pos], missing


def _tail_indices(first: int, last: int, thin_from: float, step: int) -> np.ndarray:
    """``first, ..., last``: every one below ``thin_from``, every ``step``-th from there, ``last`` kept."""
    if last < first:
        return np.zeros(0, dtype=np.int64)
    if step <= 1 or thin_from >= last:
        return np.arange(first, last + 1)
    thin_from = max(int(thin_from), first)
    out = np.concatenate([np.arange(first, thin_from), np.arange(thin_from, last + 1, step)])
    return out if out[-1] == last else np.append(out, last)


_THIN_LAMS = np.geomspace(1e-2, 1e6, 25)  # lams of the Chernoff bounds of _rest_tails


@functools.lru_cache(maxsize=64)
def _rest_tails(relation: Relation, sigma: float, q: float, max_steps: int, jump: float) -> tuple:
    """Bounds on the tails of the sum ``Y`` of ``r = max_steps - 1`` steps' (exact) losses ``L_i``, split
    into jumps ``J_i = L_i 1{|L_i| > jump}`` and the rest ``B_i``: ``(log_two, lower, upper)`` such that

    ``P(Y < -y) <= r P(L < -y/2) + exp(log_two) + min(exp(lower - lam y / 2))`` and
    ``P(Y > y) <= r P(L > y/2) + exp(log_two) + min(exp(upper - lam y / 2))`` (lams :data:`_THIN_LAMS`):

    ``Y < -y`` needs ``sum J < -y/2`` (one jump below ``-y/2``, or two jumps: ``exp(log_two)`` bounds
    that) or ``sum B < -y/2`` (Chernoff: the MGF of ``B`` bounded above by an upper sum over cells of
    the output t, whose probabilities are exact, as the loss increases in t).
    """
    rest = max(max_steps - 1, 1)
    # t where |L| <= jump: [t(-jump), t(jump)] (add/remove: from well below 0, its loss >= log(1 - q))
    t_lo = float(_inverse_loss(relation, sigma, q, np.array(-jump)))
    t_hi = float(_inverse_loss(relation, sigma, q, np.array(jump)))
    if not math.isfinite(t_lo):
        t_lo = -40.0 * sigma
    t = np.linspace(t_lo, t_hi, 257)
    cells0, below0, above0 = _gaussian_cells(0.0, sigma, t)
    cells1, below1, above1 = _gaussian_cells(1.0, sigma, t)
    p_jump = (1.0 - q) * (below0 + above0) + q * (below1 + above1)
    with np.errstate(divide="ignore"):
        log_cells = np.log((1.0 - q) * cells0 + q * cells1)
    loss = _privacy_loss(relation, sigma, q, t)
    lams = _THIN_LAMS[:, None]

    def log_mgf(exponents: np.ndarray) -> np.ndarray:  # log(P(jump) + sum exp(exponents)) per lam
        peak = np.maximum(exponents.max(axis=1), math.log(max(p_jump, 1e-300)))
        exponents -= peak[:, None]
        return peak + np.log(np.exp(exponents, out=exponents).sum(axis=1) + p_jump * np.exp(-peak))

    with np.errstate(invalid="ignore", over="ignore"):
        lower = rest * log_mgf(log_cells - lams * loss[:-1])  # E[exp(-lam B)]: loss at each cell's lower end
        upper = rest * log_mgf(log_cells + lams * loss[1:])  # E[exp(lam B)]: at its upper end
    jumps = rest * p_jump
    log_two = 2.0 * math.log(max(jumps, 1e-300)) - math.log(2.0 * (1.0 - jumps)) if jumps < 1.0 else 0.0
    return log_two, lower, upper


def _thin_from(
    relation: Relation, sigma: float, q: float, plan: _Plan, reach: float, shift: float, sign: float
) -> float:
    """The least ``a`` of 256 in ``(0, reach]`` with ``T P(sign L >= a) P(sign Y < shift - a) <= exp(log_tail +
    _SPLIT_THIN_LOG_SHARE)`` (``L``: one step's loss, ``Y``: the other steps' sum, :func:`_rest_tails`;
    ``T = plan.max_steps``); inf where none. Upper tail (``sign = 1``, ``shift`` = the largest epsilon plus
    a margin): the runs in which some step's loss lies above ``a`` and the sum of the others below
    ``shift - a`` have at most that probability, and in all other runs with such a step the sum lies
    above every epsilon asked for. Lower tail (``sign = -1``, ``shift`` = the margin): likewise below 0."""
    max_steps = plan.max_steps
    log_two, lower, upper = _rest_tails(relation, sigma, q, max_steps, _SPLIT_BULK_STDS * plan.mgf.std)
    a = np.linspace(0.0, reach, 257)[1:]
    y = a - shift  # sign Y < -y
    ok = y > 0.0
    if not np.any(ok):
        return math.inf
    a, y = a[ok], y[ok]

    def log_tail_of_loss(x: np.ndarray, upper_tail: bool) -> np.ndarray:  # log P(L >= x) or log P(L <= x)
        t = _inverse_loss(relation, sigma, q, x)
        s = -1.0 if upper_tail else 1.0
        with np.errstate(divide="ignore"):
            return np.logaddexp(
                math.log1p(-q) + scipy.special.log_ndtr(s * t / sigma),
                math.log(q) + scipy.special.log_ndtr(s * (t - 1.0) / sigma),
            )

    chernoff = ((lower if sign > 0.0 else upper)[:, None] - _THIN_LAMS[:, None] * (0.5 * y)).min(axis=0)
    one_jump = math.log(max(max_steps - 1, 1)) + log_tail_of_loss(-sign * 0.5 * y, sign < 0.0)
    log_rest = np.logaddexp(np.logaddexp(one_jump, log_two), chernoff)
    log_one = log_tail_of_loss(sign * a, sign > 0.0)
    good = np.flatnonzero(math.log(max_steps) + log_one + log_rest <= plan.log_tail + _SPLIT_THIN_LOG_SHARE)
    return float(a[good[0]]) if good.size else math.inf


def _split_scales(max_steps: int, q: float) -> tuple[int, int]:
    """(B, k) of :class:`_SplitPLD`: blocks of B steps, the coarse grid k times the fine one.

    Connecting the dots adds about ``dx^2 / 6`` to the variance of the composed loss per step on the
    fine grid, and about ``h^2 / 6`` per block coarsened onto the coarse one (T / B blocks), which is
    what the epsilon's excess follows. Blocks of about ``_SPLIT_BLOCK_QT / q`` steps (or all steps;
    at least ``sqrt(T)``) rarely hold more than a few tail events, so their expansion stays short,
    and few coarsenings let ``h`` be coarser for the same excess; ``k`` a little below ``sqrt(B)``
    balances the two errors (measured at q = 1e-5 and 1e-4: 2-4 times fewer points than B ~ sqrt(T)
    for the same excess). Below 512 steps: one block.
    """
    if max_steps < 512:
        return max_steps, 2 ** round(math.log2(math.sqrt(max_steps)))
    size = max(math.sqrt(max_steps), _SPLIT_BLOCK_QT / q)
    if size >= max_steps:
        return max_steps, 2 ** round(math.log2(math.sqrt(max_steps)) - 0.25)
    block = _block_size(max_steps, size)[0]
    return block, 2 ** round(math.log2(math.sqrt(block)) - 0.25)


def _make_pld(
    relation: Relation, sigma: float, q: float, dx: float, plan: _Plan, eps_bound: float | None = None
) -> "_FourierPLD | _SplitPLD":
    """The split grids where one step's window spans many standard deviations of its loss (small q)
    (``eps_bound``: see :class:`_SplitPLD`)."""
    if plan.max_steps > 1 and (plan.one_step.above + plan.one_step.below) > _SPLIT_MIN_STDS * plan.mgf.std:
        return _SplitPLD(relation, sigma, q, dx, plan, eps_bound)
    return _FourierPLD(relation, sigma, q, dx, plan)


def _epsilon_from_pmf(x_pos: np.ndarray, p_pos: np.ndarray, target_delta: float) -> float:
    """Smallest eps >= 0 with sum_{x > eps} (1 - exp(eps - x)) p(x) <= target_delta, exactly."""
    s0 = np.zeros(p_pos.size + 1)
    s1 = np.zeros(p_pos.size + 1)
    np.cumsum(p_pos[::-1], out=s0[-2::-1])
    np.cumsum((p_pos * np.exp(-x_pos))[::-1], out=s1[-2::-1])
    if s0[0] - s1[0] <= target_delta:
        return 0.0
    # delta(eps) = s0[j] - exp(eps) s1[j] on (x_{j-1}, x_j]; find the interval holding the root.
    delta_at_nodes = s0[1:] - np.exp(x_pos) * s1[1:]
    j = int(np.argmax(delta_at_nodes <= target_delta))
    if delta_at_nodes[j] > target_delta:
        raise _Untrusted("epsilon lies beyond the grid window")
    eps = math.log((s0[j] - target_delta) / s1[j]) if s1[j] > 0.0 else x_pos[j]
    return float(min(max(eps, x_pos[j - 1] if j > 0 else 0.0), x_pos[j]))


def _delta_from_pmf(x_pos: np.ndarray, p_pos: np.ndarray, eps: float) -> float:
    above = x_pos > eps
    return float(np.sum(-np.expm1(eps - x_pos[above]) * p_pos[above]))


def _rounding_noise(p: np.ndarray) -> float:
    """A bound on the delta that the FFT's rounding noise can hide: twice the negative mass (the noise
    is symmetric; the true probabilities are not negative)."""
    return -2.0 * float(np.sum(np.minimum(p, 0.0)))


def _pld_epsilon(pld: "_FourierPLD | _SplitPLD", num_steps: int, target_delta: float) -> float:
    """Epsilon of the discretised composition, with the delta that the grid misses taken off the target."""
    x, p, missing = pld.composed(num_steps)
    missing += _rounding_noise(p)
    if missing > 0.5 * target_delta:
        raise _Untrusted("too much probability mass beyond the grid window, or FFT rounding noise near delta")
    return _epsilon_from_pmf(x, p, target_delta - missing)


def _pld_delta(pld: "_FourierPLD | _SplitPLD", num_steps: int, eps: float) -> float:
    x, p, missing = pld.composed(num_steps)
    return _delta_from_pmf(x, p, eps) + missing + _rounding_noise(p)


def _initial_dx(plan: _Plan) -> float:
    """A grid step somewhat coarser than needed (a power of two); refinement halves it until results agree."""
    scale = min(plan.mgf.std * _DX_PER_STD, _DX_COARSEST)
    return 2.0 ** math.floor(math.log2(max(scale, 1e-300)))


def _fourier_values(
    plan: _Plan, level: Callable[[float], np.ndarray], atol: float, dx: float | None = None
) -> tuple[np.ndarray, float]:
    """``level(dx)`` on grids halved from ``dx`` until two successive ones agree: the finer values and step."""
    if plan.composed.above > _MAX_WINDOW:
        raise _OutOfWindow(f"the composed privacy loss needs a window up to {plan.composed.above:.0f}")
    dx = _initial_dx(plan) if dx is None else dx
    previous = None
    while True:
        values = level(dx)
        if previous is not None and np.all(np.abs(values - previous) <= _REFINE_RTOL * np.abs(values) + atol):
            return values, dx
        previous = values
        dx /= 2.0


# ---------------------------------------------------------------------------------------------
# Full batch (q = 1): the Gaussian mechanism, its loss N(mu^2/2, mu^2) with mu = sens sqrt(T) / sigma.


def _full_batch_mu(relation: Relation, sigma: float, num_steps: int) -> float:
    sensitivity = 1.0 if relation is Relation.ADD_REMOVE else 2.0
    return sensitivity * math.sqrt(num_steps) / sigma


def _gaussian_log_delta(mu: float, eps: float) -> float:
    """log delta(eps) = log(Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)), loss X ~ N(mu^2/2, mu^2)."""
    a = float(scipy.special.log_ndtr(mu / 2.0 - eps / mu))
    b = eps + float(scipy.special.log_ndtr(-mu / 2.0 - eps / mu))
    return a + math.log(-math.expm1(b - a)) if b < a else -math.inf


def _gaussian_delta(mu: float, eps: float) -> float:
    return math.exp(_gaussian_log_delta(mu, eps))


def _gaussian_epsilon(mu: float, target_delta: float) -> float:
    return _log_delta_to_epsilon(lambda e: _gaussian_log_delta(mu, e), target_delta)


# ---------------------------------------------------------------------------------------------
# dp-accounting fallback.


def _dp_accounting_values(
    relation: Relation, sigma: float, q: float, steps: np.ndarray, plan: _Plan, evaluate: Callable, atol: float
) -> np.ndarray:
    """``evaluate(pld)`` on dp-accounting's pessimistic PLD, its grid refined until the values settle.

    Pessimistic estimates are upper bounds that approach the true value as the grid is refined, so
    two successive values that agree to ``_DPA_RTOL`` bound the error of the finer one.
    """
    # Imported here: importing dp-accounting takes seconds.
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution

    if plan.composed.above > _MAX_DPA_WINDOW:  # dp-accounting's grid would need too many points
        raise AccountingError(
            f"no trustworthy value for sigma={sigma}, q={q}, num_steps={plan.max_steps}: the privacy loss "
            f"of the run has mean {plan.max_steps * plan.mgf.mean:.4g} (tails up to {plan.composed.above:.4g}), "
            "so epsilon is far beyond any meaningful guarantee, and tight accounting is limited to "
            f"privacy losses below {_MAX_DPA_WINDOW:g}"
        )

    neighbours = (
        NeighboringRelation.ADD_OR_REMOVE_ONE if relation is Relation.ADD_REMOVE else NeighboringRelation.REPLACE_ONE
    )
    previous = None
    for interval in _DPA_INTERVALS:
        try:
            one_step = privacy_loss_distribution.from_gaussian_mechanism(
                sigma, value_discretization_interval=interval, sampling_prob=q, neighboring_relation=neighbours
            )
            values = np.array([evaluate(one_step.self_compose(int(t))) for t in steps], dtype=float)
        except (OverflowError, ValueError, FloatingPointError, MemoryError) as err:
            raise AccountingError(
                f"no trustworthy value for sigma={sigma}, q={q}: the Fourier accountant could not be "
                f"verified and dp-accounting failed ({type(err).__name__}: {err})"
            ) from err
        if not np.all(np.isfinite(values)):
            break
        if previous is not None and np.all(np.abs(previous - values) <= _DPA_RTOL * np.abs(values) + atol):
            return values
        previous = values
    raise AccountingError(
        f"no trustworthy value for sigma={sigma}, q={q}, num_steps={steps.tolist()}: the Fourier "
        "accountant could not be verified within its grid budget and dp-accounting's PLD did not "
        f"settle down to a discretisation interval of {_DPA_INTERVALS[-1]:g}"
        + ("" if previous is None else f" (last values {previous.tolist()})")
    )


# ---------------------------------------------------------------------------------------------
# Public API.


@functools.lru_cache(maxsize=64)
def _cached_plan(relation: Relation, sigma: float, q: float, max_steps: int, delta_scale: float) -> _Plan:
    return _plan(relation, sigma, q, max_steps, delta_scale)


@functools.lru_cache(maxsize=256)
def _epsilon_level(
    relation: Relation, sigma: float, q: float, steps: tuple, target_delta: float, dx: float
) -> tuple[float, ...]:
    """Epsilons on the grid of step ``dx``: upper bounds, not yet checked by refinement (the same, up to
    rounding, whether the split grids' tails are thinned for epsilons up to :data:`_EPS_BOUND` or not)."""
    plan = _cached_plan(relation, sigma, q, max(steps), target_delta)
    pld = _make_pld(relation, sigma, q, dx, plan, _EPS_BOUND.get())
    values = tuple(_pld_epsilon(pld, t, target_delta) for t in steps)
    if getattr(pld, "eps_bound", None) is not None and max(values) > pld.eps_bound:
        pld = _make_pld(relation, sigma, q, dx, plan)  # (beyond the thinned grid's range)
        values = tuple(_pld_epsilon(pld, t, target_delta) for t in steps)
    return values


def _clear_caches() -> None:
    """Forget cached plans, grid levels and sigmas (for tests that change the module's budgets)."""
    for cached in (_cached_plan, _epsilon_level, _closed_form_sigma, _searched_sigma, _rest_tails):
        cached.cache_clear()


def _composed_epsilon(
    relation: Relation, sigma: float, q: float, steps: np.ndarray, target_delta: float
) -> tuple[np.ndarray, float | None]:
    """Checked epsilons for ``steps > 1``, ``q < 1``, and the grid step that gave them (None: dp-accounting)."""
    plan = _cached_plan(relation, sigma, q, int(steps.max()), target_delta)
    key = tuple(int(t) for t in steps)
    try:
        return _fourier_values(plan, lambda dx: np.array(_epsilon_level(relation, sigma, q, key, target_delta, dx)), _EPS_ATOL)
    except _Untrusted:
        values = _dp_accounting_values(
            relation, sigma, q, steps, plan, lambda pld: pld.get_epsilon_for_delta(target_delta), _EPS_ATOL
        )
        return values, None


def _epsilon_values(relation: Relation, sigma: float, q: float, steps: np.ndarray, target_delta: float) -> np.ndarray:
    if q == 1.0:
        return np.array([_gaussian_epsilon(_full_batch_mu(relation, sigma, int(t)), target_delta) for t in steps])
    values = np.empty(steps.shape)
    single = steps == 1
    if np.any(single):
        values[single] = _single_step_epsilon(relation, sigma, q, target_delta)
    if not np.all(single):
        values[~single] = _composed_epsilon(relation, sigma, q, steps[~single], target_delta)[0]
    return values


def epsilon(
    sigma: float,
    q: float,
    num_steps: int | Sequence[int] | np.ndarray,
    delta: float,
    relation: Relation | str = Relation.SUBSTITUTE,
) -> float | np.ndarray:
    """Tight epsilon of ``num_steps`` compositions of the subsampled Gaussian mechanism.

    :param sigma: noise multiplier: the noise std is ``sigma * C`` on the sum of gradients clipped
        to norm ``C``.
    :param q: sampling rate in (0, 1]: batch size over data size, 1 for full batches.
    :param num_steps: number of steps, or an array of them: one step's privacy loss distribution is
        built and Fourier-transformed once for all of them.
    :param delta: target delta in (0, 1).
    :param relation: the :class:`Relation` that matches the minibatch sampler.
    :return: epsilon, a float, or an array shaped like ``num_steps``.
    :raises AccountingError: if no value can be verified.

    **Example**

    .. doctest::

        >>> from d3pext.accountants import epsilon
        >>> round(epsilon(1.0, 0.01, 1000, 1e-5, relation="add_remove"), 3)
        1.828
        >>> epsilon(2.0, 0.01, [1000, 10000], 1e-5).round(2)
        array([1.21, 4.4 ])
    """
    relation = _as_relation(relation)
    sigma, q, target_delta = _check_sigma(sigma), _check_q(q), _check_delta(delta)
    steps, scalar = _check_steps(num_steps)
    eps = _epsilon_values(relation, sigma, q, steps.ravel(), target_delta).reshape(steps.shape)
    return float(eps) if scalar else eps


def delta(
    sigma: float,
    q: float,
    num_steps: int,
    epsilon: float,
    relation: Relation | str = Relation.SUBSTITUTE,
) -> float:
    """Tight delta of ``num_steps`` compositions of the subsampled Gaussian mechanism at ``epsilon``.

    Arguments as in :func:`epsilon`, with a single ``num_steps`` and ``epsilon > 0``.

    **Example**

    .. doctest::

        >>> from d3pext.accountants import delta
        >>> f"{delta(1.0, 0.01, 1000, 1.8282, relation='add_remove'):.3e}"
        '1.000e-05'
    """
    relation = _as_relation(relation)
    sigma, q, eps = _check_sigma(sigma), _check_q(q), _check_positive("epsilon", epsilon)
    steps, scalar = _check_steps(num_steps)
    if not scalar:
        raise TypeError(f"num_steps must be a single integer for delta(), got {num_steps!r}")
    if q == 1.0:
        return _gaussian_delta(_full_batch_mu(relation, sigma, int(steps)), eps)
    if int(steps) == 1:
        return math.exp(_single_step_log_delta(relation, sigma, q, eps))
    plan = _cached_plan(relation, sigma, q, int(steps), _DELTA_FLOOR)
    try:
        level = lambda dx: np.array([_pld_delta(_make_pld(relation, sigma, q, dx, plan), int(steps), eps)])
        (value,), _ = _fourier_values(plan, level, 0.0)
        if value < 1e2 * _DELTA_FLOOR:  # the window only guarantees deltas above the floor
            raise _Untrusted("delta below the resolution of the grid window")
    except _Untrusted:
        (value,) = _dp_accounting_values(
            relation, sigma, q, steps.reshape(1), plan, lambda pld: pld.get_delta_for_epsilon(eps), 0.0
        )
    return float(value)


def approximate_sigma(
    epsilon: float,
    delta: float,
    q: float,
    num_steps: int,
    relation: Relation | str = Relation.SUBSTITUTE,
    *,
    tol: float = 1e-3,
) -> SigmaResult:
    """Smallest noise multiplier sigma (up to a relative ``tol``) that keeps the run (epsilon, delta)-DP.

    A single step and full batches (``q = 1``) have closed forms, solved for sigma directly.
    Otherwise the root of ``epsilon(sigma) = target`` is bracketed in log-log space, starting from a
    central-limit guess (or, where ``q T < 1``, a participation bound if that is smaller) and
    extrapolating secants, and the bracket shrunk (inverse quadratic
    interpolation, each point placed just above the estimated root) until the upper end lies within
    half a factor ``1 + tol`` of the estimated root (or the ends within ``1 + tol`` of each other).
    Every grid gives an upper bound on epsilon, which exceeds the true one by about ``c dx^2``: the
    first point (or, where its epsilon is far above the target, the first one closer to it) starts two
    grids coarser than the initial step (:data:`_SEARCH_COARSER`) and estimates each grid's excess
    from the difference of two successive ones (Richardson), which sets the search's grid: the
    coarsest that overstates epsilon by less than about ``tol / 4``, at every sigma the same step
    relative to the spread of one step's loss. The points of the search are evaluated on a grid up to
    two halvings coarser (:data:`_SEARCH_CHEAPER`; points far from the root on the coarsest grid),
    their epsilons corrected by the difference between the grids measured at the last certified
    point; the upper end of the bracket is certified on the search's grid, and where it then lies
    more than 3/4 of the tolerance above the estimated root the bracket is searched again. The upper
    end and its epsilon on the search's grid (a certified upper bound, at most the target) are
    returned; unless the result lies close to the first point and the first point's excess was far
    below the tolerance, the coarser grid at the result estimates the excess there, and where it
    exceeds ``tol / 2`` the search goes on on a finer grid. :func:`epsilon`, on refined grids, gives at
    most that value (up to ~1e-6 relative). Results are cached. Typically 3 to 6 sigmas; on a 2-core
    machine at most about 0.15 s of CPU time for any epsilon in [0.01, 100], up to 1e6 steps and rates
    down to 1e-5, under 0.07 s for rates of 0.01 and more (small rates use split grids, see
    :class:`_SplitPLD`). Deltas below about 1e-9 together
    with rates below about 1e-4 can need dp-accounting's slow fallback (FFT rounding noise reaches
    delta).

    :param epsilon: target epsilon > 0.
    :param delta: target delta in (0, 1).
    :param q: sampling rate in (0, 1].
    :param num_steps: number of steps.
    :param relation: the :class:`Relation` that matches the minibatch sampler.
    :param tol: relative width of the final bracket on sigma, in (0, 0.5].
    :return: ``SigmaResult(sigma, epsilon, num_evaluations)`` with ``epsilon <= target``, an upper
        bound on epsilon at ``sigma`` (for ``num_steps > 1`` and ``q < 1``, from the search's grid:
        within about ``tol / 4`` above what :func:`epsilon` gives).
    :raises AccountingError: if no sigma can be certified (for instance a target epsilon so large
        that the privacy loss of the run lies beyond what the accountants can represent).

    **Example**

    .. doctest::

        >>> from d3pext.accountants import approximate_sigma
        >>> sigma, eps, n = approximate_sigma(1.0, 1e-5, 0.01, 10_000, relation="add_remove")
        >>> round(sigma, 1), eps <= 1.0
        (3.8, True)
    """
    relation = _as_relation(relation)
    target, target_delta, q = _check_positive("epsilon", epsilon), _check_delta(delta), _check_q(q)
    steps, scalar = _check_steps(num_steps)
    if not scalar:
        raise TypeError(f"num_steps must be a single integer, got {num_steps!r}")
    tol = _as_float("tol", tol)
    if not 0.0 < tol <= 0.5:
        raise ValueError(f"tol must lie in (0, 0.5], got {tol!r}")
    num_steps = int(steps)
    if q < 1.0 and -math.expm1(num_steps * math.log1p(-q)) <= target_delta:
        raise AccountingError(
            f"every sigma > 0 meets the target: with q={q} and num_steps={num_steps} an example takes part "
            f"in the run with probability 1 - (1 - q)^T <= delta={target_delta}"
        )
    if q == 1.0 or num_steps == 1:
        return _closed_form_sigma(relation, target, target_delta, q, num_steps, tol)
    return _searched_sigma(relation, target, target_delta, q, num_steps, tol)


def _confirmed(relation, sigma, q, num_steps, target, target_delta, tol) -> tuple[float, float, int]:
    """The smallest of sigma, sigma (1 + tol/8), ... whose checked epsilon is at most the target."""
    steps = np.array([num_steps])
    for k in range(64):
        eps = float(_epsilon_values(relation, sigma, q, steps, target_delta)[0])
        if eps <= target:
            return sigma, eps, k + 1
        sigma *= 1.0 + tol / 8.0
    raise AccountingError(f"no sigma with a checked epsilon below {target} was found near {sigma}")


@functools.lru_cache(maxsize=256)
def _closed_form_sigma(
    relation: Relation, target: float, target_delta: float, q: float, num_steps: int, tol: float
) -> SigmaResult:
    """Root in log sigma of the closed-form log delta(target) = log target_delta (it falls as sigma grows)."""
    evaluations = 0

    def excess(log_sigma: float) -> float:
        nonlocal evaluations
        evaluations += 1
        sigma = math.exp(log_sigma)
        if q == 1.0:
            log_delta = _gaussian_log_delta(_full_batch_mu(relation, sigma, num_steps), target)
        else:
            log_delta = _single_step_log_delta(relation, sigma, q, target)
        return max(log_delta, -1e4) - math.log(target_delta)

    lo = hi = math.log(_sigma_guess(relation, target, target_delta, q, num_steps))
    f_lo = f_hi = excess(lo)
    while f_hi > 0.0:
        lo, f_lo, hi = hi, f_hi, hi + 1.0
        f_hi = excess(hi)
    while f_lo <= 0.0:
        if lo < math.log(1e-300):
            raise AccountingError(f"no sigma meets epsilon={target}, delta={target_delta}")
        hi, lo = lo, lo - 1.0
        f_lo = excess(lo)
    root = _brentq(excess, lo, hi, xtol=1e-13)
    sigma, eps, checks = _confirmed(relation, math.exp(root), q, num_steps, target, target_delta, 1e-9)
    return SigmaResult(sigma, eps, evaluations + checks)


@functools.lru_cache(maxsize=256)
def _searched_sigma(
    relation: Relation, target: float, target_delta: float, q: float, num_steps: int, tol: float
) -> SigmaResult:
    steps = np.array([num_steps])
    sampled: set[float] = set()  # the log sigmas evaluated (num_evaluations)
    cheap: dict[float, float] = {}  # epsilon on the cheap grid at each log sigma (inf: out of the window)
    values: dict[float, float] = {}  # certified epsilon (an upper bound) on the search's grid, or dp-accounting's
    fallback: set[float] = set()  # the log sigmas whose value is from dp-accounting (no grid to compare)
    level_shift = None  # the search's grid step: the initial one at each sigma, halved this many times
    cheap_shift = None  # the grid of the search's points: up to _SEARCH_CHEAPER grids coarser than level_shift
    correction = (0.0, 0.0)  # search's grid's epsilon minus, and over, the cheap grid's (last certified point)
    first_excess = math.inf  # the first point's estimated relative excess on the search's grid
    screen_shift = None  # a still coarser grid for points far from the root (None: none)
    screen_correction = (0.0, 0.0)  # as correction, for the screening grid (at the first point)
    screened: dict[float, float] = {}  # epsilon on the screening grid at points far from the root
    coarse: dict[float, float] = {}  # epsilon on the screening grid at every point evaluated there
    ladder_point = None  # the log sigma where the grids were chosen

    def level(sigma: float, plan: _Plan, shift: int) -> float:
        # (the split grids' tails may be thinned for epsilons up to 4 times the target: see _SplitPLD)
        token = _EPS_BOUND.set(4.0 * target)
        try:
            return _epsilon_level(relation, sigma, q, (num_steps,), target_delta, _initial_dx(plan) / 2.0**shift)[0]
        finally:
            _EPS_BOUND.reset(token)

    def first_shift(plan: _Plan) -> int:
        """Up to _SEARCH_COARSER grids coarser than the initial one, at most _DX_COARSEST."""
        return -min(_SEARCH_COARSER, max(math.floor(math.log2(_DX_COARSEST / _initial_dx(plan)) + 1e-9), 0))

    def ladder(sigma: float, plan: _Plan) -> tuple[dict[int, float], float]:
        """Epsilons on the first point's grids, from up to _SEARCH_COARSER grids coarser than the initial one
        (at most _DX_COARSEST), and the estimated epsilon on the search's grid, which it sets.

        Every grid gives an upper bound on epsilon, which exceeds the true one by about ``c dx^2``:
        ``4/3`` of the change between two grids estimates the coarser one's excess, from which the grid
        step whose excess is below ``tol / 4`` follows (Richardson); all points of the search then use
        that relative step, so the sigma found is at most about ``tol / 4`` above the smallest one. The
        excess is about the same in absolute terms near the target for small q, so it is measured
        against the smaller of epsilon and the target. A grid finer than those evaluated is not
        evaluated here (the first point is rarely the result): its epsilon is extrapolated.
        """
        nonlocal level_shift, first_excess
        shift = first_shift(plan)
        eps, previous = level(sigma, plan, shift), None
        found = {shift: eps}
        while shift < 12:
            try:
                finer = level(sigma, plan, shift + 1)
            except _Untrusted as err:  # grid budget: search on the finest grid that fits
                if isinstance(err, _OutOfWindow):
                    raise
                break
            found[shift + 1] = finer
            change = max(eps - finer, 0.0)
            need = 0.25 * tol * min(finer, target) + _EPS_ATOL
            # Errors shrink by 4 per halving once the grid resolves the PLD (checked on the last two
            # changes); before that, by 2 at worst: the excess of the finer grid is about change / 3
            # (else at most change), of the coarser change more.
            ratio = 0.25 if previous is not None and change <= 0.3 * previous else 0.5
            finer_excess = change * ratio / (1.0 - ratio)
            if change + finer_excess <= need:
                first_excess = (change + finer_excess) / max(eps, 1e-300)
                break
            shift, eps = shift + 1, finer
            if finer_excess <= need:
                first_excess = finer_excess / max(finer, 1e-300)
                break
            if ratio == 0.25:  # straight to the grid wanted, extrapolated (certify() steps back where it
                wanted = shift + 1  # exceeds the budget; the result's grid is checked)
                while wanted < 12 and finer_excess / 4.0 ** (wanted - shift) > need:
                    wanted += 1
                left = finer_excess / 4.0 ** (wanted - shift)
                eps = finer - (finer_excess - left)
                first_excess = left / max(eps, 1e-300)
                shift = wanted
                break
            previous = change
        level_shift = shift
        return found, found.get(shift, eps)

    def certify(log_sigma: float) -> float:
        """The certified epsilon at exp(log_sigma), on the search's grid: where that exceeds the grid budget,
        on the finest grid that fits (the search's grid from then on), else dp-accounting's."""
        nonlocal correction, level_shift, screen_shift, screen_correction
        if log_sigma not in values:
            sigma = math.exp(log_sigma)
            plan = _cached_plan(relation, sigma, q, num_steps, target_delta)
            while log_sigma not in values:
                try:
                    values[log_sigma] = level(sigma, plan, level_shift)
                except _Untrusted:
                    if level_shift <= cheap_shift:
                        values[log_sigma] = float(_composed_epsilon(relation, sigma, q, steps, target_delta)[0][0])
                        fallback.add(log_sigma)
                    else:
                        level_shift -= 1
        unscreen(log_sigma)
        if log_sigma not in fallback and math.isfinite(cheap[log_sigma]):
            correction = _grid_correction(cheap[log_sigma], values[log_sigma])
            if log_sigma in coarse:  # the screening grid's error changes with sigma as well
                screen_correction = _grid_correction(coarse[log_sigma], values[log_sigma])
                if abs(screen_correction[1]) > _SCREEN_EXCESS:  # too coarse here: no more screening
                    screen_shift = None
        return values[log_sigma]

    def unscreen(log_sigma: float) -> None:
        """Evaluate a screened point on the cheap grid."""
        if log_sigma not in cheap:
            sigma = math.exp(log_sigma)
            cheap[log_sigma] = level(sigma, _cached_plan(relation, sigma, q, num_steps, target_delta), cheap_shift)

    def excess(log_sigma: float) -> float:
        """Estimated log(epsilon / target) on the search's grid at sigma = exp(log_sigma); inf where the loss
        is out of the window. Certified values where known, else the cheap grid's (far from the root the
        screening grid's) corrected as measured at the last certified point (:func:`_corrected_log`)."""
        nonlocal cheap_shift, correction, screen_shift, screen_correction, ladder_point
        sampled.add(log_sigma)
        if log_sigma in screened and log_sigma not in cheap:
            return _corrected_log(screened[log_sigma], screen_correction) - math.log(target) + 1e-5
        if log_sigma not in cheap:
            sigma = math.exp(log_sigma)
            if not 1e-100 < sigma < 1e100:
                raise AccountingError(f"no sigma meets epsilon={target}, delta={target_delta}: the search reached {sigma:.3g}")
            try:
                plan = _cached_plan(relation, sigma, q, num_steps, target_delta)
                if plan.composed.above > _MAX_WINDOW:
                    raise _OutOfWindow("the composed privacy loss is beyond the window")
                if level_shift is None:
                    # Points far above the target (small q, small epsilon: the first ones, often) only steer
                    # the bracket: the grids are chosen at the first point closer to it, where the excess
                    # matters (their convergence differs there; below the target the first point does).
                    coarse[log_sigma] = level(sigma, plan, first_shift(plan))
                    f_coarse = math.log(max(coarse[log_sigma], 1e-300) / target)
                    if f_coarse > _LADDER_NEAR:
                        screened[log_sigma] = coarse[log_sigma]
                        return f_coarse + 1e-5
                    ladder_point = log_sigma
                    found, estimate = ladder(sigma, plan)
                    # (grids coarser than the initial one are cheap anyway, and their errors less regular)
                    below = [s for s in found if s <= max(level_shift - _SEARCH_CHEAPER, min(level_shift, 0))]
                    cheap_shift = max(below) if below else min(found)
                    cheap[log_sigma] = found[cheap_shift]
                    if level_shift in found:
                        values[log_sigma] = estimate
                    correction = _grid_correction(cheap[log_sigma], estimate)
                    coarsest = min(found)
                    if coarsest < cheap_shift and found[coarsest] - estimate <= _SCREEN_EXCESS * estimate:
                        screen_shift, screen_correction = coarsest, _grid_correction(found[coarsest], estimate)
                        coarse[log_sigma] = found[coarsest]
                else:
                    if screen_shift is not None:
                        # Points whose estimate is far from the target only steer the bracket.
                        coarse[log_sigma] = level(sigma, plan, screen_shift)
                        f_coarse = _corrected_log(coarse[log_sigma], screen_correction) - math.log(target)
                        if abs(f_coarse) > _SCREEN_FAR:
                            screened[log_sigma] = coarse[log_sigma]
                            return f_coarse + 1e-5
                    cheap[log_sigma] = level(sigma, plan, cheap_shift)
            except _OutOfWindow:
                cheap[log_sigma] = math.inf
            except _Untrusted:  # grid budget: the checked value, from dp-accounting if need be
                cheap[log_sigma] = values[log_sigma] = float(_composed_epsilon(relation, sigma, q, steps, target_delta)[0][0])
                fallback.add(log_sigma)
        if log_sigma in values:
            log_eps = math.log(max(values[log_sigma], 1e-300))
        elif math.isfinite(cheap[log_sigma]):
            log_eps = _corrected_log(cheap[log_sigma], correction)
        else:
            return math.inf
        # (a margin of 1e-5: the checked epsilon, on finer grids, may differ from this one by ~1e-6)
        return log_eps - math.log(target) + 1e-5

    def guess(target_eps: float) -> float:
        return math.log(_sigma_guess(relation, target_eps, target_delta, q, num_steps))

    def close_enough(lo: float, f_lo: float, hi: float, f_hi: float, root: float) -> bool:
        """hi (epsilon <= target) is within half the tolerance of the estimated root, and that estimate
        (secant or inverse quadratic through points within 0.5 in log sigma) is accurate enough."""
        return math.isfinite(f_lo) and hi - lo <= 0.5 and hi - root <= 0.5 * width_tol

    def bracket(points: list, step: float) -> tuple[float, float, float, float]:
        """Step from the last point, the way its excess says, until the excess changes sign: the first
        step is ``step``, the next ones extrapolate the last two a little beyond the root (epsilon is
        close to a power of sigma)."""
        f_start = points[-1][1]
        direction = 1.0 if f_start > 0.0 else -1.0  # the way sigma has to move
        while True:
            point = points[-1][0] + direction * step
            points.append((point, excess(point)))
            (p0, f0), (p1, f1) = points[-2:]
            if (f1 > 0.0) != (f_start > 0.0):
                break
            if math.isfinite(f0) and math.isfinite(f1) and (f1 - f0) * direction < 0.0:
                secant = -f1 * (p1 - p0) / (f1 - f0)  # the extrapolated root, in direction * secant > 0
                step = min(max(1.1 * direction * secant + 0.5 * width_tol, 0.5 * width_tol), max(4.0 * step, 1.0))
            else:
                step *= 2.0
        (lo, f_lo), (hi, f_hi) = sorted(points[-2:])
        return lo, f_lo, hi, f_hi

    def restart(start: float, slope: float) -> tuple[list, tuple[float, float, float, float]]:
        """Bracket again from ``start`` (with the excesses re-estimated), the first step from the slope a
        little beyond the estimated root."""
        points = [(x, excess(x)) for x, _ in all_points if x != start] + [(start, excess(start))]
        f_start = points[-1][1]
        step = (abs(f_start / slope) if slope < 0.0 else 0.0) * 1.1 + 0.5 * width_tol
        return points, bracket(points, step)

    # Bracket the root of the decreasing excess(log sigma), starting from a central-limit guess; the
    # second point carries the guess's error at the first over as a factor on epsilon.
    width_tol = math.log1p(tol)
    first = guess(target)
    points = [(first, excess(first))]
    f_first = points[0][1]
    factor = math.exp(-min(f_first, math.log(4.0))) if f_first > 0.0 else math.exp(min(-f_first, math.log(4.0)))
    step = abs(guess(target * factor) - first) + 0.5 * width_tol
    lo, f_lo, hi, f_hi = bracket(points, step)
    all_points = points

    # Shrink the bracket with the cheap grid's estimates (or stop where the upper end is within half the
    # tolerance of the estimated root); certify the upper end on the search's grid, which also measures
    # the correction there: where the certified value exceeds the target, or the corrected estimate puts
    # the root farther below than 3/4 of the tolerance, bracket again. Then check the grid's excess at
    # the result (at most eight rounds in all).
    for _ in range(8):
        lo, f_lo, hi, f_hi = _shrink_bracket(excess, points, lo, f_lo, hi, f_hi, width_tol, close_enough)
        all_points = points
        if not math.isfinite(f_lo) or level_shift is None:
            break
        if hi not in values:
            certify(hi)
            points = [(x, excess(x)) for x, _ in points]
            all_points = points
        f_hi, f_lo = excess(hi), excess(lo)
        if lo not in cheap and f_lo <= 2.0 * _SCREEN_FAR:  # a screened lower end close to the root
            unscreen(lo)
            f_lo = excess(lo)
        slope = (f_hi - f_lo) / (hi - lo) if math.isfinite(f_lo) and hi > lo else -1.0
        if f_hi > 0.0:  # above the target on the search's grid: the root lies higher
            points, (lo, f_lo, hi, f_hi) = restart(hi, slope)
            continue
        if f_lo <= 0.0:  # the corrected estimate at lo is below the target too: the root lies lower
            points, (lo, f_lo, hi, f_hi) = restart(lo, slope)
            continue
        # (a certified upper end within 3/4 of the tolerance of the root is kept: the points are placed
        # 0.3 of it above the estimated root, and a new correction moves that estimate a little)
        if hi - lo > 0.5 or hi - _estimate_root(points, lo, f_lo, hi, f_hi) > 0.75 * width_tol:
            continue  # shrink further with the corrected estimates
        # The grid's excess at the result: its relative step at this sigma may differ from the first
        # point's by a factor 2 (the error by 4), and the error itself changes with sigma. Where the
        # first point's excess leaves room for that and the result's epsilon is within a factor 1.5 of
        # the first point's, it is taken as is; else the cheap grid (or one grid coarser) at the result
        # estimates it (Richardson, 1 / (4^d - 1) of the change over d halvings), and where it exceeds
        # tol / 2 the search goes on from the result on the grid whose estimated excess is below tol / 4.
        if hi in fallback:
            break
        if hi == ladder_point and first_excess <= 0.25 * tol:
            break
        f_ladder = math.log(max(values.get(ladder_point, cheap.get(ladder_point, math.inf)), 1e-300) / target)
        if first_excess <= tol / 32.0 and abs(f_hi - f_ladder) <= math.log(1.5):  # near the ladder's point
            break
        if cheap_shift < level_shift:
            halvings_apart, coarser = level_shift - cheap_shift, cheap[hi]
        else:
            try:
                plan = _cached_plan(relation, math.exp(hi), q, num_steps, target_delta)
                halvings_apart, coarser = 1, level(math.exp(hi), plan, level_shift - 1)
            except _Untrusted:
                break
        grid_excess = max(coarser - values[hi], 0.0) / (4.0**halvings_apart - 1.0)
        if grid_excess <= 0.5 * tol * values[hi] + _EPS_ATOL:
            break
        halvings = 1
        while halvings < 6 and grid_excess / 4.0**halvings > 0.25 * tol * values[hi] + _EPS_ATOL:
            halvings += 1
        # The finer grids lower epsilon: hi still meets the target; the root lies below it. The cheap grid
        # moves along; the values so far are forgotten (hi is certified again on the finer grid).
        level_shift += halvings
        cheap_shift += halvings
        screen_shift = None
        cheap.clear()
        values.clear()
        screened.clear()
        coarse.clear()
        all_points = [(hi, excess(hi))]
        certify(hi)
        points, (lo, f_lo, hi, f_hi) = restart(hi, slope)
    if not math.isfinite(f_lo):
        eps_hi = target * math.exp(f_hi)
        raise AccountingError(
            f"no tight sigma for epsilon={target}, delta={target_delta}, q={q}, num_steps={num_steps}: below "
            f"sigma={math.exp(hi):.4g} (epsilon {eps_hi:.4g}) the privacy loss of the run reaches beyond "
            f"{_MAX_WINDOW:g}, outside the range of tight accounting; an epsilon this large is no meaningful "
            "guarantee"
        )
    for _ in range(64):  # (where the rounds ran out before hi was certified below the target)
        excess(hi)
        if certify(hi) <= target:
            return SigmaResult(math.exp(hi), values[hi], len(sampled))
        hi += 0.25 * width_tol
    raise AccountingError(f"no sigma with a certified epsilon below {target} was found near {math.exp(hi):.6g}")


def _grid_correction(cheap: float, fine: float) -> tuple[float, float]:
    """How a finer grid's epsilon differs from a coarser one's: the difference and the log ratio."""
    return fine - cheap, math.log(max(fine, 1e-300) / max(cheap, 1e-300))


def _corrected_log(cheap: float, correction: tuple[float, float]) -> float:
    """log of the finer grid's epsilon estimated from a coarser grid's. Neither model of the grid's excess
    holds everywhere (small q: about the same absolute excess; large epsilon: it grows faster than
    epsilon): the larger estimate of the two."""
    if not math.isfinite(cheap):
        return math.inf
    difference, log_ratio = correction
    return math.log(max(cheap + difference, cheap * math.exp(log_ratio), 1e-300))


def _shrink_bracket(
    excess: Callable[[float], float],
    points: list,
    lo: float,
    f_lo: float,
    hi: float,
    f_hi: float,
    width_tol: float,
    accept: Callable[[float, float, float, float, float], bool] | None = None,
) -> tuple[float, float, float, float]:
    """Shrink ``[lo, hi]`` (``excess(lo) > 0 >= excess(hi)``) below ``width_tol``; appends to ``points``.

    Each new point lies a little beyond the estimated root (:func:`_estimate_root`), on the side of the
    end farther from it, so that each evaluation moves one end close to the root; bisection where two
    steps in a row have not halved the bracket. ``accept(lo, f_lo, hi, f_hi, root)`` may end the
    search earlier (with the estimated root).
    """
    widths = [hi - lo]
    while hi - lo > width_tol:
        root = _estimate_root(points, lo, f_lo, hi, f_hi)
        if accept is not None and accept(lo, f_lo, hi, f_hi, root):
            break
        # (with accept: always just above the root, where the next point is likely to be accepted)
        new = root + 0.3 * width_tol if accept is not None or hi - root > root - lo else root - 0.3 * width_tol
        new = min(max(new, lo + 0.1 * width_tol), hi - 0.1 * width_tol)
        if len(widths) >= 3 and widths[-1] > 0.5 * widths[-3]:
            new = 0.5 * (lo + hi)
        f_new = excess(new)
        points.append((new, f_new))
        if f_new > 0.0:
            lo, f_lo = new, f_new
        else:
            hi, f_hi = new, f_new
        widths.append(hi - lo)
    return lo, f_lo, hi, f_hi


def _estimate_root(points: list, lo: float, f_lo: float, hi: float, f_hi: float) -> float:
    """Root of f within (lo, hi), where f(lo) > 0 >= f(hi), from the evaluated ``(x, f(x))`` points."""
    finite = sorted((p for p in points if math.isfinite(p[1])), key=lambda p: abs(p[1]))[:3]
    if len(finite) == 3 and len({f for _, f in finite}) == 3:
        (a, fa), (b, fb), (c, fc) = finite
        root = a * fb * fc / ((fa - fb) * (fa - fc)) + b * fa * fc / ((fb - fa) * (fb - fc)) + c * fa * fb / ((fc - fa) * (fc - fb))
        if lo < root < hi:
            return root
    if math.isfinite(f_lo):
        return (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
    return 0.5 * (lo + hi)


def _sigma_guess(relation: Relation, target: float, target_delta: float, q: float, num_steps: int) -> float:
    """sigma at which a central-limit approximation of the composed PLD meets the target.

    The composed loss is approximated by the Gaussian mechanism's N(mu^2/2, mu^2) with mu^2 equal to
    T times the chi^2 divergence of one step's pair; for small q that is
    q^2 (e^{1/s^2} - 1) (add/remove) and 4 q^2 sinh(1/s^2) (substitute); exact for q = 1. Where
    ``q T < 1`` the smaller of it and :func:`_participation_sigma` (the central limit is poor for
    large epsilons there: up to a factor e too high in sigma at epsilon 100).
    """
    # mu with Gaussian epsilon(mu) = target (epsilon grows with mu), within [1e-6, 1e4].
    excess = lambda log_mu: _gaussian_log_delta(math.exp(log_mu), target) - math.log(target_delta)
    bounds = (math.log(1e-6), math.log(1e4))
    if excess(bounds[0]) >= 0.0 or excess(bounds[1]) <= 0.0:
        log_mu = bounds[0] if excess(bounds[0]) >= 0.0 else bounds[1]
    else:
        log_mu = _bisect(excess, *bounds, xtol=1e-6)  # a first guess: a rough root will do
    mu2 = math.exp(2.0 * log_mu)
    if q == 1.0:
        return _full_batch_mu(relation, 1.0, num_steps) / math.sqrt(mu2)
    k = mu2 / (num_steps * q**2)  # e^{1/s^2} - 1 (add/remove) or 4 sinh(1/s^2) (substitute)
    sigma = 1.0 / math.sqrt(math.log1p(k) if relation is Relation.ADD_REMOVE else math.asinh(k / 4.0))
    if 1 < num_steps and q * num_steps < 1.0:
        # Few participations: the central limit overstates sigma for large epsilons (by up to e), where
        # the participation bound below is close.
        sigma = min(sigma, _participation_sigma(target, target_delta, q, num_steps, sigma))
    return sigma


def _participation_sigma(target: float, target_delta: float, q: float, num_steps: int, cap: float) -> float:
    """sigma at which the bound that reveals the steps an example took part in meets the target.

    With K ~ Binomial(T, q) participations, joint convexity gives delta(eps) <= E_K[delta_K(eps)], where
    delta_K is the Gaussian mechanism's with mu = sqrt(K) / sigma: for add/remove an upper bound on
    delta, hence on the sigma needed. Used as a guess for both relations (at small q their large losses
    are alike); it is close where epsilon is large and few examples take part more than once (it is
    solved only below ``cap``, which it returns where it needs more).
    """
    k = np.arange(1, min(num_steps, 64) + 1)
    log_w = (
        scipy.special.gammaln(num_steps + 1) - scipy.special.gammaln(k + 1) - scipy.special.gammaln(num_steps - k + 1)
        + k * math.log(q) + (num_steps - k) * math.log1p(-q)
    )
    keep = log_w >= math.log(target_delta) - 20.0
    k, log_w = k[keep], log_w[keep]

    def excess(log_sigma: float) -> float:  # log E_K[delta_K(target)] - log target_delta, decreasing
        mu = np.sqrt(k) / math.exp(log_sigma)
        a = scipy.special.log_ndtr(mu / 2.0 - target / mu)  # as in _gaussian_log_delta
        b = target + scipy.special.log_ndtr(-mu / 2.0 - target / mu)
        with np.errstate(divide="ignore"):
            terms = log_w + np.where(b < a, a + np.log(-np.expm1(np.minimum(b - a, 0.0))), -np.inf)
        peak = float(terms.max())
        if peak == -math.inf:
            return -1e4
        return max(peak + math.log(float(np.sum(np.exp(terms - peak)))), -1e4) - math.log(target_delta)

    hi = math.log(min(cap, 1e3))
    if k.size == 0 or excess(hi) >= 0.0:
        return cap
    lo = hi - 2.0  # (the central limit is at most about a factor e too high)
    if excess(lo) <= 0.0:
        lo = math.log(min(1e-3, cap))
        if excess(lo) <= 0.0:
            return cap
    return math.exp(_brentq(excess, lo, hi, xtol=1e-3))
