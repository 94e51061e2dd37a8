"""d3pext: Bayesian inference under differential privacy for NumPyro."""

__version__ = "0.1.0"
