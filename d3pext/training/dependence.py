"""Which outputs of a traced program can depend on which inputs: a dataflow analysis of the jaxpr.

DPSVI adds the gradient of the global (prior and guide) terms without clipping or noise, so it
must know that no data value reaches them. Comparing runs on different records can only show a
dependence, never its absence (``loc = jnp.std(x)`` looks constant on records of equal spread).
Here the absence is proven instead: the function is traced once with :func:`jax.make_jaxpr`, and
every variable computed from a data input, through any chain of primitives, is marked. An output
left unmarked is the same function of the other inputs whatever the data are.

The analysis is conservative: it looks inside calls whose inner program maps inputs to outputs one
to one (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``) and otherwise marks every
output of an equation that has a marked input (loops, conditionals). It may refuse a program that
does not depend on the data; it never accepts one that does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

__all__ = ["dependent_outputs", "jaxpr_dependence"]


def _subprogram(eqn) -> Any:
    """The inner jaxpr of a call whose inputs and outputs match the equation's, else ``None``."""
    for value in eqn.params.values():
        jaxpr = value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value
        if (
            isinstance(jaxpr, jcore.Jaxpr)
            and len(jaxpr.invars) == len(eqn.invars)
            and len(jaxpr.outvars) == len(eqn.outvars)
        ):
            return jaxpr
    return None


def jaxpr_dependence(jaxpr: Any, marked_inputs: Sequence[bool]) -> list[bool]:
    """For each output of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), whether it can depend on an
    input marked ``True``; constants are unmarked.

    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x, w: (w * 2.0, jnp.std(x) * w))(jnp.ones(3), 1.0)
    >>> jaxpr_dependence(closed, [True, False])
    [False, True]
    """
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    if len(marked_inputs) != len(jaxpr.invars):
        raise ValueError(f"{len(marked_inputs)} marks for {len(jaxpr.invars)} inputs")
    marked = {v for v, m in zip(jaxpr.invars, marked_inputs) if m}

    def is_marked(v) -> bool:
        return not isinstance(v, jcore.Literal) and v in marked

    for eqn in jaxpr.eqns:
        inputs = [is_marked(v) for v in eqn.invars]
        if not any(inputs):
            continue
        inner = _subprogram(eqn)
        outputs = jaxpr_dependence(inner, inputs) if inner is not None else [True] * len(eqn.outvars)
        marked.update(v for v, m in zip(eqn.outvars, outputs) if m)
    return [is_marked(v) for v in jaxpr.outvars]


def dependent_outputs(fn: Callable, data: Any, *others: Any) -> Any:
    """The output tree of ``fn(data, *others)`` with ``True`` where a leaf can depend on ``data``.

    Nothing is compiled or run: ``fn`` is traced once with abstract values.

    >>> import jax.numpy as jnp
    >>> dependent_outputs(lambda x, w: {"prior": w + 1.0, "leak": jnp.max(x) - jnp.min(x)},
    ...                   jnp.ones(5), 0.5)
    {'leak': True, 'prior': False}
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(data, *others)
    num_data = len(jax.tree.leaves(data))
    num_others = len(jax.tree.leaves(others))
    marks = jaxpr_dependence(closed, [True] * num_data + [False] * num_others)
    return jax.tree.unflatten(jax.tree.structure(out_shape), marks)
