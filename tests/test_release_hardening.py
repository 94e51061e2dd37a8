"""Sensitivities and releases that once claimed less than they spent: bounds on vector statistics,
add/remove neighbours, vector records in the bounded statistics, custom statistics with bounds, a
heterogeneous geometric mechanism releasing each count several times or in floating point, and
simulated releases with one alpha per row."""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats as st
from jax import random

import numpyro
import numpyro.distributions as dist
from numpyro.handlers import seed, trace

from d3pext.handlers import make_release, privatize, privatize_counts
from d3pext.releases.counts import HeterogeneousGeometricMechanism
from d3pext.releases.exact import discrete_laplace_log_pmf
from d3pext.releases.mechanisms import LaplaceMechanism


def _released_sensitivity(model, data, **kwargs):
    private = privatize(model, site="x", **kwargs)
    return trace(seed(private, 0)).get_trace(data)["x_dp"]["infer"]["privatize"].mechanism.sensitivity


def _counts_model(x=None):
    with numpyro.plate("records", 5):
        numpyro.sample("x", dist.Poisson(3.0), obs=x)


@pytest.mark.parametrize("family", ["categorical", "multinomial"])
@pytest.mark.parametrize("method", ["truncate", "clamp"])
def test_bounds_on_vector_statistics_are_refused(family, method):
    def model(x=None):
        with numpyro.plate("records", 4):
            fn = dist.Categorical(jnp.ones(3) / 3) if family == "categorical" else dist.Multinomial(10, jnp.ones(3) / 3)
            numpyro.sample("x", fn, obs=x)

    x = jnp.array([0, 1, 2, 1]) if family == "categorical" else jnp.array([[10, 0, 0], [0, 10, 0], [5, 5, 0], [0, 0, 10]])
    with pytest.raises(ValueError, match="bounded already"):
        _released_sensitivity(model, x, mechanism=LaplaceMechanism(1.0), bounds=(0.0, 5.0), bounds_method=method)
    # without bounds: one record moves its whole mass (1 or 10) between components
    assert _released_sensitivity(model, x, mechanism=LaplaceMechanism(1.0)) == (2.0 if family == "categorical" else 20.0)


@pytest.mark.parametrize(
    "method, neighbouring, expected",
    [("clamp", "substitute", 5.0), ("clamp", "add_remove", 10.0),
     ("truncate", "substitute", 10.0), ("truncate", "add_remove", 10.0)],
)
def test_derived_sensitivity_follows_the_neighbouring_relation(method, neighbouring, expected):
    """Records clamped into [5, 10]: replacing one moves the sum by at most 5, adding one by 10."""
    mechanism = LaplaceMechanism(1.0, neighbouring=neighbouring)
    got = _released_sensitivity(_counts_model, jnp.arange(5.0), mechanism=mechanism, bounds=(5.0, 10.0), bounds_method=method)
    assert got == expected
    x = np.array([5.0, 7.0, 10.0, 6.0])  # the largest change of the clamped sum, by brute force
    clamped = np.clip(x, 5, 10)
    change = max(abs(np.clip(v, 5, 10) - c) for v in (5.0, 10.0) for c in clamped) if neighbouring == "substitute" else 10.0
    assert got >= change


def test_bernoulli_add_remove_sensitivity():
    def model(x=None):
        with numpyro.plate("records", 4):
            numpyro.sample("x", dist.Bernoulli(0.5), obs=x)

    mechanism = LaplaceMechanism(1.0, neighbouring="add_remove")
    assert _released_sensitivity(model, jnp.array([0.0, 1.0, 1.0, 0.0]), mechanism=mechanism) == 1.0


@pytest.mark.parametrize("statistic", ["mean", "sample_mean", "sample_variance", "records"])
def test_statistics_scaled_by_n_are_refused_under_add_remove(statistic):
    bounds = (0.0, 10.0) if statistic.startswith("sample") else None
    with pytest.raises(ValueError, match="add/remove"):
        privatize(_counts_model, site="x", mechanism=LaplaceMechanism(1.0, neighbouring="add_remove"),
                  statistic=statistic, bounds=bounds)
    # an explicit sensitivity is the curator's declaration, as for any statistic
    privatize(_counts_model, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=1.0, neighbouring="add_remove"),
              statistic=statistic, bounds=bounds)


@pytest.mark.parametrize("statistic", ["sample_mean", "sample_variance"])
def test_bounded_statistics_refuse_vector_records(statistic):
    def model(x=None):
        with numpyro.plate("records", 10):
            numpyro.sample("x", dist.Normal(jnp.zeros(4), 1.0).to_event(1), obs=x)

    private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0), statistic=statistic, bounds=(0.0, 1.0))
    with pytest.raises(ValueError, match="scalar records"):
        trace(seed(private, 0)).get_trace(jnp.zeros((10, 4)))


def test_custom_statistic_with_bounds_is_refused():
    with pytest.raises(ValueError, match="custom statistic"):
        privatize(_counts_model, site="x", mechanism=LaplaceMechanism(1.0, sensitivity=1.0), statistic=jnp.sum,
                  bounds=(0.0, 1.0), bounds_method="clamp")


def test_heterogeneous_alpha_must_match_the_counts():
    mechanism = HeterogeneousGeometricMechanism.from_alpha(np.full((50, 1), 0.5))
    with pytest.raises(ValueError, match="one alpha per count"):
        mechanism.release(None, np.array([7, 3, 0]))


def test_heterogeneous_geometric_release_is_exact_and_has_its_law():
    """Exact integer noise (float-safe), one scale per distinct alpha: chi-square against the pmf."""
    alpha = np.array([0.5, 0.9])
    mechanism = HeterogeneousGeometricMechanism.from_alpha(alpha[:, None])
    assert mechanism.float_safe
    assert mechanism.epsilon == pytest.approx(-np.log(0.5))
    value = np.array([[3, 0, 7], [1, 1, 2]])
    draws = np.asarray(mechanism.release_many(random.key(0), value, 20_000, reproducible=True))
    assert draws.dtype.kind == "i" and draws.shape == (20_000, 2, 3)
    noise = draws - value
    for row, a in enumerate(alpha):
        k = noise[:, row].ravel()
        support = np.arange(-40, 41)
        pmf = np.exp(discrete_laplace_log_pmf(support, 1 / -np.log(a)))
        observed = np.array([(k == s).sum() for s in support])
        expected = pmf * k.size
        keep = expected >= 5  # pool the tails
        obs = np.append(observed[keep], k.size - observed[keep].sum())
        exp = np.append(expected[keep], k.size - expected[keep].sum())
        assert st.chisquare(obs, exp).pvalue > 1e-3


def test_simulated_releases_follow_one_alpha_per_row():
    """The simulators work on flat release vectors: one alpha per document broadcast and raveled with
    the counts (it once paired the first alpha with every count)."""
    from d3pext.simulation.sbi import Simulator

    alpha = np.array([0.01, 0.5, 0.99])

    def model(counts=None):
        rate = numpyro.sample("rate", dist.Gamma(5.0, 1.0))
        with numpyro.plate("docs", 3, dim=-2), numpyro.plate("words", 2, dim=-1):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    private = privatize_counts(model, site="y", mechanism=HeterogeneousGeometricMechanism.from_alpha(alpha[:, None]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        release = make_release(private, jnp.array([[3, 4], [5, 6], [2, 8]]), rng_key=0, reproducible=True)
    sim = Simulator(private, release)
    _, stat = sim.simulate(random.key(1), 4000)
    points = sim.release_points(random.key(2), stat, 1, "mc")
    assert points.shape == (4000, 1, 6)
    sd = (np.asarray(points[:, 0]) - np.asarray(stat)).std(0)
    expected = np.repeat(np.sqrt(2 * alpha) / (1 - alpha), 2)  # sd of a two-sided geometric
    np.testing.assert_allclose(sd, expected, rtol=0.1)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_bounded_statistics_of_half_precision_records_are_computed_in_float32(dtype):
    """A float16 mean of 5000 records moved by up to 2.4x its sensitivity (b - a) / n when one record
    changed (bfloat16: 20x); the records are promoted before they are clipped and averaged (to
    float64 on the curator's side)."""
    def model(x=None):
        with numpyro.plate("records", 5000):
            numpyro.sample("x", dist.Normal(0.5, 1.0), obs=x)

    x = np.asarray(random.uniform(random.key(0), (5000,)))
    private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0), statistic="sample_mean", bounds=(0.0, 1.0))
    stat = lambda data: trace(seed(private, 0)).get_trace(jnp.asarray(data, dtype))["x_dp"]["infer"]["statistic"]
    assert np.asarray(stat(x)).dtype == np.float64
    changed = x.copy()
    changed[0] = 1.0 - x[0]
    reference = abs(np.mean(np.asarray(jnp.asarray(changed, dtype), np.float64)) - np.mean(np.asarray(jnp.asarray(x, dtype), np.float64)))
    assert abs(float(stat(changed)) - float(stat(x))) <= max(reference, 1 / 5000) * (1 + 1e-3)


def test_counts_beyond_the_integer_range_are_refused():
    """Counts of 2**31 and more wrapped around in JAX's default int32 (3e9 was released as -1.29e9)."""
    from d3pext.releases.counts import check_counts
    from d3pext.releases.mechanisms import GeometricMechanism

    with pytest.raises(ValueError, match="wrap around"):
        check_counts([2**31 + 5])
    with pytest.raises(ValueError, match="wrap around"):
        GeometricMechanism(1.0).release(random.key(0), np.array([3_000_000_000, 7]), reproducible=True)
    assert check_counts([2**31 - 1]).dtype == np.int32


# --- the curator's statistic in float64 -----------------------------------------------------------


def _year_model(statistic, n):
    def model(x=None):
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Exponential(1.0), obs=x)

    kwargs = {} if statistic == "mean" else {"bounds_method": "clamp"}
    return privatize(model, site="x", mechanism=LaplaceMechanism(1.0), statistic=statistic,
                     bounds=(1900.0, 2025.0), **kwargs)


@pytest.mark.parametrize("statistic", ["mean", "sample_mean", "sample_variance"])
def test_curator_statistics_move_by_at_most_their_sensitivity(statistic):
    # birth years in [1900, 2025]: one float32 ulp of the mean (1.2e-4) is about the sensitivity
    # 125 / n at n = 1e6, where the float32 sample mean of neighbours moved by 1.95x the
    # sensitivity and the mean and variance lost the change (0.18x, 0.03x of it). Here n = 1e5,
    # and the statistics must be the float64 ones (float32 is 1e-7 off)
    n = 10**5
    x = np.random.default_rng(2).integers(1920, 2010, n).astype(np.float32)
    model = _year_model(statistic, n)
    reference = np.var if statistic == "sample_variance" else np.mean
    for shared in range(2):
        x[1] = 1920 + shared
        values, exact = [], []
        for record in (1900.0, 2025.0):  # record 0 substituted, inside the bounds
            x[0] = record
            site = trace(seed(model, 0)).get_trace(jnp.asarray(x))["x_dp"]
            values.append(float(site["infer"]["statistic"]))
            exact.append(reference(x.astype(np.float64), **({"ddof": 1} if statistic == "sample_variance" else {})))
            sensitivity = site["infer"]["privatize"].mechanism.sensitivity
        assert values == pytest.approx(exact, rel=1e-12)
        assert abs(values[0] - values[1]) <= sensitivity * (1 + 1e-9)


def test_a_release_made_here_is_analysed_with_the_settings_it_was_made_with():
    # a release drawn at epsilon 0.05 and analysed as epsilon 1 gave a posterior half as wide as the
    # right one, without a word
    from d3pext.handlers import private_posterior
    from d3pext.simulation.sbi import Simulator

    def base(n, x=None):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)

    x = jnp.asarray(np.arange(50) % 2, jnp.int32)
    release = make_release(privatize(base, site="x", mechanism=LaplaceMechanism(0.05)), 50, x, rng_key=3,
                           reproducible=True)
    other = privatize(base, site="x", mechanism=LaplaceMechanism(1.0))
    with pytest.raises(ValueError, match=r"epsilon: made with 0.05, analysed as 1.0"):
        private_posterior(other, release, num_warmup=5, num_samples=5, progress_bar=False).run(random.key(0), 50)
    with pytest.raises(ValueError, match="other settings"):
        Simulator(other, release, (50,))
    same = privatize(base, site="x", mechanism=LaplaceMechanism(0.05))
    Simulator(same, release, (50,))  # the settings it was made with
    # a value this process did not make (a copy, say) is the analyst's declaration
    Simulator(other, {"x_dp": np.asarray(release["x_dp"])}, (50,))


def test_clamp_bounds_are_rounded_inwards_to_the_records_precision():
    # float32 (spacing 0.0625 at 1e6) rounds 1e6 + 0.03 down and 1e6 + 0.17 up: records clipped to
    # the rounded bounds spanned 1.34x the sensitivity b - a (6.25x for bounds (1e6 + 0.03, 1e6 + 0.04))
    a, b = 1e6 + 0.03, 1e6 + 0.17

    def model(x=None):
        with numpyro.plate("records", 100):
            numpyro.sample("x", dist.Exponential(1.0), obs=x)

    private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0), bounds=(a, b), bounds_method="clamp")
    values = []
    for record in (1.0, 2e6):  # clipped to a and to b
        x = np.full(100, 1e6 + 0.1, np.float32)
        x[0] = record
        site = trace(seed(private, 0)).get_trace(jnp.asarray(x))["x_dp"]
        values.append(float(site["infer"]["statistic"]))
        sensitivity = site["infer"]["privatize"].mechanism.sensitivity
    assert 0 < abs(values[1] - values[0]) <= sensitivity
    with pytest.raises(ValueError, match="hold no float32 value"):
        trace(seed(privatize(model, site="x", mechanism=LaplaceMechanism(1.0), bounds=(a, a + 1e-3),
                             bounds_method="clamp"), 0)).get_trace(jnp.asarray(x))


def test_a_local_release_puts_each_record_on_its_own_grid():
    """statistic="records": neighbours differ in one record's statistic, so each record is released on
    its own grid (unit sensitivity / resolution). On one grid for the whole vector (unit sensitivity /
    (resolution n)) a release of 4000 records near 1000 sensitivities had been refused as too large."""
    n = 4000

    def model(x=None):
        lam = numpyro.sample("lam", dist.Gamma(1.0, 1.0))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Exponential(lam), obs=x)

    private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0), statistic="records",
                        bounds=(1e3, 1e3 + 1.0), bounds_method="clamp")
    x = np.full(n, 1e3 + 0.5, np.float32)
    release = np.asarray(make_release(private, x, rng_key=0, reproducible=True)["x_dp"], np.float64)
    assert release.shape == (n,)
    units = release * 1024  # the default resolution; sensitivity 1
    np.testing.assert_array_equal(units, np.round(units))
    # Laplace noise of scale (1 + 1/resolution) / epsilon: mean |noise| within 3 standard errors
    assert abs(np.abs(release - x).mean() / (1 + 1 / 1024) - 1) < 3 / np.sqrt(n)
    with pytest.raises(ValueError, match=r"statistic_shape \(3,\) must be the trailing shape"):
        LaplaceMechanism(1.0, sensitivity=1.0).release(None, np.zeros((3, 2)), statistic_shape=(3,))
