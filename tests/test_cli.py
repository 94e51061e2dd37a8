"""Tests of the bundled data set and of the ``d3pext`` command line."""

import re
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from d3pext import accountants
from d3pext.cli import _run_demo, main
from d3pext.datasets import BREAST_CANCER_BOUNDS, BREAST_CANCER_FEATURES, load_breast_cancer


def _fields(text: str) -> dict:
    return dict(re.findall(r"^([a-zA-Z -]+): (.*)$", text, flags=re.M))


# ------------------------------------------------------------------ data set


def test_breast_cancer_shapes_and_ranges():
    x_train, y_train, x_test, y_test = load_breast_cancer()
    assert x_train.shape == (398, 30) and x_test.shape == (171, 30)
    assert y_train.shape == (398,) and y_test.shape == (171,)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int32
    assert np.abs(x_train).max() <= 1.0 and np.abs(x_test).max() <= 1.0
    y = np.concatenate([y_train, y_test])
    assert set(np.unique(y)) == {0, 1}
    assert (y == 0).sum() == 212 and (y == 1).sum() == 357  # malignant, benign
    assert len(BREAST_CANCER_FEATURES) == 30 and BREAST_CANCER_FEATURES[0] == "mean radius"


def test_breast_cancer_split_is_seeded_and_disjoint():
    a, b, c = load_breast_cancer(seed=1), load_breast_cancer(seed=1), load_breast_cancer(seed=2)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.x_train, c.x_train)
    full = load_breast_cancer(test_fraction=0.0)
    assert full.x_train.shape == (569, 30) and full.x_test.shape == (0, 30)
    rows = {tuple(r) for r in full.x_train}
    assert rows == {tuple(r) for r in a.x_train} | {tuple(r) for r in a.x_test}


def test_breast_cancer_scaling_uses_only_public_bounds():
    """The scaled data are the fixed affine map of the raw data by the declared bounds, then clipped."""
    raw, scaled = load_breast_cancer(standardize=False, test_fraction=0.0), load_breast_cancer(test_fraction=0.0)
    low, high = BREAST_CANCER_BOUNDS
    expected = np.clip(2 * (raw.x_train.astype(np.float64) - low) / (high - low) - 1, -1, 1)
    np.testing.assert_allclose(scaled.x_train, expected, rtol=1e-5, atol=1e-6)
    # The published ranges are rounded, so clipping is not a no-op for a few records.
    outside = (raw.x_train < low) | (raw.x_train > high)
    assert 0 < outside.sum() < 0.01 * outside.size


def test_breast_cancer_matches_scikit_learn():
    datasets = pytest.importorskip("sklearn.datasets")
    ref = datasets.load_breast_cancer()
    raw = load_breast_cancer(standardize=False, test_fraction=0.0, seed=0)
    order = np.random.default_rng(0).permutation(569)
    np.testing.assert_allclose(raw.x_train, ref.data[order], rtol=1e-6)
    np.testing.assert_array_equal(raw.y_train, ref.target[order])
    assert list(BREAST_CANCER_FEATURES) == [str(n) for n in ref.feature_names]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"test_fraction": 1.0}, ValueError, r"test_fraction must be in \[0, 1\)"),
        ({"test_fraction": -0.1}, ValueError, "test_fraction"),
        ({"standardize": "yes"}, TypeError, "standardize must be a bool"),
    ],
)
def test_breast_cancer_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        load_breast_cancer(**kwargs)


# ------------------------------------------------------------------ command line


def test_epsilon_matches_independent_accountant(capsys):
    """Reference values from dp-accounting's PLD accountant (q = 0.01, T = 1e4, delta = 1e-5 give epsilon 1)."""
    assert main(["epsilon", "--sigma", "7.461", "--q", "0.01", "--steps", "10000", "--delta", "1e-5"]) == 0
    out = _fields(capsys.readouterr().out)
    assert float(out["epsilon"]) == pytest.approx(1.0, abs=0.005)
    assert out["relation"] == "substitute" and out["steps"] == "10000" and float(out["sigma"]) == 7.461
    argv = ["epsilon", "--sigma", "3.8128", "--q", "0.01", "--steps", "10000", "--delta", "1e-5"]
    assert main([*argv, "--relation", "add_remove"]) == 0
    out = _fields(capsys.readouterr().out)
    assert float(out["epsilon"]) == pytest.approx(1.0, abs=0.005)
    assert out["relation"] == "add_remove"


def test_sigma_inverts_epsilon(capsys):
    argv = ["sigma", "--epsilon", "2", "--q", "0.01", "--steps", "10000", "--delta", "1e-5"]
    assert main(argv) == 0
    out = _fields(capsys.readouterr().out)
    sigma = float(out["sigma"])
    assert sigma == pytest.approx(3.988, rel=0.005)  # dp-accounting PLD, substitute relation
    assert float(out["epsilon"].split()[0]) <= 2.0
    assert accountants.epsilon(sigma, 0.01, 10000, 1e-5, "substitute") <= 2.0


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "required: command|the following arguments are required"),
        (["epsilon", "--sigma", "0", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], r"--sigma: value must be > 0"),
        (["epsilon", "--sigma", "1", "--q", "1.5", "--steps", "10", "--delta", "1e-5"], r"--q: q must be in \(0, 1\]"),
        (["epsilon", "--sigma", "1", "--q", "0.1", "--steps", "0", "--delta", "1e-5"], r"--steps: must be a positive"),
        (["epsilon", "--sigma", "1", "--q", "0.1", "--steps", "10", "--delta", "1"], r"--delta: delta must be in"),
        (["epsilon", "--sigma", "x", "--q", "0.1", "--steps", "10", "--delta", "1e-5"], "expected a number"),
        (
            ["sigma", "--epsilon", "1", "--q", "0.1", "--steps", "10", "--delta", "1e-5", "--relation", "x"],
            "invalid choice",
        ),
        (["demo", "--batch-size", "1000"], r"--batch-size: must be at most the number of training records \(398\)"),
        (["demo", "--seed", "-1"], r"--seed: seed must be in"),
        (  # sigma^2 overflowed: a traceback
            ["epsilon", "--sigma", "2e154", "--q", "0.01", "--steps", "10", "--delta", "1e-5"],
            "too large to account",
        ),
    ],
)
def test_bad_input_exits_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert re.search(match, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["epsilon", "sigma"])
def test_accounting_failure_is_a_user_error(command, capsys, monkeypatch):
    """When the accountant cannot certify a value, the command says so and exits 2, without a traceback."""

    def refuse(*args, **kwargs):
        raise accountants.AccountingError("window too small for this composition")

    monkeypatch.setattr(accountants, "epsilon", refuse)
    monkeypatch.setattr(accountants, "approximate_sigma", refuse)
    first = "--sigma" if command == "epsilon" else "--epsilon"
    with pytest.raises(SystemExit) as exc:
        main([command, first, "1", "--q", "0.1", "--steps", "10", "--delta", "1e-5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"d3pext {command}: error: window too small" in err and "Traceback" not in err


def test_demo_reports_privacy_and_accuracy(capsys):
    argv = ["demo", "--epsilon", "2", "--steps", "300", "--seed", "0"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    out = _fields(text)
    assert out["records"].startswith("398 train, 171 test, 30 features")
    assert float(out["epsilon"].split()[0]) <= 2.0
    assert float(out["delta"]) <= 1e-5 < 1 / 398
    assert float(out["q"].split()[0]) == pytest.approx(200 / 398, rel=1e-3)
    assert out["steps"] == "300"
    assert out["relation"].startswith("substitute")
    assert float(out["sigma"].split()[0]) > 0 and "noise multiplier" in out["sigma"]
    assert "sampling rate" in out["q"] and "replaced" in out["relation"]
    dp, plain = (float(out[f"test accuracy {k}"].split()[0]) for k in ("DP", "non-private"))
    assert re.search(r"^test accuracy DP over 3 runs: mean 0\.\d+, sd 0\.\d+", text, flags=re.M)
    # 63% of the test records are benign: both fits must beat predicting the majority class.
    assert plain > 0.9 and dp > 0.75, (dp, plain)


def test_demo_randomness(monkeypatch):
    """--seed fixes the DP run's key; without it DPSVI gets None and draws its key from OS entropy."""
    from d3pext import DPSVI

    class Stop(Exception):
        pass

    keys = []

    def record(self, rng_key, *args, **kwargs):
        keys.append(rng_key)
        raise Stop

    monkeypatch.setattr(DPSVI, "run", record)
    data = load_breast_cancer()
    settings = dict(epsilon=1.0, delta=None, steps=10, batch_size=200, clip=1.0, learning_rate=0.1)
    for seed in (7, 7, 8, None):
        with pytest.raises(Stop):
            _run_demo(data, seed=seed, **settings)
    same, other = (np.asarray(jax.random.key_data(k)) for k in keys[1:3])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys[0])), same)
    assert not np.array_equal(same, other)
    assert keys[3] is None


def test_module_and_console_script_entry_points():
    proc = subprocess.run([sys.executable, "-m", "d3pext", "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "{demo,epsilon,sigma}" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "d3pext", "sigma"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "required" in proc.stderr
    script = shutil.which("d3pext")
    if script is not None:
        proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and "demo" in proc.stdout


def test_a_finished_command_exits_with_all_its_output_through_a_pipe():
    # run() leaves without the interpreter's teardown: what was printed must still arrive, whole
    argv = ["epsilon", "--sigma", "2", "--q", "0.01", "--steps", "1000", "--delta", "1e-5"]
    proc = subprocess.run([sys.executable, "-m", "d3pext", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith("epsilon: ") and proc.stdout.endswith("relation: substitute\n")
    assert proc.stdout == subprocess.run(
        [sys.executable, "-c", f"from d3pext.cli import main; main({argv!r})"], capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout


def test_audit_command(capsys):
    assert main(["audit", "--releases", "2000", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "| GeometricMechanism (0 vs 1) | 1 |" in out
    assert "no shipped mechanism leaks more than it claims" in out


# ------------------------------------------------------------------ persistent compilation cache

_COMPILE_SOMETHING = """
import sys, d3pext, jax
print(d3pext.enable_compile_cache(min_compile_time_secs=0.0) if sys.argv[1] == "enable" else None)
jax.jit(lambda x: x * 2.0 + 1.0)(1.0).block_until_ready()
"""


def _cache_run(tmp_path, mode, **env):
    import os

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("D3PEXT_", "JAX_COMPILATION_CACHE"))}
    clean["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SOMETHING, mode], capture_output=True, text=True,
                          timeout=120, env={**clean, **env}, check=True)  # fmt: skip
    return proc.stdout.strip()


def _entries(directory):
    return sorted(p.name for p in directory.rglob("*") if p.is_file()) if directory.exists() else []


def test_compile_cache_writes_entries_and_honours_the_opt_out(tmp_path):
    # the default directory: $XDG_CACHE_HOME/d3pext/jax
    default = tmp_path / "xdg" / "d3pext" / "jax"
    if sys.platform.startswith("linux"):
        assert _cache_run(tmp_path, "enable") == str(default)
        assert _entries(default)
    # D3PEXT_CACHE_DIR overrides it
    chosen = tmp_path / "chosen"
    assert _cache_run(tmp_path, "enable", D3PEXT_CACHE_DIR=str(chosen)) == str(chosen)
    assert any(name.startswith("jit_") for name in _entries(chosen))
    # D3PEXT_NO_COMPILE_CACHE=1: nothing is written
    off = tmp_path / "off"
    assert _cache_run(tmp_path, "enable", D3PEXT_CACHE_DIR=str(off), D3PEXT_NO_COMPILE_CACHE="1") == "None"
    assert not off.exists()
    # the library never turns the cache on by itself
    shutil.rmtree(tmp_path / "xdg", ignore_errors=True)
    assert _cache_run(tmp_path, "leave") == "None"
    assert not (tmp_path / "xdg").exists()


def test_compile_cache_is_size_limited_so_that_processes_can_share_it(tmp_path):
    # with a size limit JAX evicts by access time and locks the directory around each read and write
    shared = tmp_path / "shared"
    assert _cache_run(tmp_path, "enable", D3PEXT_CACHE_DIR=str(shared)) == str(shared)
    names = _entries(shared)
    assert any(n.endswith("-cache") for n in names) and any(n.endswith("-atime") for n in names), names
    assert ".lockfile" in names
    import d3pext

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_size"):
            d3pext.enable_compile_cache(max_size=bad)


def test_cli_turns_the_compile_cache_on(monkeypatch):
    import d3pext.compile_cache

    calls = []
    monkeypatch.setattr(d3pext.compile_cache, "enable_compile_cache", lambda *a, **k: calls.append(1))
    with pytest.raises(SystemExit):  # a batch larger than the data: refused after the cache call
        main(["demo", "--batch-size", "100000"])
    assert calls == [1]
    import gc

    assert gc.isenabled()  # the demo turns collection off while it imports; also on its way out by an error
    main(["epsilon", "--sigma", "2", "--q", "0.01", "--steps", "10", "--delta", "1e-5"])
    assert calls == [1]  # the accounting commands compile nothing and leave JAX alone
