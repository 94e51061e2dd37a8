"""What a release carries: :class:`ReleaseInfo`, the metadata of one release site.

The ``privatize`` handler puts a ``ReleaseInfo`` in the ``infer["privatize"]`` of each release site
it emits; inference backends read it (:func:`release_sites`) to know which statistic of which
confidential site was released, through which mechanism, with which bounds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from numpyro.primitives import CondIndepStackFrame

__all__ = ["CONFIDENTIAL", "ReleaseInfo", "release_sites"]


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
    :param num_records: number of records of the source site.
    :param stat_shape: shape of the statistic of one record (or of the custom statistic).
    :param plates: the source site's plates (the release of ``"records"`` lives in them).
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
