"""Release mechanisms: how a curator privatizes a statistic, and what an analyst must model.

Each mechanism is a frozen (hashable) dataclass that gives the law of a release given the
confidential value (:meth:`Mechanism.release_distribution`, for inference), draws releases
(:meth:`Mechanism.release`, for the curator), exposes the quantile function of its noise
(:meth:`Mechanism.noise_icdf`, :meth:`Mechanism.release_icdf`, for randomized quasi-Monte Carlo)
and reports its privacy cost (:meth:`Mechanism.cost`) for the
:class:`~d3pext.accountants.ledger.PrivacyLedger`.

``sensitivity`` is the largest change of the released statistic between neighbouring data sets
under the mechanism's ``neighbouring`` relation (``"substitute"``: replace one record;
``"add_remove"``: add or remove one record): L1 for Laplace, geometric and binomial, L2 for
Gaussian. ``None`` means "not known yet": the privatize handler derives it from declared bounds
and calls :meth:`Mechanism.with_sensitivity`.

**Threat model.** The adversary sees every release, knows the mechanism, its parameters and the
code, and may know every record but one; the guarantee is the stated (epsilon, delta) between
neighbouring data sets. What is protected, and how:

- *Floating-point leaks* (Mironov 2012): a release ``value + scale * (E0 - E1)`` computed in
  floating point has outputs whose low-order bits depend on the input. The Laplace, Gaussian and
  geometric mechanisms are **float-safe**: :meth:`Mechanism.release` maps the value to a grid of
  spacing ``sensitivity / resolution`` by exact randomized rounding, adds exact discrete Laplace
  or discrete Gaussian noise (Canonne, Kamath & Steinke 2020, :mod:`d3pext.releases.exact`) with
  integer arithmetic only, and returns the grid point: a function of an integer that is
  differentially private as such. The Laplace cost is exactly its epsilon, with noise
  ``1 + 1/resolution`` times the nominal scale: one grid unit per value for the randomized
  rounding and one in all for the float rounding of the statistic (under a unit: the statistic
  below ``2^49`` units in L1, computed in float64 by :func:`~d3pext.handlers.privatize.make_release`). The
  scalar discrete Gaussian's exact delta is checked against the target (Theorem 7); vectors are
  accounted as the continuous Gaussian at the rounding-inflated sensitivity (their noise is
  ``(r + sqrt(d) + 1) / r`` times the nominal sigma, ``r = resolution * ceil(sqrt(d))``: 1.0012 for
  ``d = 2`` at the default resolution), and the ledger composes Gaussian releases as continuous
  Gaussians (their single-release curves agree to 1e-4 relative at the default resolution). The
  release is returned in the default float dtype; where float32's spacing at the released values
  exceeds 1/4 of the noise's scale it warns (:class:`ReleasePrecisionWarning`). The binomial
  mechanism still samples in floating point.
- *Predictable noise*: without a key, noise comes from a ChaCha20 key seeded by OS entropy
  (:func:`d3pext.prng.secure_key`); an explicit key warns (:class:`ReproducibleReleaseWarning`).
- *Bad inputs*: non-finite values are refused; a non-integer sensitivity of the geometric
  mechanism (which would double its true epsilon) is refused.
- *Not covered*: the sensitivity is the curator's declaration (bounds, clamping, the statistic).
  :func:`~d3pext.handlers.privatize.make_release` computes the statistics it releases from concrete data
  in float64 (sums correctly rounded, integer sums exact), so they move between neighbours by
  the sensitivity plus under a grid unit; a statistic computed by the caller and passed to
  :meth:`Mechanism.release` is trusted to that precision (a float32 mean of 1e7 records can move
  by 20 times its sensitivity). Side channels such as timing are not addressed.

For inference, :meth:`Mechanism.release_distribution` is the continuous law of the nominal
noise (``1/resolution`` narrower than the noise drawn, 0.1% at the default). For a scalar Laplace
release the exact law of the grid point differs from ``grid *`` the continuous density of its own
scale by a factor within ``exp(+-(1/t + 1/(12 t^2)))``, ``t = (resolution + 1) / epsilon``
(``tests/test_exact.py`` checks the bound), so posteriors are unchanged to that factor.
"""

import abc
import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache, partial
from fractions import Fraction
import math
import warnings
from typing import ClassVar, Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.scipy.special import betainc, ndtri
from jax.typing import ArrayLike
import numpy as np

import numpyro.distributions as dist
from numpyro.distributions import Distribution
from numpyro.util import not_jax_tracer

from d3pext.accountants.ledger import (
    NEIGHBOURING_RELATIONS,
    PrivacyCost,
    analytic_gaussian_delta,
    analytic_gaussian_epsilon,
    analytic_gaussian_noise_multiplier,
)
from d3pext.distributions.geometric import TwoSidedGeometric
from d3pext.dtypes import as_int_dtype, float_dtype
from d3pext.releases.exact import (
    KeyBits,
    discrete_gaussian,
    discrete_gaussian_delta,
    discrete_laplace,
    randomized_round,
)
from d3pext.prng import secure_key
from d3pext.validation import check_finite, check_positive, check_positive_int, check_real

__all__ = [
    "ReleasePrecisionWarning",
    "ReproducibleReleaseWarning",
    "BinomialMechanism",
    "GaussianMechanism",
    "GeometricMechanism",
    "LaplaceMechanism",
    "Mechanism",
]

Array = jax.Array


DEFAULT_RESOLUTION = 1024
"""Released values of the Laplace and Gaussian mechanisms lie on the grid ``sensitivity /
resolution``: fine enough that the release law is the continuous one up to a factor
``exp(+-1/(2 t))`` in the likelihood (``t = resolution / epsilon`` for Laplace)."""


def to_grid_units(value: np.ndarray, sensitivity: float, resolution: int, size: int = 1) -> np.ndarray:
    """``value * resolution / sensitivity`` as exact rationals (floats at their binary value), for
    releases of ``size`` values each (the trailing ones of ``value``)."""
    ratio = Fraction(resolution) / Fraction(sensitivity)
    flat = [Fraction(float(v)) * ratio for v in np.asarray(value, dtype=np.float64).reshape(-1)]
    # below 2^49 grid units in L1, a float64 statistic rounded twice per value (a correctly
    # rounded sum, then a division) moves neighbours' values apart by under a quarter unit in all,
    # which the mechanisms' one unit of slack absorbs
    total = max((sum(abs(a) for a in flat[i:i + size]) for i in range(0, len(flat), size)), default=0)
    if total >= 2**49:
        raise ValueError(
            "the statistic is too large for its sensitivity: the sum of |value| / sensitivity * "
            f"resolution must stay below 2^49 (got {float(total):.3g}); lower the mechanism's "
            "resolution or rescale the statistic."
        )
    return np.array(flat, dtype=object).reshape(np.shape(value))


def from_grid_units(units: np.ndarray, sensitivity: float, resolution: int, like: np.ndarray) -> np.ndarray:
    """The grid points ``units * sensitivity / resolution``, in the floating dtype of ``like``
    (a deterministic function of the integers: post-processing)."""
    return (np.asarray(units, dtype=np.float64) * (sensitivity / resolution)).astype(float_dtype(like))


@lru_cache(maxsize=256)
def _discrete_gaussian_variance(
    epsilon: float, delta: float, noise_multiplier: float, resolution: int, size: int
) -> Fraction:
    """``sigma^2`` in grid units of the discrete Gaussian release: the noise multiplier times the
    sensitivity after randomized rounding, with one unit for the float rounding of the statistic
    (under one unit: see :func:`to_grid_units`): ``resolution + 1`` for a scalar (an integer: the
    rounded values of neighbours differ by ``ceil(y) < y + 1``), at most ``resolution +
    sqrt(size) + 1`` in L2 for a vector. For a scalar, raised until the exact discrete ``delta``
    (Canonne et al., Theorem 7) meets the target; vectors are accounted as the continuous Gaussian
    at that sensitivity (their discrete privacy curve is not computed here)."""
    sensitivity = resolution + 1 if size == 1 else resolution + math.sqrt(size) + 1
    sigma = noise_multiplier * sensitivity

    def rounded_up(sigma: float) -> Fraction:
        # sigma^2 rounded up to a multiple of 1/q with about 20 significant bits: more noise than
        # asked for by at most a relative 2^-20, and small integers for the exact sampler
        exact = Fraction(sigma) ** 2
        q = 2 ** max(0, 20 - int(exact).bit_length())
        return Fraction(math.ceil(exact * q), q)

    while size == 1 and discrete_gaussian_delta(epsilon, rounded_up(sigma), resolution + 1) > delta:
        sigma *= 1 + 2**-20
    return rounded_up(sigma)


class ReproducibleReleaseWarning(UserWarning):
    """A release drawn from an explicit key: anyone who has the key can reproduce its noise."""


class ReleasePrecisionWarning(UserWarning):
    """A release returned in a float dtype (float32 while JAX's 64-bit types are off) whose spacing at the
    released values is more than 1/4 of the noise's scale: the rounding moves the release off the law
    that inference assumes."""


def warn_reproducible(stacklevel: int = 2) -> None:
    """Warn that a release uses an explicit key (:class:`ReproducibleReleaseWarning`)."""
    warnings.warn(
        "this release draws its noise from an explicit key, so anyone who has the key can "
        "reproduce the noise and subtract it. Pass rng_key=None for a real release (OS entropy), "
        "or reproducible=True to say that this is a simulation or a test.",
        ReproducibleReleaseWarning,
        stacklevel=stacklevel + 1,
    )


@partial(jax.jit, static_argnums=0)
def _binomial_icdf(total_count: int, probs: Array, u: Array) -> Array:
    n = total_count
    u, probs = jnp.broadcast_arrays(u, probs)

    def body(_, bounds):  # invariant: cdf(lo) < u <= cdf(hi)
        lo, hi = bounds
        mid = jnp.floor((lo + hi) / 2)
        k = jnp.clip(mid, 0, n - 1)
        above = betainc(n - k, k + 1, 1 - probs) >= u
        open_ = hi - lo > 1
        return jnp.where(open_ & ~above, mid, lo), jnp.where(open_ & above, mid, hi)

    bounds = (jnp.full_like(u, -1.0), jnp.full_like(u, float(n)))
    _, hi = lax.fori_loop(0, math.ceil(math.log2(n + 1)) + 1, body, bounds)
    return jnp.where(u <= 0, 0.0, hi)


@partial(jax.jit, static_argnums=0)
def _draw(mechanism: "Mechanism", rng_key: Array, value: Array) -> Array:
    # Compiled once per mechanism (hashable) and value shape.
    return mechanism._draw(rng_key, value)


class Mechanism(abc.ABC):
    """A release mechanism (abstract base class; subclasses are frozen dataclasses).

    Attributes every mechanism has: ``epsilon`` and ``delta`` (privacy cost of one release at
    its sensitivity), ``sensitivity`` (``None`` until known) and ``neighbouring``.
    """

    kind: ClassVar[str]
    #: releases are drawn with exact integer arithmetic from the key's bits (no float noise)
    float_safe: ClassVar[bool] = False
    epsilon: float
    delta: float
    sensitivity: Optional[float]
    neighbouring: str

    def _validate_common(self) -> None:
        if self.neighbouring not in NEIGHBOURING_RELATIONS:
            raise ValueError(
                f"neighbouring must be one of {NEIGHBOURING_RELATIONS}, got {self.neighbouring!r}"
            )
        if self.sensitivity is not None:
            object.__setattr__(self, "sensitivity", check_positive("sensitivity", self.sensitivity))

    def _require_sensitivity(self) -> float:
        if self.sensitivity is None:
            raise ValueError(
                f"{type(self).__name__} has no sensitivity yet: declare bounds on the privatized"
                " statistic or call .with_sensitivity(...)"
            )
        return self.sensitivity

    def with_sensitivity(self, sensitivity: float) -> "Mechanism":
        """The same mechanism, calibrated to a statistic of the given sensitivity."""
        return dataclasses.replace(self, sensitivity=sensitivity)

    @abc.abstractmethod
    def release_distribution(self, value: ArrayLike) -> Distribution:
        """The law ``p(release | value)`` of a release of the confidential ``value``."""

    def noise_distribution(self) -> Optional[Distribution]:
        """Additive mechanisms: the law of ``release - value``; ``None`` otherwise."""
        return None

    def noise_icdf(self, u: ArrayLike) -> Array:
        """Additive mechanisms: quantile function of the noise, computed in the dtype of ``u``.

        Pass float64 ``u`` (under ``jax.enable_x64``) for quantiles near 0 or 1.
        """
        raise NotImplementedError(
            f"{type(self).__name__} is not additive; use release_icdf(value, u)"
        )

    def release_icdf(self, value: ArrayLike, u: ArrayLike) -> Array:
        """Quantile function of the release given ``value`` (``value + noise_icdf(u)``)."""
        return value + self.noise_icdf(u)

    def noise_parameters(self) -> dict:
        """The noise parameters recorded with the cost (``scale``, ``sigma``, ``alpha``, ...)."""
        return {}

    def release_parameters(self) -> dict:
        """The noise parameters in full, recorded with each release
        (:func:`~d3pext.releases.info.describe_release`): an analysis must assume exactly these."""
        return self.noise_parameters()

    def cost(self) -> PrivacyCost:
        """The privacy cost of one release, for the ledger."""
        return PrivacyCost(
            self.kind,
            self.epsilon,
            self.delta,
            self.neighbouring,
            noise_multiplier=getattr(self, "noise_multiplier", None) if self.kind == "gaussian" else None,
            parameters={"sensitivity": self._require_sensitivity(), **self.noise_parameters()},
        )

    def _check_value(self, value: ArrayLike) -> None:
        """Curator-side checks of a concrete confidential value (none by default)."""

    def _check_precision(self, value: ArrayLike) -> None:
        """Warn (:class:`ReleasePrecisionWarning`) where the float dtype the release of ``value`` is returned
        in (float32 while JAX's 64-bit types are off) is spaced wider than 1/4 of the noise's scale at
        the released values: the release keeps its privacy but not the law inference assumes (a mean of
        1e7 birth years released at scale 1.2e-5 came back as one of 3 float32 values, its error 4.7
        scales in sd instead of 1.4)."""
        parameters = self.noise_parameters()
        spread = parameters.get("scale", parameters.get("sigma"))  # None for integer noise
        if spread is None or not not_jax_tracer(value):
            return
        dtype = float_dtype(value)
        top = float(np.max(np.abs(np.asarray(value, np.float64)), initial=0.0)) + 40.0 * spread
        spacing = float(np.spacing(np.asarray(top, dtype)))
        if spacing > spread / 4:  # rounding then adds under 0.3% to the variance, and shifts by under 1/8 scale
            warnings.warn(
                f"{type(self).__name__}.release: values near {top:.6g} are {np.dtype(dtype).name} numbers "
                f"{spacing:.3g} apart, more than 1/4 of the noise's scale {spread:.3g}: the release is rounded "
                "off the law that inference assumes (its privacy is kept). Enable 64-bit types first, "
                "jax.config.update('jax_enable_x64', True), or release a statistic of smaller magnitude "
                "(e.g. centred on a public value).",
                ReleasePrecisionWarning,
                stacklevel=4,
            )

    def release(
        self,
        rng_key: Optional[Array],
        value: ArrayLike,
        *,
        reproducible: bool = False,
        statistic_shape: Optional[tuple[int, ...]] = None,
    ) -> Array:
        """Draw a release of ``value`` (the curator's side).

        :param rng_key: ``None`` (the default, what a real release should do) draws the noise
            from a ChaCha20 key seeded by OS entropy (:func:`d3pext.prng.secure_key`). A key makes
            the noise reproducible by anyone who has it: it warns
            (:class:`ReproducibleReleaseWarning`) unless ``reproducible=True``, for simulations
            and tests.
        :param value: the confidential statistic; it must be finite.
        :param statistic_shape: for a local release (one statistic per record, as
            ``privatize(..., statistic="records")`` makes), the shape of one record's statistic:
            ``value`` stacks them along its leading axes, and the sensitivity bounds each record's
            change. Neighbours then differ in one record's statistic only, so each is released on its
            own grid (float-safe mechanisms); ``None``: ``value`` is one statistic.
        """
        if statistic_shape is not None:
            statistic_shape = tuple(int(k) for k in statistic_shape)
            shape = np.shape(value)
            if shape[len(shape) - len(statistic_shape):] != statistic_shape or len(shape) < len(statistic_shape):
                raise ValueError(
                    f"statistic_shape {statistic_shape} must be the trailing shape of the value's {shape}."
                )
        return self._release(rng_key, value, None, reproducible, statistic_shape)

    def release_many(
        self, rng_key: Optional[Array], value: ArrayLike, num: int, *, reproducible: bool = False
    ) -> Array:
        """``num`` independent releases of ``value``, shape ``(num, *value.shape)``, each with the
        law of one :meth:`release` (for audits and simulation studies)."""
        if isinstance(num, bool) or int(num) != num or num < 1:
            raise ValueError(f"num must be a positive integer, got {num!r}")
        return self._release(rng_key, value, int(num), reproducible)

    def _release(
        self, rng_key, value, num: Optional[int], reproducible: bool, statistic_shape: Optional[tuple] = None
    ) -> Array:
        self._require_sensitivity()
        if not_jax_tracer(value):
            check_finite(value, f"{type(self).__name__}.release: the confidential value",
                         "a release of it would be non-finite or reveal it. Check the data and the statistic.")
            self._check_value(value)
            if self.float_safe:
                self._check_precision(value)
        if rng_key is None:
            rng_key = secure_key()
        elif not reproducible:
            warn_reproducible(stacklevel=4)
        if self.float_safe:
            if not not_jax_tracer(value):
                raise TypeError(
                    f"{type(self).__name__}.release draws exact noise from concrete values: "
                    "call it outside jit (simulations can use release_distribution(value))."
                )
            value = np.asarray(value)
            values = value if num is None else np.broadcast_to(value, (num, *value.shape))
            size = value.size if statistic_shape is None else math.prod(statistic_shape)
            if size == 0:
                return jnp.asarray(value)
            return jnp.asarray(self._exact_draw(KeyBits(rng_key), values, size))
        if num is None:
            return _draw(self, rng_key, jnp.asarray(value))
        keys = jax.random.split(rng_key, num)
        return jax.vmap(lambda k: _draw(self, k, jnp.asarray(value)))(keys)

    def _exact_draw(self, bits: KeyBits, value: np.ndarray, size: int) -> np.ndarray:
        """Float-safe mechanisms: releases of ``value`` (one statistic of ``size`` entries, or a
        stack of them along leading axes), by exact integer arithmetic."""
        raise NotImplementedError

    def flattened(self, shape: tuple[int, ...]) -> "Mechanism":
        """This mechanism for a statistic of ``shape`` raveled to one axis (simulators work on flat
        release vectors): itself, unless its parameters have a shape of their own."""
        return self

    def _draw(self, rng_key: Array, value: Array) -> Array:
        return self.release_distribution(value).sample(rng_key)


@dataclass(frozen=True)
class LaplaceMechanism(Mechanism):
    r"""The Laplace mechanism: ``release = value + Laplace(0, b)``, ``b = sensitivity / epsilon``.

    * Sensitivity: L1, :math:`\Delta_1 = \max \|f(D) - f(D')\|_1` over neighbours.
    * Guarantee: pure :math:`\epsilon`-DP (``delta = 0``); the log density ratio between
      neighbouring values is at most :math:`\|f(D) - f(D')\|_1 / b \le \epsilon`.
    * Density: :math:`p(y \mid x) = \prod_j \frac{1}{2b} \exp(-|y_j - x_j| / b)`.
    * Float-safe: releases are grid points ``k * sensitivity / resolution``, drawn exactly (see
      the module docstring); ``release_distribution`` is the continuous law above.

    >>> import jax
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> m = LaplaceMechanism(0.5, sensitivity=2.0)
    >>> m.scale
    4.0
    >>> y = m.release(jax.random.PRNGKey(0), 10.0, reproducible=True)  # seeded: an example
    >>> m.cost().epsilon
    0.5
    """

    kind: ClassVar[str] = "laplace"
    float_safe: ClassVar[bool] = True
    epsilon: float
    sensitivity: Optional[float] = None
    neighbouring: str = "substitute"
    resolution: int = field(default=DEFAULT_RESOLUTION, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))
        object.__setattr__(self, "resolution", check_positive_int("resolution", self.resolution))
        self._validate_common()

    @property
    def grid(self) -> float:
        """Spacing of the released values: ``sensitivity / resolution``."""
        return self._require_sensitivity() / self.resolution

    @property
    def delta(self) -> float:
        return 0.0

    @property
    def scale(self) -> float:
        return self._require_sensitivity() / self.epsilon

    def noise_distribution(self) -> Distribution:
        return dist.Laplace(0.0, self.scale)

    def release_distribution(self, value: ArrayLike) -> Distribution:
        return dist.Laplace(value, self.scale)

    def _grid_bound(self, d: int) -> tuple[int, int]:
        """Grid units per sensitivity ``r`` and the L1 bound between neighbours' rounded values,
        for a statistic of ``d`` values."""
        r = self.resolution * d
        return r, r + d

    def _exact_draw(self, bits: KeyBits, value: np.ndarray, size: int) -> np.ndarray:
        # In grid units (sensitivity / r, r = resolution * d for d values) neighbours differ by
        # at most r in L1, plus the float rounding of the statistic (under one unit: see
        # to_grid_units). For a fixed uniform, randomized rounding turns a difference y into at
        # most ceil(y) < y + 1 per coordinate, so the rounded values differ by an integer below
        # r + d + 1: at most r + d. The discrete Laplace of scale (r + d) / epsilon then gives
        # exactly epsilon, with (1 + 1/resolution) times the nominal noise.
        sensitivity = self._require_sensitivity()
        r, bound = self._grid_bound(size)
        j = randomized_round(bits, to_grid_units(value, sensitivity, r, size))
        k = discrete_laplace(bits, Fraction(bound) / Fraction(self.epsilon), j.shape)
        return from_grid_units(j + k, sensitivity, r, value)

    def noise_icdf(self, u: ArrayLike) -> Array:
        # Two branches so that 1 - u is exact (Sterbenz) and never rounds to 0 before 1 does.
        u = jnp.asarray(u)
        lower = u < 0.5
        u_lo = jnp.where(lower, u, 0.25)
        u_hi = jnp.where(lower, 0.75, u)
        return self.scale * jnp.where(lower, jnp.log(2 * u_lo), -jnp.log(2 * (1 - u_hi)))

    def noise_parameters(self) -> dict:
        return {"scale": self.scale}


@dataclass(frozen=True)
class GaussianMechanism(Mechanism):
    r"""The Gaussian mechanism, ``release = value + N(0, sigma^2)``, calibrated analytically.

    * Sensitivity: L2, :math:`\Delta_2 = \max \|f(D) - f(D')\|_2` over neighbours.
    * Guarantee: :math:`(\epsilon, \delta)`-DP with the smallest noise multiplier
      :math:`z = \sigma / \Delta_2` such that
      :math:`\Phi(\frac{1}{2z} - \epsilon z) - e^{\epsilon} \Phi(-\frac{1}{2z} - \epsilon z)
      \le \delta` (the analytic Gaussian mechanism, Balle & Wang 2018; exact for every
      :math:`\epsilon > 0`, unlike the classical :math:`\sqrt{2 \ln(1.25/\delta)}/\epsilon`).
      Its ledger cost carries ``noise_multiplier`` so that Gaussian releases compose exactly.
    * Density: :math:`p(y \mid x) = \prod_j \mathcal{N}(y_j; x_j, \sigma^2)`.

    :param epsilon: target epsilon (> 0).
    :param delta: target delta, in (0, 1).
    :param sensitivity: L2 sensitivity, or ``None``.
    :param noise_multiplier: ``sigma / sensitivity``, when fixed by hand (see :meth:`from_sigma`);
        it must give (epsilon, delta)-DP.

    >>> from d3pext.releases.mechanisms import GaussianMechanism
    >>> m = GaussianMechanism(1.0, 1e-5, sensitivity=2.0)
    >>> round(m.noise_multiplier, 4), round(m.sigma, 4)
    (3.7306, 7.4613)
    >>> round(GaussianMechanism.from_sigma(7.4613, 2.0, 1e-5).epsilon, 4)
    1.0
    """

    kind: ClassVar[str] = "gaussian"
    float_safe: ClassVar[bool] = True
    epsilon: float
    delta: float
    sensitivity: Optional[float] = None
    neighbouring: str = "substitute"
    noise_multiplier: Optional[float] = field(default=None, kw_only=True)
    resolution: int = field(default=DEFAULT_RESOLUTION, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))
        delta = check_real("delta", self.delta)
        if not 0 < delta < 1:
            raise ValueError(f"delta must lie in (0, 1) for the Gaussian mechanism, got {delta}")
        object.__setattr__(self, "delta", delta)
        self._validate_common()
        if self.noise_multiplier is None:
            z = analytic_gaussian_noise_multiplier(self.epsilon, self.delta)
        else:
            z = check_positive("noise_multiplier", self.noise_multiplier)
            if analytic_gaussian_delta(self.epsilon, z) > self.delta * (1 + 1e-9):
                needed = analytic_gaussian_noise_multiplier(self.epsilon, self.delta)
                raise ValueError(
                    f"noise_multiplier {z} is too small for ({self.epsilon}, {self.delta})-DP;"
                    f" it needs at least {needed}"
                )
        object.__setattr__(self, "noise_multiplier", z)
        object.__setattr__(self, "resolution", check_positive_int("resolution", self.resolution))

    @classmethod
    def from_sigma(
        cls, sigma: float, sensitivity: float, delta: float, neighbouring: str = "substitute"
    ) -> "GaussianMechanism":
        """The Gaussian mechanism with noise standard deviation ``sigma``; its epsilon is the
        smallest for which it is (epsilon, delta)-DP at this sensitivity."""
        z = check_positive("sigma", sigma) / check_positive("sensitivity", sensitivity)
        epsilon = analytic_gaussian_epsilon(delta, z)
        if epsilon == 0:
            raise ValueError(
                f"sigma / sensitivity = {z} gives (0, {delta})-DP; choose a smaller delta"
            )
        return cls(epsilon, delta, sensitivity, neighbouring, noise_multiplier=z)

    @property
    def sigma(self) -> float:
        return self.noise_multiplier * self._require_sensitivity()

    def noise_distribution(self) -> Distribution:
        return dist.Normal(0.0, self.sigma)

    def release_distribution(self, value: ArrayLike) -> Distribution:
        return dist.Normal(value, self.sigma)

    def _exact_draw(self, bits: KeyBits, value: np.ndarray, size: int) -> np.ndarray:
        # grid sensitivity / r with r = resolution * ceil(sqrt(d)): neighbours differ by at most
        # r in L2, plus at most sqrt(d) from randomized rounding (1 per coordinate) and under 1
        # from the float rounding of the statistic (see _discrete_gaussian_variance)
        sensitivity, d = self._require_sensitivity(), size
        r = self.resolution * math.isqrt(d - 1) + self.resolution if d > 1 else self.resolution
        j = randomized_round(bits, to_grid_units(value, sensitivity, r, size))
        sigma2 = _discrete_gaussian_variance(self.epsilon, self.delta, self.noise_multiplier, r, d)
        k = discrete_gaussian(bits, sigma2, j.shape)
        return from_grid_units(j + k, sensitivity, r, value)

    def noise_icdf(self, u: ArrayLike) -> Array:
        return self.sigma * ndtri(jnp.asarray(u))

    def noise_parameters(self) -> dict:
        return {"sigma": self.sigma}


@dataclass(frozen=True)
class GeometricMechanism(Mechanism):
    r"""The two-sided geometric mechanism (Ghosh et al. 2012; seed 002, section 3) for integers:
    ``release = value + TwoSidedGeometric(alpha)``, ``alpha = exp(-epsilon / sensitivity)``.

    * Sensitivity: L1 of an integer-valued statistic (default 1: a count).
    * Guarantee: pure :math:`\epsilon`-DP; for neighbours with :math:`\|x - x'\|_1 \le \Delta`
      the probability ratio is at most :math:`\alpha^{-\Delta} = e^{\epsilon}` (seed 002,
      Theorem 1, with :math:`N = \Delta`).
    * Probability: :math:`P(y \mid x) = \prod_j \frac{1 - \alpha}{1 + \alpha}
      \alpha^{|y_j - x_j|}`, :math:`y_j \in \mathbb{Z}`.

    >>> import jax
    >>> from d3pext.releases.mechanisms import GeometricMechanism
    >>> m = GeometricMechanism(1.0)
    >>> round(m.alpha, 4)
    0.3679
    >>> m.release(jax.random.PRNGKey(0), 7, reproducible=True).dtype  # seeded: an example
    dtype('int32')
    """

    kind: ClassVar[str] = "geometric"
    float_safe: ClassVar[bool] = True
    epsilon: float
    sensitivity: Optional[float] = 1.0
    neighbouring: str = "substitute"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))
        self._validate_common()
        if self.sensitivity is not None and self.sensitivity != int(self.sensitivity):
            # integer releases of neighbours differ by at least ceil(sensitivity): a fraction
            # would make the true epsilon ceil(sensitivity) / sensitivity times the stated one
            raise ValueError(
                "the geometric mechanism releases integers, so its sensitivity must be a positive integer "
                f"(the largest L1 change of an integer statistic), got {self.sensitivity}"
            )

    @classmethod
    def from_alpha(
        cls, alpha: float, sensitivity: float = 1.0, neighbouring: str = "substitute"
    ) -> "GeometricMechanism":
        """The mechanism with decay ``alpha`` in (0, 1): ``epsilon = -sensitivity log(alpha)``."""
        alpha = check_real("alpha", alpha)
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
        epsilon = -check_positive("sensitivity", sensitivity) * math.log(alpha)
        return cls(epsilon, sensitivity, neighbouring)

    @property
    def delta(self) -> float:
        return 0.0

    @property
    def log_alpha(self) -> float:
        return -self.epsilon / self._require_sensitivity()

    @property
    def alpha(self) -> float:
        return math.exp(self.log_alpha)

    def noise_distribution(self) -> Distribution:
        return TwoSidedGeometric(log_alpha=self.log_alpha)

    def release_distribution(self, value: ArrayLike) -> Distribution:
        return TwoSidedGeometric(log_alpha=self.log_alpha, loc=value)

    def noise_icdf(self, u: ArrayLike) -> Array:
        return self.noise_distribution().icdf(u)

    def _check_value(self, value: ArrayLike) -> None:
        if not np.all(np.mod(np.asarray(value), 1) == 0):
            raise ValueError("the geometric mechanism releases integer values; got non-integers")

    def _exact_draw(self, bits: KeyBits, value: np.ndarray, size: int) -> np.ndarray:
        # alpha^|k| = exp(-|k| / t) with t = sensitivity / epsilon, an exact rational
        scale = Fraction(self._require_sensitivity()) / Fraction(self.epsilon)
        noise = discrete_laplace(bits, scale, value.shape)
        return as_int_dtype(value.astype(np.int64) + noise, "the released values")

    def noise_parameters(self) -> dict:
        return {"alpha": self.alpha}


@dataclass(frozen=True)
class BinomialMechanism(Mechanism):
    r"""The binomial mechanism of seed 000, Proposition 4, for counts in ``{0, ..., population}``:

    .. math::
        s \sim \mathrm{Binomial}\left(n, \frac{c + m}{K + 2m}\right), \qquad
        m = \frac{n \Delta_1}{\epsilon},

    with ``n = total_count`` trials, ``K = population`` (the largest possible count ``c``) and the
    pseudo-count ``m``. Counts are clamped to ``[0, K]`` inside the model
    (:meth:`release_distribution`); :meth:`release` refuses counts outside it.

    * Sensitivity: L1 over the released counts, e.g. 1 for one count and ``L`` for ``L`` counts
      that each move by at most one when one record is substituted (the population ``K`` is
      fixed, so the relation is ``"substitute"``).
    * Guarantee: pure :math:`\epsilon`-DP with :math:`\epsilon = n \Delta_1 / m`. A count moving by
      :math:`d` changes the log probability by at most :math:`n \log(1 + d/m) \le n d / m`
      (proof of Proposition 4, S2), and these add to at most :math:`n \Delta_1 / m` over the
      counts. For a single count the exact bound :math:`n \log(1 + 1/m)` is a little smaller;
      the ledger records :math:`n \Delta_1 / m`, as the paper does (:math:`\epsilon = nL/m`).
    * Probability: :math:`P(s \mid c) = \prod_j \binom{n}{s_j} p_j^{s_j} (1 - p_j)^{n - s_j}`,
      :math:`p_j = (c_j + m) / (K + 2m)`.

    Not additive: use :meth:`release_icdf` for randomized quasi-Monte Carlo.

    :param epsilon: privacy cost of a release (> 0).
    :param total_count: number of trials ``n`` (positive integer).
    :param population: ``K``, the largest possible count (positive integer).
    :param sensitivity: L1 sensitivity of the released counts (default 1).

    >>> from d3pext.releases.mechanisms import BinomialMechanism
    >>> m = BinomialMechanism.from_pseudo_count(total_count=100, pseudo_count=50.0, population=1000)
    >>> m.epsilon
    2.0
    >>> float(m.release_distribution(200).mean)  # 100 * (200 + 50) / 1100
    22.72...
    """

    kind: ClassVar[str] = "binomial"
    epsilon: float
    total_count: int
    population: int
    sensitivity: Optional[float] = 1.0
    neighbouring: str = "substitute"

    def __post_init__(self) -> None:
        object.__setattr__(self, "epsilon", check_positive("epsilon", self.epsilon))
        object.__setattr__(self, "total_count", check_positive_int("total_count", self.total_count))
        object.__setattr__(self, "population", check_positive_int("population", self.population))
        self._validate_common()

    @classmethod
    def from_pseudo_count(
        cls,
        total_count: int,
        pseudo_count: float,
        population: int,
        sensitivity: float = 1.0,
        neighbouring: str = "substitute",
    ) -> "BinomialMechanism":
        """The mechanism with pseudo-count ``m > 0``: ``epsilon = total_count sensitivity / m``."""
        epsilon = (
            check_positive_int("total_count", total_count)
            * check_positive("sensitivity", sensitivity)
            / check_positive("pseudo_count", pseudo_count)
        )
        return cls(epsilon, total_count, population, sensitivity, neighbouring)

    @property
    def delta(self) -> float:
        return 0.0

    @property
    def pseudo_count(self) -> float:
        return self.total_count * self._require_sensitivity() / self.epsilon

    def probs(self, value: ArrayLike) -> Array:
        """Success probability ``(clip(value, 0, K) + m) / (K + 2m)`` of the binomial draw."""
        m = self.pseudo_count
        return (jnp.clip(value, 0, self.population) + m) / (self.population + 2 * m)

    def release_distribution(self, value: ArrayLike) -> Distribution:
        return dist.BinomialProbs(self.probs(value), total_count=self.total_count)

    def release_icdf(self, value: ArrayLike, u: ArrayLike) -> Array:
        """Smallest ``s`` with ``P(release <= s | value) >= u``, by bisection on the exact cdf
        ``P(release <= s) = I_{1 - p}(n - s, s + 1)``, in the dtype of ``u``."""
        u = jnp.asarray(u)
        dtype = u.dtype if jnp.issubdtype(u.dtype, jnp.floating) else jnp.result_type(float)
        probs = self.probs(jnp.asarray(value, dtype)).astype(dtype)
        return _binomial_icdf(self.total_count, probs, u.astype(dtype))

    def _check_value(self, value: ArrayLike) -> None:
        value = np.asarray(value)
        in_range = (value >= 0) & (value <= self.population)
        if not (np.all(np.mod(value, 1) == 0) and np.all(in_range)):
            raise ValueError(
                f"the binomial mechanism releases counts in {{0, ..., {self.population}}}"
                " (population); got values outside"
            )

    def noise_parameters(self) -> dict:
        return {
            "total_count": self.total_count,
            "pseudo_count": self.pseudo_count,
            "population": self.population,
        }
