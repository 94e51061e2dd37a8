"""Per-record gradient norms without per-record gradients ("ghost norms").

DP-SGD clips each record's gradient, so it needs each record's gradient norm. Forming the
gradients one record at a time costs B copies of the parameters; for a weight ``W`` that a
record's loss uses only in one matrix product ``y = a W``, the record's gradient is the
contraction of the product's input ``a`` with the output cotangent ``g = dL/dy``, and

    ||grad_W||_F^2 = ||A^T G||_F^2 = <A A^T, G G^T>_F,

with ``A`` (P x in) the record's rows of ``a`` and ``G`` (P x out) those of ``g``, ``P`` the
number of rows the record contributes (1 for a dense layer applied once, the particles of a
multi-sample ELBO). The right-hand side costs ``P^2 (in + out)`` instead of ``P in out``
(Goodfellow 2015, "Efficient per-example gradient computations"; Li et al. 2022, "ghost
clipping"). Only ``a`` and ``g`` are needed, and one backward pass with respect to the
activations gives every ``g``, so the weights' own per-record gradients are never formed.

:func:`value_and_grad_norm` finds such weights in the traced loss itself (no layer library is
assumed): a parameter leaf qualifies when its only use, possibly transposed and through any
nesting of ``jit``, is one operand of a ``dot_general`` without batch dimensions. Every other
leaf (biases, parameters used twice, inside ``scan`` or custom derivatives, or otherwise
transformed before use) gets its per-record gradient formed as usual. The result is exact, not an approximation: the test suite
compares it with the norms of materialized gradients. What gains: networks with point-estimated
weights (amortized encoders and decoders, ``numpyro.module``/``numpyro.param`` networks). What does
not: weights drawn from a guide (a Bayesian neural network), whose variational parameters enter
elementwise (``loc + scale * eps``) and so get per-record gradients.
"""

from __future__ import annotations

from collections.abc import Callable
import math

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, Var
import jax.numpy as jnp

__all__ = ["PerRecordGradients", "value_and_grad_norm"]

_CALLS = ("jit", "pjit", "closed_call", "core_call")


def _is_call(eqn) -> bool:
    return eqn.primitive.name in _CALLS and isinstance(eqn.params.get("jaxpr"), ClosedJaxpr)


def _find_products(jaxpr: Jaxpr, tracked: dict, uses: dict, products: dict, path: tuple = ()) -> None:
    """Count the uses of each tracked leaf; record the products ``dot_general`` it enters.

    ``tracked`` maps a variable to ``(leaf, perm)``: the variable is ``transpose(leaf, perm)``.
    A product is identified by its path, the ids of the calls leading to it and its own: one
    jitted function called twice has one jaxpr, so an equation's id alone is not unique.
    """
    for eqn in jaxpr.eqns:
        ins = [(i, v) for i, v in enumerate(eqn.invars) if isinstance(v, Var) and v in tracked]
        if not ins:
            continue
        if eqn.primitive is lax.transpose_p:  # W.T: follow it, it is not a use
            k, perm = tracked[ins[0][1]]
            tracked[eqn.outvars[0]] = (k, tuple(perm[i] for i in eqn.params["permutation"]))
            continue
        if eqn.primitive is lax.dot_general_p and len(ins) == 1:
            (_, batch) = eqn.params["dimension_numbers"]
            side, v = ins[0]
            if not batch[0] and not batch[1]:
                k, perm = tracked[v]
                uses[k] += 1
                products.setdefault(k, []).append((eqn, side, perm, path + (id(eqn),)))
                continue
        if _is_call(eqn):
            inner = eqn.params["jaxpr"].jaxpr
            _find_products(inner, {inner.invars[i]: tracked[v] for i, v in ins}, uses, products,
                           path + (id(eqn),))
            continue
        for _, v in ins:  # any other use: the leaf's gradient is formed directly
            uses[tracked[v][0]] += 2
    for v in jaxpr.outvars:
        if isinstance(v, Var) and v in tracked:
            uses[tracked[v][0]] += 2


def _evaluate(jaxpr: Jaxpr, consts, args, taps: dict, seen: dict, path: tuple = ()) -> list:
    """``jax.core.eval_jaxpr`` that adds ``taps[path][0]`` to the output of each tapped product
    and stores the product's other operand in ``seen[path]`` (paths as in :func:`_find_products`;
    ``taps`` also holds each tapped path's prefixes, mapped to ``None``)."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        key = path + (id(eqn),)
        if key in taps and taps[key] is not None:
            tap, side = taps[key]
            out = [eqn.primitive.bind(*invals, **eqn.params) + tap]
            seen[key] = invals[1 - side]
        elif key in taps:  # a call with tapped products inside
            inner = eqn.params["jaxpr"]
            out = _evaluate(inner.jaxpr, inner.consts, invals, taps, seen, key)
        else:
            with eqn.ctx.manager:
                out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                out = [out]
        for v, x in zip(eqn.outvars, out):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _rows(eqn, side: int, other, cotangent) -> tuple[jax.Array, jax.Array]:
    """The product's other operand as ``A`` (P x in) and its output cotangent as ``G`` (P x out),
    so that the weight's gradient is ``A^T G`` (in the layout of :func:`_weight_layout`)."""
    (contract, _) = eqn.params["dimension_numbers"]
    c_other = tuple(contract[1 - side])
    free = tuple(d for d in range(other.ndim) if d not in c_other)
    rows = math.prod(other.shape[d] for d in free)
    a = jnp.transpose(other, free + c_other).reshape(rows, -1)
    # dot_general's output: the lhs free dimensions, then the rhs free dimensions
    g = cotangent.reshape(rows, -1) if side == 1 else cotangent.reshape(-1, rows).T
    return a, g


def _weight_layout(eqn, side: int, perm: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``A^T G`` has the operand's contracting axes (in ``dimension_numbers`` order), then its free
    axes; the operand is ``transpose(weight, perm)``. That shape, and the permutation back to the
    weight's own axis order."""
    (contract, _) = eqn.params["dimension_numbers"]
    shape = eqn.invars[side].aval.shape
    axes = tuple(contract[side]) + tuple(d for d in range(len(shape)) if d not in contract[side])
    weight_axes = tuple(perm[d] for d in axes)  # weight axis held by each axis of A^T G
    inverse = tuple(sorted(range(len(axes)), key=lambda i: weight_axes[i]))
    return tuple(shape[d] for d in axes), inverse


def _sq_norm(a: jax.Array, g: jax.Array) -> jax.Array:
    """``||A^T G||_F^2``, by Gram matrices when the record contributes few rows."""
    hi = lax.Precision.HIGHEST
    rows, n_in, n_out = a.shape[0], a.shape[1], g.shape[1]
    if rows * (n_in + n_out) <= n_in * n_out:
        return jnp.sum(jnp.matmul(a, a.T, precision=hi) * jnp.matmul(g, g.T, precision=hi))
    return jnp.sum(jnp.matmul(a.T, g, precision=hi) ** 2)


class PerRecordGradients:
    """One record's loss, gradient norm and the parts its gradient is made of; after ``vmap``
    over records, :meth:`weighted_sum` gives ``sum_i w_i grad loss_i`` without forming the ghost
    weights' per-record gradients.

    Calling it returns ``(value, norm, parts)`` for one record: ``parts`` holds the per-record
    gradients of the leaves formed directly, and ``A``, ``G`` of each ghost weight. The layout
    (which leaves are ghost weights) is fixed when the function is traced.

    >>> import jax, jax.numpy as jnp
    >>> def loss(p, x):
    ...     return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]))
    >>> p = {"w": jnp.ones((5, 3)) / 5, "b": jnp.zeros(3)}
    >>> x = jax.random.normal(jax.random.key(0), (4, 5))
    >>> per_record = PerRecordGradients(loss)
    >>> _, norms, parts = jax.vmap(per_record, (None, 0))(p, x)
    >>> w = jnp.minimum(1.0, 0.5 / norms)  # clip each record's gradient at norm 0.5
    >>> ref = jax.grad(lambda p: jnp.sum(w * jax.vmap(loss, (None, 0))(p, x)))(p)
    >>> got = per_record.weighted_sum(parts, w)
    >>> bool(jnp.allclose(got["w"], ref["w"], atol=1e-6)), per_record.num_ghost
    (True, 1)
    """

    def __init__(self, fun: Callable[..., jax.Array]) -> None:
        self.fun = fun
        self._layout = None

    @property
    def num_ghost(self) -> int:
        """How many parameter leaves are ghost weights (known once traced)."""
        if self._layout is None:
            raise RuntimeError("call (and trace) the function first")
        return len(self._layout["ghost"])

    def __call__(self, params, *args):
        leaves, treedef = jax.tree.flatten(params)

        def flat(leaves):
            return self.fun(jax.tree.unflatten(treedef, leaves), *args)

        closed = jax.make_jaxpr(flat)(leaves)
        jaxpr = closed.jaxpr
        uses = {k: 0 for k in range(len(leaves))}
        products: dict = {}
        tracked = {v: (k, tuple(range(jnp.ndim(leaves[k])))) for k, v in enumerate(jaxpr.invars)}
        _find_products(jaxpr, tracked, uses, products)
        ghost = [k for k in range(len(leaves)) if uses[k] == 1 and len(products.get(k, ())) == 1]
        sites = [products[k][0] for k in ghost]
        direct = [k for k in range(len(leaves)) if k not in ghost]
        self._layout = {
            "treedef": treedef, "ghost": ghost, "direct": direct,
            "weights": [_weight_layout(eqn, side, perm) for eqn, side, perm, _ in sites],
        }

        def tapped(direct_leaves, taps):
            full = list(leaves)
            for k, x in zip(direct, direct_leaves):
                full[k] = x
            seen: dict = {}
            tap_map = {key[:i]: None for *_, key in sites for i in range(1, len(key))}
            tap_map.update({key: (t, side) for (_, side, _, key), t in zip(sites, taps)})
            (out,) = _evaluate(jaxpr, closed.consts, full, tap_map, seen)
            return out, [seen[key] for *_, key in sites]

        zeros = [jnp.zeros(eqn.outvars[0].aval.shape, eqn.outvars[0].aval.dtype) for eqn, *_ in sites]
        (value, others), (g_direct, g_taps) = jax.value_and_grad(tapped, (0, 1), has_aux=True)(
            [leaves[k] for k in direct], zeros
        )
        rows = [_rows(eqn, side, o, g) for (eqn, side, *_), o, g in zip(sites, others, g_taps)]
        sq = sum((jnp.sum(jnp.square(g)) for g in g_direct), jnp.zeros((), jnp.result_type(value)))
        sq = sq + sum((_sq_norm(a, g) for a, g in rows), jnp.zeros_like(sq))
        return value, jnp.sqrt(sq), (g_direct, rows)

    def weighted_sum(self, parts, weights: jax.Array, mask: jax.Array | None = None):
        """``sum_i w_i grad loss_i`` from the parts of a batch of records (leading axis);
        records outside ``mask`` are left out by selection, so their NaNs cannot reach the sum."""
        if self._layout is None:
            raise RuntimeError("call (and trace) the function first")
        g_direct, rows = parts
        keep = (lambda x: x) if mask is None else (
            lambda x: jnp.where(jnp.reshape(mask, (-1,) + (1,) * (x.ndim - 1)), x, 0.0))
        layout = self._layout
        out = [None] * (len(layout["ghost"]) + len(layout["direct"]))
        # Sums at full float32 precision, like the norms: each record then adds w_i times the gradient
        # its norm was computed from (on a GPU the default precision rounds both factors to TF32 first,
        # and a record's share of the sum could exceed C by about 1e-3 of it).
        full = lax.Precision.HIGHEST
        for k, g in zip(layout["direct"], g_direct):
            out[k] = jnp.tensordot(weights, keep(g), 1, precision=full)
        for k, (a, g), (shape, inverse) in zip(layout["ghost"], rows, layout["weights"]):
            a, g = keep(a), keep(g) * weights[:, None, None]
            total = jnp.einsum("bpi,bpo->io", a, g, precision=full)
            out[k] = jnp.transpose(total.reshape(shape), inverse)
        return jax.tree.unflatten(layout["treedef"], out)


def value_and_grad_norm(fun: Callable[..., jax.Array]) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """``(fun(params, *args), ||grad_params fun(params, *args)||_2)`` with ghost norms for the weights
    of matrix products (see the module docstring); meant to be ``vmap``-ed over records.

    :param fun: scalar loss of one record, differentiable in its first argument (a pytree).

    >>> import jax, jax.numpy as jnp
    >>> def loss(p, x):  # a one-hidden-layer network on one record
    ...     return jnp.sum(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"])
    >>> p = {"w1": jnp.ones((50, 16)) / 8, "b1": jnp.zeros(16), "w2": jnp.ones((16, 3))}
    >>> x = jax.random.normal(jax.random.key(0), (32, 50))
    >>> value, norm = jax.vmap(value_and_grad_norm(loss), (None, 0))(p, x)
    >>> sq_norm = lambda g: sum(jnp.sum(v**2) for v in jax.tree.leaves(g))
    >>> direct = jax.vmap(lambda x: jnp.sqrt(sq_norm(jax.grad(loss)(p, x))))(x)
    >>> bool(jnp.allclose(norm, direct, rtol=1e-4))
    True
    """
    per_record = PerRecordGradients(fun)

    def wrapped(params, *args):
        value, norm, _ = per_record(params, *args)
        return value, norm

    return wrapped
