"""Empirical privacy audits with teeth: broken mechanisms are caught, the shipped ones are not."""

import jax
import jax.numpy as jnp
import pytest

from d3pext.audit import AuditResult, audit_mechanism, audit_report
from d3pext.releases.mechanisms import GaussianMechanism, GeometricMechanism, LaplaceMechanism

N = 40_000


def too_little_noise(epsilon):
    """Claims epsilon but adds a tenth of the Laplace noise epsilon needs."""

    def release(key, value):
        return value + jax.random.laplace(key, (), jnp.float32) / (10 * epsilon)

    return release


def test_audit_catches_noise_too_small():
    result = audit_mechanism(too_little_noise(1.0), 0.0, 1.0, num_releases=N, rng_key=1, name="tenth")
    assert result.epsilon_lower_bound > 3.0  # true epsilon 10 against a claim of 1
    assert result.test.startswith("threshold")


@pytest.mark.parametrize(
    "mechanism, x0, x1",
    [
        (LaplaceMechanism(0.3, sensitivity=1.0), 0.0, 0.1),  # the float attack's inputs
        (LaplaceMechanism(1.0, sensitivity=1.0), 0.0, 1.0),
        (GaussianMechanism(1.0, 1e-5, sensitivity=1.0), 0.0, 1.0),
        (GeometricMechanism(1.0), 0, 1),
    ],
)
def test_shipped_mechanisms_stay_below_their_claim(mechanism, x0, x1):
    result = audit_mechanism(mechanism, x0, x1, num_releases=N, rng_key=3)
    assert not result.violates_claim, result
    assert result.claimed_epsilon == mechanism.epsilon


def test_audit_has_power_on_an_exact_mechanism():
    # the geometric mechanism at epsilon 1 between 0 and 1: the bound comes close to the truth
    result = audit_mechanism(GeometricMechanism(1.0), 0, 1, num_releases=N, rng_key=4)
    assert 0.5 < result.epsilon_lower_bound <= 1.0, result


def test_report_and_bad_arguments():
    table = audit_report([AuditResult("m", 1.0, 0.5, "threshold>0", 0.3, 0.2, 100, 0.95)])
    assert "| m | 1 | 0.500 |" in table
    with pytest.raises(ValueError, match="confidence"):
        audit_mechanism(GeometricMechanism(1.0), 0, 1, num_releases=1000, confidence=1.5)
    with pytest.raises(ValueError, match="num_releases"):
        audit_mechanism(GeometricMechanism(1.0), 0, 1, num_releases=10)
