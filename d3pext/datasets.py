"""Bundled data sets.

``load_breast_cancer`` returns the Breast Cancer Wisconsin (Diagnostic) data set (W. H. Wolberg,
W. N. Street, O. L. Mangasarian, 1995; UCI Machine Learning Repository,
https://doi.org/10.24432/C5DW2B), bundled as ``d3pext/data/breast_cancer.csv`` from
scikit-learn's copy. It is licensed under Creative Commons Attribution 4.0 International
(CC BY 4.0, https://creativecommons.org/licenses/by/4.0/); see ``d3pext/data/README.md``.
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple

import numpy as np

__all__ = ["BREAST_CANCER_FEATURES", "BREAST_CANCER_BOUNDS", "TrainTestSplit", "load_breast_cancer"]

# Per-feature (min, max) as published in the data set's description (UCI / scikit-learn,
# rounded to about three significant digits), in the column order of the CSV.
_PUBLISHED_RANGES = (
    (6.981, 28.11), (9.71, 39.28), (43.79, 188.5), (143.5, 2501.0), (0.053, 0.163),
    (0.019, 0.345), (0.0, 0.427), (0.0, 0.201), (0.106, 0.304), (0.05, 0.097),
    (0.112, 2.873), (0.36, 4.885), (0.757, 21.98), (6.802, 542.2), (0.002, 0.031),
    (0.002, 0.135), (0.0, 0.396), (0.0, 0.053), (0.008, 0.079), (0.001, 0.03),
    (7.93, 36.04), (12.02, 49.54), (50.41, 251.2), (185.2, 4254.0), (0.071, 0.223),
    (0.027, 1.058), (0.0, 1.252), (0.0, 0.291), (0.156, 0.664), (0.055, 0.208),
)  # fmt: skip

#: Public per-feature bounds ``(low, high)``, each of shape ``(30,)``, used by the scaling.
BREAST_CANCER_BOUNDS: tuple[np.ndarray, np.ndarray] = (
    np.array([r[0] for r in _PUBLISHED_RANGES]),
    np.array([r[1] for r in _PUBLISHED_RANGES]),
)


class TrainTestSplit(NamedTuple):
    """Features (float32, records along axis 0) and binary labels (int32) of a train/test split."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _read_csv() -> tuple[tuple[str, ...], np.ndarray]:
    path = resources.files("d3pext") / "data" / "breast_cancer.csv"
    with path.open("r") as f:
        header = f.readline().strip().split(",")
        table = np.loadtxt(f, delimiter=",", dtype=np.float64)
    return tuple(header[:-1]), table


#: Names of the 30 features, in column order.
BREAST_CANCER_FEATURES: tuple[str, ...] = _read_csv()[0]


def load_breast_cancer(
    standardize: bool = True, test_fraction: float = 0.3, seed: int = 0
) -> TrainTestSplit:
    """Breast Cancer Wisconsin (Diagnostic): 569 records, 30 features, label 1 = benign.

    With ``standardize=True`` each feature is mapped affinely from its public range
    :data:`BREAST_CANCER_BOUNDS` onto ``[-1, 1]`` and clipped to ``[-1, 1]``.

    Why public bounds rather than training-set mean and standard deviation: statistics of the
    training split are functions of the confidential records, and publishing a model fitted on
    data scaled by them leaks those statistics outside the differential-privacy guarantee. The
    bounds are fixed constants declared before the data are seen (here the ranges printed in the
    data set's description, standing in for a data holder's domain knowledge), so the scaling is
    the same map for every neighbouring data set and the privacy spent by a DP fit is the whole
    cost. Why clip: the published ranges are rounded, so a few records fall just outside them, and
    any new record may too; clipping makes every record lie in ``[-1, 1]^30`` (norm at most
    ``sqrt(30)``), so per-example gradients of models such as logistic regression are bounded and
    rarely dominated by outliers, which keeps DP-VI's gradient clipping from biasing the fit.

    The features are not centred, so a linear model needs an intercept (e.g. a column of ones).

    Args:
        standardize: scale to ``[-1, 1]`` by the public bounds (else the raw measurements).
        test_fraction: share of records held out for testing, in ``[0, 1)``.
        seed: seed of the random split (the split is not private: it only decides which records
            are trained on).

    Returns:
        :class:`TrainTestSplit` of float32 features and int32 labels.

    >>> from d3pext.datasets import load_breast_cancer
    >>> x_train, y_train, x_test, y_test = load_breast_cancer()
    >>> x_train.shape, x_test.shape
    ((398, 30), (171, 30))
    >>> bool(abs(x_train).max() <= 1.0)
    True
    """
    if not isinstance(standardize, bool):
        raise TypeError(f"standardize must be a bool, got {type(standardize).__name__}")
    test_fraction = float(test_fraction)
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    _, table = _read_csv()
    x, y = table[:, :-1], table[:, -1].astype(np.int32)
    if standardize:
        low, high = BREAST_CANCER_BOUNDS
        x = np.clip(2.0 * (x - low) / (high - low) - 1.0, -1.0, 1.0)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    x = x.astype(np.float32)
    return TrainTestSplit(x[train], y[train], x[test], y[test])
