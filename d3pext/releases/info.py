"""What a release carries: :class:`ReleaseInfo`, the metadata of one release site.

The ``privatize`` handler puts a ``ReleaseInfo`` in the ``infer["privatize"]`` of each release site
it emits; inference backends read it (:func:`release_sites`) to know which statistic of which
confidential site was released, through which mechanism, with which bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
import threading
from typing import Any
import weakref

import numpy as np

from numpyro.primitives import CondIndepStackFrame

__all__ = ["CONFIDENTIAL", "ReleaseInfo", "describe_release", "release_sites"]


CONFIDENTIAL = "d3pext_confidential"
"""``infer`` key that ``privatize`` sets (to ``True``) on the confidential site it releases, so that
the handlers outside it know the site before its release is emitted."""


@dataclass(frozen=True)
class ReleaseInfo:
    """Metadata of one release site (``site["infer"]["privatize"]``).

    :param name: the release site.
    :param source: the confidential sample site.
    :param statistic: ``"sufficient"``, ``"mean"``, ``"records"`` or ``"custom"``.
    :param mechanism: the mechanism, with its sensitivity set.
    :param bounds: declared bounds ``(a, b)`` of the records, or ``None``.
    :param bounds_method: ``"truncate"`` (records outside are dropped, Bernstein & Sheldon) or
        ``"clamp"`` (records are clipped into the bounds).
    :param num_records: number of cells of the source site the statistic is over (records times
        ``cells_per_record``): the ``n`` of the sum of iid cells that the inference backends model.
    :param stat_shape: shape of the statistic of one record (or of the custom statistic).
    :param plates: the source site's plates (the release of ``"records"`` lives in them).
    :param cells_per_record: how many cells one record (the individual, ``privatize``'s
        ``record_plate``) holds; the sensitivity covers all of them.
    """

    name: str
    source: str
    statistic: str
    mechanism: Any
    bounds: tuple[float, float] | None
    bounds_method: str
    num_records: int
    stat_shape: tuple[int, ...]
    plates: tuple[CondIndepStackFrame, ...]
    cells_per_record: int = 1

    @property
    def sensitivity(self) -> float:
        return self.mechanism.sensitivity

    def cost(self):
        """The privacy cost of the release (the mechanism's, whatever the statistic)."""
        return self.mechanism.cost()


def release_sites(model_trace: Mapping[str, dict]) -> dict[str, ReleaseInfo]:
    """The release sites of a trace of a privatized model, by name."""
    return {
        name: site["infer"]["privatize"]
        for name, site in model_trace.items()
        if site["type"] == "sample" and "privatize" in site.get("infer", {})
    }


# --- releases made in this process or read from a release file, so that an analysis under other settings is caught

_MADE: dict[int, tuple[weakref.ref, dict[str, Any], str]] = {}
_MADE_LOCK = threading.Lock()


def remember_release(
    value: Any, info: ReleaseInfo | Mapping[str, Any], origin: str = "by make_release in this process"
) -> None:
    """Note that ``value`` (an array :func:`~d3pext.handlers.privatize.make_release` returned, or one read
    from a release file) was released as ``info`` (a :class:`ReleaseInfo` or its :func:`describe_release`),
    for as long as the array lives. ``origin`` says where the settings come from, for error messages."""
    described = describe_release(info) if isinstance(info, ReleaseInfo) else dict(info)
    key = id(value)

    def forget(ref: weakref.ref, key: int = key) -> None:
        with _MADE_LOCK:
            if key in _MADE and _MADE[key][0] is ref:
                del _MADE[key]

    try:
        ref = weakref.ref(value, forget)
    except TypeError:  # an object without weak references: not remembered
        return
    with _MADE_LOCK:
        _MADE[key] = (ref, described, origin)


def made_as(value: Any) -> tuple[dict[str, Any], str] | None:
    """The settings ``value`` was released with and where they come from, if this process made or read it."""
    with _MADE_LOCK:
        entry = _MADE.get(id(value))
    return (entry[1], entry[2]) if entry is not None and entry[0]() is value else None


def _plain(value: Any) -> Any:
    """``value`` as JSON types (numbers, strings, ``None`` and nested lists)."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    array = np.asarray(value)
    if array.dtype.kind in "iub":
        return array.astype(np.int64).tolist() if array.dtype.kind != "b" else array.tolist()
    return array.astype(np.float64).tolist()


def describe_release(info: ReleaseInfo) -> dict[str, Any]:
    """The settings of a release as plain values (JSON types): what an analysis must assume
    (``cells_per_record`` only when one record holds several cells).

    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> info = ReleaseInfo("x_dp", "x", "sufficient", LaplaceMechanism(0.5, sensitivity=1.0), None,
    ...                    "truncate", 10, (), ())
    >>> describe_release(info)["epsilon"], describe_release(info)["mechanism"]
    (0.5, 'LaplaceMechanism')
    """
    mechanism = info.mechanism
    cost = mechanism.cost()
    described = {
        "statistic": info.statistic,
        "bounds": info.bounds,
        "bounds_method": info.bounds_method if info.bounds is not None else None,
        "num_records": info.num_records,
        "stat_shape": tuple(info.stat_shape),
        "mechanism": type(mechanism).__name__,
        "neighbouring": getattr(mechanism, "neighbouring", None),
        "epsilon": cost.epsilon,
        "delta": cost.delta,
        "sensitivity": mechanism.sensitivity,
        **{f"noise {k}": v for k, v in mechanism.release_parameters().items()},
    }
    if info.cells_per_record != 1:
        # only when not 1: releases described before it existed (release files) still match
        described["cells_per_record"] = info.cells_per_record
    return {k: _plain(v) for k, v in described.items()}


def _same(a: Any, b: Any, broadcast: bool = False) -> bool:
    """Equal settings; with ``broadcast`` (per-element noise parameters) equal once broadcast: an alpha
    of shape (1,) is that alpha for every count."""
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    try:
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if broadcast:
            a, b = np.broadcast_arrays(a, b)
    except (TypeError, ValueError):  # not numbers, or shapes that do not broadcast (other laws)
        return False
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=0.0))


def check_made_as_analysed(name: str, value: Any, analysed: ReleaseInfo) -> None:
    """Refuse to analyse ``value`` as the release ``analysed`` describes if this process made it
    (:func:`~d3pext.handlers.privatize.make_release`) or read it from a release file
    (:func:`~d3pext.releases.files.load_releases`) with other settings: the posterior would assume other
    noise, bounds or records than the release has (a release drawn at epsilon 0.05 and analysed as
    epsilon 1 gave a posterior half as wide as it should be). Other values are not checked: an analyst
    must declare the mechanism that the curator used."""
    made = made_as(value)
    if made is None:
        return
    ours, origin = made
    theirs = describe_release(analysed)
    ours, theirs = ({"cells_per_record": 1, **d} for d in (ours, theirs))  # described only when not 1
    differ = [
        k for k in sorted(set(ours) | set(theirs))
        if not _same(ours.get(k), theirs.get(k), broadcast=k.startswith("noise "))
    ]
    if differ:
        detail = "; ".join(f"{k}: made with {ours.get(k)!r}, analysed as {theirs.get(k)!r}" for k in differ)
        raise ValueError(
            f"The release {name!r} was made ({origin}) with other settings than the model "
            f"analyses it with ({detail}): the posterior would assume other noise than the release "
            "has. Analyse it with the privatize settings it was made with."
        )
