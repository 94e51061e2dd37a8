"""The ``privatize`` effect handler and the curator's ``make_release``.

``privatize`` inserts a release into an ordinary NumPyro model: the statistic of a confidential
sample site (its sufficient statistic, their mean, or the records themselves under local privacy)
is passed through a mechanism, and the released value becomes a new sample site named
``f"{site}_dp"``, distributed as ``mechanism.release_distribution(statistic)``. The release
metadata (:class:`ReleaseInfo`) rides in the site's ``infer["privatize"]``.

The same privatized model serves both sides: run forward on confidential data (:func:`make_release`)
it produces a release and records its privacy cost; conditioned on a release it is the generative
model that :func:`~d3pext.handlers.private_posterior` works with.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
import math
from typing import Any, Literal
import warnings

import numpy as np

import jax
import jax.numpy as jnp

import numpyro
from numpyro.distributions.transforms import biject_to
from numpyro.handlers import seed, substitute, trace
from numpyro.primitives import Messenger

from d3pext._threads import one_model_at_a_time
from d3pext.distributions.expfam import family_of, record_distribution
from d3pext.prng import secure_key
from d3pext.releases.counts import check_counts
from d3pext.releases.info import CONFIDENTIAL, ReleaseInfo, release_sites, remember_release
from d3pext.releases.mechanisms import warn_reproducible
from d3pext.releases.sums import exact_sum
from d3pext.validation import check_finite

__all__ = ["curator_key", "make_release", "privatize", "privatize_counts"]

StatisticKind = Literal["sufficient", "mean", "records", "sample_mean", "sample_variance"]
_KINDS = ("sufficient", "mean", "records", "sample_mean", "sample_variance")
# statistics of bounded scalar records (Kazan & Reiter, seed 001): records are clipped into the
# bounds, the sensitivities are (b - a) / n and (b - a)^2 / n (Du et al. 2020, Lemmas 11-12)
_BOUNDED_KINDS = ("sample_mean", "sample_variance")


def _is_concrete(x: Any) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _inward(bounds: tuple[float, float], dtype: Any) -> tuple[Any, Any]:
    """``bounds`` rounded inwards to ``dtype``: records clipped to them lie in ``[a, b]`` exactly
    (rounded to nearest, a float32 ``b`` of 45.1235 lies above it, and a clipped record then
    spans more than the sensitivity ``b - a``: 6x for bounds (1e6 + 0.03, 1e6 + 0.04))."""
    a, b = bounds
    lo, hi = np.asarray(a, dtype), np.asarray(b, dtype)
    if float(lo) < a:
        lo = np.nextafter(lo, np.asarray(np.inf, dtype))
    if float(hi) > b:
        hi = np.nextafter(hi, np.asarray(-np.inf, dtype))
    if lo > hi:
        raise ValueError(f"bounds {bounds} hold no {np.dtype(dtype).name} value: widen them.")
    return lo, hi


class privatize(Messenger):
    """Release a statistic of the confidential sample site ``site`` through ``mechanism``.

    The release is emitted after the model body as the sample site ``name`` (default
    ``f"{site}_dp"``), outside the model's plates except for ``statistic="records"``.
    Like every NumPyro handler it works as a wrapper, ``privatize(model, site=..., ...)``, and as
    a ``with`` block around the model call, which emits the release when the block exits. Nest
    several ``privatize`` handlers for several releases.

    :param fn: the model.
    :param str site: the confidential sample site (records in a plate).
    :param mechanism: a mechanism of :mod:`d3pext.releases.mechanisms`; when its sensitivity is ``None``
        it is derived from the family of the records and the bounds, for the mechanism's
        ``neighbouring`` relation (under ``"add_remove"`` only for ``"sufficient"``: the other
        statistics' sensitivities involve ``n``, which is then private).
    :param statistic: ``"sufficient"`` (sum of the sufficient statistics ``t(x_i)``),
        ``"mean"`` (that sum over ``n``), ``"records"`` (each ``t(x_i)``: local privacy),
        ``"sample_mean"`` / ``"sample_variance"`` (of scalar records clipped into ``bounds``,
        which are required; variance with denominator ``n - 1``; sensitivities ``(b - a) / n``
        and ``(b - a)^2 / n``) or a callable of the site value (then the mechanism needs an
        explicit sensitivity, that of one record: see ``record_plate``).
    :param bounds: ``(a, b)`` on scalar records, needed when ``t(x)`` is unbounded (not with a
        callable statistic, which sees the records unclipped).
    :param bounds_method: ``"truncate"`` (drop records outside ``[a, b]``; sensitivity bound of
        Bernstein & Sheldon section 3.3) or ``"clamp"`` (clip records into ``[a, b]``).
    :param name: name of the release site.
    :param record_plate: the plate (or plates) whose index identifies one record, the individual
        that the privacy guarantee protects. The site's other batch elements (its cells in other
        plates, or the distribution's own batch dims) belong to that record: with ``m`` cells per
        record the derived sensitivities are ``m`` times one cell's (an individual moves ``m``
        cells), also for ``"records"``, whose cells are released one by one but cost ``epsilon``
        together. By default the site's plate when it is in exactly one (``m`` is the product of its
        other batch dims, usually 1); a site in several plates needs it stated:
        ``record_plate="records"`` when each individual has a cell in each of the other plates,
        ``record_plate=("groups", "members")`` when every cell is an individual. An explicit
        sensitivity (``mechanism.with_sensitivity``, and always for a callable statistic) is taken
        as that of one record, all its cells, and is not scaled.

    **Example**

    >>> import jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import seed, substitute, trace
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> def model(n, x=None):
    ...     theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(0.5))
    >>> tr = trace(seed(private, 0)).get_trace(10, jnp.ones(10))
    >>> tr["x_dp"]["infer"]["privatize"].sensitivity
    1.0
    """

    def __init__(
        self,
        fn: Callable | None = None,
        *,
        site: str,
        mechanism: Any,
        statistic: StatisticKind | Callable[[jax.Array], jax.Array] = "sufficient",
        bounds: tuple[float, float] | None = None,
        bounds_method: Literal["truncate", "clamp"] = "truncate",
        name: str | None = None,
        record_plate: str | tuple[str, ...] | None = None,
    ) -> None:
        if not isinstance(site, str):
            raise TypeError(f"site must be a site name (str), got {type(site).__name__}.")
        if record_plate is not None:
            plates = (record_plate,) if isinstance(record_plate, str) else record_plate
            if not (
                isinstance(plates, (tuple, list)) and plates
                and all(isinstance(p, str) for p in plates) and len(set(plates)) == len(plates)
            ):
                raise ValueError(
                    "record_plate must be a plate name or a tuple of distinct plate names, "
                    f"got {record_plate!r}."
                )
            record_plate = tuple(plates)
        for attr in ("epsilon", "sensitivity", "release_distribution", "with_sensitivity", "cost"):
            if not hasattr(mechanism, attr):
                raise TypeError(
                    f"mechanism must be a d3pext mechanism (missing {attr!r}), got {mechanism!r}."
                )
        if not (mechanism.epsilon > 0):
            raise ValueError(f"mechanism epsilon must be > 0, got {mechanism.epsilon}.")
        if not callable(statistic) and statistic not in _KINDS:
            raise ValueError(f"statistic must be one of {_KINDS} or a callable, got {statistic!r}.")
        if callable(statistic) and mechanism.sensitivity is None:
            raise ValueError(
                "A custom statistic needs an explicit sensitivity: pass "
                "mechanism.with_sensitivity(value)."
            )
        if callable(statistic) and bounds is not None:
            raise ValueError(
                "bounds are not applied to a custom statistic (it receives the records as they are): "
                "clip the records inside the statistic and give its sensitivity, without bounds."
            )
        if (
            getattr(mechanism, "neighbouring", "substitute") == "add_remove"
            and mechanism.sensitivity is None
            and statistic in ("mean", "records", *_BOUNDED_KINDS)
        ):
            raise ValueError(
                f"statistic={statistic!r} has no sensitivity to derive under add/remove neighbours: "
                + ("a local release protects the value of each record (use neighbouring='substitute')."
                   if statistic == "records" else
                   "its noise would be scaled by the number of records n, which then is private. Use "
                   "neighbouring='substitute', release the sum, or give an explicit sensitivity.")
            )
        if bounds is not None:
            if len(bounds) != 2:
                raise ValueError(f"bounds must be a pair (a, b), got {bounds!r}.")
            a, b = (float(v) for v in bounds)
            if not (math.isfinite(a) and math.isfinite(b)):
                raise ValueError(f"bounds must be finite, got ({a}, {b}).")
            if not a < b:
                raise ValueError(f"bounds must satisfy a < b, got ({a}, {b}).")
            bounds = (a, b)
        if statistic in _BOUNDED_KINDS and bounds is None:
            raise ValueError(f"statistic={statistic!r} needs bounds=(a, b) on the records.")
        if bounds_method not in ("truncate", "clamp"):
            raise ValueError(f"bounds_method must be 'truncate' or 'clamp', got {bounds_method!r}.")
        self.site = site
        self.mechanism = mechanism
        self.statistic = statistic
        self.bounds = bounds
        self.bounds_method = bounds_method
        self.name = f"{site}_dp" if name is None else name
        self.record_plate = record_plate
        self._captured: dict | None = None
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and msg["name"] == self.site:
            # a new dict: the model's own stays as it is
            msg["infer"] = {**(msg.get("infer") or {}), CONFIDENTIAL: True}

    def postprocess_message(self, msg: dict) -> None:
        if msg["type"] == "sample" and msg["name"] == self.site:
            self._captured = msg

    def __enter__(self) -> "privatize":
        self._captured = None
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        super().__exit__(exc_type, exc_value, traceback)
        msg, self._captured = self._captured, None
        if exc_type is not None:
            return
        if msg is None:
            raise ValueError(f"privatize: the model has no sample site {self.site!r}.")
        # emitted after the block, outside this handler but inside the enclosing ones
        self._emit(msg)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:  # used as a decorator
            (fn,) = args
            self.fn = fn
            return self
        with self:
            return self.fn(*args, **kwargs)

    def _statistic(self, msg: dict) -> tuple[jax.Array, float | None, int, tuple[int, ...]]:
        value = msg["value"]
        if self.statistic in _BOUNDED_KINDS:
            event_shape = tuple(getattr(msg["fn"], "event_shape", ()))
            if event_shape:
                raise ValueError(
                    f"privatize({self.site!r}): statistic={self.statistic!r} is for scalar records, but the "
                    f"records have event shape {event_shape}. Nothing was released."
                )
            return self._bounded_statistic(value)
        if callable(self.statistic):
            stat = self.statistic(value)
            # a concrete NumPy statistic stays as computed (float64: jnp.asarray would round it to float32)
            stat = np.asarray(stat) if isinstance(stat, (np.ndarray, np.generic)) else jnp.asarray(stat)
            return stat, None, int(np.prod(msg["fn"].batch_shape)), stat.shape
        record = record_distribution(msg["fn"])
        family = family_of(record)
        if msg["is_observed"] and _is_concrete(value):
            in_support = np.asarray(record.support(jnp.asarray(value)))
            if not in_support.all():
                raise ValueError(
                    f"Confidential data at site {self.site!r} lie outside the support of "
                    f"{type(record).__name__} ({int((~in_support).sum())} records)."
                )
        if self.bounds is not None and not family.univariate:
            raise ValueError(
                f"privatize({self.site!r}): bounds apply to scalar records; the {family.name} family's "
                f"statistic (shape {family.stat_shape}) is bounded already: omit bounds."
            )
        x = value
        bounds = None
        if self.bounds is not None:
            if self.bounds_method == "clamp":
                dtype = jnp.promote_types(jnp.result_type(x), jnp.result_type(float))
                x = jnp.clip(jnp.asarray(x, dtype), *_inward(self.bounds, dtype))
            else:
                bounds = self.bounds
        t = family.truncated_statistic(x, bounds)
        batch_ndim = t.ndim - len(family.stat_shape)
        n = int(np.prod(t.shape[:batch_ndim]))
        neighbouring = getattr(self.mechanism, "neighbouring", "substitute")
        if self.bounds is not None and self.bounds_method == "clamp":
            a, b = self.bounds
            # a clipped record lies in [a, b]: replacing one moves the sum by b - a, adding one by |x|
            sensitivity = float(b - a) if neighbouring == "substitute" else float(max(abs(a), abs(b)))
        else:
            sensitivity = family.sensitivity(bounds, neighbouring)
        if self.statistic == "records":
            return t, sensitivity, n, family.stat_shape
        if msg["is_observed"] and _is_concrete(t):
            stat = exact_sum(t, batch_ndim)
        else:
            stat = jnp.sum(t, axis=tuple(range(batch_ndim)))
        if self.statistic == "mean":
            return stat / n, sensitivity / n, n, family.stat_shape
        return stat, sensitivity, n, family.stat_shape

    def _bounded_statistic(self, value) -> tuple[jax.Array, float, int, tuple[int, ...]]:
        a, b = self.bounds
        n = int(np.prod(jnp.shape(value)))
        if n < 2:
            raise ValueError(f"privatize({self.site!r}): {self.statistic} needs n >= 2 records.")
        if _is_concrete(value):  # the curator's data: clipped, summed and divided in float64
            x = np.clip(np.asarray(value, np.float64).reshape(-1), a, b)
            mean = float(exact_sum(x, 1)) / n
            if self.statistic == "sample_mean":
                return np.float64(mean), (b - a) / n, n, ()
            squares = float(exact_sum((x - mean) ** 2, 1))
            return np.float64(squares / (n - 1)), (b - a) ** 2 / n, n, ()
        # traced (the analyst's model): at least the default float, as a float16 mean rounds by
        # more than the sensitivity (b - a) / n
        x = jnp.clip(jnp.asarray(value, jnp.promote_types(jnp.result_type(value), jnp.result_type(float))), a, b)
        if self.statistic == "sample_mean":
            return jnp.mean(x), (b - a) / n, n, ()
        return jnp.var(x, ddof=1), (b - a) ** 2 / n, n, ()

    def _check_records(self, msg: dict) -> None:
        """The confidential data must have exactly the plate's number of records: the plate's
        size sets n, and with it the sensitivity."""
        shape = jnp.shape(msg["value"])
        event_dim = len(getattr(msg["fn"], "event_shape", ()))
        for frame in msg["cond_indep_stack"]:
            axis = len(shape) - event_dim + frame.dim
            if 0 <= axis < len(shape) and shape[axis] != frame.size:
                raise ValueError(
                    f"privatize({self.site!r}): the confidential data have {shape[axis]} records along plate "
                    f"{frame.name!r} of size {frame.size}; the plate's size must be the number of records "
                    "(it sets n, and with it the sensitivity). Nothing was released."
                )

    def _cells_per_record(self, msg: dict, derived: bool) -> int:
        """How many of the site's batch elements (cells) one record holds: those outside the record
        plates. Without ``record_plate`` a derived sensitivity needs the record to be unambiguous (one
        plate, or no plate and at most one batch dim); an explicit one is the user's, for one record."""
        shape = jnp.shape(msg["value"])
        batch_shape = shape[:len(shape) - len(getattr(msg["fn"], "event_shape", ()))]
        frames = sorted(msg["cond_indep_stack"], key=lambda frame: frame.dim)  # outermost first
        names = tuple(frame.name for frame in frames)
        if len(set(names)) < len(names) and (derived or self.record_plate is not None):
            # NumPyro nests plates of one name; a name then no longer says which dim is the individual
            raise ValueError(
                f"privatize({self.site!r}): the site's plates {list(names)} share a name: give each plate "
                "its own name, so that which of them identifies one record is unambiguous. Nothing was released."
            )
        if self.record_plate is not None:
            unknown = [p for p in self.record_plate if p not in names]
            if unknown:
                raise ValueError(
                    f"privatize({self.site!r}): record_plate names {unknown}, but the site's plates are "
                    f"{list(names)}: name the plate(s) that index its records. Nothing was released."
                )
            record = [frame for frame in frames if frame.name in self.record_plate]
        elif not derived:
            return 1
        elif len(sized := [frame.name for frame in frames if frame.size > 1]) > 1:
            options = "; ".join(
                f"record_plate={name!r} if each index of {name!r} is one individual, with a cell in each of "
                f"the other plates" for name in sized
            )
            raise ValueError(
                f"privatize({self.site!r}): the site is in the plates {list(names)}, and which of them "
                "identifies one record (the individual that the privacy guarantee protects) sets the "
                f"sensitivity, which covers all of that individual's cells. Pass {options}; or "
                f"record_plate={tuple(sized)!r} if every cell is an individual. Nothing was released."
            )
        elif not frames:
            if len(batch_shape) > 1:
                raise ValueError(
                    f"privatize({self.site!r}): the site is in no plate and has batch shape {batch_shape}: "
                    "which dims index its records is not known. Put the records in a numpyro.plate (the "
                    "other dims in plates or in the distribution's batch shape; with several plates pass "
                    "record_plate). Nothing was released."
                )
            return 1
        else:  # one plate of several records (with plates of one, which hold one cell each way)
            record = [frame for frame in frames if frame.size > 1] or frames
        axes = {len(batch_shape) + frame.dim for frame in record}
        cells = [size for axis, size in enumerate(batch_shape) if axis not in axes]
        return int(np.prod(cells, dtype=np.int64))

    def _emit(self, msg: dict) -> None:
        if msg["is_observed"]:
            self._check_records(msg)
        stat, derived, n, stat_shape = self._statistic(msg)
        # an individual moves each of its cells by at most one cell's sensitivity (L1 and L2 alike)
        cells = self._cells_per_record(msg, derived is not None)
        if derived is not None and cells != 1:
            derived = derived * cells
        if msg["is_observed"] and _is_concrete(stat):
            check_finite(stat, f"privatize({self.site!r}): the released statistic",
                         "check the confidential data. Nothing was released.")
        mechanism = self.mechanism
        if mechanism.sensitivity is None:
            mechanism = mechanism.with_sensitivity(derived)
        elif derived is not None and mechanism.sensitivity < derived:
            warnings.warn(
                f"privatize({self.site!r}): the mechanism's sensitivity {mechanism.sensitivity} "
                f"is below the bound {derived} derived from the family and bounds; the release "
                "may not be as private as its stated epsilon.",
                stacklevel=3,
            )
        plates = tuple(msg["cond_indep_stack"]) if self.statistic == "records" else ()
        info = ReleaseInfo(
            name=self.name,
            source=self.site,
            statistic=self.statistic if isinstance(self.statistic, str) else "custom",
            mechanism=mechanism,
            bounds=self.bounds,
            bounds_method=self.bounds_method,
            num_records=n,
            stat_shape=tuple(stat_shape),
            plates=plates,
            cells_per_record=cells,
        )
        release_dist = mechanism.release_distribution(stat)
        if len(stat_shape):
            release_dist = release_dist.to_event(len(stat_shape))
        with ExitStack() as stack:
            for frame in plates:
                stack.enter_context(numpyro.plate(frame.name, frame.size, dim=frame.dim))
            value = numpyro.sample(
                self.name, release_dist, infer={"privatize": info, "statistic": stat}
            )
        if jnp.shape(value) != jnp.shape(stat):
            raise ValueError(
                f"The release {self.name!r} has shape {jnp.shape(value)}, but the "
                f"{info.statistic} statistic of {self.site!r} has shape {jnp.shape(stat)}."
            )


class privatize_counts(privatize):
    """Release each count of the confidential site ``site`` through a geometric mechanism (local
    privacy; the release ``f"{site}_dp"`` lives in the site's plates, one noisy count per count).

    Like ``privatize(..., statistic="records")`` for count sites whose records need not be
    identically distributed (Poisson factorization: a rate per count) and whose range is
    unbounded: the privacy unit is set by the mechanism's sensitivity ``N`` (Theorem 1), not by
    bounds on the counts.

    :param fn: the model; ``site`` must be a count site (Poisson).
    :param site: the confidential count site.
    :param mechanism: :class:`~d3pext.releases.mechanisms.GeometricMechanism` (e.g.
        :func:`~d3pext.releases.counts.limited_precision_mechanism`) or
        :class:`~d3pext.releases.counts.HeterogeneousGeometricMechanism`.

    >>> import jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.releases.counts import limited_precision_mechanism
    >>> def model(counts=None):
    ...     rate = numpyro.sample("rate", dist.Gamma(1.0, 0.1))
    ...     with numpyro.plate("cells", 4):
    ...         numpyro.sample("y", dist.Poisson(rate), obs=counts)
    >>> private = privatize_counts(model, site="y", mechanism=limited_precision_mechanism(1.0, N=2))
    >>> make_release(private, jnp.array([3, 0, 7, 1]), rng_key=0)["y_dp"].shape
    (4,)
    """

    def __init__(
        self, fn: Callable | None = None, *, site: str, mechanism: Any, name: str | None = None
    ) -> None:
        if getattr(mechanism, "kind", None) != "geometric" or not hasattr(mechanism, "log_alpha"):
            raise ValueError(
                "privatize_counts needs a geometric mechanism (GeometricMechanism, "
                f"HeterogeneousGeometricMechanism), got {mechanism!r}."
            )
        n = mechanism.sensitivity
        if n is None or not (n >= 1 and float(n) == int(n)):
            raise ValueError(
                f"the mechanism's sensitivity is N, the L1 neighbourhood of an observation: a "
                f"positive integer, got {n!r}."
            )
        super().__init__(fn, site=site, mechanism=mechanism, statistic="records", name=name)

    def _statistic(self, msg: dict):
        value = msg["value"]
        if msg["is_observed"] and not isinstance(value, jax.core.Tracer):
            check_counts(value, f"The confidential counts at site {self.site!r}")
        la = np.shape(self.mechanism.log_alpha)
        try:
            if np.broadcast_shapes(la, jnp.shape(value)) != jnp.shape(value):
                raise ValueError
        except ValueError:
            raise ValueError(
                f"The mechanism's alpha has shape {la}, which does not broadcast to the counts of "
                f"site {self.site!r} with shape {jnp.shape(value)}."
            ) from None
        return value, None, int(np.prod(jnp.shape(value))), ()


def curator_key(rng_key: jax.Array | int | None = None) -> jax.Array:
    """The key for release noise: fresh OS entropy unless a seed is asked for explicitly.

    >>> k = curator_key()  # ChaCha20 key from OS entropy
    >>> k2 = curator_key(0)  # reproducible, for tests and examples only
    """
    if rng_key is None:
        return secure_key()
    if isinstance(rng_key, int):
        return jax.random.key(rng_key)
    return rng_key


def _statistic_placeholder(msg: dict) -> jax.Array | None:
    infer = msg.get("infer") or {}
    return infer.get("statistic") if "privatize" in infer else None


def _feasible_point(msg: dict) -> jax.Array | None:
    """A point in the support of an unobserved continuous site, found without drawing it.

    A release depends only on the confidential data, not on the model's parameters, so
    :func:`make_release` does not draw them from the prior: a draw takes no time to run, but
    compiles a sampler per distribution and shape (about 2 s for a gamma on a CPU). Discrete sites
    and supports without a bijection are still drawn."""
    if msg["type"] != "sample" or msg["is_observed"] or msg["value"] is not None:
        return None
    fn = msg["fn"]
    try:
        if fn.support.is_discrete:
            return None
        transform = biject_to(fn.support)
        shape = tuple(msg["kwargs"].get("sample_shape", ())) + tuple(transform.inverse_shape(fn.shape()))
    except (AttributeError, NotImplementedError):
        return None
    return transform(jnp.zeros(shape))


def _release_placeholder(msg: dict) -> jax.Array | None:
    statistic = _statistic_placeholder(msg)
    return _feasible_point(msg) if statistic is None else statistic


@one_model_at_a_time
def make_release(
    model: Callable,
    *args: Any,
    rng_key: jax.Array | int | None = None,
    ledger: Any = None,
    reproducible: bool = False,
    **kwargs: Any,
) -> dict[str, jax.Array]:
    """Curator side: run a privatized model forward on confidential data and return the releases.

    The confidential data go in through the model's arguments (observed sites). The model is
    traced without drawing any release noise (nor its continuous parameters, which the releases do
    not depend on: they are set to a point of their support), and every released statistic is
    checked (finite) before any noise is drawn. Then each release is drawn by its mechanism
    (``mechanism.release``) from a ChaCha20 key seeded by OS entropy. An explicit ``rng_key``
    makes the noise reproducible by anyone who has the key: it warns
    (:class:`~d3pext.releases.mechanisms.ReproducibleReleaseWarning`) unless
    ``reproducible=True`` (simulations and tests). With a ``ledger``
    (:class:`d3pext.accountants.ledger.PrivacyLedger`) the costs of all the releases are checked
    against the budget together and recorded before any noise is drawn: all or nothing.

    >>> import jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.accountants.ledger import PrivacyLedger
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> def model(n, x=None):
    ...     theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(0.5))
    >>> ledger = PrivacyLedger(budget_epsilon=1.0)
    >>> release = make_release(private, 5, jnp.array([1, 0, 1, 1, 0]), ledger=ledger)
    >>> sorted(release), ledger.spent()
    (['x_dp'], (0.5, 0.0))
    """
    if rng_key is not None and not reproducible:
        warn_reproducible()
    model_key = curator_key(rng_key)
    model_trace = trace(
        substitute(seed(model, model_key), substitute_fn=_release_placeholder)
    ).get_trace(*args, **kwargs)
    infos = release_sites(model_trace)
    if not infos:
        raise ValueError("The model has no release sites: wrap it with privatize(...).")
    for info in infos.values():
        if not model_trace[info.source]["is_observed"]:
            raise ValueError(
                f"The confidential site {info.source!r} is not observed: pass the confidential "
                "data to the model so that the release is computed from them."
            )
    statistics = {name: model_trace[name]["infer"]["statistic"] for name in infos}
    for name, statistic in statistics.items():
        check_finite(statistic, f"The statistic released at {name!r}",
                     f"check the confidential data of {infos[name].source!r}. Nothing was released.")
    if ledger is not None:
        ledger.record_many([(name, info.cost()) for name, info in infos.items()])
    releases = {}
    for i, (name, info) in enumerate(infos.items()):
        key = None if rng_key is None else jax.random.fold_in(model_key, i)
        local = info.statistic == "records"  # one statistic per record: each on its own grid
        releases[name] = info.mechanism.release(
            key, statistics[name], reproducible=True, statistic_shape=info.stat_shape if local else None
        )
        remember_release(releases[name], info)  # an analysis under other settings is refused
    return releases
