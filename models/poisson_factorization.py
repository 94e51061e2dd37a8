"""Poisson factorization models of Schein et al. (seed 002) with their non-private Gibbs updates.

- :func:`topic_model`: the LDA-like topic model, ``y_dv ~ Pois(sum_k theta_dk phi_kv)``;
- :func:`community_model`: the mixed-membership stochastic block model (MMSB),
  ``y_ij ~ Pois(sum_cd theta_ic theta_jd pi_cd)`` for ``i != j`` (no self-loops),

with independent ``Gamma(a0, b0)`` priors (shape, rate; the paper's ``a0 = 0.1, b0 = 1``). Each
model declares its non-private Gibbs updates on its count site
(``infer={"count_updates": ...}``, :class:`~d3pext.inference.counts.CountUpdates`), so that
``private_posterior`` runs them inside :class:`~d3pext.inference.counts.CountGibbs` after each draw of
the confidential counts (method ``"gibbs"``) or on the truncated release (``"naive"``). The
updates allocate each count to the latent components (multinomial, Zhou & Carin 2012) and draw the
factors from their gamma conditionals; the MMSB actor factors are drawn one actor after the
other (``lax.fori_loop``): the conditional of actor ``i`` depends on all the other actors, so a
``vmap`` over actors would not be a Gibbs step.

``private_topic_model`` and ``private_community_model`` attach the geometric mechanism to each
count (:func:`~d3pext.inference.counts.privatize_counts`; one ``alpha`` per document for heterogeneous
noise). ``simulate_topic_corpus`` and ``simulate_network`` generate the synthetic data of the
paper's sections 5.1 and 5.2.

>>> import jax
>>> from jax import random
>>> from d3pext.handlers import make_release, private_posterior
>>> data = simulate_topic_corpus(random.key(0), num_docs=12)
>>> model = private_topic_model(epsilon=1.0, N=1)
>>> release = make_release(model, 12, 15, 3, data.counts, rng_key=1)
>>> mcmc = private_posterior(model, release, num_warmup=20, num_samples=20, progress_bar=False)
>>> mcmc.run(random.key(2), 12, 15, 3)
>>> mcmc.get_samples()["phi"].shape
(20, 3, 15)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.typing import ArrayLike

import numpyro
import numpyro.distributions as dist

from d3pext.inference.counts import FactorizationUpdates
from d3pext.releases.counts import HeterogeneousGeometricMechanism, check_counts, limited_precision_mechanism
from d3pext.handlers.privatize import privatize_counts

__all__ = [
    "CommunityModelUpdates",
    "NetworkData",
    "TopicCorpus",
    "TopicModelUpdates",
    "community_model",
    "community_rates",
    "private_community_model",
    "private_topic_model",
    "simulate_network",
    "simulate_topic_corpus",
    "topic_model",
    "topic_rates",
]

Array = jax.Array


def _floor(x: Array) -> Array:
    # gamma draws with shape 0.1 underflow to 0 in float32; a zero factor would make a rate 0
    # with a positive count (impossible under the model), so keep them at the smallest normal
    return jnp.maximum(x, jnp.finfo(x.dtype).tiny)


def _check_shape(counts, shape: tuple[int, ...], what: str) -> None:
    if counts is not None and tuple(jnp.shape(counts)) != shape:
        raise ValueError(f"{what} must have shape {shape}, got {tuple(jnp.shape(counts))}.")


def _check_hyper(a0: float, b0: float) -> None:
    if not (a0 > 0 and b0 > 0):
        raise ValueError(f"the gamma prior needs a0 > 0 and b0 > 0, got a0={a0}, b0={b0}.")


# ---------------------------------------------------------------------------------------------
# Topic model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopicModelUpdates(FactorizationUpdates):
    """Non-private Gibbs sweep of the topic model given the counts ``y`` (D x V):
    ``(y_dv1..y_dvK) ~ Mult(y_dv, theta_dk phi_kv / mu_dv)``, then
    ``theta_dk ~ Gamma(a0 + sum_v y_dvk, b0 + sum_v phi_kv)`` and
    ``phi_kv ~ Gamma(a0 + sum_d y_dvk, b0 + sum_d theta_dk)`` (rows are conditionally
    independent given the other factor, so each factor is one vectorised draw)."""

    a0: float = 0.1
    b0: float = 1.0
    sites: tuple[str, ...] = ("theta", "phi")

    def component_rates(self, values):
        theta, phi = (values[name] for name in self.sites)
        return theta[:, None, :] * phi.T[None, :, :]  # (D, V, K)

    def gamma_shapes(self, values, allocation):
        # the shapes of both conditionals are known after the allocation: the standard variates are
        # drawn at once, and the rates then scale them (theta first, phi given the new theta)
        return self.a0 + jnp.concatenate([allocation.sum(1), allocation.sum(0)], axis=0)  # (D + V, K)

    def from_gammas(self, values, allocation, gammas):
        name_theta, name_phi = self.sites
        phi = values[name_phi]
        num_docs = allocation.shape[0]
        theta = _floor(gammas[:num_docs] / (self.b0 + phi.sum(1)))
        phi = _floor(gammas[num_docs:].T / (self.b0 + theta.sum(0))[:, None])
        return {name_theta: theta, name_phi: phi}


def topic_rates(theta: ArrayLike, phi: ArrayLike) -> Array:
    """``mu_dv = sum_k theta_dk phi_kv`` (batched over leading sample axes)."""
    return jnp.einsum("...dk,...kv->...dv", theta, phi)


def topic_model(
    num_docs: int,
    num_words: int,
    num_topics: int,
    counts: ArrayLike | None = None,
    a0: float = 0.1,
    b0: float = 1.0,
) -> None:
    """LDA-like Poisson factorization: ``theta_dk, phi_kv ~ Gamma(a0, b0)``,
    ``counts_dv ~ Pois(sum_k theta_dk phi_kv)`` (sites ``theta`` (D, K), ``phi`` (K, V),
    ``counts`` (D, V))."""
    _check_hyper(a0, b0)
    _check_shape(counts, (num_docs, num_words), "counts")
    if counts is not None and not isinstance(counts, jax.core.Tracer):
        counts = check_counts(counts, "counts")
    with numpyro.plate("topics", num_topics):
        phi = numpyro.sample("phi", dist.Gamma(a0, b0).expand([num_words]).to_event(1))
    with numpyro.plate("docs_theta", num_docs):
        theta = numpyro.sample("theta", dist.Gamma(a0, b0).expand([num_topics]).to_event(1))
    with numpyro.plate("docs", num_docs, dim=-2), numpyro.plate("words", num_words, dim=-1):
        numpyro.sample(
            "counts",
            dist.Poisson(topic_rates(theta, phi)),
            obs=counts,
            infer={"count_updates": TopicModelUpdates(a0, b0)},
        )


def _geometric(epsilon, N, alpha, per: str):
    if alpha is None:
        if epsilon is None:
            raise ValueError("give epsilon (with N) or alpha.")
        return limited_precision_mechanism(epsilon, N)
    if epsilon is not None:
        raise ValueError("give either epsilon or alpha, not both.")
    alpha = np.asarray(alpha, np.float64)
    if alpha.ndim == 0:
        return HeterogeneousGeometricMechanism.from_alpha(alpha, sensitivity=N)
    if alpha.ndim != 1:
        raise ValueError(f"alpha must be a scalar or one value per {per}, got shape {alpha.shape}.")
    return HeterogeneousGeometricMechanism.from_alpha(alpha[:, None], sensitivity=N)


def private_topic_model(
    epsilon: float | None = None, N: int = 1, alpha: ArrayLike | None = None
):
    """:func:`topic_model` with each count released through the geometric mechanism: give
    ``epsilon`` and ``N`` (each document is ``(N, epsilon)``-private, ``alpha = exp(-epsilon/N)``)
    or ``alpha``, a scalar or one decay per document (heterogeneous noise, section 5.1).
    The release site is ``"counts_dp"``."""
    return privatize_counts(topic_model, site="counts", mechanism=_geometric(epsilon, N, alpha, "document"))


class TopicCorpus(NamedTuple):
    counts: np.ndarray  # (D, V) confidential counts
    theta: np.ndarray  # (D, K)
    phi: np.ndarray  # (K, V)
    rates: np.ndarray  # (D, V) true Poisson rates


def simulate_topic_corpus(
    rng_key: Array,
    num_docs: int = 90,
    num_topics: int = 3,
    num_words: int = 15,
    doc_length: float = 30.0,
    concentration: float = 0.9,
) -> TopicCorpus:
    """Synthetic corpus of seed 002, section 5.1: well separated topics, each putting
    ``concentration`` of its mass on its own block of ``num_words / num_topics`` word types, and
    documents in ``num_topics`` equal groups, each putting ``concentration`` of its topic mass
    on its group's topic; ``doc_length`` expected tokens per document.

    >>> data = simulate_topic_corpus(random.key(0))
    >>> data.counts.shape, data.phi.shape
    ((90, 15), (3, 15))
    """
    if num_words % num_topics or num_docs % num_topics:
        raise ValueError("num_words and num_docs must be multiples of num_topics.")
    block = num_words // num_topics
    k1, k2, k3 = random.split(rng_key, 3)
    own = np.kron(np.eye(num_topics), np.ones((1, block)))  # (K, V)
    phi = own * concentration / block + (1 - own) * (1 - concentration) / (num_words - block)
    phi = phi * np.asarray(random.uniform(k1, phi.shape, minval=0.7, maxval=1.3))
    phi = phi / phi.sum(1, keepdims=True)
    group = np.repeat(np.arange(num_topics), num_docs // num_topics)
    weights = np.where(np.eye(num_topics)[group] > 0, concentration, (1 - concentration) / (num_topics - 1))
    lengths = doc_length * np.asarray(random.gamma(k2, 20.0, (num_docs,))) / 20.0
    theta = weights * lengths[:, None]
    rates = theta @ phi
    counts = np.asarray(random.poisson(k3, rates)).astype(np.int64)
    return TopicCorpus(counts, theta, phi, rates)


# ---------------------------------------------------------------------------------------------
# Mixed-membership stochastic block model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommunityModelUpdates(FactorizationUpdates):
    """Non-private Gibbs sweep of the MMSB given the counts ``y`` (V x V, diagonal ignored):
    allocation ``(y_ijcd)_cd ~ Mult(y_ij, theta_ic theta_jd pi_cd / mu_ij)``, then actor by
    actor (sequentially: each conditional involves the other actors' current factors)
    ``theta_ic ~ Gamma(a0 + sum_jd y_ijcd + sum_jd y_jidc,
    b0 + sum_{j != i} sum_d theta_jd (pi_cd + pi_dc))``, then
    ``pi_cd ~ Gamma(a0 + sum_ij y_ijcd, b0 + sum_{i != j} theta_ic theta_jd)``.

    The gamma variates with the (known) shapes are drawn in one call before the actor loop,
    which then only rescales them by the rates."""

    a0: float = 0.1
    b0: float = 1.0
    sites: tuple[str, ...] = ("theta", "pi")

    def component_rates(self, values):
        theta, pi = (values[name] for name in self.sites)
        num_actors, num_comm = theta.shape
        offdiag = 1.0 - jnp.eye(num_actors, dtype=theta.dtype)  # no self-loops: the diagonal is left out
        rates = theta[:, None, :, None] * theta[None, :, None, :] * pi * offdiag[:, :, None, None]
        return rates.reshape(num_actors, num_actors, num_comm * num_comm)

    def gamma_shapes(self, values, allocation):
        num_actors = allocation.shape[0]
        alloc = allocation.reshape(num_actors, num_actors, *values[self.sites[1]].shape)
        # counts of actor i in community c: as sender (i, j, c, .) and as receiver (j, i, ., c)
        shape_theta = self.a0 + alloc.sum((1, 3)) + alloc.sum((0, 2))
        shape_pi = self.a0 + alloc.sum((0, 1))
        return jnp.concatenate([shape_theta, shape_pi], axis=0)  # (V + C, C)

    def from_gammas(self, values, allocation, gammas):
        name_theta, name_pi = self.sites
        theta, pi = values[name_theta], values[name_pi]
        num_actors = theta.shape[0]
        gammas, gammas_pi = gammas[:num_actors], gammas[num_actors:]
        sym = pi + pi.T

        def actor(i, carry):
            theta, total = carry
            others = total - theta[i]
            new = _floor(gammas[i] / (self.b0 + sym @ others))
            return theta.at[i].set(new), others + new

        theta, total = lax.fori_loop(0, num_actors, actor, (theta, theta.sum(0)))
        rate_pi = self.b0 + jnp.maximum(jnp.outer(total, total) - theta.T @ theta, 0.0)
        pi = _floor(gammas_pi / rate_pi)
        return {name_theta: theta, name_pi: pi}


def community_rates(theta: ArrayLike, pi: ArrayLike) -> Array:
    """``mu_ij = sum_cd theta_ic theta_jd pi_cd`` for ``i != j``, 0 on the diagonal (batched)."""
    mu = jnp.einsum("...ic,...jd,...cd->...ij", theta, theta, pi)
    return mu * (1 - jnp.eye(mu.shape[-1], dtype=mu.dtype))


def community_model(
    num_actors: int,
    num_communities: int,
    counts: ArrayLike | None = None,
    a0: float = 0.1,
    b0: float = 1.0,
) -> None:
    """MMSB Poisson factorization: ``theta_ic, pi_cd ~ Gamma(a0, b0)``,
    ``counts_ij ~ Pois(sum_cd theta_ic theta_jd pi_cd)`` for ``i != j``; the diagonal (no
    self-loops) has rate 0, so its counts must be 0 (and their releases are pure noise)."""
    _check_hyper(a0, b0)
    _check_shape(counts, (num_actors, num_actors), "counts")
    if counts is not None and not isinstance(counts, jax.core.Tracer):
        counts = check_counts(counts, "counts")
        if np.any(np.diag(counts) != 0):
            raise ValueError("the MMSB has no self-loops: the diagonal of counts must be 0.")
    with numpyro.plate("actors", num_actors):
        theta = numpyro.sample("theta", dist.Gamma(a0, b0).expand([num_communities]).to_event(1))
    pi = numpyro.sample(
        "pi", dist.Gamma(a0, b0).expand([num_communities, num_communities]).to_event(2)
    )
    with numpyro.plate("senders", num_actors, dim=-2), numpyro.plate("receivers", num_actors, dim=-1):
        numpyro.sample(
            "counts",
            dist.Poisson(community_rates(theta, pi)),
            obs=counts,
            infer={"count_updates": CommunityModelUpdates(a0, b0)},
        )


def private_community_model(
    epsilon: float | None = None, N: int = 1, alpha: ArrayLike | None = None
):
    """:func:`community_model` with each count ``y_ij`` released through the geometric mechanism
    (``epsilon`` and ``N``, or ``alpha``: a scalar or one decay per sender). Release site
    ``"counts_dp"``."""
    return privatize_counts(community_model, site="counts", mechanism=_geometric(epsilon, N, alpha, "actor"))


class NetworkData(NamedTuple):
    counts: np.ndarray  # (V, V) confidential counts, zero diagonal
    theta: np.ndarray  # (V, C)
    pi: np.ndarray  # (C, C)
    rates: np.ndarray  # (V, V)


def simulate_network(
    rng_key: Array,
    num_actors: int = 20,
    num_communities: int = 5,
    a0: float = 0.01,
    b0: float = 0.5,
) -> NetworkData:
    """Synthetic network of seed 002, section 5.2: ``theta*, pi* ~ Gamma(a0, b0)`` with the
    sparse ``a0 = 0.01, b0 = 0.5`` that exaggerates the block structure, then
    ``y_ij ~ Pois(mu*_ij)``, ``i != j``.

    >>> simulate_network(random.key(0)).counts.shape
    (20, 20)
    """
    k1, k2, k3 = random.split(rng_key, 3)
    with jax.enable_x64(True):  # shape 0.01 gammas underflow in float32
        theta = np.asarray(random.gamma(k1, a0, (num_actors, num_communities), jnp.float64)) / b0
        pi = np.asarray(random.gamma(k2, a0, (num_communities, num_communities), jnp.float64)) / b0
    rates = np.asarray(community_rates(theta, pi))
    counts = np.asarray(random.poisson(k3, jnp.asarray(rates, jnp.float32))).astype(np.int64)
    return NetworkData(counts, theta, pi, rates)
