"""Argument checks shared by DPSVI, the mechanisms, ``privatize``, the backends and the models.

Each check returns the normalised value or raises a ``TypeError``/``ValueError`` that names the
argument and says what is expected, so that a bad input fails here with a clear message rather
than deep inside JAX. Only concrete values are checked: arrays traced under ``jit`` pass through
the shape checks alone.

>>> check_positive("epsilon", 0.5)
0.5
>>> check_bounds("bounds", (0, 1))
(0.0, 1.0)
>>> check_positive("epsilon", 0.0)
Traceback (most recent call last):
...
ValueError: epsilon must be finite and > 0, got 0.0
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

__all__ = [
    "check_batch_size",
    "check_bounds",
    "check_finite",
    "check_int",
    "check_labels",
    "check_positive",
    "check_positive_if_number",
    "check_positive_int",
    "check_real",
    "check_records",
]


def check_real(name: str, value: Any) -> float:
    """A real scalar as ``float``; ``TypeError`` for anything else (bool, str, arrays with axes)."""
    if value is None or isinstance(value, (bool, str, bytes, complex)) or np.ndim(value) != 0:
        raise TypeError(f"{name} must be a real number, got {value!r}")
    return float(value)


def check_positive(name: str, value: Any) -> float:
    """A finite real ``> 0``."""
    value = check_real(name, value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def check_int(name: str, value: Any, low: int = 1) -> int:
    """An integer ``>= low`` (integer-valued floats accepted)."""
    if isinstance(value, bool) or np.ndim(value) != 0 or int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    """A positive integer."""
    value = check_real(name, value)
    if not (math.isfinite(value) and value >= 1 and value == int(value)):
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return int(value)


def check_bounds(name: str, bounds: Any) -> tuple[float, float]:
    """A pair ``(a, b)`` of finite reals with ``a < b``."""
    if bounds is None or np.ndim(bounds) != 1 or len(bounds) != 2:
        raise ValueError(f"{name} must be a pair (a, b), got {bounds!r}.")
    a, b = (float(v) for v in bounds)
    if not (math.isfinite(a) and math.isfinite(b) and a < b):
        raise ValueError(f"{name} must be finite with a < b, got ({a}, {b}).")
    return a, b


def check_records(name: str, x: Any, ndim: int) -> tuple[int, ...]:
    """Shape of a data argument with records along axis 0; ``ValueError`` for the wrong rank."""
    shape = np.shape(x)
    if len(shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array with records along axis 0, got shape {shape}")
    return shape


def check_labels(name: str, y: Any, n: int) -> None:
    """``y`` is ``None`` or has shape ``(n,)``, one label per record."""
    if y is not None and np.shape(y) != (n,):
        raise ValueError(f"{name} must have shape ({n},) to match the records, got {np.shape(y)}")


def check_batch_size(batch_size: Optional[int], n: int) -> None:
    """``batch_size`` is ``None`` or an int in ``[1, n]``."""
    if batch_size is None:
        return
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
        raise TypeError(f"batch_size must be an int or None, got {type(batch_size).__name__}")
    if not 1 <= batch_size <= n:
        raise ValueError(f"batch_size must be in [1, {n}] (the number of records), got {batch_size}")


def check_positive_if_number(name: str, value: Any) -> None:
    """``value > 0`` when it is a Python number; arrays (possibly traced under ``jit``) pass."""
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def check_finite(value: Any, what: str, advice: str) -> None:
    """Refuse a concrete value with NaN or infinite entries: ``"{what} has k non-finite entries
    (nan/inf); {advice}"``.

    >>> check_finite([1.0, float("nan")], "the statistic", "check the data.")
    Traceback (most recent call last):
    ...
    ValueError: the statistic has 1 non-finite entries (nan/inf); check the data.
    """
    finite = np.isfinite(np.asarray(value, dtype=float))
    if not finite.all():
        raise ValueError(f"{what} has {int((~finite).sum())} non-finite entries (nan/inf); {advice}")

