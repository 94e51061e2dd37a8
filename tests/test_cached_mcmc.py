"""CachedMCMC (d3pext.inference.mcmc): the same draws as numpyro's MCMC, and a second run with
the same shapes compiles nothing (numpyro's MCMC compiles its sampling loop on every run)."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
from numpyro.infer.mcmc import MCMCKernel

from d3pext.inference.mcmc import CachedMCMC

from compilations import count_compilations


class _State(NamedTuple):
    z: dict
    rng_key: jax.Array


class _RandomWalk(MCMCKernel):
    """A Gaussian random walk (vectorized over chains when given a batch of keys)."""

    sample_field = "z"

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        return _State({"x": jnp.zeros(rng_key.shape)}, rng_key)

    def _step(self, state):
        key, sub = jax.random.split(state.rng_key)
        return _State({"x": state.z["x"] + jax.random.normal(sub)}, key)

    def sample(self, state, model_args, model_kwargs):
        return jax.vmap(self._step)(state) if state.rng_key.ndim else self._step(state)

    def postprocess_fn(self, model_args, model_kwargs):
        return lambda z: z


@pytest.mark.parametrize("num_chains, chain_method", [(1, "vectorized"), (3, "vectorized"), (2, "sequential")])
@pytest.mark.parametrize("thinning", [1, 3])
def test_same_draws_as_numpyro(num_chains, chain_method, thinning):
    runs = []
    for cls in (CachedMCMC, MCMC):
        mcmc = cls(_RandomWalk(), num_warmup=7, num_samples=11, num_chains=num_chains,
                   chain_method=chain_method, thinning=thinning, progress_bar=False)
        mcmc.run(jax.random.key(3))
        runs.append((mcmc.get_samples(group_by_chain=True)["x"], mcmc.last_state.z["x"]))
    (x, last), (x_ref, last_ref) = runs
    assert x.shape == (num_chains, 11 // thinning)
    np.testing.assert_array_equal(x, x_ref)
    np.testing.assert_array_equal(last, last_ref)


def test_second_run_compiles_nothing():
    mcmc = CachedMCMC(_RandomWalk(), num_warmup=5, num_samples=20, num_chains=4,
                      chain_method="vectorized", progress_bar=False)
    mcmc.run(jax.random.key(0))
    first = mcmc.get_samples()["x"]
    with count_compilations() as compiled:
        mcmc.run(jax.random.key(1))
        second = mcmc.get_samples()["x"]
    assert compiled == []
    assert not np.array_equal(first, second)
    # the counter sees compilations: numpyro's MCMC compiles its loop again
    ref = MCMC(_RandomWalk(), num_warmup=5, num_samples=20, num_chains=4,
               chain_method="vectorized", progress_bar=False)
    ref.run(jax.random.key(0))
    with count_compilations() as compiled:
        ref.run(jax.random.key(1))
    assert len(compiled) >= 1


def test_nuts_warmup_then_run():
    def model():
        numpyro.sample("x", dist.Normal(1.0, 2.0))

    mcmc = CachedMCMC(NUTS(model), num_warmup=200, num_samples=400, progress_bar=False)
    mcmc.warmup(jax.random.key(0))
    mcmc.run(jax.random.key(1))
    x = mcmc.get_samples()["x"]
    assert x.shape == (400,) and abs(float(x.mean()) - 1.0) < 0.6
    with count_compilations() as compiled:
        mcmc.run(jax.random.key(2))
    assert compiled == []
