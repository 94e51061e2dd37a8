"""Empirical privacy audits with teeth: broken mechanisms are caught, the shipped ones are not."""

import math

import jax
import jax.numpy as jnp
import pytest

from d3pext.audit import AuditResult, NaiveFloatLaplace, audit_dpsvi, audit_mechanism, audit_report, one_run_epsilon_bound
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


@pytest.mark.parametrize("epsilon", [0.3, 1.0])
def test_audit_catches_the_naive_float_laplace(epsilon):
    """Inputs that are not multiples of the float grid: 0.1 and 1.1. Outputs of 0.1 sit on a lattice
    (few significant bits of y - 0.1 where the noise is small) that outputs of 1.1 miss."""
    result = audit_mechanism(NaiveFloatLaplace(epsilon), 0.1, 1.1, num_releases=200_000, rng_key=5)
    assert result.violates_claim, result
    assert result.test.startswith("bits")


@pytest.mark.parametrize(
    "mechanism, x0, x1",
    [
        (LaplaceMechanism(0.3, sensitivity=1.0), 0.0, 0.1),  # the float attack's inputs
        (LaplaceMechanism(1.0, sensitivity=1.0), 0.0, 1.0),
        (LaplaceMechanism(1.0, sensitivity=1.0), 0.1, 1.1),
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


def test_one_run_bound_is_exact_at_its_edges():
    # all 100 guesses right: P[Binomial(100, p) = 100] = p^100 = 0.05 at p = 0.05^(1/100)
    p = 0.05 ** (1 / 100)
    assert one_run_epsilon_bound(100, 100, 200) == pytest.approx(math.log(p / (1 - p)), rel=1e-6)
    assert one_run_epsilon_bound(50, 100, 200) == 0.0
    assert one_run_epsilon_bound(100, 100, 200, delta=1e-5) < one_run_epsilon_bound(100, 100, 200)
    with pytest.raises(ValueError, match="num_correct"):
        one_run_epsilon_bound(101, 100, 200)


def test_dpsvi_canary_audit_flags_missing_noise_and_passes_the_real_thing():
    """One training run with 200 canaries: with a hundredth of the calibrated noise the membership
    guesses are nearly all right (bound above the claim); with the calibrated noise they are not."""
    broken = audit_dpsvi(epsilon=1.0, noise_factor=0.01, rng_key=0)
    assert broken.violates_claim, broken
    shipped = audit_dpsvi(epsilon=1.0, rng_key=0)
    assert not shipped.violates_claim, shipped
    assert shipped.claimed_epsilon == pytest.approx(1.0, rel=1e-3)
