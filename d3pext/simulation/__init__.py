"""Simulation-based inference from private releases (Xiong, Ju & Zhang, seed 000).

- :mod:`~d3pext.simulation.sbi`: ``SPPE`` and ``SPLE``, sequential neural posterior and
  likelihood estimation with the mechanism integrated out;
- :mod:`~d3pext.simulation.flows`: conditional neural spline flows (flowjax, the ``[flows]``
  extra) and their trainer;
- :mod:`~d3pext.simulation.rqmc`: randomized quasi-Monte Carlo over the mechanism's noise
  (scrambled Sobol points);
- :mod:`~d3pext.simulation.abc`: rejection and SMC-ABC reference posteriors.
"""
