"""Privacy accountants: tight (epsilon, delta) for DP-VI and budget ledgers for releases."""

from d3pext.accountants.fourier import (
    AccountingError,
    Relation,
    SigmaResult,
    approximate_sigma,
    delta,
    epsilon,
)
from d3pext.accountants.ledger import (
    NEIGHBOURING_RELATIONS,
    LedgerEntry,
    LedgerError,
    LedgerWarning,
    PrivacyBudgetExceeded,
    PrivacyCost,
    PrivacyLedger,
    analytic_gaussian_delta,
    analytic_gaussian_epsilon,
    analytic_gaussian_noise_multiplier,
    compose,
)

__all__ = [
    "AccountingError",
    "LedgerEntry",
    "LedgerError",
    "LedgerWarning",
    "NEIGHBOURING_RELATIONS",
    "PrivacyBudgetExceeded",
    "PrivacyCost",
    "PrivacyLedger",
    "Relation",
    "SigmaResult",
    "analytic_gaussian_delta",
    "analytic_gaussian_epsilon",
    "analytic_gaussian_noise_multiplier",
    "approximate_sigma",
    "compose",
    "delta",
    "epsilon",
]
