"""Mechanisms for locally private counts (Schein et al., seed 002).

Each confidential count is released through a two-sided geometric mechanism
(:class:`~d3pext.releases.mechanisms.GeometricMechanism`); Theorem 1 makes each observation
``(N, epsilon)``-private with ``alpha = exp(-epsilon / N)`` (:func:`limited_precision_mechanism`).
:class:`HeterogeneousGeometricMechanism` gives each count its own ``alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
import math
from typing import Any, ClassVar, Optional

import numpy as np

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

import numpyro.distributions as dist

from d3pext.distributions import TwoSidedGeometric
from d3pext.dtypes import as_int_dtype
from d3pext.releases.exact import KeyBits, discrete_laplace
from d3pext.releases.mechanisms import GeometricMechanism, Mechanism

__all__ = ["HeterogeneousGeometricMechanism", "check_counts", "limited_precision_mechanism"]

Array = jax.Array


def limited_precision_mechanism(epsilon: float, N: int = 1) -> GeometricMechanism:
    r"""The geometric mechanism that makes each observation ``(N, epsilon)``-private (seed 002,
    Theorem 1): ``alpha = exp(-epsilon / N)``, so that observations within L1 distance ``N``
    (e.g. a document and one with up to ``N`` more or fewer word tokens) are
    ``epsilon``-indistinguishable.

    >>> m = limited_precision_mechanism(2.0, N=4)
    >>> round(m.alpha, 4), m.sensitivity
    (0.6065, 4.0)
    """
    if isinstance(N, bool) or not np.isscalar(N) or not (N >= 1 and float(N) == int(N)):
        raise ValueError(f"N must be a positive integer (the L1 neighbourhood), got {N!r}.")
    if not np.isscalar(epsilon) or not (math.isfinite(float(epsilon)) and float(epsilon) > 0):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}.")
    return GeometricMechanism(float(epsilon), sensitivity=float(N))


def _nested_tuple(x: np.ndarray):
    return tuple(_nested_tuple(v) for v in x) if x.ndim else float(x)


@dataclass(frozen=True)
class HeterogeneousGeometricMechanism(Mechanism):
    r"""Two-sided geometric noise with a decay per record (or per group of records), e.g. one
    ``alpha_d`` per document as in seed 002, section 5.1: ``release = value + 2Geo(alpha)`` with
    ``alpha`` broadcast against the released counts (``alpha[:, None]`` for one per row).

    Record ``i`` is ``(N, N ln(1/alpha_i))``-private; :attr:`epsilon` (what the ledger records)
    is the guarantee that holds for every record, ``N ln(1 / min(alpha))``. Float-safe like
    :class:`~d3pext.releases.mechanisms.GeometricMechanism`: :meth:`release` draws exact
    discrete Laplace noise, ``P(k) ~ exp(-|k| ln(1/alpha_i))`` with ``ln(1/alpha_i)`` as the float
    the ledger's epsilon is computed from, one exact scale per distinct ``alpha``.

    :param alpha: decays in (0, 1), any shape broadcastable to the counts.
    :param sensitivity: ``N``, the L1 neighbourhood of an observation (default 1).

    >>> import numpy as np
    >>> m = HeterogeneousGeometricMechanism.from_alpha(np.array([[0.5], [0.9]]), sensitivity=2)
    >>> round(m.epsilon, 4), m.log_alpha.shape
    (1.3863, (2, 1))
    """

    kind: ClassVar[str] = "geometric"
    float_safe: ClassVar[bool] = True
    alpha: Any = 0.5
    sensitivity: Optional[float] = 1.0
    neighbouring: str = "substitute"
    _shape: tuple = field(default=(), repr=False)

    def __post_init__(self) -> None:
        a = np.asarray(self.alpha, np.float64)
        if a.size == 0 or not np.all((a > 0) & (a < 1)):
            raise ValueError(f"alpha must lie in (0, 1) for every record, got {self.alpha!r}.")
        object.__setattr__(self, "alpha", _nested_tuple(a))
        object.__setattr__(self, "_shape", a.shape)
        self._validate_common()

    @classmethod
    def from_alpha(
        cls, alpha: ArrayLike, sensitivity: float = 1.0, neighbouring: str = "substitute"
    ) -> "HeterogeneousGeometricMechanism":
        """The mechanism with per-record decays ``alpha``."""
        return cls(np.asarray(alpha), sensitivity, neighbouring)

    @property
    def epsilon(self) -> float:
        return self._require_sensitivity() * max(_unique_rates(self.alpha)[1])

    @property
    def delta(self) -> float:
        return 0.0

    @property
    def log_alpha(self) -> np.ndarray:
        return np.log(np.asarray(self.alpha, np.float64)).reshape(self._shape)

    def noise_distribution(self) -> dist.Distribution:
        return TwoSidedGeometric(log_alpha=jnp.asarray(self.log_alpha))

    def release_distribution(self, value: ArrayLike) -> dist.Distribution:
        return TwoSidedGeometric(log_alpha=jnp.asarray(self.log_alpha), loc=value)

    def noise_icdf(self, u: ArrayLike) -> Array:
        return self.noise_distribution().icdf(u)

    def _check_value(self, value: ArrayLike) -> None:
        check_counts(value, "the released value", nonnegative=False)
        try:
            fits = np.broadcast_shapes(self._shape, np.shape(value)) == np.shape(value)
        except ValueError:
            fits = False
        if not fits:  # a wider alpha would release each count several times, at the cost of one
            raise ValueError(
                f"alpha of shape {self._shape} does not broadcast to the counts of shape "
                f"{np.shape(value)} (one alpha per count)."
            )

    def _exact_draw(self, bits: KeyBits, value: np.ndarray, size: int) -> np.ndarray:
        # alpha_i^|k| = exp(-|k| / t_i), t_i = 1 / ln(1 / alpha_i) as an exact rational of the float rate
        alpha = np.broadcast_to(np.asarray(self.alpha, np.float64).reshape(self._shape), value.shape)
        noise = np.zeros(value.shape, np.int64)
        for a, rate in zip(*_unique_rates(alpha)):
            where = alpha == a
            noise[where] = discrete_laplace(bits, 1 / Fraction(rate), (int(where.sum()),))
        return as_int_dtype(value.astype(np.int64) + noise, "the released counts")

    def flattened(self, shape: tuple[int, ...]) -> "HeterogeneousGeometricMechanism":
        """The mechanism for counts of ``shape`` raveled to one axis (alpha broadcast and raveled)."""
        alpha = np.broadcast_to(np.asarray(self.alpha, np.float64).reshape(self._shape), shape)
        return HeterogeneousGeometricMechanism(alpha.ravel(), self.sensitivity, self.neighbouring)

    def noise_parameters(self) -> dict:
        return {
            "alpha_min": float(np.min(self.alpha)),
            "alpha_max": float(np.max(self.alpha)),
        }

    def release_parameters(self) -> dict:
        # every count's alpha, not only the extremes: counts released at other alphas than analysed
        # (alphas swapped between counts) kept the extremes and had passed the check
        return {"alpha": np.asarray(self.alpha, np.float64).reshape(self._shape).tolist()}


def _unique_rates(alpha) -> tuple[np.ndarray, list[float]]:
    """The distinct decays and their rates ``ln(1 / alpha)``, each computed once, as Python floats."""
    distinct = np.unique(np.asarray(alpha, np.float64))
    return distinct, [-math.log(float(a)) for a in distinct]


def check_counts(value: ArrayLike, what: str = "counts", nonnegative: bool = True) -> np.ndarray:
    """``value`` as an integer array; a clear ``ValueError`` for non-integer (or negative) counts.

    >>> check_counts([0, 3, 2]).dtype.kind
    'i'
    """
    x = np.asarray(value)
    if x.dtype == bool or not (
        np.issubdtype(x.dtype, np.integer)
        or (np.issubdtype(x.dtype, np.floating) and np.all(np.isfinite(x)) and np.all(x == np.round(x)))
    ):
        raise ValueError(f"{what} must be integers, got {x.dtype} values such as {x.ravel()[:3]}.")
    if nonnegative and np.any(x < 0):
        raise ValueError(f"{what} must be non-negative integers (confidential counts).")
    return as_int_dtype(x, what)

