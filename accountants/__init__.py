"""Privacy accountants: tight (epsilon, delta) for DP-VI and budget ledgers for releases."""

from d3pext.accountants.fourier import (
    AccountingError,
    Relation,
    SigmaResult,
    approximate_sigma,
    delta,
    epsilon,
)

__all__ = [
    "AccountingError",
    "Relation",
    "SigmaResult",
    "approximate_sigma",
    "delta",
    "epsilon",
]
