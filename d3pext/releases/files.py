"""Releases on disk: a curator saves releases with the settings they were made with; an analyst in
another process reads them back, and the analysis is held to those settings.

A release file is JSON (human-readable, exact: every value round-trips bit for bit)::

    {"format": "d3pext-releases", "version": 1,
     "releases": {"x_dp": {"value": 7.25, "dtype": "float32", "shape": [],
                           "made_with": {"statistic": "sufficient", "mechanism": "LaplaceMechanism",
                                         "epsilon": 0.5, "sensitivity": 1.0, ...}}}}

:func:`load_releases` returns the values as arrays that :func:`~d3pext.handlers.private_posterior`
and the simulators recognise: analysed under other settings than ``made_with`` (another epsilon,
mechanism, sensitivity, bounds or number of records), they are refused, as releases that
:func:`~d3pext.handlers.privatize.make_release` made in the same process are. The file is not
signed: it guards against honest mistakes (a release analysed as if drawn at another epsilon), not
against someone who edits it.
"""

from __future__ import annotations

from collections.abc import Mapping
import json
import math
import os
from pathlib import Path
import tempfile
from typing import Any

import numpy as np

import jax
import jax.numpy as jnp

from d3pext.releases.info import made_as, remember_release

__all__ = ["load_releases", "save_releases"]

FORMAT = "d3pext-releases"
VERSION = 1

# what every release's ``made_with`` holds (``describe_release``), and what each must be
_NUMBER = (int, float)
_REQUIRED: dict[str, Any] = {
    "statistic": str,
    "mechanism": str,
    "epsilon": _NUMBER,
    "delta": _NUMBER,
    "num_records": int,
    "stat_shape": list,
}


def save_releases(path: str | os.PathLike, releases: Mapping[str, Any], *, overwrite: bool = False) -> Path:
    """Write releases that :func:`~d3pext.handlers.privatize.make_release` made in this process (or that
    :func:`load_releases` read) to ``path``, each with the settings it was made with.

    Only such releases can be saved: their settings are known, not declared. The file is written
    whole or not at all (a temporary file renamed into place), and an existing file is kept unless
    ``overwrite=True``: a release costs privacy, and a file that held one is not replaced by accident.

    >>> import tempfile, os, jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext import LaplaceMechanism, make_release, privatize
    >>> def model(n, x=None):
    ...     theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(0.5))
    >>> release = make_release(private, 5, jnp.array([1, 0, 1, 1, 0]))
    >>> path = save_releases(os.path.join(tempfile.mkdtemp(), "release.json"), release)
    >>> loaded = load_releases(path)
    >>> bool(loaded["x_dp"] == release["x_dp"])
    True
    """
    if not isinstance(releases, Mapping) or not releases:
        raise ValueError("releases must be a non-empty dict of release sites, as make_release returns.")
    entries = {}
    for name, value in releases.items():
        if not isinstance(name, str):
            raise TypeError(f"release names must be str, got {name!r}.")
        made = made_as(value)
        if made is None:
            raise ValueError(
                f"The release {name!r} was not made by make_release in this process (nor read by "
                "load_releases): its settings are unknown, so it cannot be saved with them. Save the "
                "dict that make_release returned, as it returned it."
            )
        array = np.asarray(value)
        entries[name] = {
            "value": array.tolist(),
            "dtype": array.dtype.name,
            "shape": list(array.shape),
            "made_with": made[0],
        }
    text = json.dumps({"format": FORMAT, "version": VERSION, "releases": entries}, indent=1, allow_nan=False)
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} exists: a release file is not replaced unless overwrite=True.")
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        if overwrite:
            os.replace(temporary, path)
        else:
            _link_new(temporary, path, text)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def _link_new(temporary: str, path: Path, text: str) -> None:
    """Put the written file at ``path`` unless something is there, atomically where the file system
    has hard links (a rename would replace a file that another writer created meanwhile)."""
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise FileExistsError(f"{str(path)!r} exists: a release file is not replaced unless overwrite=True.") from None
    except OSError:  # no hard links here: create exclusively and write
        with open(path, "x", encoding="utf-8") as file:
            file.write(text)


def load_releases(path: str | os.PathLike) -> dict[str, jax.Array]:
    """Read a release file that :func:`save_releases` wrote; the values come back as arrays that the
    analysis holds to the settings they were made with (see the module's description).

    :raises ValueError: if the file is not a valid release file (what is wrong is named).
    """
    path = Path(path)
    try:
        content = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise ValueError(f"{str(path)!r} is not a release file: {error}.") from None
    where = f"release file {str(path)!r}"
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{where}: not a d3pext release file (its 'format' is not {FORMAT!r}).")
    if content.get("version") != VERSION:
        raise ValueError(
            f"{where}: version {content.get('version')!r}; this d3pext reads version {VERSION}: upgrade d3pext."
        )
    entries = content.get("releases")
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"{where}: 'releases' must be a non-empty object.")
    releases = {}
    for name, entry in entries.items():
        value, made_with = _read_entry(entry, f"{where}, release {name!r}")
        remember_release(value, made_with, origin=f"as recorded in the {where}")
        releases[name] = value
    return releases


def _refuse_constant(constant: str) -> None:
    raise ValueError(f"a release file holds finite numbers only, found {constant}")


def _read_entry(entry: Any, where: str) -> tuple[jax.Array, dict[str, Any]]:
    if not isinstance(entry, dict) or not {"value", "dtype", "shape", "made_with"} <= set(entry):
        raise ValueError(f"{where}: needs 'value', 'dtype', 'shape' and 'made_with'.")
    try:
        dtype = np.dtype(entry["dtype"])
    except TypeError:
        raise ValueError(f"{where}: unknown dtype {entry['dtype']!r}.") from None
    if dtype.kind not in "iuf":
        raise ValueError(f"{where}: a release holds integers or reals, not {dtype.name}.")
    try:
        array = np.array(entry["value"])
    except ValueError:  # ragged lists
        array = np.array(None)
    if array.dtype.kind not in "if":
        raise ValueError(f"{where}: 'value' must be a number or nested lists of numbers.")
    if not np.all(np.isfinite(array)):  # 1e999 parses as inf
        raise ValueError(f"{where}: 'value' must be finite.")
    read, array = array, array.astype(np.float64 if dtype.kind == "f" else np.int64)
    if not np.array_equal(array, read):
        raise ValueError(f"{where}: 'value' holds non-integers for dtype {dtype.name}.")
    if list(array.shape) != entry["shape"]:
        raise ValueError(f"{where}: 'value' has shape {list(array.shape)}, the file says {entry['shape']}.")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = array.astype(dtype)
        fits = np.array_equal(cast.astype(array.dtype), array)
    if not fits:
        raise ValueError(f"{where}: 'value' does not fit dtype {dtype.name} exactly.")
    made_with = entry["made_with"]
    native = jax.dtypes.canonicalize_dtype(dtype)
    if native != dtype:  # 64-bit types off in this process
        with np.errstate(over="ignore", invalid="ignore"):
            narrowed = cast.astype(native)
            moved = np.abs(narrowed.astype(np.float64) - cast.astype(np.float64))
        # kept where the narrowing moves no value by more than 1/8 of the noise's scale (as a release made
        # in 32 bits would be: ReleasePrecisionWarning), exactly for integer releases
        spread = made_with.get("noise scale", made_with.get("noise sigma")) if isinstance(made_with, dict) else None
        allowed = spread / 8 if dtype.kind == "f" and isinstance(spread, _NUMBER) and spread > 0 else 0.0
        if not (np.all(np.isfinite(moved)) and float(np.max(moved, initial=0.0)) <= allowed):
            raise ValueError(
                f"{where}: holds {dtype.name} values that this process's JAX would change in "
                f"{np.dtype(native).name} (64-bit types are off) by more than 1/8 of the noise's scale: "
                "enable them before loading, jax.config.update('jax_enable_x64', True)."
            )
        cast = narrowed
    if not isinstance(made_with, dict):
        raise ValueError(f"{where}: 'made_with' must be an object.")
    for key, kind in _REQUIRED.items():
        if key not in made_with:
            raise ValueError(f"{where}: 'made_with' lacks {key!r}.")
        if not isinstance(made_with[key], kind) or isinstance(made_with[key], bool):
            raise ValueError(f"{where}: 'made_with'[{key!r}] = {made_with[key]!r} has the wrong type.")
    epsilon, delta = made_with["epsilon"], made_with["delta"]
    if not (math.isfinite(epsilon) and epsilon > 0) or not 0 <= delta < 1:
        raise ValueError(f"{where}: 'made_with' has epsilon {epsilon!r} and delta {delta!r}: not a privacy cost.")
    return jnp.asarray(cast), made_with
