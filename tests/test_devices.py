"""Chains and releases over several devices (4 forced CPU devices, in a subprocess).

``XLA_FLAGS=--xla_force_host_platform_device_count=4`` must be set before JAX starts, so each
check runs in a fresh interpreter. The devices share this machine's cores: these tests check
results, not speed.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest

HEADER = """
import jax, jax.numpy as jnp, numpy as np
from jax import random
import numpyro, numpyro.distributions as dist
from d3pext import privatize, private_posterior, sample_releases, LaplaceMechanism
assert len(jax.devices()) == 4, jax.devices()

def beta_binomial(n):
    theta = numpyro.sample("theta", dist.Beta(2.0, 2.0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Bernoulli(theta))

private = privatize(beta_binomial, site="x", mechanism=LaplaceMechanism(1.0))
"""


def _run(code: str, timeout: int = 600) -> str:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", HEADER + textwrap.dedent(code)], env=env, capture_output=True,
        text=True, timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


RELEASES = """
    # 3 releases x 3 chains = 9 chains over 4 devices (padded to 12): the same draws as one device
    rel = {"x_dp": jnp.array([10.2, 55.0, 80.7])}
    kw = dict(num_warmup=50, num_samples=100, num_chains=3)
    one = sample_releases(private, rel, random.key(0), 100, devices=jax.devices()[:1], **kw)
    four = sample_releases(private, rel, random.key(0), 100, **kw)
    assert four["theta"].shape == (3, 3, 100)
    print("releases, largest difference:", float(np.max(np.abs(np.asarray(one["theta"]) - np.asarray(four["theta"])))))
"""


@pytest.fixture(scope="module")
def default_run() -> str:
    """The default checks in one subprocess (a JAX start-up each would cost more than some checks)."""
    return _parallel_chains("""
        MODELS = {"gibbs": (private, {"x_dp": jnp.array(41.3)}, (100,))}
    """, before=RELEASES)


def test_sample_releases_over_four_devices_matches_one(default_run):
    found = re.search(r"releases, largest difference: (\S+)", default_run)
    assert found, default_run
    assert float(found.group(1)) < 1e-5


def _parallel_chains(models: str, before: str = "") -> str:
    return _run(textwrap.dedent(before) + textwrap.dedent(models) + textwrap.dedent("""
        for name, (model, data, args) in MODELS.items():
            mcmc = private_posterior(model, data, num_warmup=100, num_samples=100, num_chains=4,
                                     chain_method="parallel", progress_bar=False)
            mcmc.run(random.key(0), *args)
            draws = mcmc.get_samples(group_by_chain=True)
            leaves = jax.tree.leaves(draws)
            assert all(v.shape[:2] == (4, 100) and np.isfinite(np.asarray(v)).all() for v in leaves), name
            print(name, "ok")
    """))


def test_parallel_chains_exponential_family(default_run):
    assert "gibbs ok" in default_run


@pytest.mark.slow
def test_parallel_chains_every_backend():
    out = _parallel_chains("""
        from d3pext import privatize_counts
        from d3pext.inference.bounded import FlatPrior
        from d3pext.releases.counts import limited_precision_mechanism
        from d3pext import make_release
        from d3pext.models import (BROWNLEE_LIKE, private_bounded_gaussian, private_constrained_regression,
                                   simulate_drinking_cirrhosis)

        def counts_model(n):
            rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
            with numpyro.plate("cells", n):
                numpyro.sample("y", dist.Poisson(rate))

        s = BROWNLEE_LIKE
        regression = private_constrained_regression(s["n"], s["epsilon"], s["bounds_x"], s["bounds_y"],
                                                    s["prior"], constrained=True)
        regression_release = make_release(regression, records=simulate_drinking_cirrhosis(random.key(0)),
                                          rng_key=1, reproducible=True)
        MODELS = {
            "gibbs": (private, {"x_dp": jnp.array(41.3)}, (100,)),
            "bounded": (private_bounded_gaussian(0.25, 0.25, (0.0, 100.0), FlatPrior(), constrained=True),
                        {"y_mean_dp": jnp.array(31.0), "y_var_dp": jnp.array(250.0)}, (43,)),
            "counts": (privatize_counts(counts_model, site="y", mechanism=limited_precision_mechanism(1.0)),
                       {"y_dp": jnp.array([3, -1, 4, 6, 2])}, (5,)),
            "regression": (regression, regression_release, ()),
        }
    """)
    for name in ("gibbs", "bounded", "counts", "regression"):
        assert f"{name} ok" in out
