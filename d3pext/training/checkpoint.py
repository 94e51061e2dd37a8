"""Save and load a DP-trained fit: the variational parameters with the privacy they cost.

The parameters of a private training run are its private output; the privacy report says what
they cost. :func:`save_fit` writes both, with any metadata, to one ``.npz`` file: the arrays as
``.npy`` entries and everything else (the tree structure, dtypes, the
:class:`~d3pext.training.svi.PrivacyReport`, the metadata) as one JSON string. Nothing is
pickled, and :func:`load_fit` reads with ``allow_pickle=False``, so loading an untrusted file
cannot run code. Loading needs neither the training data nor the model.

To use a loaded fit, rebuild the guide the same way and pass the parameters to it:
``Predictive(model, guide=guide, params=fit.params, num_samples=...)``, or
``guide.sample_posterior(key, fit.params, sample_shape=...)`` once the guide has been run (an
autoguide sets itself up on its first call, from the shapes of the model's arguments: observed
sites must be given, with data of the training shapes where the model has local latent sites).

>>> import os, tempfile
>>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist, optax
>>> from numpyro.infer import Predictive
>>> from numpyro.infer.autoguide import AutoDiagonalNormal
>>> from d3pext import DPSVI
>>> def model(x, y=None, batch_size=None):
...     w = numpyro.sample("w", dist.Normal(0, 2).expand([x.shape[1]]).to_event(1))
...     with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
...         xb = numpyro.subsample(x, event_dim=1)
...         yb = None if y is None else numpyro.subsample(y, event_dim=0)
...         numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)
>>> x = jax.random.normal(jax.random.key(0), (200, 2))
>>> y = (x[:, 0] > 0).astype(jnp.float32)
>>> svi = DPSVI(model, AutoDiagonalNormal(model), optax.adam(0.05), clipping_threshold=1.0,
...             epsilon=1.0, delta=1e-3, num_steps=50)
>>> result = svi.run(jax.random.key(1), 50, x, y, batch_size=20, progress_bar=False)
>>> path = os.path.join(tempfile.mkdtemp(), "fit.npz")
>>> _ = save_fit(path, result.params, result.privacy, model="logistic", features=2)
>>> fit = load_fit(path)  # no data, no model
>>> fit.privacy == result.privacy, fit.metadata["features"], sorted(fit.params)
(True, 2, ['auto_loc', 'auto_scale'])
>>> guide = AutoDiagonalNormal(model)  # rebuilt as in training
>>> _ = numpyro.handlers.seed(guide, 0)(x[:5], y[:5])  # an autoguide sets itself up (shapes)
>>> draws = guide.sample_posterior(jax.random.key(2), fit.params, sample_shape=(100,))
>>> draws["w"].shape
(100, 2)
>>> Predictive(model, posterior_samples=draws)(jax.random.key(3), x[:5])["y"].shape  # new records
(100, 5)
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import math
import os
from pathlib import Path
import tempfile
from typing import Any, NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from d3pext.accountants.fourier import Relation
from d3pext.accountants.fourier import epsilon as accountant_epsilon
from d3pext.training.svi import PrivacyReport

__all__ = ["FORMAT", "FORMAT_VERSION", "SavedFit", "load_fit", "save_fit"]

FORMAT = "d3pext-fit"
"""The ``format`` field of a saved fit's header."""
FORMAT_VERSION = 1
"""The version of the file layout that :func:`save_fit` writes."""

_HEADER = "__d3pext_fit__"


class SavedFit(NamedTuple):
    """What :func:`load_fit` returns."""

    params: Any
    """The parameters, the saved pytree (dicts, lists, tuples, ``None``) of ``jax`` arrays."""
    privacy: PrivacyReport | None
    """The privacy report saved with them (``None`` if none was)."""
    metadata: dict
    """The keyword metadata given to :func:`save_fit`."""


def _json_value(x: Any) -> Any:
    """JSON fallback for numpy and JAX scalars and small arrays in the report or metadata."""
    if isinstance(x, (np.generic, np.ndarray, jax.Array)):
        return np.asarray(x).tolist()
    if isinstance(x, (Path, os.PathLike)):
        return os.fspath(x)
    raise TypeError(
        f"metadata must be JSON-serializable (str, numbers, bools, None, lists, dicts); got "
        f"{type(x).__name__}."
    )


def _encode(tree: Any, arrays: list, dtypes: list) -> Any:
    """The JSON description of ``tree``; its leaves are appended to ``arrays``."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        if not all(isinstance(k, str) for k in tree):
            raise TypeError("save_fit: parameter dicts must have string keys.")
        return {"dict": {k: _encode(v, arrays, dtypes) for k, v in tree.items()}}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        kind = "list" if isinstance(tree, list) else "tuple"
        return {kind: [_encode(v, arrays, dtypes) for v in tree]}
    if isinstance(tree, (jax.Array, np.ndarray, np.generic, float, int, bool)):
        dtype = jnp.result_type(tree) if isinstance(tree, (float, int, bool)) else tree.dtype
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            raise TypeError("save_fit: PRNG key arrays are not parameters; leave them out.")
        value = np.asarray(jax.device_get(tree), dtype=dtype)
        name = np.dtype(dtype).name
        if value.dtype.kind == "V":  # ml_dtypes (bfloat16, float8...): stored as raw bits
            value = value.view(f"u{value.dtype.itemsize}")
        arrays.append(value)
        dtypes.append(name)
        return {"leaf": len(arrays) - 1}
    raise TypeError(
        f"save_fit: parameters must be a pytree of dicts, lists, tuples and arrays; got a "
        f"{type(tree).__name__} node."
    )


def _decode(spec: Any, arrays: dict, dtypes: list) -> Any:
    if spec is None:
        return None
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"not a {FORMAT} file: bad tree description {spec!r}.")
    (kind, body), = spec.items()
    if kind == "dict":
        return {k: _decode(v, arrays, dtypes) for k, v in body.items()}
    if kind in ("list", "tuple"):
        items = [_decode(v, arrays, dtypes) for v in body]
        return items if kind == "list" else tuple(items)
    if kind == "leaf":
        i = int(body)
        value = arrays[f"leaf_{i}"]
        dtype = jnp.dtype(dtypes[i])
        if value.dtype != dtype:
            value = value.view(dtype)
        return jnp.asarray(value)
    raise ValueError(f"not a {FORMAT} file: unknown tree node {kind!r}.")


def save_fit(
    path: str | os.PathLike,
    params: Any,
    privacy_report: PrivacyReport | None = None,
    **metadata: Any,
) -> Path:
    """Write ``params`` and ``privacy_report`` (and ``metadata``) to the ``.npz`` file ``path``.

    :param path: the file to write (replaced atomically if it exists; the name is kept as given).
    :param params: the fitted parameters (``result.params`` of ``DPSVI.run`` or
        ``svi.get_params(state)``): a pytree of dicts with string keys, lists and tuples of arrays.
    :param privacy_report: the run's :class:`~d3pext.training.svi.PrivacyReport`
        (``result.privacy``); ``None`` saves the parameters alone.
    :param metadata: JSON-serializable notes (model name, data version, step count...).
    :return: the path written.
    """
    if privacy_report is not None and not isinstance(privacy_report, PrivacyReport):
        raise TypeError(f"privacy_report must be a PrivacyReport, got {type(privacy_report).__name__}.")
    arrays: list = []
    dtypes: list = []
    tree = _encode(params, arrays, dtypes)
    header = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tree": tree,
        "dtypes": dtypes,
        "privacy": None if privacy_report is None else dataclasses.asdict(privacy_report),
        "metadata": metadata,
    }
    text = json.dumps(header, default=_json_value)
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{_HEADER: np.array(text)}, **{f"leaf_{i}": a for i, a in enumerate(arrays)})
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load_fit(path: str | os.PathLike) -> SavedFit:
    """Read a fit written by :func:`save_fit`: ``SavedFit(params, privacy, metadata)``.

    The file is read without unpickling (``allow_pickle=False``); a file that is not a saved fit,
    or was written by a newer layout, raises ``ValueError``, as does a privacy report with fields
    out of range or an epsilon below the accountant's for its noise multiplier, sampling rate,
    steps and delta (an edit that understates the privacy spent while keeping the training
    settings). The file is not signed: whoever can write it can change the parameters too. The arrays come back as ``jax``
    arrays of their saved dtypes (64-bit ones need ``jax_enable_x64``, as anywhere in JAX).
    """
    with np.load(path, allow_pickle=False) as z:
        if _HEADER not in z.files:
            raise ValueError(f"{os.fspath(path)!r} is not a {FORMAT} file (no header).")
        try:
            header = json.loads(str(z[_HEADER]))
        except json.JSONDecodeError as e:
            raise ValueError(f"{os.fspath(path)!r}: unreadable {FORMAT} header ({e}).") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"{os.fspath(path)!r} is not a {FORMAT} file.")
        version = header.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(
                f"{os.fspath(path)!r} has {FORMAT} layout version {version!r}; this d3pext reads "
                f"versions up to {FORMAT_VERSION}: upgrade d3pext."
            )
        arrays = {k: z[k] for k in z.files if k != _HEADER}
    params = _decode(header["tree"], arrays, list(header["dtypes"]))
    report = header.get("privacy")
    if report is not None:
        report = _checked_report(report, repr(os.fspath(path)))
    return SavedFit(params, report, dict(header.get("metadata") or {}))


def _checked_report(fields: Any, where: str) -> PrivacyReport:
    """The saved privacy report, with its fields' types and ranges checked, and its epsilon checked
    against the accountant's for its noise multiplier, sampling rate, steps, delta and relation."""
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: the saved privacy report is not a record of fields.")
    known = {f.name for f in dataclasses.fields(PrivacyReport)}
    try:
        report = PrivacyReport(**{k: v for k, v in fields.items() if k in known})
    except TypeError as e:
        raise ValueError(f"{where}: the saved privacy report does not fit PrivacyReport ({e}).") from None

    def real(name: str, ok: Callable[[float], bool], what: str) -> list[str]:
        value = getattr(report, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not ok(value):
            return [f"{name} = {value!r} is not {what}"]
        return []

    problems = (
        real("epsilon", lambda v: v >= 0, ">= 0")
        + real("delta", lambda v: 0 <= v <= 1, "in [0, 1]")
        + real("noise_multiplier", lambda v: v > 0, "> 0")
        + real("clipping_threshold", lambda v: 0 < v < math.inf, "finite and > 0")
        + real("sampling_rate", lambda v: 0 < v <= 1, "in (0, 1]")
    )
    if isinstance(report.num_steps, bool) or not isinstance(report.num_steps, int) or report.num_steps < 0:
        problems.append(f"num_steps = {report.num_steps!r} is not a whole number >= 0")
    if report.relation not in {r.value for r in Relation}:
        problems.append(f"relation = {report.relation!r} is not one of {[r.value for r in Relation]}")
    if not isinstance(report.sampler, str):
        problems.append(f"sampler = {report.sampler!r} is not a name")
    if problems:
        raise ValueError(f"{where}: the saved privacy report is invalid ({'; '.join(problems)}): the file was "
                         "damaged or edited.")
    if report.num_steps and math.isfinite(report.epsilon) and math.isfinite(report.noise_multiplier) \
            and 0 < report.delta < 1:
        # the report's delta includes the sampler's and the noise's extra terms: the accountant's
        # epsilon at it is at most the one reported
        least = accountant_epsilon(report.noise_multiplier, report.sampling_rate, report.num_steps,
                                   report.delta, report.relation)
        if report.epsilon < least * (1 - 1e-4):
            raise ValueError(
                f"{where}: the saved privacy report says epsilon = {report.epsilon:.6g}, but "
                f"{report.num_steps} steps at noise multiplier {report.noise_multiplier:.6g} and sampling "
                f"rate {report.sampling_rate:.6g} ({report.relation}) cost at least {least:.6g} at delta "
                f"{report.delta:.3g}: the file was damaged or edited. The file is not signed: keep fits "
                "where only their curator can write."
            )
    return report
