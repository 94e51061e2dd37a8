"""Per-record clipping: the sum over a batch of each record's gradient clipped to L2 norm ``C``.

Three strategies give the same sum (up to float rounding) and differ in memory and time:

- :func:`materialized_clipped_sum`: per-record gradients of the whole parameter tree (B copies);
- :func:`ghost_clipped_sum`: one pass; the weights of matrix products never get per-record
  gradients, their norms and clipped sum come from each record's layer inputs and output
  gradients (:mod:`d3pext.training.ghost`);
- :func:`reweighted_clipped_sum`: ghost norms, then one batched backward pass of
  ``sum_i w_i loss_i`` with the clip weights ``w_i = min(1, C / norm_i)`` held fixed.

Each takes ``record_loss(params, key, args, kwargs, record)`` through ``per_record(fn, params,
records, args)`` (which vmaps ``fn`` over the batch) and returns ``(clipped_sum, losses, mask)``.
Records outside ``mask`` (Poisson padding slots) are selected out, never multiplied by zero, so
that not even a NaN of theirs reaches the sum; with ``drop_nonfinite`` a record whose loss or
gradient is not finite leaves the mask too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from d3pext.training.ghost import PerRecordGradients, value_and_grad_norm

__all__ = [
    "CLIPPED_SUMS",
    "GHOST_THRESHOLD",
    "choose_clipping",
    "clip_gradient",
    "clip_weights",
    "ghost_clipped_sum",
    "materialized_clipped_sum",
    "normalize_gradient",
    "reweighted_clipped_sum",
    "tree_norms",
]

GHOST_THRESHOLD = 2**22
"""``clipping="auto"`` uses ghost clipping above this many batch x parameter values."""


def tree_norms(tree: Any) -> jax.Array:
    """Per-record L2 norms over the whole tree; every leaf has the records on axis 0.

    >>> import jax.numpy as jnp
    >>> tree_norms({"a": jnp.array([[3.0], [0.0]]), "b": jnp.array([[4.0, 0.0], [0.0, 1.0]])})
    Array([5., 1.], dtype=float32)
    """
    squares = [jnp.sum(jnp.reshape(g, (g.shape[0], -1)) ** 2, axis=1) for g in jax.tree.leaves(tree)]
    return jnp.sqrt(sum(squares))


def clip_gradient(tree: Any, threshold: float) -> Any:
    """``tree`` scaled to L2 norm at most ``threshold`` over all its leaves (d3p's ``clip_gradient``,
    for one gradient; DPSVI clips each record's gradient itself).

    >>> import jax.numpy as jnp
    >>> clip_gradient({"a": jnp.array([3.0]), "b": jnp.array([4.0])}, 1.0)["b"]
    Array([0.8], dtype=float32)
    """
    threshold = float(threshold)
    if not (np.isfinite(threshold) and threshold > 0):
        raise ValueError(f"threshold must be finite and > 0, got {threshold}")
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)))
    factor = threshold / jnp.maximum(norm, threshold)
    return jax.tree.map(lambda g: g * factor, tree)


def normalize_gradient(tree: Any) -> Any:
    """``tree`` divided by its L2 norm over all leaves (d3p's ``normalize_gradient``); a zero
    gradient stays zero.

    >>> import jax.numpy as jnp
    >>> normalize_gradient({"a": jnp.array([3.0, 4.0])})["a"]
    Array([0.6, 0.8], dtype=float32)
    """
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)))
    return jax.tree.map(lambda g: jnp.where(norm > 0, g / jnp.where(norm > 0, norm, 1.0), 0.0), tree)


def choose_clipping(clipping: str, batch_size: int, params: Any) -> str:
    """The strategy ``clipping`` names; ``"auto"``: ghost above :data:`GHOST_THRESHOLD`.

    >>> import jax.numpy as jnp
    >>> choose_clipping("auto", 100, {"w": jnp.zeros((400, 784))})
    'ghost'
    """
    if clipping != "auto":
        return clipping
    num_params = sum(int(np.prod(jnp.shape(leaf))) for leaf in jax.tree.leaves(params))
    return "ghost" if batch_size * num_params > GHOST_THRESHOLD else "materialize"


def clip_weights(
    norms: jax.Array, losses: jax.Array, mask: jax.Array, threshold: float, drop_nonfinite: bool
) -> tuple[jax.Array, jax.Array]:
    """``min(1, C / norm)`` per record and 0 outside the mask (which, with ``drop_nonfinite``,
    also drops records whose loss or norm is not finite); returns the weights and the mask."""
    if drop_nonfinite:
        mask = mask & jnp.isfinite(norms) & jnp.isfinite(losses)
    c = threshold
    return jnp.where(mask, c / jnp.maximum(jnp.where(mask, norms, c), c), 0.0), mask


def _weighted_sum(weights: jax.Array, per_record: jax.Array) -> jax.Array:
    """``sum_i w_i g_i`` over the leading axis, at full float32 precision: on a GPU the default
    precision (TF32) rounds ``w_i`` and ``g_i`` first, and a clipped record's share of the sum could then
    exceed C by about 1e-3 of it."""
    return jnp.tensordot(weights, per_record, axes=1, precision=lax.Precision.HIGHEST)


def _select(mask: jax.Array, tree: Any) -> Any:
    return jax.tree.map(lambda g: jnp.where(jnp.reshape(mask, (-1,) + (1,) * (g.ndim - 1)), g, 0.0), tree)


def materialized_clipped_sum(
    record_loss: Callable, per_record: Callable, params: Any, args: tuple, records: Any,
    mask: jax.Array, threshold: float, drop_nonfinite: bool, plate_mode: bool,
) -> tuple[Any, jax.Array, jax.Array]:
    """Clipped sum from materialized per-record gradients (B copies of the parameter tree).

    As in the other strategies, a record is non-finite when its loss or its gradient's norm is (a NaN
    or infinite entry makes the norm so): one pass over the gradients for the norms serves both."""
    losses, grads = per_record(jax.value_and_grad(record_loss), params, records, args)
    weights, mask = clip_weights(tree_norms(grads), losses, mask, threshold, drop_nonfinite)
    return jax.tree.map(lambda g: _weighted_sum(weights, g), _select(mask, grads)), losses, mask


def ghost_clipped_sum(
    record_loss: Callable, per_record: Callable, params: Any, args: tuple, records: Any,
    mask: jax.Array, threshold: float, drop_nonfinite: bool, plate_mode: bool,
) -> tuple[Any, jax.Array, jax.Array]:
    """Clipped sum in one pass: ghost norms, then ``sum_i w_i A_i^T G_i`` for the weights of matrix
    products and ``sum_i w_i grad_i`` for the other leaves (:class:`~d3pext.training.ghost.PerRecordGradients`)."""
    record_grads = PerRecordGradients(record_loss)
    losses, norms, parts = per_record(record_grads, params, records, args)
    weights, mask = clip_weights(norms, losses, mask, threshold, drop_nonfinite)
    return record_grads.weighted_sum(parts, weights, mask), losses, mask


def reweighted_clipped_sum(
    record_loss: Callable, per_record: Callable, params: Any, args: tuple, records: Any,
    mask: jax.Array, threshold: float, drop_nonfinite: bool, plate_mode: bool,
) -> tuple[Any, jax.Array, jax.Array]:
    """Clipped sum as the gradient of ``sum_i w_i loss_i``, ``w_i = min(1, C / |grad loss_i|)`` held fixed.

    The norms are reduced per record as the gradients are formed; the second pass is one batched
    backward pass. Records outside the mask are replaced by the first record inside it before that
    pass, so that their weight of exactly 0 multiplies a finite gradient (a padding slot's or a
    non-finite record's NaN never reaches the sum).
    """
    # Both passes at full float32 precision: a record's weight comes from its norm in the first pass
    # and multiplies its gradient in the second, and on a GPU the default precision (TF32) rounds the
    # two differently, by up to about 1e-3, which would let its share of the sum exceed C.
    with jax.default_matmul_precision("highest"):
        losses, norms = per_record(value_and_grad_norm(record_loss), params, records, args)
        weights, mask = clip_weights(norms, losses, mask, threshold, drop_nonfinite)
        first = jnp.argmax(mask)

        def substitute(tree):
            return jax.tree.map(
                lambda v: jnp.where(jnp.reshape(mask, (-1,) + (1,) * (v.ndim - 1)), v, v[first]), tree
            )

        if plate_mode:
            records = substitute(records)
        else:
            records, args = substitute(records), substitute(args)
        grads = jax.grad(lambda p: jnp.sum(weights * per_record(record_loss, p, records, args)))(params)
        grads = jax.tree.map(lambda g: jnp.where(jnp.any(mask), g, 0.0), grads)
        return grads, losses, mask


CLIPPED_SUMS: dict[str, Callable] = {
    "materialize": materialized_clipped_sum,
    "ghost": ghost_clipped_sum,
    "reweight": reweighted_clipped_sum,
}
"""The clipping strategies by name (``DPSVI(clipping=...)``)."""
