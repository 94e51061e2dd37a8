"""Tight (epsilon, delta) accounting for the subsampled Gaussian mechanism of DP-SGD / DP-VI.

One step adds Gaussian noise of standard deviation ``sigma * C`` to the sum of per-example
gradients clipped to norm ``C``, on a batch drawn with sampling rate ``q``; ``num_steps`` such steps
are composed. Two neighbouring relations are supported (:class:`Relation`).

The privacy loss distribution (PLD) of one step is discretised with fourier-accountant's
formulas (Koskela, Jälkö & Honkela, 2020), Fourier-transformed once and raised to the power of each
step count. A value is returned only after it has been checked:

* the grid window holds the composed PLD: a Chernoff bound from the one-step moment generating
  function caps the mass that wraps around the circular convolution at ``1e-4 * delta``;
* the discretised one-step PLD conserves probability mass over all compositions;
* halving the grid step changes the result by less than a relative ``1e-4``;
* epsilon comes from exact inversion of the piecewise-smooth ``delta(epsilon)`` of the composed
  discrete PLD, not from Newton's method.

If the checks cannot be passed within the grid budget, the value comes from dp-accounting's PLD
accountant (pessimistic, hence an upper bound), its discretisation refined until the value is
stable; if that fails as well, :class:`AccountingError` is raised. Full-batch steps (``q = 1``) are
Gaussian mechanisms and use the closed-form hockey-stick divergence.
"""

from __future__ import annotations

import enum
import math
from typing import Callable, NamedTuple, Sequence

import numpy as np
import scipy.fft
import scipy.optimize
import scipy.special

# Private function of fourier-accountant, pinned to ==0.12.11 in pyproject.toml; tested.
from fourier_accountant.common import _evaluate_pld

__all__ = [
    "AccountingError",
    "Relation",
    "SigmaResult",
    "approximate_sigma",
    "delta",
    "epsilon",
]


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
    """Result of :func:`approximate_sigma`; unpacks as ``sigma, epsilon, num_evaluations``."""

    sigma: float
    epsilon: float
    num_evaluations: int


# Checks and budgets of the Fourier path.
_WRAP_FRACTION = 1e-4  # mass allowed to wrap around the window, relative to delta
_MASS_TOL = 1e-3  # allowed |mass - 1| of the composed PLD (refinement checks the rest)
_REFINE_RTOL = 1e-4  # allowed relative change of a result when the grid step is halved
_EPS_ATOL = 1e-7  # absolute floor of that tolerance for epsilon close to 0
_MAX_NX = 2**23  # points of the composed grid (about 400 MB of working memory)
_MAX_NX_ONE_STEP = 2**21  # points on which fourier-accountant evaluates one step (~350 MB)
_MAX_WINDOW = 600.0  # exp(x) must stay finite on the window
_DX_COARSEST = 2.0**-7
_DELTA_FLOOR = 1e-12  # delta() sizes its window for deltas down to this value
# dp-accounting fallback.
_DPA_RTOL = 2e-3
_MAX_DPA_WINDOW = 1e4  # dp-accounting's grid spans the privacy loss, at 1e-2 (or finer) per point
_DPA_INTERVALS = (1e-2, 3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5)  # value_discretization_interval


class _Untrusted(Exception):
    """The Fourier path cannot certify a value within its budget."""


class _Unconverged(Exception):
    """The grid step is too coarse: refine it."""


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
    if relation is Relation.ADD_REMOVE:
        return np.logaddexp(math.log1p(-q), math.log(q) + (2.0 * t - 1.0) / s2)
    base = math.log1p(-q) - t**2 / s2
    return np.logaddexp(base, math.log(q) - (t - 1.0) ** 2 / s2) - np.logaddexp(
        base, math.log(q) - (t + 1.0) ** 2 / s2
    )


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
    if relation is Relation.ADD_REMOVE:
        return _Window(-math.log1p(-q), above)  # the loss is bounded below by log(1 - q)
    return _Window(float(_privacy_loss(relation, sigma, q, np.array(z * sigma))), above)


class _LossMGF:
    """Log moment generating function ``log E_P[exp(lam l(t))]`` of one step's loss, lam in both signs.

    It is integrated over t by the trapezoidal rule, spectrally accurate for these smooth
    Gaussian-tailed integrands. One step's loss has Gaussian tails of std ``1/sigma``, so the lam
    that matter are below ~8 sigma; as ``0 <= l'(t) <= 2 / sigma^2``, tilting by lam moves the mass
    of t by at most 2 lam, which the t-grid covers.
    """

    def __init__(self, relation: Relation, sigma: float, q: float):
        self.lam = np.geomspace(1e-4, 10.0 * sigma + 2.0, 61)
        reach = 2.0 * self.lam[-1] + 12.0 * sigma + 2.0
        step = min(sigma / 4.0, sigma**2 / 2.0)
        t = np.linspace(-reach, 1.0 + reach, int(np.clip((2.0 * reach + 1.0) / step, 512, 20001)))
        log_p = _log_p(sigma, q, t) + math.log(t[1] - t[0])
        loss = _privacy_loss(relation, sigma, q, t)
        self.log_mgf = {
            sign: scipy.special.logsumexp(sign * self.lam[:, None] * loss + log_p, axis=1) for sign in (-1.0, 1.0)
        }
        self.mean = float(np.sum(np.exp(log_p) * loss))  # KL(P || Q)

    def tail_bound(self, sign: float, num_steps: int, log_tail: float) -> float:
        """w with P(sign * (sum of num_steps losses) > w) <= exp(log_tail) (Chernoff)."""
        return float(np.min((num_steps * self.log_mgf[sign] - log_tail) / self.lam))


class _Plan(NamedTuple):
    """Windows of one step and of the composition of ``max_steps`` steps."""

    one_step: _Window
    composed: _Window
    mgf: _LossMGF
    max_steps: int


def _plan(relation: Relation, sigma: float, q: float, max_steps: int, delta_scale: float) -> _Plan:
    """Windows that lose at most ``_WRAP_FRACTION * delta_scale / 2`` of the mass on each side."""
    log_tail = math.log(_WRAP_FRACTION * delta_scale / 2.0)
    one_step = _one_step_window(relation, sigma, q, math.exp(log_tail) / max_steps)
    mgf = _LossMGF(relation, sigma, q)
    chernoff = _Window(mgf.tail_bound(-1.0, max_steps, log_tail), mgf.tail_bound(1.0, max_steps, log_tail))
    # The composed loss lies within T times one step's window; Chernoff is tighter for large T.
    composed = _Window(*(min(max_steps * a, max(c, a)) for a, c in zip(one_step, chernoff)))
    return _Plan(one_step, composed, mgf, max_steps)


# ---------------------------------------------------------------------------------------------
# The Fourier path.


def _one_step_pmf(relation: Relation, sigma: float, q: float, dx: float, half: int) -> np.ndarray:
    """Probabilities of one step's loss at ``x_j = (j - half) dx``, by fourier-accountant."""
    code = "R" if relation is Relation.ADD_REMOVE else "S"
    try:
        with np.errstate(all="ignore"):
            _, cfx, dx_fa = _evaluate_pld(code, np.array([sigma]), np.array([q]), np.array([1]), 2 * half, half * dx)
    except (ValueError, OverflowError) as err:
        raise _Untrusted(f"fourier-accountant failed: {err}") from err
    if dx_fa != dx:  # exact: grid steps are powers of two
        raise _Untrusted(f"fourier-accountant changed the grid step from {dx} to {dx_fa}")
    pmf = np.real(cfx) * dx
    if not np.all(np.isfinite(pmf)):
        raise _Untrusted("fourier-accountant produced non-finite densities")
    return pmf


class _FourierPLD:
    """One step's discretised PLD, Fourier-transformed once, composed for any number of steps.

    The composed grid has ``nx`` points in FFT order: ``x = i dx`` for ``i < nx - n_neg`` and
    ``x = (i - nx) dx`` for the last ``n_neg`` points, which hold the negative losses.
    """

    def __init__(
        self,
        relation: Relation,
        sigma: float,
        q: float,
        dx: float,
        one_step: _Window,
        n_neg: int,
        nx: int,
        max_steps: int,
    ):
        half = _one_step_half_size(one_step, dx)
        pmf = _one_step_pmf(relation, sigma, q, dx, half)
        above = pmf[half : half + math.ceil(one_step.above / dx) + 1]
        below = pmf[half - math.ceil(one_step.below / dx) - 1 : half]
        mass_error = max_steps * abs(float(np.sum(above) + np.sum(below)) - 1.0)
        if mass_error > _MASS_TOL:
            raise _Unconverged(mass_error)
        ordered = np.zeros(nx)
        ordered[: above.size] = above
        ordered[nx - below.size :] = below
        spectrum = scipy.fft.rfft(ordered, workers=-1)
        # Powers as exp(T log F) are much faster than complex integer powers, and as accurate.
        self.log_spectrum = np.log(np.where(spectrum == 0.0, 1e-300, spectrum))
        self.nx = nx
        self.n_pos = nx - n_neg
        self.x_pos = np.arange(1, self.n_pos) * dx

    def positive_part(self, num_steps: int) -> np.ndarray:
        """Probabilities of the composed loss at ``x_pos > 0``, the part that enters delta."""
        composed = scipy.fft.irfft(np.exp(num_steps * self.log_spectrum), n=self.nx, workers=-1)
        return composed[1 : self.n_pos]


def _one_step_half_size(one_step: _Window, dx: float) -> int:
    """fourier-accountant evaluates one step on [-half dx, half dx), a fast FFT length for numpy."""
    return scipy.fft.next_fast_len(math.ceil(max(one_step) / dx) + 2, real=True)


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
    eps = math.log((s0[j] - target_delta) / s1[j])
    return float(min(max(eps, x_pos[j - 1] if j > 0 else 0.0), x_pos[j]))


def _delta_from_pmf(x_pos: np.ndarray, p_pos: np.ndarray, eps: float) -> float:
    above = x_pos > eps
    return float(np.sum(-np.expm1(eps - x_pos[above]) * p_pos[above]))


def _initial_dx(relation: Relation, sigma: float, q: float) -> float:
    """A grid step somewhat coarser than needed; refinement halves it until results agree."""
    if relation is Relation.ADD_REMOVE:
        # One step's loss piles up just above log(1 - q), on a scale ~ q exp(-(4 sigma + 1/2) / sigma^2).
        scale = q * math.exp(-(4.0 * sigma + 0.5) / sigma**2)
    else:
        scale = q * math.exp(-0.5 / sigma**2) / sigma
    return min(2.0 ** math.floor(math.log2(max(scale, 1e-300))), _DX_COARSEST)


def _fourier_values(
    relation: Relation,
    sigma: float,
    q: float,
    steps: np.ndarray,
    plan: _Plan,
    evaluate: Callable[[_FourierPLD, int], float],
    atol: float,
) -> np.ndarray:
    """``evaluate(pld, T)`` for every T, on grids halved until two successive ones agree."""
    if plan.composed.above > _MAX_WINDOW:
        raise _Untrusted(f"the composed privacy loss needs a window up to {plan.composed.above:.0f}")
    dx = _initial_dx(relation, sigma, q)

    def grid(dx: float) -> tuple[int, int]:
        """Points of the negative part and of the whole composed grid (a fast FFT length)."""
        if 2.0 * max(plan.one_step) / dx > _MAX_NX_ONE_STEP or sum(plan.composed) / dx > _MAX_NX:
            raise _Untrusted(f"a grid step of {dx:.2g} exceeds the grid budget")
        n_neg = math.ceil(plan.composed.below / dx) + 1
        nx = scipy.fft.next_fast_len(n_neg + math.ceil(plan.composed.above / dx) + 1, real=True)
        if 2 * _one_step_half_size(plan.one_step, dx) > _MAX_NX_ONE_STEP or nx > _MAX_NX:
            raise _Untrusted(f"a grid step of {dx:.2g} exceeds the grid budget")
        return n_neg, nx

    previous, last_mass_error = None, None
    while True:
        try:
            pld = _FourierPLD(relation, sigma, q, dx, plan.one_step, *grid(dx), plan.max_steps)
            values = np.array([evaluate(pld, int(t)) for t in steps])
        except _Unconverged as unconverged:
            # Give up early when the grid that would conserve mass (and the next finer one, for the
            # refinement check) cannot fit: the mass error falls by a factor `rate` per halving.
            (mass_error,) = unconverged.args
            rate = 30.0 if last_mass_error is None else min(max(last_mass_error / mass_error, 4.0), 1e3)
            halvings = math.ceil(math.log(mass_error / _MASS_TOL) / math.log(rate))
            grid(dx / 2.0 ** (halvings + 1))
            values, last_mass_error = None, mass_error
        if values is not None and previous is not None:
            if np.all(np.abs(values - previous) <= _REFINE_RTOL * np.abs(values) + atol):
                return values
        previous = values
        dx /= 2.0


# ---------------------------------------------------------------------------------------------
# Full batch (q = 1): the Gaussian mechanism, its loss N(mu^2/2, mu^2) with mu = sens sqrt(T) / sigma.


def _full_batch_mu(relation: Relation, sigma: float, num_steps: int) -> float:
    sensitivity = 1.0 if relation is Relation.ADD_REMOVE else 2.0
    return sensitivity * math.sqrt(num_steps) / sigma


def _gaussian_delta(mu: float, eps: float) -> float:
    """delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu), for the loss X ~ N(mu^2/2, mu^2)."""
    a = scipy.special.log_ndtr(mu / 2.0 - eps / mu)
    b = eps + scipy.special.log_ndtr(-mu / 2.0 - eps / mu)
    return float(np.exp(a) * -np.expm1(b - a))


def _gaussian_epsilon(mu: float, target_delta: float) -> float:
    if _gaussian_delta(mu, 0.0) <= target_delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(mu, hi) > target_delta:
        hi *= 2.0
    log_target = math.log(target_delta)
    return scipy.optimize.brentq(
        lambda e: math.log(max(_gaussian_delta(mu, e), 1e-300)) - log_target, 0.0, hi, xtol=1e-14, rtol=1e-13
    )


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


def _epsilon_values(relation: Relation, sigma: float, q: float, steps: np.ndarray, target_delta: float) -> np.ndarray:
    if q == 1.0:
        return np.array([_gaussian_epsilon(_full_batch_mu(relation, sigma, int(t)), target_delta) for t in steps])
    plan = _plan(relation, sigma, q, int(steps.max()), target_delta)
    try:
        return _fourier_values(
            relation,
            sigma,
            q,
            steps,
            plan,
            lambda pld, t: _epsilon_from_pmf(pld.x_pos, pld.positive_part(t), target_delta),
            _EPS_ATOL,
        )
    except _Untrusted:
        return _dp_accounting_values(
            relation, sigma, q, steps, plan, lambda pld: pld.get_epsilon_for_delta(target_delta), _EPS_ATOL
        )


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
    sigma, q, target_delta = _check_positive("sigma", sigma), _check_q(q), _check_delta(delta)
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
    sigma, q, eps = _check_positive("sigma", sigma), _check_q(q), _check_positive("epsilon", epsilon)
    steps, scalar = _check_steps(num_steps)
    if not scalar:
        raise TypeError(f"num_steps must be a single integer for delta(), got {num_steps!r}")
    if q == 1.0:
        return _gaussian_delta(_full_batch_mu(relation, sigma, int(steps)), eps)
    plan = _plan(relation, sigma, q, int(steps), _DELTA_FLOOR)
    try:
        (value,) = _fourier_values(
            relation,
            sigma,
            q,
            steps.reshape(1),
            plan,
            lambda pld, t: _delta_from_pmf(pld.x_pos, pld.positive_part(t), eps),
            0.0,
        )
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

    The root of ``epsilon(sigma) = target`` is bracketed and the bracket shrunk (Illinois
    regula falsi in log-log space) until its ends are within a factor ``1 + tol``; the upper end,
    whose epsilon has been computed and is at most the target, is returned.

    :param epsilon: target epsilon > 0.
    :param delta: target delta in (0, 1).
    :param q: sampling rate in (0, 1].
    :param num_steps: number of steps.
    :param relation: the :class:`Relation` that matches the minibatch sampler.
    :param tol: relative width of the final bracket on sigma, in (0, 0.5].
    :return: ``SigmaResult(sigma, epsilon, num_evaluations)`` with ``epsilon <= target``.

    **Example**

    .. doctest::

        >>> from d3pext.accountants import approximate_sigma
        >>> sigma, eps, n = approximate_sigma(1.0, 1e-5, 0.01, 10_000, relation="add_remove")
        >>> round(sigma, 2), eps <= 1.0
        (3.81, True)
    """
    relation = _as_relation(relation)
    target, target_delta, q = _check_positive("epsilon", epsilon), _check_delta(delta), _check_q(q)
    steps, scalar = _check_steps(num_steps)
    if not scalar:
        raise TypeError(f"num_steps must be a single integer, got {num_steps!r}")
    tol = _as_float("tol", tol)
    if not 0.0 < tol <= 0.5:
        raise ValueError(f"tol must lie in (0, 0.5], got {tol!r}")

    evaluations = 0

    def excess(log_sigma: float) -> tuple[float, float]:
        """log(epsilon / target) at sigma = exp(log_sigma), and epsilon."""
        nonlocal evaluations
        evaluations += 1
        eps = float(_epsilon_values(relation, math.exp(log_sigma), q, steps.reshape(1), target_delta)[0])
        return math.log(max(eps, 1e-300) / target), eps

    def guess(target_eps: float) -> float:
        return math.log(_sigma_guess(relation, target_eps, target_delta, q, int(steps)))

    # Bracket the root in log sigma, starting from a central-limit guess; the second point carries
    # the guess's error at the first over as a factor on epsilon.
    width_tol = math.log1p(tol)
    first = guess(target)
    f_first, eps_first = excess(first)
    direction = 1.0 if f_first > 0.0 else -1.0  # the way sigma has to move
    corrected = guess(target * min(max(target / max(eps_first, 1e-300), 0.25), 4.0))
    step = max(direction * (corrected - first), 0.0) + 0.5 * width_tol
    ends = [(first, f_first, eps_first)]
    while True:
        point = ends[-1][0] + direction * step
        ends.append((point, *excess(point)))
        if (ends[-1][1] > 0.0) != (f_first > 0.0):
            break
        step *= 2.0
    (lo, f_lo, _), (hi, f_hi, eps_hi) = sorted(ends[-2:])

    # Illinois regula falsi; new points kept a little inside the bracket so that both ends move.
    side = 0
    while hi - lo > width_tol:
        margin = 0.4 * width_tol
        if hi - lo <= 2.5 * margin:
            new = 0.5 * (lo + hi)
        else:
            new = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            new = min(max(new, lo + margin), hi - margin)
        f_new, eps_new = excess(new)
        if f_new > 0.0:
            lo, f_lo = new, f_new
            if side == 1:
                f_hi /= 2.0
            side = 1
        else:
            hi, f_hi, eps_hi = new, f_new, eps_new
            if side == -1:
                f_lo /= 2.0
            side = -1
    return SigmaResult(math.exp(hi), eps_hi, evaluations)


def _sigma_guess(relation: Relation, target: float, target_delta: float, q: float, num_steps: int) -> float:
    """sigma at which a central-limit approximation of the composed PLD meets the target.

    The composed loss is approximated by the Gaussian mechanism's N(mu^2/2, mu^2) with mu^2 equal to
    T times the chi^2 divergence of one step's pair; for small q that is
    q^2 (e^{1/s^2} - 1) (add/remove) and 2 q^2 (e^{1/s^2} - e^{-1/s^2}) (substitute); exact for q = 1.
    """
    # mu with Gaussian epsilon(mu) = target (epsilon grows with mu), within [1e-6, 1e4].
    excess = lambda log_mu: _gaussian_epsilon(math.exp(log_mu), target_delta) - target
    bounds = (math.log(1e-6), math.log(1e4))
    if excess(bounds[0]) >= 0.0 or excess(bounds[1]) <= 0.0:
        log_mu = bounds[0] if excess(bounds[0]) >= 0.0 else bounds[1]
    else:
        log_mu = scipy.optimize.brentq(excess, *bounds, xtol=1e-6)
    mu2 = math.exp(2.0 * log_mu)
    if q == 1.0:
        return _full_batch_mu(relation, 1.0, num_steps) / math.sqrt(mu2)
    k = mu2 / (num_steps * q**2)  # e^{1/s^2} - 1 (add/remove) or 2 sinh(1/s^2) (substitute)
    return 1.0 / math.sqrt(math.log1p(k) if relation is Relation.ADD_REMOVE else math.asinh(k / 2.0))
