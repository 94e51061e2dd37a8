"""Releases: how a curator privatizes statistics, and what a release carries.

- :mod:`~d3pext.releases.mechanisms`: the Laplace, Gaussian, geometric and binomial mechanisms
  (law of a release, its draw, its noise quantiles, its privacy cost);
- :mod:`~d3pext.releases.counts`: mechanisms for locally private counts (seed 002);
- :mod:`~d3pext.releases.info`: ``ReleaseInfo``, the metadata of a release site, and
  ``release_sites``;
- :mod:`~d3pext.releases.files`: ``save_releases`` / ``load_releases``, releases on disk with the
  settings they were made with;
- :mod:`~d3pext.releases.sums`: ``exact_sum``, the curator's correctly rounded sums of records.
"""
