"""The base class of the data-augmentation Gibbs kernels, and their stuck-chain check."""

from __future__ import annotations

from collections.abc import Sequence
import copy

import numpy as np

import jax
from jax import lax
import jax.numpy as jnp

from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity

__all__ = ["ConstrainedGibbsKernel", "DEFAULT_MAX_STALLS", "raise_if_stuck"]

DEFAULT_MAX_STALLS = 20
"""Sweeps in a row in which a capped rejection step keeps its value before the run fails."""


def raise_if_stuck(
    stalls: jax.Array, max_stalls: int, kernel: str, updates: Sequence[str], failed: str, advice: str
) -> jax.Array:
    """Raise on the host if one chain's capped rejection step kept its value ``max_stalls`` sweeps in
    a row; returns ``False`` (feed it into the draws, or JAX removes the check as dead code).

    A rejection step that keeps the previous value after its cap is still an exact update (the
    chance of that does not depend on the previous value), so isolated kept values are fine; a
    chain that keeps one every sweep is stuck, which would otherwise go unnoticed.

    :param stalls: ``(len(updates),)`` per chain: consecutive sweeps in which each update kept its
        value.
    :param kernel: the kernel's name, for the message.
    :param updates: the updates' names (``"statistic update"``), for the message.
    :param failed: what each kept value means (``"found no feasible draw in 100 proposals"``).
    :param advice: the likely cause and what to do.

    The callback sits in a ``lax.while_loop`` whose body runs only in sweeps where some chain is
    stuck, so it costs nothing otherwise; under ``vmap`` it receives the counts of all chains (hence
    the chain indices). JAX re-raises the error from the run as a ``JaxRuntimeError`` (a
    ``RuntimeError``; some dispatch paths surface it as a ``ValueError``).

    >>> import jax.numpy as jnp
    >>> stalls = jnp.array([3, 0])  # the first update kept its value in the last 3 sweeps
    >>> bool(raise_if_stuck(stalls, 20, "MyKernel", ("first update", "second update"), "kept", ""))
    False
    """

    def report(counts):
        shape = np.shape(counts)[:-1]
        stuck = np.asarray(counts).reshape(-1, len(updates)) >= max_stalls
        chains = np.flatnonzero(stuck.any(1))
        if chains.size:
            names = " and the ".join(n for n, s in zip(updates, stuck.any(0)) if s)
            raise RuntimeError(
                f"{kernel}: the {names} {failed} in {max_stalls} sweeps in a row for chain(s) {chains.tolist()} "
                "(index over the vectorised chains; over releases x chains in sample_releases), so "
                f"the chain is stuck. {advice}"
            )
        return np.zeros(shape, bool)

    def body(flag):
        return jax.pure_callback(
            report, jax.ShapeDtypeStruct(jnp.shape(flag), jnp.bool_), stalls, vmap_method="expand_dims"
        )

    return lax.while_loop(lambda flag: flag, body, jnp.any(stalls >= max_stalls, -1))


class ConstrainedGibbsKernel(MCMCKernel):
    """Base of the data-augmentation Gibbs kernels: state ``z`` in the constrained space.

    Subclasses set ``self._model`` and implement ``init``/``sample``/``sites``; this class supplies
    what NumPyro's ``MCMC`` and composite ``Gibbs`` ask of every such kernel (identity transforms,
    no cached state, and ``wrap_model`` to run inside ``numpyro.infer.Gibbs``).
    """

    sample_field = "z"
    _standalone = True  # False once wrapped as a block of numpyro.infer.Gibbs

    @property
    def model(self):
        return self._model

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z",)

    def refresh(self, state, model_args, model_kwargs):
        """Identity: nothing is cached between sweeps."""
        return state

    def wrap_model(self, wrapper):
        kernel = copy.copy(self)
        kernel._model = wrapper(self._model)
        kernel._standalone = False
        return kernel

    def get_constrain_fn(self, model_args, model_kwargs):
        """Identity: the kernel works with constrained values."""
        return identity

    def postprocess_fn(self, model_args, model_kwargs):
        return identity

    def get_diagnostics_str(self, state) -> str:
        return ""
