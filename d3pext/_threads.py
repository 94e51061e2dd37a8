"""One model at a time per process.

NumPyro keeps its effect handlers in one process-wide stack (``numpyro.primitives._PYRO_STACK``): two
threads that run models at the same moment see each other's handlers, and their traces mix (sites of
one model in the other's trace, a plate's indices applied to the other's data). d3pext's entry points
that run a model (``DPSVI``'s ``init``, ``update``, ``stable_update``, ``run`` and ``evaluate``,
``make_release``, ``sample_releases``, ``private_posterior`` and the ``run`` of the ``MCMC`` it returns,
``rejection_abc``, ``smc_abc``, the ``Simulator`` (construction, ``simulate``, ``log_prior``), the
``run`` of SPPE/SPLE and SPLE's ``sample_unconstrained``/``log_prob``) hold :data:`MODEL_LOCK` while
they do:
threads then take turns, each with correct results. For parallel work, use processes (a file-backed
:class:`~d3pext.accountants.ledger.PrivacyLedger` serves several).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["MODEL_LOCK", "one_model_at_a_time"]

MODEL_LOCK = threading.RLock()

F = TypeVar("F", bound=Callable)


def one_model_at_a_time(fn: F) -> F:
    """``fn`` run holding :data:`MODEL_LOCK`."""

    @functools.wraps(fn)
    def locked(*args, **kwargs):
        with MODEL_LOCK:
            return fn(*args, **kwargs)

    return locked  # type: ignore[return-value]
