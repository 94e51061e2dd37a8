"""Inference from private releases: the backend registry and one module per backend.

- :mod:`~d3pext.inference.structure`: ``PrivateModel``, the concrete structure of a privatized
  model that backends read, and ``inspect_model`` that builds it;
- :mod:`~d3pext.inference.registry`: the ordered table of built-in backends and
  ``register_backend`` for new ones;
- :mod:`~d3pext.inference.gibbs_base` and :mod:`~d3pext.inference.draws`: the base class of the
  data-augmentation Gibbs kernels and the uniform-driven samplers they share;
- :mod:`~d3pext.inference.mcmc`: ``CachedMCMC``, NumPyro's ``MCMC`` whose sampling loop is compiled
  once per kernel and settings (``private_posterior`` returns one: a second ``run`` compiles nothing);
- backends:

  - :mod:`~d3pext.inference.expfam_backend` with the kernel :mod:`~d3pext.inference.expfam_gibbs`:
    exponential families from noisy sufficient statistics (Bernstein & Sheldon, seed 004),
    methods ``"gibbs"``, ``"naive"``, ``"clt"``;
  - :mod:`~d3pext.inference.bounded`: bounded Gaussian data from a noisy mean and variance,
    exact TGM Gibbs (Kazan & Reiter, seed 001);
  - :mod:`~d3pext.inference.counts`: locally private counts, Bessel/Skellam augmentation
    (Schein et al., seed 002);
  - :mod:`~d3pext.inference.regression`: simple linear regression from noisy sufficient
    statistics with Kazan & Reiter's constraints.

Simulation-based methods (``"sppe"``, ``"sple"``) live in :mod:`d3pext.simulation` and are
registered here as estimator backends.
"""
