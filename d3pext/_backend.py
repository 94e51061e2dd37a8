"""One computation in two forms: one for CPUs, one for accelerators, picked when the program is lowered.

On a GPU each pass of a data-dependent ``lax.while_loop`` waits for the host to read its predicate,
so the samplers there avoid such loops where a loop-free form gives the same law; on a CPU the loops
skip work. :func:`forced_form` runs one form on any backend (tests check the accelerator forms on a CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Optional

from jax import lax

_forced: Optional[str] = None


def by_backend(cpu: Callable, accelerator: Callable, *args):
    """``cpu(*args)`` on a CPU, ``accelerator(*args)`` elsewhere (``lax.platform_dependent``)."""
    if _forced is not None:
        return (cpu if _forced == "cpu" else accelerator)(*args)
    return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


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
