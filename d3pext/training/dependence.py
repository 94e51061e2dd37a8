"""Which outputs of a traced program can depend on which inputs: a dataflow analysis of the jaxpr.

DPSVI adds the gradient of the global (prior and guide) terms without clipping or noise, so it
must know that no data value reaches them. Comparing runs on different records can only show a
dependence, never its absence (``loc = jnp.std(x)`` looks constant on records of equal spread).
Here the absence is proven instead: the function is traced once with :func:`jax.make_jaxpr`, and
every variable computed from a data input, through any chain of primitives, is marked. An output
left unmarked is the same function of the other inputs whatever the data are.

The analysis is conservative: it looks inside calls whose inner program maps inputs to outputs one
to one (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``); through loops it follows
the carry to a fixed point (``scan``; ``while``, whose every output is marked when its condition
reads a marked value: the data then set the trip count); through ``cond`` it takes the union over
the branches (every output when the branch index is marked). Any other equation with a marked input
has every output marked. It may refuse a program that does not depend on the data; it never accepts
one that does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

__all__ = ["dependent_outputs", "jaxpr_dependence"]


# calls whose inner program maps the equation's inputs to its outputs one to one, by the param holding it
_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr",
}


def _jaxpr(value) -> Any:
    return value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value


def _call_outputs(eqn, inputs: list[bool]) -> list[bool] | None:
    """The marks of a known call's outputs, or ``None`` if ``eqn`` is not one (or not as expected)."""
    name = _CALLS.get(eqn.primitive.name)
    inner = _jaxpr(eqn.params.get(name)) if name else None
    if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(inputs) and len(inner.outvars) == len(eqn.outvars):
        return jaxpr_dependence(inner, inputs)
    return None


def _scan_outputs(eqn, inputs: list[bool]) -> list[bool]:
    """Body inputs: constants, carry, slices; outputs: carry, stacked results. A carry that becomes
    marked in one iteration is marked in the next: iterate the body to a fixed point."""
    consts, carry_count = eqn.params["num_consts"], eqn.params["num_carry"]
    body = _jaxpr(eqn.params["jaxpr"])
    carry = list(inputs[consts:consts + carry_count])
    while True:
        outputs = jaxpr_dependence(body, inputs[:consts] + carry + inputs[consts + carry_count:])
        merged = [a or b for a, b in zip(carry, outputs[:carry_count])]
        if merged == carry:
            return outputs
        carry = merged


def _while_outputs(eqn, inputs: list[bool]) -> list[bool]:
    """Inputs: the condition's constants, the body's constants, the carry. Data that reach the
    condition set the number of iterations, and with it every output."""
    cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    cond_consts, body_consts, carry = inputs[:cond_n], inputs[cond_n:cond_n + body_n], list(inputs[cond_n + body_n:])
    body = _jaxpr(eqn.params["body_jaxpr"])
    while True:
        merged = [a or b for a, b in zip(carry, jaxpr_dependence(body, body_consts + carry))]
        if merged == carry:
            break
        carry = merged
    if any(jaxpr_dependence(_jaxpr(eqn.params["cond_jaxpr"]), cond_consts + carry)):
        return [True] * len(eqn.outvars)
    return carry


def _cond_outputs(eqn, inputs: list[bool]) -> list[bool]:
    """Inputs: the branch index, the operands; an output is marked if it is in any branch."""
    if inputs[0]:
        return [True] * len(eqn.outvars)
    marks = [jaxpr_dependence(_jaxpr(branch), inputs[1:]) for branch in eqn.params["branches"]]
    return [any(m) for m in zip(*marks)]


_HIGHER_ORDER = {"scan": _scan_outputs, "while": _while_outputs, "cond": _cond_outputs}


def _outputs(eqn, inputs: list[bool]) -> list[bool]:
    rule = _HIGHER_ORDER.get(eqn.primitive.name)
    if rule is not None:
        return rule(eqn, inputs)
    found = _call_outputs(eqn, inputs)
    return found if found is not None else [True] * len(eqn.outvars)


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
        marked.update(v for v, m in zip(eqn.outvars, _outputs(eqn, inputs)) if m)
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
