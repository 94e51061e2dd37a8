"""The base class of the data-augmentation Gibbs kernels."""

from __future__ import annotations

import copy

from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity

__all__ = ["ConstrainedGibbsKernel"]


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
