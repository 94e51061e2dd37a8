"""Private training: differentially private variational inference (DP-VI, seed 003).

- :mod:`~d3pext.training.svi`: ``DPSVI``, the drop-in for ``numpyro.infer.SVI``, and its
  ``PrivacyReport``;
- :mod:`~d3pext.training.clipping`: the per-record clipping strategies (materialise, ghost,
  reweight), all giving the same clipped sum;
- :mod:`~d3pext.training.ghost`: per-record gradient norms of matrix-product weights from layer
  inputs and output gradients;
- :mod:`~d3pext.training.minibatch`: Feistel fixed-size and Poisson minibatch samplers, each with
  the neighbouring relation its accountant assumes;
- :mod:`~d3pext.training.streaming`: ``MemmapBatches`` and ``fit_streaming``, DP-VI on data
  larger than memory: each step's rows read from memory-mapped ``.npy`` files by a prefetch thread;
- :mod:`~d3pext.training.checkpoint`: ``save_fit`` and ``load_fit``, the fitted parameters with
  their privacy report in one ``.npz`` file (no pickle), e.g.
  ``save_fit("fit.npz", result.params, result.privacy)``, then
  ``fit = load_fit("fit.npz")`` and ``Predictive(model, guide=guide, params=fit.params)``.

The secure random numbers (ChaCha20) are :mod:`d3pext.prng`, shared with the releases.
"""

from d3pext._lazy import lazy_attributes

# lazy, so that importing one training module does not load the others
_LAZY = {
    "SavedFit": "d3pext.training.checkpoint",
    "load_fit": "d3pext.training.checkpoint",
    "save_fit": "d3pext.training.checkpoint",
    "MemmapBatches": "d3pext.training.streaming",
    "fit_streaming": "d3pext.training.streaming",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
