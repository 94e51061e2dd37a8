"""Ghost norms and the one-pass clipped sum (d3pext.training.ghost) against materialized per-record gradients."""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

from d3pext.training.clipping import CLIPPED_SUMS
from d3pext.training.ghost import PerRecordGradients, value_and_grad_norm


def _params(key, shapes):
    keys = jax.random.split(key, len(shapes))
    return {name: jax.random.normal(k, shape) / np.sqrt(shape[0]) for (name, shape), k in zip(shapes.items(), keys)}


@jax.jit
def _jitted_layer(x, w):
    return jnp.tanh(x @ w)


def dense(p, x):  # x: (5,)  -> W as rhs, one row per record
    return jnp.sum(jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"])


def weight_on_the_left(p, x):  # W @ x: W is the lhs of the product
    return jnp.sum(jnp.sin(p["w1"].T @ x)) + jnp.sum(p["w2"] @ jnp.ones(4)) * jnp.sum(x)


def several_rows(p, x):  # a record contributes three rows (like ELBO particles or tokens)
    h = jnp.tanh(jnp.stack([x, 2 * x, x**2]) @ p["w1"])
    return jnp.sum(h @ p["w2"] ** 1)


def two_contracting_axes(p, x):  # einsum over two axes of a 3-d weight
    w = p["w3"]
    return jnp.sum(jnp.cos(jnp.einsum("ij,ijk->k", x.reshape(5, 1) * jnp.ones((1, 2)), w)))


def used_twice(p, x):  # w1 enters two products: its gradient is formed directly
    return jnp.sum(jnp.tanh(x @ p["w1"])) + jnp.sum((2 * x) @ p["w1"]) + jnp.sum(p["w2"])


def inside_jit_and_scan(p, x):  # w1 through a nested jit (ghost), w2 inside scan (direct)
    h = _jitted_layer(x, p["w1"])

    def body(c, _):
        return jnp.tanh(c @ p["w2"]), None

    out, _ = lax.scan(body, h, None, length=2)
    return jnp.sum(out)


def one_jitted_layer_twice(p, x):  # the same jaxpr (one cached trace) holds two weights' products
    return jnp.sum(_jitted_layer(_jitted_layer(x, p["w1"]), p["w2"]))


CASES = {
    "one_jitted_layer_twice": (one_jitted_layer_twice, {"w1": (5, 4), "w2": (4, 4)}, 2),
    "dense": (dense, {"w1": (5, 4), "b": (4,), "w2": (4, 3)}, 2),
    "weight_on_the_left": (weight_on_the_left, {"w1": (5, 4), "w2": (3, 4)}, 2),
    "several_rows": (several_rows, {"w1": (5, 4), "w2": (4, 3)}, 1),  # w2 ** 1 is a use of its own
    "two_contracting_axes": (two_contracting_axes, {"w3": (5, 2, 3)}, 1),
    "used_twice": (used_twice, {"w1": (5, 4), "w2": (4,)}, 0),
    "inside_jit_and_scan": (inside_jit_and_scan, {"w1": (5, 4), "w2": (4, 4)}, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_norms_and_weighted_sum_equal_materialized(case):
    # the identity holds in float32: on a GPU the reference's own products would round to TF32
    with jax.default_matmul_precision("highest"):
        fun, shapes, num_ghost = CASES[case]
        p = _params(jax.random.key(0), shapes)
        x = jax.random.normal(jax.random.key(1), (16, 5))
        mask = jnp.arange(16) % 5 != 3
        x = jnp.where(mask[:, None], x, jnp.nan)  # left-out records hold NaN: they must not reach the sum
        per_record = PerRecordGradients(fun)
        values, norms, parts = jax.jit(jax.vmap(per_record, (None, 0)))(p, x)
        assert per_record.num_ghost == num_ghost
        grads = jax.vmap(jax.grad(fun), (None, 0))(p, x)
        direct = jnp.sqrt(sum(jnp.sum(g.reshape(16, -1) ** 2, 1) for g in jax.tree.leaves(grads)))
        # (two float32 evaluations, one jitted: on a GPU they round differently, by up to about 10 ulp)
        np.testing.assert_allclose(values[mask], jax.vmap(fun, (None, 0))(p, x)[mask], rtol=4e-6)
        np.testing.assert_allclose(norms[mask], direct[mask], rtol=1e-5)
        w = jnp.where(mask, jnp.minimum(1.0, 0.5 / jnp.where(mask, norms, 1.0)), 0.0)
        got = per_record.weighted_sum(parts, w, mask)
        for name in p:
            ref = jnp.tensordot(w, jnp.where(mask.reshape((-1,) + (1,) * (grads[name].ndim - 1)), grads[name], 0.0), 1)
            assert got[name].shape == p[name].shape
            np.testing.assert_allclose(got[name], ref, rtol=1e-5, atol=1e-6)
        _, norm_only = jax.vmap(value_and_grad_norm(fun), (None, 0))(p, x)
        np.testing.assert_allclose(norm_only[mask], norms[mask], rtol=1e-6)


@pytest.mark.parametrize("method", sorted(CLIPPED_SUMS))
def test_each_record_adds_c_at_a_gpus_default_precision(method):
    """With one record kept at a time, the clipped sum is that record's share of it, which must have norm
    C (every gradient here is larger) up to float32 rounding. Traced at TF32 matmul precision, a GPU's
    default: the weights must multiply the gradients their norms came from, at full precision. (A CPU
    computes in float32 whatever the setting: there this checks the float32 bound alone.)"""
    p = _params(jax.random.key(0), CASES["dense"][1])
    x = 3.0 * jax.random.normal(jax.random.key(1), (16, 5))
    c = 1e-2

    def record_loss(p, x, _):
        return dense(p, x)

    def per_record(fn, p, records, args):
        return jax.vmap(fn, (None, 0, None))(p, records, args)

    @jax.jit
    def shares(p, x):
        def share(i):
            clipped, _, _ = CLIPPED_SUMS[method](record_loss, per_record, p, (), x, jnp.arange(16) == i, c, False, True)
            return jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(clipped)))

        with jax.default_matmul_precision("tensorfloat32"):
            return lax.map(share, jnp.arange(16))

    np.testing.assert_allclose(shares(p, x), c, rtol=2e-6)


def test_layout_is_needed_before_use():
    per_record = PerRecordGradients(dense)
    with pytest.raises(RuntimeError, match="trace"):
        per_record.num_ghost
