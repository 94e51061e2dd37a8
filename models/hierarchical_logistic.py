"""Hierarchical logistic regression (seed 003, section 3.3, eq. 5 and listing 4; after Wong & Mason, 1985).

For records ``x_i`` in group ``l_i`` with public group characteristics ``g_l`` (``L`` groups, ``K``
characteristics each):

    y_i ~ Bernoulli(sigmoid(w_{l_i}^T x_i)),   w_l ~ N(M g_l, Sigma_l),   M_{d,k} ~ N(mu_0, sigma_0^2),

with ``Sigma_l = I``, ``mu_0 = 0`` and ``sigma_0 = 4`` as in the paper. The records, labels and group
indicators are confidential (inside the data plate); the group characteristics are public.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import random

import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
from d3pext.validation import check_batch_size, check_labels, check_positive_if_number, check_records


__all__ = [
    "HierarchicalLogisticData",
    "hierarchical_logistic_regression",
    "hierarchical_logistic_guide",
    "hierarchical_logistic_logits",
    "simulate_hierarchical_logistic",
]


def _check_groups(group, group_features, n: int) -> tuple[int, int]:
    if group_features is None:
        raise TypeError("group_features (the public (L, K) matrix of group characteristics) is required")
    gshape = jnp.shape(group_features)
    if len(gshape) != 2:
        raise ValueError(f"group_features must be a 2-D array of shape (L, K), got shape {gshape}")
    if jnp.shape(group) != (n,):
        raise ValueError(f"group must have shape ({n},) to match the records, got {jnp.shape(group)}")
    if not jnp.issubdtype(jnp.result_type(group), jnp.integer):
        raise TypeError(f"group must hold integer group indices, got dtype {jnp.result_type(group)}")
    if not isinstance(group, jax.core.Tracer):
        values = np.asarray(group)
        if values.size and (values.min() < 0 or values.max() >= gshape[0]):
            raise ValueError(
                f"group indices must be in [0, {gshape[0] - 1}], got range [{values.min()}, {values.max()}]"
            )
    return gshape


def hierarchical_logistic_regression(
    x: jax.Array,
    group: jax.Array,
    y: Optional[jax.Array] = None,
    *,
    group_features: jax.Array,
    batch_size: Optional[int] = None,
    prior_scale: float = 4.0,
    weight_scale: float = 1.0,
) -> None:
    """Hierarchical logistic regression with group weights ``w_l ~ N(M g_l, weight_scale^2 I)``.

    Args:
        x: features, shape ``(N, D)``.
        group: group index ``l_i`` of each record, integers in ``[0, L)``, shape ``(N,)``.
        y: binary labels, shape ``(N,)``; ``None`` to sample them.
        group_features: public group characteristics ``g_l``, shape ``(L, K)``.
        batch_size: records per step (``None``: all).
        prior_scale: sigma_0, the prior standard deviation of each entry of ``M`` (paper: 4).
        weight_scale: standard deviation of ``w_l`` around ``M g_l`` (paper: ``Sigma_l = I``).

    Sites: ``M`` (shape ``(D, K)``), ``ws`` (shape ``(L, D)``, in plate ``"groups"``), ``y`` in the
    data plate ``"data"``. Fit with :func:`hierarchical_logistic_guide`.

    >>> import jax, numpyro
    >>> from numpyro.infer import SVI, Trace_ELBO
    >>> from d3pext.models import (hierarchical_logistic_regression, hierarchical_logistic_guide,
    ...                            simulate_hierarchical_logistic)
    >>> data = simulate_hierarchical_logistic(jax.random.key(0), 500)
    >>> svi = SVI(hierarchical_logistic_regression, hierarchical_logistic_guide, numpyro.optim.Adam(0.05),
    ...           Trace_ELBO())
    >>> result = svi.run(jax.random.key(1), 500, data.x, data.group, data.y,
    ...                  group_features=data.group_features, batch_size=50, progress_bar=False)
    >>> result.params["M_loc"].shape
    (5, 3)
    """
    n, d = check_records("x", x, 2)
    check_labels("y", y, n)
    num_groups, k = _check_groups(group, group_features, n)
    check_batch_size(batch_size, n)
    check_positive_if_number("prior_scale", prior_scale)
    check_positive_if_number("weight_scale", weight_scale)
    m = numpyro.sample("M", dist.Normal(0.0, prior_scale).expand([d, k]).to_event(2))
    with numpyro.plate("groups", num_groups):
        ws = numpyro.sample("ws", dist.Normal(group_features @ m.T, weight_scale).to_event(1))
    with numpyro.plate("data", n, subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        gb = numpyro.subsample(group, event_dim=0)
        yb = None if y is None else numpyro.subsample(y, event_dim=0)
        numpyro.sample("y", dist.Bernoulli(logits=jnp.sum(xb * ws[gb], axis=-1)), obs=yb)


def hierarchical_logistic_guide(
    x: jax.Array,
    group: jax.Array,
    y: Optional[jax.Array] = None,
    *,
    group_features: jax.Array,
    batch_size: Optional[int] = None,
    prior_scale: float = 4.0,
    weight_scale: float = 1.0,
) -> None:
    """The paper's guide (eq. 6): mean-field ``q(M) = N(M_loc, M_scale^2)``, and ``q(w_l | M) = p(w_l | M g_l)``.

    The group weights follow their conditional prior given ``M`` (the paper's eq. 7); drawing them here
    rather than leaving them to the model makes their log-densities cancel exactly in the ELBO.
    Parameters: ``M_loc`` (initialised at 0) and ``M_scale`` (positive, initialised at 0.1).

    >>> import jax.numpy as jnp
    >>> from numpyro.handlers import seed, trace
    >>> from d3pext.models import hierarchical_logistic_guide
    >>> tr = trace(seed(hierarchical_logistic_guide, 0)).get_trace(
    ...     jnp.ones((4, 5)), jnp.zeros(4, int), group_features=jnp.ones((3, 2)))
    >>> tr["M"]["value"].shape, tr["ws"]["value"].shape
    ((5, 2), (3, 5))
    """
    d = jnp.shape(x)[-1]
    num_groups, k = jnp.shape(group_features)
    m_loc = numpyro.param("M_loc", jnp.zeros((d, k)))
    m_scale = numpyro.param("M_scale", jnp.full((d, k), 0.1), constraint=constraints.positive)
    m = numpyro.sample("M", dist.Normal(m_loc, m_scale).to_event(2))
    with numpyro.plate("groups", num_groups):
        numpyro.sample("ws", dist.Normal(group_features @ m.T, weight_scale).to_event(1))


def hierarchical_logistic_logits(m: jax.Array, x: jax.Array, group: jax.Array, group_features: jax.Array) -> jax.Array:
    """Logits ``(M g_{l_i})^T x_i`` of the records for a coefficient matrix ``M`` (e.g. the fitted ``M_loc``).

    ``E[w_l | M] = M g_l``, so with the posterior mean of ``M`` these are the logits at the mean weights.

    >>> import jax.numpy as jnp
    >>> from d3pext.models import hierarchical_logistic_logits
    >>> hierarchical_logistic_logits(jnp.eye(2), jnp.array([[1.0, 2.0]]), jnp.array([1]), jnp.eye(2))
    Array([2.], dtype=float32)
    """
    weights = group_features @ m.T
    return jnp.sum(x * weights[group], axis=-1)


class HierarchicalLogisticData(NamedTuple):
    """A simulated data set: records ``x``, ``group``, ``y`` and the public and true parameters."""

    x: jax.Array
    group: jax.Array
    y: jax.Array
    group_features: jax.Array
    M: jax.Array
    weights: jax.Array


def simulate_hierarchical_logistic(
    rng_key: jax.Array,
    num_records: int,
    *,
    num_features: int = 5,
    num_groups: int = 3,
    num_group_features: int = 3,
    coef_scale: float = 1.0,
    weight_scale: float = 1.0,
) -> HierarchicalLogisticData:
    """Synthetic data with the structure of section 3.3, sized as in section 5.3 (D = 5, L = 3, K = 3).

    The paper does not state how it drew its data; here ``g_l ~ N(0, I_K)``,
    ``M ~ N(0, coef_scale^2)`` elementwise, ``w_l ~ N(M g_l, weight_scale^2 I)``, groups uniform,
    ``x_i ~ N(0, I_D)`` and ``y_i ~ Bernoulli(sigmoid(w_{l_i}^T x_i))``. Groups differ enough that a
    single pooled logistic regression is clearly worse than the hierarchical model (the contrast of
    the paper's Figure 4). Draw ``2 N`` records and split them for a test set from the same groups.

    >>> import jax
    >>> from d3pext.models import simulate_hierarchical_logistic
    >>> data = simulate_hierarchical_logistic(jax.random.key(0), 100)
    >>> data.x.shape, data.group.shape, data.group_features.shape, data.M.shape, data.weights.shape
    ((100, 5), (100,), (3, 3), (5, 3), (3, 5))
    """
    for name, value in (("num_records", num_records), ("num_features", num_features),
                        ("num_groups", num_groups), ("num_group_features", num_group_features)):  # fmt: skip
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    check_positive_if_number("coef_scale", coef_scale)
    check_positive_if_number("weight_scale", weight_scale)
    return HierarchicalLogisticData(
        *_simulate_hierarchical(
            rng_key, num_records, num_features, num_groups, num_group_features, float(coef_scale), float(weight_scale)
        )
    )


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _simulate_hierarchical(
    rng_key, num_records, num_features, num_groups, num_group_features, coef_scale, weight_scale
):
    kg, km, kw, kl, kx, ky = random.split(rng_key, 6)
    g = random.normal(kg, (num_groups, num_group_features))
    m = coef_scale * random.normal(km, (num_features, num_group_features))
    w = g @ m.T + weight_scale * random.normal(kw, (num_groups, num_features))
    group = random.randint(kl, (num_records,), 0, num_groups)
    x = random.normal(kx, (num_records, num_features))
    y = random.bernoulli(ky, jax.nn.sigmoid(jnp.sum(x * w[group], axis=-1))).astype(jnp.float32)
    return x, group, y, g, m, w
