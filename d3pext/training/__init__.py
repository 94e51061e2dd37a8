"""Private training: differentially private variational inference (DP-VI, seed 003).

- :mod:`~d3pext.training.svi`: ``DPSVI``, the drop-in for ``numpyro.infer.SVI``, and its
  ``PrivacyReport``;
- :mod:`~d3pext.training.clipping`: the per-record clipping strategies (materialise, ghost,
  reweight), all giving the same clipped sum;
- :mod:`~d3pext.training.ghost`: per-record gradient norms of matrix-product weights from layer
  inputs and output gradients;
- :mod:`~d3pext.training.minibatch`: Feistel fixed-size and Poisson minibatch samplers, each with
  the neighbouring relation its accountant assumes.

The secure random numbers (ChaCha20) are :mod:`d3pext.prng`, shared with the releases.
"""
