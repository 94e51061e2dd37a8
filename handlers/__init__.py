"""Effect handlers that put privacy into NumPyro models: ``privatize`` and ``private_posterior``."""
