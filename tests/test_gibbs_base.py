"""The stuck-chain check of the Gibbs kernels (d3pext.inference.gibbs_base.raise_if_stuck): silent
while no chain is stuck, an error naming the stuck updates and chains once one is, and kept by JAX
when its result feeds the draws (the fast twin of the kernels' slow stuck-release tests)."""

import jax
import jax.numpy as jnp
import pytest

from d3pext.inference.gibbs_base import raise_if_stuck


def _run(kept, max_stalls):
    """Counts consecutive kept values per chain and update over sweeps, as the kernels do; returns the
    (unchanged) draws. ``kept``: (sweeps, chains, updates) booleans."""

    def sweep(carry, kept_now):
        x, stalls = carry
        stalls = jnp.where(kept_now, stalls + 1, 0)
        stuck = jax.vmap(lambda s: raise_if_stuck(s, max_stalls, "Kernel", ("first update", "second update"), "kept", "Advice."))(stalls)
        return (jnp.where(stuck, -1.0, x + 1.0), stalls), None

    chains = kept.shape[1]
    init = (jnp.zeros(chains), jnp.zeros((chains, 2), jnp.int32))
    # jit + scan: the check lives in a compiled loop; the final counts are dropped, only x is returned
    return jax.jit(lambda k: jax.lax.scan(sweep, init, k)[0][0])(kept)


def test_isolated_kept_values_pass_and_a_stuck_chain_fails():
    kept = jnp.zeros((30, 3, 2), bool).at[::2, 1, 0].set(True)  # every other sweep: never 3 in a row
    assert _run(kept, 3).tolist() == [30.0, 30.0, 30.0]
    stuck = kept.at[10:13, 2, 1].set(True)
    with pytest.raises((RuntimeError, ValueError), match=r"Kernel: the second update kept in 3 sweeps in a row for chain\(s\) \[2\] .* stuck. Advice."):
        jax.block_until_ready(_run(stuck, 3))
    both = stuck.at[20:23, 0, 0].set(True).at[10:13, 0, 0].set(True)
    with pytest.raises((RuntimeError, ValueError), match=r"Kernel: the first update and the second update kept in 3 sweeps in a row for chain\(s\) \[0, 2\]"):
        jax.block_until_ready(_run(both, 3))
