"""Saving and loading a DP-trained fit (``d3pext.training.checkpoint``): round trip of the
parameters and the privacy report, sampling from the rebuilt guide, and a safe file format."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro
import numpyro.distributions as dist
from numpyro.infer import Predictive
from numpyro.infer.autoguide import AutoDiagonalNormal

from d3pext import DPSVI
from d3pext.training import SavedFit, load_fit, save_fit
from d3pext.training.checkpoint import FORMAT_VERSION
from d3pext.training.svi import PrivacyReport


def logistic(x, y=None, batch_size=None):
    w = numpyro.sample("w", dist.Normal(0, 2).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("data", x.shape[0], subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)


@pytest.fixture(scope="module")
def fit():
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (300, 3))
    y = jax.random.bernoulli(ky, jax.nn.sigmoid(x @ jnp.array([1.0, -1.0, 0.5]))).astype(jnp.float32)
    svi = DPSVI(logistic, AutoDiagonalNormal(logistic), optax.adam(0.05), clipping_threshold=1.0,
                epsilon=2.0, delta=1e-4, num_steps=30)
    result = svi.run(jax.random.key(1), 30, x, y, batch_size=30, progress_bar=False)
    return result, x, y


def test_round_trip_of_a_dpsvi_fit(fit, tmp_path):
    result, x, y = fit
    path = save_fit(tmp_path / "fit.ckpt", result.params, result.privacy, model="logistic",
                    num_records=x.shape[0], features=("a", "b", "c"), steps=np.int64(30))
    assert path == tmp_path / "fit.ckpt" and path.exists()  # the name is kept (no ".npz" added)
    assert [p.name for p in tmp_path.iterdir()] == ["fit.ckpt"]  # no temporary file left
    loaded = load_fit(path)
    assert isinstance(loaded, SavedFit)
    assert isinstance(loaded.privacy, PrivacyReport) and loaded.privacy == result.privacy
    assert str(loaded.privacy) == str(result.privacy)
    assert loaded.metadata == {"model": "logistic", "num_records": 300, "features": ["a", "b", "c"], "steps": 30}
    assert sorted(loaded.params) == sorted(result.params)
    for k, v in result.params.items():
        assert isinstance(loaded.params[k], jax.Array) and loaded.params[k].dtype == v.dtype
        np.testing.assert_array_equal(loaded.params[k], v)


def test_loaded_guide_samples_as_the_trained_one(fit, tmp_path):
    result, x, y = fit
    save_fit(tmp_path / "fit.npz", result.params, result.privacy)
    params = load_fit(tmp_path / "fit.npz").params
    guide = AutoDiagonalNormal(logistic)  # rebuilt: no training state, no data beyond shapes
    predictive = Predictive(logistic, guide=guide, params=params, num_samples=50, return_sites=["w"])
    w = predictive(jax.random.key(2), x[:4], y[:4])["w"]
    assert w.shape == (50, 3) and bool(jnp.all(jnp.isfinite(w)))
    # the guide is set up now: sample_posterior gives the draws of the original parameters
    key = jax.random.key(3)
    loaded = guide.sample_posterior(key, params, sample_shape=(20,))
    original = guide.sample_posterior(key, result.params, sample_shape=(20,))
    np.testing.assert_array_equal(loaded["w"], original["w"])
    # posterior predictive for new records
    y_new = Predictive(logistic, posterior_samples=loaded)(jax.random.key(4), x[:7])["y"]
    assert y_new.shape == (20, 7)


def test_pytrees_dtypes_and_no_report(tmp_path):
    params = {
        "net": {"dense": [jnp.ones((2, 3)), jnp.zeros(3, jnp.bfloat16)], "skip": None},
        "counts": (jnp.arange(4, dtype=jnp.int32), np.float32(2.5)),
        "flag": jnp.array(True),
    }
    save_fit(tmp_path / "tree.npz", params)
    loaded = load_fit(tmp_path / "tree.npz")
    assert loaded.privacy is None and loaded.metadata == {}
    assert jax.tree.structure(loaded.params) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(params)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_file_is_plain_npz_and_json(fit, tmp_path):
    result, _, _ = fit
    path = save_fit(tmp_path / "fit.npz", result.params, result.privacy, note="x")
    with np.load(path, allow_pickle=False) as z:  # readable without d3pext, nothing pickled
        header = json.loads(str(z["__d3pext_fit__"]))
        assert all(z[k].dtype != object for k in z.files)
    assert header["format"] == "d3pext-fit" and header["version"] == FORMAT_VERSION
    assert header["privacy"]["epsilon"] == result.privacy.epsilon


def test_untrusted_and_foreign_files_are_refused(tmp_path):
    # an object array needs pickle: refused, never unpickled
    pickled = tmp_path / "evil.npz"
    np.savez(pickled, __d3pext_fit__=np.array('{"format": "d3pext-fit", "version": 1}'),
             leaf_0=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        load_fit(pickled)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, a=np.ones(3))
    with pytest.raises(ValueError, match="not a d3pext-fit file"):
        load_fit(foreign)
    newer = tmp_path / "newer.npz"
    np.savez(newer, __d3pext_fit__=np.array(json.dumps({"format": "d3pext-fit", "version": 99})))
    with pytest.raises(ValueError, match="upgrade d3pext"):
        load_fit(newer)


def _edited(tmp_path, fit, **changes):
    result, _, _ = fit
    path = save_fit(tmp_path / "fit.npz", result.params, result.privacy)
    with np.load(path, allow_pickle=False) as z:
        arrays = dict(z)
    header = json.loads(str(arrays["__d3pext_fit__"]))
    header["privacy"].update(changes)
    arrays["__d3pext_fit__"] = np.array(json.dumps(header))
    edited = tmp_path / "edited.npz"
    np.savez(edited, **arrays)
    return edited


@pytest.mark.parametrize("changes", [
    {"epsilon": float("nan")}, {"epsilon": -3.0}, {"num_steps": "many"}, {"num_steps": 2.5},
    {"delta": 2.0}, {"sampling_rate": 0.0}, {"noise_multiplier": -1.0}, {"relation": "any"},
])
def test_a_saved_report_out_of_range_is_refused(fit, tmp_path, changes):
    # such reports loaded silently and printed as the fit's privacy
    with pytest.raises(ValueError, match="privacy report is invalid"):
        load_fit(_edited(tmp_path, fit, **changes))


def test_a_saved_report_below_the_accountant_s_epsilon_is_refused(fit, tmp_path):
    # an edited epsilon of 0.01 loaded silently; the accountant gives the run's own for its settings
    result, _, _ = fit
    with pytest.raises(ValueError, match="damaged or edited"):
        load_fit(_edited(tmp_path, fit, epsilon=0.01))
    with pytest.raises(ValueError, match="damaged or edited"):
        load_fit(_edited(tmp_path, fit, num_steps=3 * result.privacy.num_steps))
    assert load_fit(_edited(tmp_path, fit, epsilon=2 * result.privacy.epsilon)).privacy.epsilon > 0


def test_bad_inputs(tmp_path):
    with pytest.raises(TypeError, match="pytree of dicts"):
        save_fit(tmp_path / "a.npz", {"f": lambda: 0})
    with pytest.raises(TypeError, match="string keys"):
        save_fit(tmp_path / "a.npz", {1: jnp.ones(2)})
    with pytest.raises(TypeError, match="JSON-serializable"):
        save_fit(tmp_path / "a.npz", {"w": jnp.ones(2)}, note=object())
    with pytest.raises(TypeError, match="PrivacyReport"):
        save_fit(tmp_path / "a.npz", {"w": jnp.ones(2)}, {"epsilon": 1.0})
    with pytest.raises(TypeError, match="PRNG key"):
        save_fit(tmp_path / "a.npz", {"k": jax.random.key(0)})
    assert not list(tmp_path.iterdir())  # nothing written by a failed save
