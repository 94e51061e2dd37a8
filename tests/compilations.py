"""Counting XLA compilations in tests (``jax.monitoring`` events), shared by the test files that
check that a second call compiles nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def count_compilations() -> Iterator[list[str]]:
    """The XLA compilations inside the block: the name of each program compiled (``jit(f)``)."""
    names: list[str] = []

    def listener(name, *args, **kwargs):
        if name.endswith("backend_compile_duration"):
            names.append(kwargs.get("fun_name", name))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
