"""Small fitted SPPE estimators shared by the test files that need one.

Fitting costs mostly compilation (simulator, RQMC releases, training epoch, validation), so one
fit per test process serves ``test_sbi.py`` and ``test_arviz.py`` (cached here: under
``pytest -n 0`` they share it; under ``--dist loadfile`` each worker that needs it fits it once).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import random


@functools.cache
def tiny_sppe():
    """One round (maximum likelihood) on the linear-regression example of seed 000, at the
    paper's release ``PAPER_S_DP``: small enough to fit in seconds, trained enough that the
    posterior leaves the prior towards the reference (beta_1 near -2.7)."""
    from d3pext.handlers import private_posterior
    from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression

    model = private_linear_regression(100, 10.0, sensitivity=0.13)
    post = private_posterior(
        model, {"records_dp": jnp.array(PAPER_S_DP)}, method="sppe", rounds=1,
        simulations_per_round=420, num_points=4, max_epochs=40, learning_rate=5e-3,
        num_samples=500, flow_kwargs=dict(layers=2, width=8, knots=4), progress_bar=False,
    )
    return post.run(random.key(0), 100)
