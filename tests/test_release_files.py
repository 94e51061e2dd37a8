"""Releases on disk (`save_releases` / `load_releases`): the values round-trip bit for bit with the
settings they were made with, an analysis in another process is held to those settings, and a file
that is not a valid release file is refused with what is wrong."""

import gc
import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro
import numpyro.distributions as dist

from d3pext import load_releases, save_releases
from d3pext.handlers import make_release, privatize, privatize_counts
from d3pext.releases.counts import HeterogeneousGeometricMechanism
from d3pext.releases.mechanisms import GaussianMechanism, LaplaceMechanism
from d3pext.simulation.sbi import Simulator


def bernoulli(n, x=None):
    theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    with numpyro.plate("records", n):
        numpyro.sample("x", dist.Bernoulli(theta), obs=x)


def normal(n, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("records", n):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def both(n, x=None, y=None):
    bernoulli(n, x)
    normal(n, y)


X = jnp.asarray(np.arange(40) % 3 == 0, jnp.int32)
Y = jnp.asarray(np.linspace(-1.0, 2.0, 40), jnp.float32)


def _private(epsilon=0.05, bounds=(-3.0, 3.0)):
    return privatize(
        privatize(both, site="x", mechanism=LaplaceMechanism(epsilon)),
        site="y", mechanism=GaussianMechanism(0.5, 1e-6), statistic="sample_mean", bounds=bounds,
        bounds_method="clamp",
    )


def _released(epsilon=0.05):
    private = _private(epsilon)
    return private, make_release(private, 40, X, Y, rng_key=1, reproducible=True)


def test_releases_round_trip_bit_for_bit_with_their_settings(tmp_path):
    private, release = _released()
    path = save_releases(tmp_path / "release.json", release)
    saved = json.loads(path.read_text())
    made = saved["releases"]["y_dp"]["made_with"]
    assert made["mechanism"] == "GaussianMechanism" and made["bounds"] == [-3.0, 3.0]
    assert made["bounds_method"] == "clamp" and made["statistic"] == "sample_mean" and made["num_records"] == 40
    loaded = load_releases(path)
    assert sorted(loaded) == ["x_dp", "y_dp"]
    for name in release:
        assert loaded[name].dtype == release[name].dtype and loaded[name].shape == release[name].shape
        np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(release[name]))
    # what was loaded can be saved again, with the same settings
    again = json.loads(save_releases(tmp_path / "again.json", loaded).read_text())
    assert again == saved


def test_integer_and_vector_releases_round_trip(tmp_path):
    def counts(y=None):
        with numpyro.plate("cells", 4):
            numpyro.sample("y", dist.Poisson(5.0), obs=y)

    alphas = jnp.array([0.5, 0.6, 0.7, 0.8])
    private = privatize_counts(counts, site="y", mechanism=HeterogeneousGeometricMechanism(alphas))
    release = make_release(private, jnp.array([3, 0, 7, 1]), rng_key=2, reproducible=True)
    loaded = load_releases(save_releases(tmp_path / "counts.json", release))
    (name,) = release
    assert np.issubdtype(loaded[name].dtype, np.integer)
    np.testing.assert_array_equal(np.asarray(loaded[name]), np.asarray(release[name]))


def test_a_loaded_release_is_analysed_with_the_settings_it_was_made_with(tmp_path):
    private, release = _released(epsilon=0.05)
    path = save_releases(tmp_path / "release.json", release)
    del release
    gc.collect()  # the analyst's arrays are the file's, not the curator's
    loaded = load_releases(path)
    with pytest.raises(ValueError, match=r"as recorded in the release file .*epsilon: made with 0.05, analysed as 1.0"):
        Simulator(_private(epsilon=1.0), loaded, (40,))
    with pytest.raises(ValueError, match=r"bounds: made with \[-3.0, 3.0\], analysed as \[-5.0, 5.0\]"):
        Simulator(_private(bounds=(-5.0, 5.0)), loaded, (40,))
    Simulator(private, loaded, (40,))  # the settings it was made with


def test_another_process_is_held_to_the_file(tmp_path):
    """The curator and the analyst in two processes: the analyst's posterior is refused under another
    epsilon (a release at 0.05 analysed as 1 gave a posterior half as wide as it should be)."""
    _, release = _released(epsilon=0.05)
    path = save_releases(tmp_path / "release.json", release)
    script = textwrap.dedent(f"""
        import numpyro, numpyro.distributions as dist
        from d3pext import LaplaceMechanism, load_releases, privatize
        from d3pext.inference.structure import inspect_model

        def bernoulli(n, x=None):
            theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
            with numpyro.plate("records", n):
                numpyro.sample("x", dist.Bernoulli(theta), obs=x)

        release = load_releases({str(path)!r})
        try:
            inspect_model(privatize(bernoulli, site="x", mechanism=LaplaceMechanism(1.0)),
                          {{"x_dp": release["x_dp"]}}, (40,), {{}})
        except ValueError as error:
            print("refused:", error)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", **__import__("os").environ})
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "epsilon: made with 0.05, analysed as 1.0" in out.stdout


def test_only_releases_with_known_settings_are_saved_and_files_are_not_replaced(tmp_path):
    _, release = _released()
    with pytest.raises(ValueError, match="was not made by make_release in this process"):
        save_releases(tmp_path / "copy.json", {"x_dp": np.asarray(release["x_dp"])})
    with pytest.raises(ValueError, match="non-empty dict"):
        save_releases(tmp_path / "empty.json", {})
    path = save_releases(tmp_path / "release.json", {"x_dp": release["x_dp"]})
    with pytest.raises(FileExistsError, match="overwrite=True"):
        save_releases(path, release)
    assert sorted(load_releases(path)) == ["x_dp"]  # unchanged
    save_releases(path, release, overwrite=True)
    assert sorted(load_releases(path)) == ["x_dp", "y_dp"]
    assert [p.name for p in tmp_path.iterdir()] == ["release.json"]  # no temporary file is left


def _edited(tmp_path, edit):
    _, release = _released()
    path = save_releases(tmp_path / "release.json", release, overwrite=True)
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.update(format="npz"), "not a d3pext release file"),
        (lambda c: c.update(version=2), "version 2; this d3pext reads version 1"),
        (lambda c: c.update(releases={}), "non-empty object"),
        (lambda c: c["releases"]["x_dp"].pop("made_with"), "needs 'value', 'dtype', 'shape' and 'made_with'"),
        (lambda c: c["releases"]["x_dp"].update(shape=[2]), r"'value' has shape \[\], the file says \[2\]"),
        (lambda c: c["releases"]["x_dp"].update(dtype="bool"), "integers or reals, not bool"),
        (lambda c: c["releases"]["x_dp"].update(dtype="nonsense"), "unknown dtype"),
        (lambda c: c["releases"]["x_dp"].update(value="3"), "number or nested lists of numbers"),
        (lambda c: c["releases"]["x_dp"].update(value=1e300), "does not fit dtype float32"),
        (lambda c: c["releases"]["x_dp"].update(value=[[1.0], [2.0, 3.0]]), "number or nested lists of numbers"),
        (lambda c: c["releases"]["x_dp"].update(dtype="int32", value=2.5), "non-integers for dtype int32"),
        (lambda c: c["releases"]["x_dp"]["made_with"].pop("epsilon"), "lacks 'epsilon'"),
        (lambda c: c["releases"]["x_dp"]["made_with"].update(epsilon="1"), "wrong type"),
        (lambda c: c["releases"]["x_dp"]["made_with"].update(epsilon=-1.0), "not a privacy cost"),
        (lambda c: c["releases"]["x_dp"]["made_with"].update(delta=1.0), "not a privacy cost"),
    ],
)
def test_a_file_that_is_not_a_valid_release_file_is_refused(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_releases(_edited(tmp_path, edit))


def test_non_finite_and_truncated_files_are_refused(tmp_path):
    _, release = _released()
    path = save_releases(tmp_path / "release.json", release)
    text = path.read_text()
    path.write_text(text.replace(str(float(release["x_dp"])), "NaN", 1))
    with pytest.raises(ValueError, match="finite numbers only"):
        load_releases(path)
    path.write_text(text.replace(str(float(release["x_dp"])), "1e999", 1))
    with pytest.raises(ValueError, match="must be finite"):
        load_releases(path)
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="is not a release file"):
        load_releases(path)


def test_a_release_file_then_a_posterior(tmp_path):
    """End to end: the loaded release feeds private_posterior like the curator's own."""
    from d3pext.handlers import private_posterior

    private = privatize(bernoulli, site="x", mechanism=LaplaceMechanism(0.5))
    release = make_release(private, 40, X, rng_key=0, reproducible=True)
    loaded = load_releases(save_releases(tmp_path / "r.json", release))
    draws = {}
    for name, given in (("made", release), ("loaded", loaded)):
        mcmc = private_posterior(private, given, num_warmup=100, num_samples=200, progress_bar=False)
        mcmc.run(jax.random.key(0), 40)
        draws[name] = np.asarray(mcmc.get_samples()["theta"])
    np.testing.assert_array_equal(draws["made"], draws["loaded"])


def _counts_model(y=None):
    rate = numpyro.sample("rate", dist.Gamma(1.0, 0.1))
    with numpyro.plate("cells", 4):
        numpyro.sample("y", dist.Poisson(rate), obs=y)


def test_per_count_alphas_are_part_of_the_settings(tmp_path):
    """Counts released at alphas [0.05, 0.999, 0.999, 0.999] and analysed at the same alphas in
    another order had passed (the record kept only the smallest and the largest alpha): the analysis
    took the last count, released at alpha 0.999 (value -600), as nearly exact."""
    from d3pext.inference.structure import inspect_model

    made = HeterogeneousGeometricMechanism(jnp.array([0.05, 0.999, 0.999, 0.999]))
    release = make_release(privatize_counts(_counts_model, site="y", mechanism=made), jnp.array([3, 0, 7, 1]),
                           rng_key=2, reproducible=True)
    loaded = load_releases(save_releases(tmp_path / "counts.json", release))
    swapped = HeterogeneousGeometricMechanism(jnp.array([0.999, 0.999, 0.999, 0.05]))
    assert swapped.epsilon == made.epsilon
    for given in (release, loaded):
        with pytest.raises(ValueError, match="noise alpha: made with"):
            inspect_model(privatize_counts(_counts_model, site="y", mechanism=swapped), dict(given), (), {})
        inspect_model(privatize_counts(_counts_model, site="y", mechanism=made), dict(given), (), {})
    # one alpha for every count is the same law however its shape broadcasts
    one = make_release(privatize_counts(_counts_model, site="y", mechanism=HeterogeneousGeometricMechanism(
        jnp.array([0.5]))), jnp.array([3, 0, 7, 1]), rng_key=2, reproducible=True)
    inspect_model(privatize_counts(_counts_model, site="y", mechanism=HeterogeneousGeometricMechanism(
        jnp.full(4, 0.5))), dict(one), (), {})


@pytest.mark.skipif(jax.config.jax_enable_x64, reason="checks a process with 64-bit types off")
def test_64_bit_values_are_not_narrowed_silently(tmp_path):
    """A curator with 64-bit types writes float64/int64 releases; a default (32-bit) JAX had narrowed
    them without a word: 2**40 came back as 0 (int32), a mean moved by 2.9 noise scales."""
    def edit(dtype, value, scale=20.0):
        def apply(content):
            content["releases"]["x_dp"].update(dtype=dtype, value=value)
            content["releases"]["x_dp"]["made_with"]["noise scale"] = scale
        return apply

    for dtype, value, scale in (("float64", 1960.0071678515626, 1.2e-5), ("int64", 2**40, 20.0)):
        with pytest.raises(ValueError, match="by more than 1/8 of the noise's scale: enable them before loading"):
            load_releases(_edited(tmp_path, edit(dtype, value, scale)))
    loaded = load_releases(_edited(tmp_path, edit("float64", 2.5)))  # exact in float32: kept
    assert loaded["x_dp"].dtype == jnp.float32 and float(loaded["x_dp"]) == 2.5
    # narrowed by 1e-5 of its noise's scale (a Bernoulli mean of 1000 records at epsilon 1): kept, in float32
    loaded = load_releases(_edited(tmp_path, edit("float64", 0.3001234567891234, 1e-3)))
    assert float(loaded["x_dp"]) == float(np.float32(0.3001234567891234))
