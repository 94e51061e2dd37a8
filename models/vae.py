"""Variational auto-encoder for binary images (seed 003, section 5.1; Kingma & Welling).

    z_i ~ N(0, I_latent),   x_i | z_i ~ Bernoulli(logits = decoder(z_i)),
    q(z_i | x_i) = N(encoder_loc(x_i), diag(encoder_scale(x_i)^2)).

Encoder and decoder are feed-forward networks with one hidden layer (softplus), written with
:mod:`jax.example_libraries.stax` and registered by :func:`numpyro.module`. With 784 pixels, the
defaults ``hidden_dim=400`` and ``latent_dim=50`` give 688 884 trainable parameters, the count the
paper reports for MNIST. The local latent ``z`` lives inside the data plate and the guide is
amortized, so each record's gradient (decoder and encoder) is clipped as one unit under DP-VI.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
from jax import random
from jax.example_libraries import stax

import numpyro
import numpyro.distributions as dist
from d3pext.validation import check_batch_size, check_records


__all__ = ["vae_model", "vae_guide", "vae_encoder", "vae_decoder", "simulate_binary_images"]


def _check_dims(hidden_dim: int, latent_dim: int) -> None:
    for name, value in (("hidden_dim", hidden_dim), ("latent_dim", latent_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def vae_encoder(hidden_dim: int, latent_dim: int) -> tuple:
    """stax network ``x -> (loc, scale)`` of ``q(z | x)``: one softplus hidden layer, scale by ``exp``.

    >>> import jax, jax.numpy as jnp
    >>> from d3pext.models import vae_encoder
    >>> init, apply = vae_encoder(8, 2)
    >>> _, params = init(jax.random.key(0), (1, 6))
    >>> [a.shape for a in apply(params, jnp.ones((3, 6)))]
    [(3, 2), (3, 2)]
    """
    return stax.serial(
        stax.Dense(hidden_dim),
        stax.Softplus,
        stax.FanOut(2),
        stax.parallel(stax.Dense(latent_dim), stax.serial(stax.Dense(latent_dim), stax.Exp)),
    )


def vae_decoder(hidden_dim: int, out_dim: int) -> tuple:
    """stax network ``z -> logits`` of ``p(x | z)``: one softplus hidden layer, linear output.

    >>> import jax, jax.numpy as jnp
    >>> from d3pext.models import vae_decoder
    >>> init, apply = vae_decoder(8, 6)
    >>> _, params = init(jax.random.key(0), (1, 2))
    >>> apply(params, jnp.ones((3, 2))).shape
    (3, 6)
    """
    return stax.serial(stax.Dense(hidden_dim), stax.Softplus, stax.Dense(out_dim))


def vae_model(
    x: jax.Array, *, batch_size: Optional[int] = None, hidden_dim: int = 400, latent_dim: int = 50
) -> None:
    """VAE generative model ``p(x, z)`` with a Bernoulli likelihood over the pixels of each record.

    Args:
        x: binary records (e.g. 784 pixels in {0, 1}), shape ``(N, P)``.
        batch_size: records per step (``None``: all).
        hidden_dim: width of the decoder's hidden layer.
        latent_dim: dimension of ``z``.

    Sites: module ``"decoder"``; ``z`` and ``x`` in the data plate ``"data"``. Fit with
    :func:`vae_guide` (same keyword arguments).

    >>> import jax, numpyro
    >>> from numpyro.infer import SVI, Trace_ELBO
    >>> from d3pext.models import vae_model, vae_guide, simulate_binary_images
    >>> x = simulate_binary_images(jax.random.key(0), 200, dim=16)
    >>> svi = SVI(vae_model, vae_guide, numpyro.optim.Adam(1e-2), Trace_ELBO())
    >>> result = svi.run(jax.random.key(1), 100, x, batch_size=50, hidden_dim=8, latent_dim=2,
    ...                  progress_bar=False)
    >>> bool(result.losses[-10:].mean() < result.losses[:10].mean())
    True
    """
    n, num_pixels = check_records("x", x, 2)
    check_batch_size(batch_size, n)
    _check_dims(hidden_dim, latent_dim)
    decode = numpyro.module("decoder", vae_decoder(hidden_dim, num_pixels), (1, latent_dim))
    with numpyro.plate("data", n, subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([latent_dim]).to_event(1))
        numpyro.sample("x", dist.Bernoulli(logits=decode(z)).to_event(1), obs=xb)


def vae_guide(
    x: jax.Array, *, batch_size: Optional[int] = None, hidden_dim: int = 400, latent_dim: int = 50
) -> None:
    """Amortized guide ``q(z | x)`` of :func:`vae_model` (module ``"encoder"``), in the same data plate.

    >>> import jax.numpy as jnp
    >>> from numpyro.handlers import seed, trace
    >>> from d3pext.models import vae_guide
    >>> trace(seed(vae_guide, 0)).get_trace(jnp.ones((4, 6)), hidden_dim=8, latent_dim=2)["z"]["value"].shape
    (4, 2)
    """
    n, num_pixels = check_records("x", x, 2)
    _check_dims(hidden_dim, latent_dim)
    encode = numpyro.module("encoder", vae_encoder(hidden_dim, latent_dim), (1, num_pixels))
    with numpyro.plate("data", n, subsample_size=batch_size):
        xb = numpyro.subsample(x, event_dim=1)
        loc, scale = encode(xb)
        numpyro.sample("z", dist.Normal(loc, scale).to_event(1))


def simulate_binary_images(
    rng_key: jax.Array, num_records: int, *, dim: int = 784, num_prototypes: int = 10, flip: float = 0.05
) -> jax.Array:
    """Binary "images" with cluster structure, a stand-in for MNIST in tests (no download needed).

    Each record copies one of ``num_prototypes`` random binary prototypes (pixels on with
    probability 0.3) and flips each pixel with probability ``flip``. Returns float32 of shape
    ``(num_records, dim)``.

    >>> import jax
    >>> from d3pext.models import simulate_binary_images
    >>> simulate_binary_images(jax.random.key(0), 5).shape
    (5, 784)
    """
    if num_records < 1 or dim < 1 or num_prototypes < 1:
        raise ValueError(
            f"num_records, dim and num_prototypes must be >= 1, got {num_records}, {dim}, {num_prototypes}"
        )
    if not 0.0 <= flip <= 0.5:
        raise ValueError(f"flip must be in [0, 0.5], got {flip}")
    return _simulate_binary_images(rng_key, num_records, dim, num_prototypes, float(flip))


@partial(jax.jit, static_argnums=(1, 2, 3))
def _simulate_binary_images(rng_key, num_records, dim, num_prototypes, flip):
    k_proto, k_pick, k_flip = random.split(rng_key, 3)
    prototypes = random.bernoulli(k_proto, 0.3, (num_prototypes, dim))
    picked = prototypes[random.randint(k_pick, (num_records,), 0, num_prototypes)]
    flips = random.bernoulli(k_flip, flip, (num_records, dim))
    return jnp.logical_xor(picked, flips).astype(jnp.float32)
