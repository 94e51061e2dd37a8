"""The record (individual) that ``privatize`` protects: ``record_plate``, and the cells each record holds.

An individual with ``D`` cells (one per feature, or a vector batch of its distribution) moves ``D``
cells of the statistic: its sensitivity is ``D`` times one cell's. Treating every cell as a record
once gave a stated epsilon ``D`` times below the individual's."""

import warnings

import numpy as np
import pytest

import jax.numpy as jnp
from jax import random

import numpyro
import numpyro.distributions as dist
from numpyro.handlers import seed, trace

from d3pext.handlers import make_release, private_posterior, privatize, privatize_counts
from d3pext.releases.counts import limited_precision_mechanism
from d3pext.releases.info import check_made_as_analysed, describe_release, made_as, release_sites
from d3pext.releases.mechanisms import GaussianMechanism, LaplaceMechanism

N, D = 5, 4


def nested(n, x=None):
    """One row of ``D`` cells per individual: records x features."""
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    with numpyro.plate("records", n, dim=-2), numpyro.plate("features", D, dim=-1):
        numpyro.sample("x", dist.Bernoulli(theta), obs=x)


def vector_batch(n, x=None):
    """One plate; the distribution's own batch dim holds each record's ``D`` cells."""
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    with numpyro.plate("records", n, dim=-2):
        numpyro.sample("x", dist.Bernoulli(theta).expand([1, D]), obs=x)


def nested_normal(n, x=None):
    with numpyro.plate("records", n, dim=-2), numpyro.plate("features", D, dim=-1):
        numpyro.sample("x", dist.Normal(0.5, 1.0), obs=x)


X = np.asarray(random.bernoulli(random.key(0), 0.3, (N, D)), np.int32)


def _release(model, x=X, **kwargs):
    kwargs.setdefault("mechanism", LaplaceMechanism(1.0))
    release = make_release(privatize(model, site="x", **kwargs), N, x, rng_key=0, reproducible=True)
    (value,) = release.values()
    return value, made_as(value)[0]


def _info(model, **kwargs):
    kwargs.setdefault("mechanism", LaplaceMechanism(1.0))
    tr = trace(seed(privatize(model, site="x", **kwargs), 0)).get_trace(N)
    return release_sites(tr)["x_dp"]


@pytest.mark.parametrize("statistic", ["sufficient", "mean", "records"])
def test_a_site_in_several_plates_needs_its_record_plate(statistic):
    """Which plate indexes individuals sets the sensitivity: not guessed (it was 1 for D cells each)."""
    # every plate is offered, none preferred: the outermost suggested alone was the wrong one (too small
    # a sensitivity) whenever the individuals were indexed by an inner plate
    with pytest.raises(ValueError, match=r"plates \['records', 'features'\].*record_plate='records' if each index "
                                         r".*record_plate='features' if each index.*"
                                         r"record_plate=\('records', 'features'\) if every cell"):
        make_release(privatize(nested, site="x", mechanism=LaplaceMechanism(1.0), statistic=statistic),
                     N, X, rng_key=0, reproducible=True)


def test_record_plate_scales_the_sensitivity_by_the_cells_of_a_record():
    value, made = _release(nested, record_plate="records")
    assert made["sensitivity"] == D * 1.0 and made["cells_per_record"] == D and made["num_records"] == N * D
    assert float(value) == pytest.approx(X.sum(), abs=200)  # the sum over all cells
    # every cell an individual: one cell's sensitivity, today's description
    _, made = _release(nested, record_plate=("records", "features"))
    assert made["sensitivity"] == 1.0 and "cells_per_record" not in made and made["num_records"] == N * D
    info = _info(nested, record_plate=("features", "records"))  # in any order
    assert info.sensitivity == 1.0 and info.cells_per_record == 1


def test_mean_sensitivity_covers_the_record_and_divides_by_the_cells():
    value, made = _release(nested, record_plate="records", statistic="mean",
                           mechanism=GaussianMechanism(1.0, 1e-5))
    assert made["sensitivity"] == pytest.approx(D / (N * D)) and made["cells_per_record"] == D
    assert made["num_records"] == N * D


def test_one_plate_with_a_vector_batch_counts_the_cells_of_each_record():
    """``plate("records", n)`` around a batch of ``D``: each record holds ``D`` cells (it was 1)."""
    _, made = _release(vector_batch)
    assert made["sensitivity"] == D * 1.0 and made["cells_per_record"] == D and made["num_records"] == N * D


@pytest.mark.parametrize("model", [nested, vector_batch])
def test_local_release_of_a_record_costs_epsilon_for_all_its_cells(model):
    """Each cell still on its own grid, with noise for the record's ``D`` cells together (one cell's
    noise gave each individual D x epsilon)."""
    kwargs = {"record_plate": "records"} if model is nested else {}
    value, made = _release(model, statistic="records", mechanism=LaplaceMechanism(0.5), **kwargs)
    assert value.shape == (N, D) and made["stat_shape"] == []
    assert made["sensitivity"] == D * 1.0 and made["noise scale"] == pytest.approx(D / 0.5)
    assert made["cells_per_record"] == D and made["epsilon"] == 0.5


@pytest.mark.parametrize("statistic", ["sample_mean", "sample_variance"])
def test_bounded_statistics_in_nested_plates(statistic):
    per_cell = 1.0 / (N * D)  # (b - a) / n and (b - a)^2 / n over the n = N * D cells, bounds (0, 1)
    x = np.asarray(random.uniform(random.key(1), (N, D)))
    kwargs = dict(statistic=statistic, bounds=(0.0, 1.0))
    with pytest.raises(ValueError, match="record_plate"):
        _release(nested_normal, x, **kwargs)
    value, made = _release(nested_normal, x, record_plate="records", **kwargs)
    assert made["sensitivity"] == pytest.approx(D * per_cell) and made["cells_per_record"] == D
    _, made = _release(nested_normal, x, record_plate=("records", "features"), **kwargs)
    assert made["sensitivity"] == pytest.approx(per_cell)


def test_record_plate_must_name_plates_of_the_site():
    with pytest.raises(ValueError, match=r"names \['rows'\].*plates are \['records', 'features'\]"):
        _release(nested, record_plate="rows")
    for bad in ((), ("records", "records"), 3):
        with pytest.raises(ValueError, match="record_plate must be"):
            privatize(nested, site="x", mechanism=LaplaceMechanism(1.0), record_plate=bad)


def test_a_site_without_plates_and_several_batch_dims_is_refused():
    def unplated(n, x=None):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        numpyro.sample("x", dist.Bernoulli(theta).expand([n, D]), obs=x)

    with pytest.raises(ValueError, match=r"no plate and has batch shape \(5, 4\)"):
        _release(unplated)

    def one_dim(n, x=None):  # no plate, one batch dim: each element a record, as before
        numpyro.sample("x", dist.Bernoulli(0.5).expand([n]), obs=x)

    _, made = _release(one_dim, X[:, 0])
    assert made["sensitivity"] == 1.0 and "cells_per_record" not in made


def test_an_explicit_sensitivity_is_one_records_and_is_checked_against_the_cells():
    """Not scaled, but a per-cell value below the record's derived bound warns."""
    with pytest.warns(UserWarning, match=r"sensitivity 1.0 is below the bound 4.0"):
        _, made = _release(nested, record_plate="records", mechanism=LaplaceMechanism(1.0, sensitivity=1.0))
    assert made["sensitivity"] == 1.0 and made["cells_per_record"] == D
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, made = _release(nested, record_plate="records", mechanism=LaplaceMechanism(1.0, sensitivity=4.0))
    assert made["sensitivity"] == 4.0


def test_custom_statistics_and_count_releases_keep_the_users_sensitivity():
    """A callable's sensitivity is the user's, for one individual: not scaled, no plate required;
    ``privatize_counts`` keeps one release per count."""
    _, made = _release(nested, statistic=lambda x: x.sum(-1), mechanism=LaplaceMechanism(1.0, sensitivity=D))
    assert made["sensitivity"] == D and "cells_per_record" not in made
    _, made = _release(nested, statistic=lambda x: x.sum(-1), mechanism=LaplaceMechanism(1.0, sensitivity=D),
                       record_plate="records")
    assert made["sensitivity"] == D and made["cells_per_record"] == D

    def counts_model(counts=None):
        rate = numpyro.sample("rate", dist.Gamma(5.0, 1.0))
        with numpyro.plate("docs", 3, dim=-2), numpyro.plate("words", 2, dim=-1):
            numpyro.sample("y", dist.Poisson(rate), obs=counts)

    private = privatize_counts(counts_model, site="y", mechanism=limited_precision_mechanism(1.0, N=2))
    release = make_release(private, jnp.array([[3, 4], [5, 6], [2, 8]]), rng_key=0, reproducible=True)
    made = made_as(release["y_dp"])[0]
    assert made["sensitivity"] == 2 and "cells_per_record" not in made


def test_a_release_analysed_under_another_record_plate_is_refused():
    """Same mechanism, same number of cells, another individual: refused (describe_release has the cells)."""
    mechanism = LaplaceMechanism(1.0, sensitivity=4.0)
    value, _ = _release(nested, record_plate="records", mechanism=mechanism)
    check_made_as_analysed("x_dp", value, _info(nested, record_plate="records", mechanism=mechanism))
    other = _info(nested, record_plate=("records", "features"), mechanism=mechanism)
    assert describe_release(other).get("cells_per_record") is None
    with pytest.raises(ValueError, match="cells_per_record: made with 4, analysed as 1"):
        check_made_as_analysed("x_dp", value, other)
    with pytest.raises(ValueError, match="cells_per_record"):
        private_posterior(
            privatize(nested, site="x", mechanism=mechanism, record_plate=("records", "features")),
            {"x_dp": value}, num_warmup=2, num_samples=2,
        ).run(random.key(0), N)


def test_single_plate_models_keep_their_sensitivities():
    """Scalar records in one plate: one cell per record, exactly today's sensitivities and descriptions."""
    from d3pext.models.bounded_gaussian import private_bounded_gaussian
    from d3pext.models.expfam import (
        private_beta_binomial, private_dirichlet_multinomial, private_exponential_gamma,
    )

    cases = [
        (private_beta_binomial(1.0), (10,), jnp.ones(10), {"x_dp": 1.0}),
        (private_dirichlet_multinomial(1.0), (10,), jnp.arange(10) % 4, {"x_dp": 2.0}),
        (private_exponential_gamma(1.0), (10,), jnp.full(10, 1.0), {"x_dp": 3.689}),
        (private_bounded_gaussian(1.0, 1.0, (0.0, 2.0)), (10,), jnp.full(10, 1.0),
         {"y_mean_dp": 2.0 / 10, "y_var_dp": 4.0 / 10}),
    ]
    for model, args, data, sensitivities in cases:
        kw = {"y": data} if "y_mean_dp" in sensitivities else {"x": data}
        release = make_release(model, *args, **kw, rng_key=0, reproducible=True)
        for name, sensitivity in sensitivities.items():
            made = made_as(release[name])[0]
            assert made["sensitivity"] == sensitivity and made["num_records"] == 10
            assert "cells_per_record" not in made


def test_plates_sharing_a_name_are_refused():
    """NumPyro nests two plates of one name; record_plate="records" had matched both, so every cell was
    taken as an individual: sensitivity 1 where a row of 4 cells moves the sum by 4."""
    def model(x=None):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        with numpyro.plate("records", 5, dim=-2), numpyro.plate("records", 4, dim=-1):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)

    x = jnp.ones((5, 4))
    for record_plate in ("records", None):
        private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0), record_plate=record_plate)
        with pytest.raises(ValueError, match="share a name"):
            make_release(private, x, rng_key=0, reproducible=True)


def test_plates_of_one_leave_the_record_plate_unambiguous():
    """A plate of size 1 beside the records plate holds one cell either way: not refused (it had been, and
    the message had suggested the plate of one, which gave 6x the sensitivity)."""
    def model(x=None):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        with numpyro.plate("groups", 1, dim=-2), numpyro.plate("records", 6, dim=-1):
            numpyro.sample("x", dist.Bernoulli(theta), obs=x)

    tr = trace(seed(privatize(model, site="x", mechanism=LaplaceMechanism(1.0)), 0)).get_trace(jnp.ones((1, 6)))
    info = tr["x_dp"]["infer"]["privatize"]
    assert info.sensitivity == 1.0 and info.cells_per_record == 1 and info.num_records == 6


def test_records_with_event_dims_are_refused_with_the_plate_form_to_use():
    """A record written as ``.to_event(1)`` was refused as "records must be iid" with advice to move
    per-record parameters into a plate, which it had none of; the message now names the event dims and
    the nested-plate form that the methods take."""

    def events(n, x=None):
        theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
        with numpyro.plate("records", n):
            numpyro.sample("x", dist.Bernoulli(theta).expand([D]).to_event(1), obs=x)

    with pytest.raises(ValueError, match=r"event dimensions \(BernoulliProbs\(...\).to_event\(1\), event shape \(4,\)\)"
                                         r".*plate inside the records' plate"):
        _release(events)
    # the form the message asks for releases with the record's cells counted (unwrapping the event dims
    # instead would count each cell as a record: sensitivity 1 for an individual who moves D cells)
    _, made = _release(nested, record_plate="records")
    assert made["sensitivity"] == D * 1.0 and made["cells_per_record"] == D
