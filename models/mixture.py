"""Gaussian mixture with the assignments integrated out (seed 003, section 5.4 and appendix A).

    log p(x_i | pi, mu, sigma) = log sum_j pi_j N(x_i; mu_j, sigma_j^2 I),
    pi ~ Dirichlet(1, ..., 1),   mu_j ~ N(0, I),   sigma_j ~ InverseGamma(1, 1).

Marginalising the component assignments z_i leaves no per-record latent variable to learn, which
private inference could not fit well (Jälkö et al.); the likelihood is NumPyro's
:class:`~numpyro.distributions.MixtureSameFamily`, the same marginal as the paper's listing 5.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import random

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints, transforms
from d3pext.validation import check_batch_size, check_positive_if_number, check_records


__all__ = [
    "MixtureData",
    "gaussian_mixture",
    "gaussian_mixture_guide",
    "gaussian_mixture_likelihood",
    "simulate_mixture",
]


def gaussian_mixture_likelihood(weights: jax.Array, locs: jax.Array, scales: jax.Array) -> dist.Distribution:
    """Mixture of spherical Gaussians ``sum_j weights_j N(locs_j, scales_j^2 I)``, event shape ``(d,)``.

    ``weights``: ``(k,)`` on the simplex, ``locs``: ``(k, d)``, ``scales``: ``(k,)``.

    >>> import jax.numpy as jnp
    >>> from d3pext.models import gaussian_mixture_likelihood
    >>> mix = gaussian_mixture_likelihood(jnp.array([0.5, 0.5]), jnp.zeros((2, 3)), jnp.ones(2))
    >>> mix.event_shape, round(float(mix.log_prob(jnp.zeros(3))), 4)
    ((3,), -2.7568)
    """
    components = dist.Normal(locs, scales[..., None]).to_event(1)
    return dist.MixtureSameFamily(dist.Categorical(probs=weights), components)


def gaussian_mixture(x: jax.Array, *, num_components: int = 5, batch_size: Optional[int] = None) -> None:
    """Gaussian mixture model of appendix A (listing 6) with marginalised assignments.

    Args:
        x: records, shape ``(N, d)`` (always observed: the likelihood has no latent assignment).
        num_components: k, the number of mixture components.
        batch_size: records per step (``None``: all).

    Sites: ``weights`` (Dirichlet), ``locs`` (``(k, d)``) and ``scales`` (``(k,)``) in plate
    ``"components"``, ``x`` in the data plate ``"data"``. Fit with :func:`gaussian_mixture_guide`
    or, equivalently, :class:`~numpyro.infer.autoguide.AutoNormal`.

    >>> import jax, numpyro
    >>> from numpyro.infer import SVI, Trace_ELBO
    >>> from d3pext.models import gaussian_mixture, gaussian_mixture_guide, simulate_mixture
    >>> data = simulate_mixture(jax.random.key(0), 500, num_components=3)
    >>> svi = SVI(gaussian_mixture, gaussian_mixture_guide, numpyro.optim.Adam(0.05), Trace_ELBO())
    >>> result = svi.run(jax.random.key(1), 200, data.x, num_components=3, batch_size=100, progress_bar=False)
    >>> result.params["locs_loc"].shape
    (3, 2)
    """
    n, d = check_records("x", x, 2)
    if isinstance(num_components, bool) or not isinstance(num_components, int) or num_components < 1:
        raise ValueError(f"num_components must be a positive int, got {num_components!r}")
    check_batch_size(batch_size, n)
    weights = numpyro.sample("weights", dist.Dirichlet(jnp.ones(num_components)))
    with numpyro.plate("components", num_components):
        locs = numpyro.sample("locs", dist.Normal(0.0, 1.0).expand([d]).to_event(1))
        scales = numpyro.sample("scales", dist.InverseGamma(1.0, 1.0))
    with numpyro.plate("data", n, subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        numpyro.sample("x", gaussian_mixture_likelihood(weights, locs, scales), obs=xb)


def gaussian_mixture_guide(x: jax.Array, *, num_components: int = 5, batch_size: Optional[int] = None) -> None:
    """Mean-field Gaussian guide for :func:`gaussian_mixture` in the unconstrained space (as Jälkö et al.).

    ``weights``: a diagonal Gaussian pushed through the stick-breaking map onto the simplex;
    ``locs``: diagonal Gaussian; ``scales``: log-normal. Scales start at 0.1 and the component
    locations at independent standard normal draws, which breaks the symmetry between components.
    Parameters: ``weights_loc``, ``weights_scale``, ``locs_loc``, ``locs_scale``, ``scales_loc``,
    ``scales_scale``.

    >>> import jax.numpy as jnp
    >>> from numpyro.handlers import seed, trace
    >>> from d3pext.models import gaussian_mixture_guide
    >>> tr = trace(seed(gaussian_mixture_guide, 0)).get_trace(jnp.zeros((10, 2)), num_components=3)
    >>> tr["weights"]["value"].shape, tr["locs"]["value"].shape, tr["scales"]["value"].shape
    ((3,), (3, 2), (3,))
    """
    k, d = num_components, jnp.shape(x)[-1]
    init_scale = jnp.full(k - 1, 0.1)
    w_loc = numpyro.param("weights_loc", jnp.zeros(k - 1))
    w_scale = numpyro.param("weights_scale", init_scale, constraint=constraints.positive)
    numpyro.sample(
        "weights",
        dist.TransformedDistribution(dist.Normal(w_loc, w_scale).to_event(1), transforms.StickBreakingTransform()),
    )
    locs_loc = numpyro.param("locs_loc", lambda key: random.normal(key, (k, d)))
    locs_scale = numpyro.param("locs_scale", jnp.full((k, d), 0.1), constraint=constraints.positive)
    scales_loc = numpyro.param("scales_loc", jnp.zeros(k))
    scales_scale = numpyro.param("scales_scale", jnp.full(k, 0.1), constraint=constraints.positive)
    with numpyro.plate("components", k):
        numpyro.sample("locs", dist.Normal(locs_loc, locs_scale).to_event(1))
        numpyro.sample("scales", dist.LogNormal(scales_loc, scales_scale))


class MixtureData(NamedTuple):
    """Simulated mixture data: records ``x``, their components and the true parameters."""

    x: jax.Array
    component: jax.Array
    weights: jax.Array
    locs: jax.Array
    scales: jax.Array


def simulate_mixture(
    rng_key: jax.Array, num_records: int, *, num_components: int = 5, dim: int = 2, scale: float = 0.2
) -> MixtureData:
    """Records from ``num_components`` spherical clusters, as in the DP-VI experiment (5 clusters in 2-D).

    Equal weights, centres from the model's prior ``N(0, I)`` and a common standard deviation ``scale``.

    >>> import jax
    >>> from d3pext.models import simulate_mixture
    >>> simulate_mixture(jax.random.key(0), 100).x.shape
    (100, 2)
    """
    if num_records < 1 or num_components < 1 or dim < 1:
        raise ValueError(
            f"num_records, num_components and dim must be >= 1, got {num_records}, {num_components}, {dim}"
        )
    check_positive_if_number("scale", scale)
    return MixtureData(*_simulate_mixture(rng_key, num_records, num_components, dim, float(scale)))


@partial(jax.jit, static_argnums=(1, 2, 3))
def _simulate_mixture(rng_key, num_records, num_components, dim, scale):
    k_loc, k_z, k_x = random.split(rng_key, 3)
    weights = jnp.full(num_components, 1.0 / num_components)
    locs = random.normal(k_loc, (num_components, dim))
    scales = jnp.full(num_components, scale)
    component = random.categorical(k_z, jnp.log(weights), shape=(num_records,))
    x = locs[component] + scale * random.normal(k_x, (num_records, dim))
    return x, component, weights, locs, scales
