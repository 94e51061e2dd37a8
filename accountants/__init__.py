"""Privacy accountants: tight (epsilon, delta) for DP-VI and budget ledgers for releases."""
