"""Conditional spline flows and their compiled training loop (d3pext.simulation.flows)."""

import functools
import math
import sys

import numpy as np
import pytest

import jax
from jax import random
import jax.numpy as jnp

pytest.importorskip("flowjax")

import equinox as eqx  # noqa: E402 (flowjax's dependency)

from d3pext.simulation.flows import FlowTrainer, conditional_spline_flow, require_flowjax  # noqa: E402


@functools.partial(jax.jit, static_argnums=1)  # one program (op by op: a dozen)
def _gaussian_data(key, n):
    kc, ky = random.split(key)
    c = random.uniform(kc, (n, 1), minval=-1, maxval=1)
    y = jnp.concatenate([2 * c, -c], 1) + 0.5 * random.normal(ky, (n, 2))
    return {"y": y, "c": c}


def _nll(flow, batch, key):
    return -flow.log_prob(batch["y"], batch["c"])


@pytest.mark.slow
def test_flow_learns_a_conditional_gaussian():
    flow = conditional_spline_flow(random.key(0), 2, 1, layers=2, width=16, knots=6)
    data = _gaussian_data(random.key(1), 1100)
    train = {k: v[:1000] for k, v in data.items()}
    valid = {k: v[1000:] for k, v in data.items()}
    trainer = FlowTrainer(_nll, learning_rate=5e-3, max_epochs=60, patience=10)
    flow, report = trainer.fit(flow, train, 1000, valid, 100, random.key(2))
    assert report.nonfinite_steps == 0 and report.epochs >= 10
    # patience: the run stops 10 epochs after its best one, or at max_epochs
    assert report.epochs == min(report.best_epoch + 10, 60)
    # the exact conditional entropy is 2 * 0.5 log(2 pi e 0.25) = 1.4516
    assert report.best_valid_loss < 1.4516 + 0.15
    for c in (-0.8, 0.8):
        draws = flow.sample(random.key(3), (2000,), condition=jnp.array([c]))
        np.testing.assert_allclose(np.asarray(draws.mean(0)), [2 * c, -c], atol=0.12)
        np.testing.assert_allclose(np.asarray(draws.std(0)), [0.5, 0.5], atol=0.1)


def _poisoned_nll(flow, batch, key):
    return _nll(flow, batch, key) + jnp.where(batch["bad"] > 0, jnp.nan, 0.0)


@pytest.fixture(scope="module")
def small_trainer():
    """The trainer of the fast fit, shared with the padding test: a trainer compiles its epoch and
    validation programs once per flow (_small_flow) and shape (500 training rows, 100 validation
    rows here)."""
    return FlowTrainer(_poisoned_nll, learning_rate=1e-2, max_epochs=25, patience=25)


@functools.cache
def _small_flow():
    # one object: a trainer's compiled programs are keyed on the flow's static part, which a flow
    # built anew does not share (flows are immutable: fit returns a new one)
    return conditional_spline_flow(random.key(0), 2, 1, layers=2, width=8, knots=4)


def test_fast_fit_skips_nonfinite_steps(small_trainer):
    # fast twin of the test above: a tiny flow, a few epochs, a flagged row poisoning its batch
    flow = _small_flow()
    data = _gaussian_data(random.key(1), 600)
    data["bad"] = (jnp.arange(600) == 7).astype(jnp.float32)
    valid = {k: v[500:] for k, v in data.items()}
    valid["bad"] = jnp.zeros(100)
    flow2, report = small_trainer.fit(flow, {k: v[:500] for k, v in data.items()}, 500, valid, 100,
                                      random.key(2))
    assert report.nonfinite_steps == report.epochs  # one poisoned batch per epoch, skipped
    assert all(math.isfinite(v) for v in report.train_losses)
    assert report.best_valid_loss < report.valid_losses[0] - 0.3
    # one compiled program (eagerly, flowjax compiles its layer scan again for every operation)
    draws = eqx.filter_jit(lambda f, k: f.sample(k, (2000,), condition=jnp.array([0.8])))(flow2, random.key(3))
    assert float(draws[:, 0].mean()) > 0.8 and float(draws[:, 1].mean()) < -0.3


def test_bad_input_and_missing_extra(monkeypatch):
    with pytest.raises(ValueError, match="dim"):
        conditional_spline_flow(random.key(0), 0, 1)
    flow = conditional_spline_flow(random.key(0), 2, 1, layers=1, width=4, knots=4)
    data = _gaussian_data(random.key(1), 50)
    with pytest.raises(ValueError, match="batch"):
        FlowTrainer(_nll).fit(flow, data, 50, data, 10, random.key(0))
    monkeypatch.setitem(sys.modules, "flowjax", None)
    with pytest.raises(ImportError, match=r"d3pext\[flows\]"):
        require_flowjax()


def test_validation_ignores_padding_batches(small_trainer):
    # a validation buffer of 3 batches holding one batch of data (the rest NaN padding, as in
    # early rounds of SPPE/SPLE) gives exactly the loss of the unpadded buffer, epoch after epoch
    # (the fast fit's trainer and shapes: only the 300-row validation buffer compiles anew)
    flow = _small_flow()
    data = _gaussian_data(random.key(1), 500)
    data["bad"] = jnp.zeros(500)  # no poisoned rows: the loss is the flow's
    padded = {k: v[:300].at[100:].set(jnp.nan) for k, v in data.items()}
    first = {k: v[:100] for k, v in data.items()}
    _, a = small_trainer.fit(flow, data, 500, first, 100, random.key(2))
    _, b = small_trainer.fit(flow, data, 500, padded, 100, random.key(2))
    assert a.epochs == b.epochs == 25 and a.nonfinite_steps == 0
    assert a.valid_losses == b.valid_losses and all(math.isfinite(v) for v in a.valid_losses)


def test_flows_of_one_architecture_share_their_compiled_programs():
    # flowjax's layers keep a closure that rebuilds the spline from the conditioner's output; a new
    # flow had new closures, which jit keys on by identity: every fit (an SPPE sweep over epsilon)
    # compiled its training epoch, validation, sample and log_prob again
    import equinox as eqx
    from compilations import count_compilations

    log_prob = eqx.filter_jit(lambda flow, y, c: flow.log_prob(y, c))
    y, c = jnp.zeros((4, 2)), jnp.ones((4, 3))
    first = conditional_spline_flow(random.key(0), 2, 3, layers=2, width=8, knots=5)
    second = conditional_spline_flow(random.key(1), 2, 3, layers=2, width=8, knots=5)
    other = conditional_spline_flow(random.key(1), 2, 3, layers=2, width=8, knots=6)
    log_prob(first, y, c)
    with count_compilations() as compiled:
        values = log_prob(second, y, c)
    assert not compiled, compiled
    assert not np.allclose(values, log_prob(first, y, c))  # other weights, the same program
    with count_compilations() as compiled:
        log_prob(other, y, c)
    assert compiled  # another spline: its own program
