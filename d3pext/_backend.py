"""One computation in two forms: one for CPUs, one for accelerators, picked when the program is lowered
(or, where the CPU is the only backend, when it is traced).

On a GPU each pass of a data-dependent ``lax.while_loop`` waits for the host to read its predicate,
so the samplers there avoid such loops where a loop-free form gives the same law; on a CPU the loops
skip work. :func:`forced_form` runs one form on any backend (tests check the accelerator forms on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Optional

import jax
import jax.extend.backend
from jax import lax

_forced: Optional[str] = None


def by_backend(cpu: Callable, accelerator: Callable, *args):
    """``cpu(*args)`` on a CPU, ``accelerator(*args)`` elsewhere (``lax.platform_dependent``).

    In a process whose only backend is the CPU, only the CPU form is traced: ``platform_dependent``
    traces every form, and the accelerator forms cost a fifth of a Gibbs sampler's tracing, in every
    process, for a program that can only run on the CPU. (A program exported from such a process for
    an accelerator keeps the CPU form: the same law, run more slowly there.)
    """
    if _forced is not None:
        return (cpu if _forced == "cpu" else accelerator)(*args)
    if _cpu_only():
        return cpu(*args)
    return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def _cpu_only() -> bool:
    try:
        return set(jax.extend.backend.backends()) == {"cpu"}
    except Exception:  # backends that fail to initialise: decide when the program is lowered
        return False


@contextmanager
def forced_form(form: Literal["cpu", "accelerator"]) -> Iterator[None]:
    """Trace :func:`by_backend` computations in ``form`` whatever the backend (for tests: a program
    traced earlier and kept by ``jit`` keeps its form)."""
    global _forced
    previous, _forced = _forced, form
    try:
        yield
    finally:
        _forced = previous


# Every engine module imports this one: the CPU lowering of Threefry over one flat axis (same bits,
# seconds less compilation per multi-dimensional draw; see d3pext._threefry_cpu) is in place before
# any of their programs is lowered.
from d3pext._threefry_cpu import install as _install_flat_threefry  # noqa: E402

_install_flat_threefry()
