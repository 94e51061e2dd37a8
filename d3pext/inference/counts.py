"""Locally private count data: the geometric mechanism on each count and the Schein et al.
augmentation that recovers the counts inside MCMC (seed 002).

Each confidential count ``y ~ Pois(mu)`` is released as ``y~ = y + tau``, ``tau ~ 2Geo(alpha)``
(:func:`privatize_counts`; Theorem 1: for observations within L1 distance ``N`` the release is
``epsilon = N ln(1/alpha)`` private, :func:`limited_precision_mechanism`). With the noise written as
``Skel(lambda+, lambda-)``, ``lambda+- ~ Exp(mean alpha / (1 - alpha))`` (Theorem 2), one sweep of
the count update (:func:`sample_true_counts`) is, element-wise,

1. ``m ~ Bessel(|y~|, 2 sqrt((lambda+ + mu) lambda-))`` (eq. 13, Theorem 3): the minimum of
   ``y+ = y + g+`` and ``g-``, whose difference is ``y~``; then ``y+`` and ``g-`` (eq. 14);
2. ``y ~ Binom(y+, mu / (mu + lambda+))`` and ``g+ = y+ - y`` (eq. 15);
3. ``lambda* ~ Gamma(1 + g*, rate 1/alpha)`` (eq. 16; the prior rate ``(1 - alpha)/alpha`` plus 1).

The model's own (non-private) updates then run on the sampled counts. Where they are those of a
Poisson factorization (:class:`FactorizationUpdates`: the counts split among latent Poisson components,
then gamma conditionals), steps 2 and 3 merge with them: the binomial split of ``y+`` and the
allocation of ``y`` among the components ``mu = sum_k mu_k`` are one multinomial split of ``y+`` among
``(lambda+, mu_1, ..., mu_K)`` (:func:`split_counts`), and the gamma variates of ``lambda*`` and of the
factors are drawn in one call. :class:`CountGibbs` is the
kernel; it is built by the ``private_posterior`` backends registered here:

- ``"gibbs"`` / ``"schein-bessel"``: the augmentation above;
- ``"naive"`` / ``"truncated-counts"``: the release, negative counts truncated at zero, taken as
  the exact counts (the paper's naive baseline, i.e. the truncated geometric mechanism).

The other latent sites are updated by the model's declared non-private Gibbs updates, by a
conjugate gamma update where a ``Gamma`` site is the Poisson rate of the counts (given the counts
``y_1..y_n`` its full conditional is ``Gamma(a + sum y, b + n)``; detected by
:func:`poisson_gamma_sites`), or else by NUTS (as a block of :class:`numpyro.infer.Gibbs`). A model declares its
updates on the count site: ``numpyro.sample("y", dist.Poisson(mu), infer={"count_updates":
updates})`` with ``updates`` a :class:`CountUpdates` (see :mod:`d3pext.models.poisson_factorization`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.typing import ArrayLike

import numpyro
import numpyro.distributions as dist
from numpyro.distributions.distribution import ExpandedDistribution, Independent, MaskedDistribution
from numpyro.handlers import seed, substitute, trace
from numpyro.infer import NUTS, Gibbs
from numpyro.infer.gibbs import conditioned
from numpyro.infer.mcmc import MCMCKernel
from numpyro.primitives import Messenger

from d3pext.distributions import sample_bessel
from d3pext.inference.gibbs_base import DEFAULT_MAX_STALLS, ConstrainedGibbsKernel, raise_if_stuck
from d3pext.inference.registry import NotApplicable, PrivateModel
from d3pext.inference.structure import init_to_uniform_but_confidential
from d3pext.releases.counts import check_counts
from d3pext.releases.info import ReleaseInfo

__all__ = [
    "CountBlock",
    "CountGibbs",
    "CountGibbsState",
    "CountUpdates",
    "FactorizationUpdates",
    "augment_counts",
    "count_kernel",
    "noise_rate_site",
    "poisson_gamma_sites",
    "sample_true_counts",
    "split_counts",
]

Array = jax.Array


# ---------------------------------------------------------------------------------------------
# The augmentation (eqs. 13-16)
# ---------------------------------------------------------------------------------------------


def _float() -> Any:
    return jnp.result_type(float)


def _binomial_split(key: Array, n: Array, rate: Array, other: Array) -> Array:
    """``k ~ Binomial(n, rate / (rate + other))``: the share of ``n`` Poisson events from ``rate``.

    The binomial is drawn for the smaller share, with its probability computed directly (at
    counts of 1e6 and noise rates near 1, ``1 - p`` is about 1e-6, which ``p`` in float32 keeps
    to a few per cent only), so its probability is in ``(0, 1/2]``: never 0, and never 1 or within
    rounding of it, where JAX's inversion algorithm divides by ``log1p(-p) = 0`` (on an H100 the
    old form's draws came back NaN there, and the counts kept 0 for the rest of the chain).
    """
    rate_smaller = rate <= other
    p = jnp.where(rate_smaller, rate, other) / (rate + other)  # <= 1/2
    degenerate = ~(p > 0)  # a share of 0 (or NaN): no events from the smaller rate
    k = random.binomial(key, n, jnp.where(degenerate, 0.5, p), jnp.shape(n), n.dtype)
    k = jnp.where(degenerate, 0.0, k)
    return jnp.where(rate_smaller, k, n - k)


def split_counts(rng_key: Array, counts: ArrayLike, rates: ArrayLike) -> Array:
    """``(n_1, ..., n_K) ~ Mult(counts, rates / sum(rates))`` over the last axis of ``rates``: how
    ``counts`` Poisson events divide among independent Poisson components with these ``rates``.

    One binomial per component, for its share of the events left to it and the components after it,
    each drawn by :func:`_binomial_split` (for the smaller share, at a probability in ``(0, 1/2]``
    computed directly): unlike ``jax.random.multinomial``, which draws the last component's share
    at probability 1, no draw is made where JAX's binomial divides by ``log1p(-p) = 0``. Counts
    whose rates are all 0 are dropped (every share 0). Returns floats of the rates' dtype.

    >>> import jax, jax.numpy as jnp
    >>> shares = split_counts(jax.random.key(0), jnp.array([5, 3]), jnp.array([[1.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))
    >>> shares.sum(-1), shares[0, 1], shares.shape
    (Array([5., 0.], dtype=float32), Array(0., dtype=float32), (2, 3))
    """
    rates = jnp.asarray(rates)
    rates = rates.astype(jnp.promote_types(rates.dtype, _float()))
    counts = jnp.broadcast_to(jnp.asarray(counts).astype(rates.dtype), rates.shape[:-1])
    rates = jnp.moveaxis(rates, -1, 0)
    from_here = jnp.flip(jnp.cumsum(jnp.flip(rates, 0), 0), 0)  # sum over the components j >= k
    after = jnp.concatenate([from_here[1:], jnp.zeros_like(from_here[:1])])  # j > k

    def share(left, inputs):
        key, rate, other = inputs
        taken = _binomial_split(key, left, rate, other)
        return left - taken, taken

    keys = random.split(rng_key, rates.shape[0])
    _, shares = lax.scan(share, jnp.where(from_here[0] > 0, counts, 0.0), (keys, rates, after))
    return jnp.moveaxis(shares, 0, -1)


def _bessel_step(rng_key: Array, release: Array, rate: Array, noise_rates: Array) -> tuple[Array, Array, Array]:
    """Eqs. 13-14: ``(y+, g-, ok)`` given the release ``y~ = y+ - g-`` (floats), the counts' rates and
    ``(lambda+, lambda-)``; ``ok`` is ``False`` where the Bessel sampler ran out of proposals."""
    tiny = jnp.finfo(release.dtype).tiny
    # y~ ~ Skel(lambda+ + mu, lambda-), m = min(y+, g-) ~ Bessel(|y~|, 2 sqrt(...))
    a = jnp.maximum(2 * jnp.sqrt((noise_rates[..., 0] + rate) * noise_rates[..., 1]), tiny)
    m, ok = sample_bessel(rng_key, jnp.abs(release), a, jnp.shape(release))
    m = m.astype(release.dtype)
    # the larger of the two counts is the minimum plus |y~|
    return jnp.where(release <= 0, m, m + release), jnp.where(release <= 0, m - release, m), ok


def _float_inputs(release: ArrayLike, rate: ArrayLike, log_alpha: ArrayLike) -> tuple[Array, Array, Array]:
    """The release, the counts' rates and ``alpha`` as floats of the release's shape."""
    dtype = _float()
    y_t = jnp.asarray(release).astype(dtype)
    shape = jnp.shape(y_t)
    mu = jnp.broadcast_to(jnp.asarray(rate, dtype), shape)
    return y_t, mu, jnp.broadcast_to(jnp.exp(jnp.asarray(log_alpha, dtype)), shape)


def _noise_rates(gammas: Array, alpha: Array) -> Array:
    """Eq. 16: ``lambda* = alpha Gamma(1 + g*, 1)`` from the standard variates, kept above 0."""
    return jnp.maximum(gammas * alpha[..., None], jnp.finfo(gammas.dtype).tiny)


def _count_dtype() -> Any:
    return jnp.int64 if jax.config.jax_enable_x64 else jnp.int32


def sample_true_counts(
    rng_key: Array, release: ArrayLike, rate: ArrayLike, noise_rates: ArrayLike, log_alpha: ArrayLike
) -> tuple[Array, Array, Array]:
    """One draw of the confidential counts and the noise rates given the privatized counts
    (seed 002, eqs. 13-16), element-wise.

    :param release: privatized counts ``y~`` (integers, possibly negative).
    :param rate: Poisson rates ``mu >= 0`` of the counts.
    :param noise_rates: current ``(lambda+, lambda-)``, shape ``release.shape + (2,)``.
    :param log_alpha: ``log(alpha)``, broadcastable to ``release``.
    :return: ``(counts, noise_rates, ok)``; ``ok`` is ``False`` where the Bessel sampler ran out
        of proposals (then the counts are ``-1``; the kernel keeps its previous state there).

    >>> import jax, jax.numpy as jnp
    >>> y, lam, ok = sample_true_counts(jax.random.PRNGKey(0), jnp.array([-2, 0, 5]),
    ...                                 jnp.array([1.0, 3.0, 4.0]), jnp.ones((3, 2)), jnp.log(0.5))
    >>> y.shape, lam.shape, bool(ok.all())
    ((3,), (3, 2), True)
    """
    dtype = _float()
    y_t, mu, alpha = _float_inputs(release, rate, log_alpha)
    lam = jnp.asarray(noise_rates, dtype)
    key_m, key_y, key_l = random.split(rng_key, 3)
    y_plus, g_minus, ok = _bessel_step(key_m, y_t, mu, lam)  # eqs. 13-14
    # eq. 15: y+ = y + g+ is a sum of Poissons with rates mu and lambda+
    y = _binomial_split(key_y, jnp.maximum(y_plus, 0.0), mu, lam[..., 0])
    g_plus = y_plus - y
    # eq. 16: Gamma(1 + g, rate (1 - alpha)/alpha + 1 = 1/alpha)
    g = jnp.stack([g_plus, g_minus], axis=-1)
    new_lam = _noise_rates(random.gamma(key_l, 1.0 + jnp.maximum(g, 0.0), dtype=dtype), alpha)
    counts = jnp.where(ok, y, -1.0).astype(_count_dtype())
    return counts, new_lam, ok


# ---------------------------------------------------------------------------------------------
# Model updates, blocks and the kernel
# ---------------------------------------------------------------------------------------------


class CountUpdates(abc.ABC):
    """Non-private Gibbs updates of a count model, declared on its count site as
    ``infer={"count_updates": updates}``; :class:`CountGibbs` runs them after each draw of the
    counts. Implementations are hashable (frozen dataclasses) and pure JAX.
    """

    #: latent sites that the updates own (all latent sites of the model but the counts)
    sites: tuple[str, ...] = ()

    @abc.abstractmethod
    def __call__(self, rng_key: Array, values: Mapping[str, Array], counts: Array) -> dict[str, Array]:
        """One sweep: new values of :attr:`sites` given their current ``values`` and the counts."""


class FactorizationUpdates(CountUpdates):
    """:class:`CountUpdates` of a Poisson factorization, in three parts: the counts are split among
    latent Poisson components whose rates sum to the counts' rate (:meth:`component_rates`,
    :func:`split_counts`), standard gamma variates are drawn with shapes that follow from the split
    (:meth:`gamma_shapes`), and the factors from those (:meth:`from_gammas`).

    Given the parts, :class:`CountGibbs` draws the confidential counts and the factors together:
    Schein et al.'s split of ``y+`` into the counts ``y`` and the noise ``g+`` (eq. 15) followed by
    the allocation of ``y`` among the components is one split of ``y+`` among ``(lambda+, mu_1, ...,
    mu_K)``, and the noise rates' gamma variates (eq. 16) are drawn in the factors' call. The sweep
    then compiles one binomial and one gamma sampler instead of two of each.
    """

    @abc.abstractmethod
    def component_rates(self, values: Mapping[str, Array]) -> Array:
        """Rates ``counts.shape + (K,)`` of the components; their sum over the last axis is the
        counts' Poisson rate. Counts whose component rates are all 0 are left out of the split."""

    @abc.abstractmethod
    def gamma_shapes(self, values: Mapping[str, Array], allocation: Array) -> Array:
        """Shapes of the standard gamma variates that :meth:`from_gammas` needs, given the split
        ``allocation`` (``counts.shape + (K,)``, floats)."""

    @abc.abstractmethod
    def from_gammas(self, values: Mapping[str, Array], allocation: Array, gammas: Array) -> dict[str, Array]:
        """New values of :attr:`sites` from the split and ``Gamma(shape, 1)`` variates with the shapes
        of :meth:`gamma_shapes`."""

    def __call__(self, rng_key, values, counts):
        key_split, key_gamma = random.split(rng_key)
        allocation = split_counts(key_split, counts, self.component_rates(values))
        gammas = random.gamma(key_gamma, self.gamma_shapes(values, allocation))
        return self.from_gammas(values, allocation, gammas)


def _factorization_sweep(
    rng_key: Array, updates: FactorizationUpdates, values: Mapping[str, Array], release: ArrayLike,
    rate: ArrayLike, noise_rates: Array, log_alpha: ArrayLike, counts: Array,
) -> tuple[Array, Array, Array, dict[str, Array]]:
    """:func:`sample_true_counts` and the factorization's update in one (see :class:`FactorizationUpdates`):
    ``(counts, noise_rates, ok, new values)``. Where the Bessel draw fails, the previous ``counts`` and
    noise rates are kept, and the counts split among the components alone."""
    dtype = _float()
    y_t, mu, alpha = _float_inputs(release, rate, log_alpha)
    key_m, key_split, key_gamma = random.split(rng_key, 3)
    y_plus, g_minus, ok = _bessel_step(key_m, y_t, mu, noise_rates)  # eqs. 13-14
    # eq. 15 and the allocation: (g+, y_1, ..., y_K) ~ Mult(y+, (lambda+, mu_1, ..., mu_K) / (lambda+ + mu))
    total = jnp.where(ok, jnp.maximum(y_plus, 0.0), counts.astype(dtype))
    rates = updates.component_rates(values).astype(dtype)
    noise = jnp.where(ok, noise_rates[..., 0], 0.0)
    split = split_counts(key_split, total, jnp.concatenate([noise[..., None], rates], axis=-1))
    g_plus, allocation = split[..., 0], split[..., 1:]
    # eq. 16 and the factors' conditionals: one call for all the standard gamma variates
    g = jnp.stack([g_plus, g_minus], axis=-1)
    shapes = updates.gamma_shapes(values, allocation)
    gammas = random.gamma(key_gamma, jnp.concatenate([(1.0 + jnp.maximum(g, 0.0)).ravel(), shapes.ravel()]))
    new_lam = jnp.where(ok[..., None], _noise_rates(gammas[: g.size].reshape(g.shape), alpha), noise_rates)
    new = updates.from_gammas(values, allocation, gammas[g.size :].reshape(shapes.shape))
    return (total - g_plus).astype(counts.dtype), new_lam, ok, new


@dataclass(frozen=True, eq=False)
class CountBlock:
    """One privatized count site for :class:`CountGibbs`.

    :param source: the confidential count site (latent in the analyst's model).
    :param release: the observed release site.
    :param noise_rates: latent site of ``(lambda+, lambda-)`` (``None`` in naive mode).
    :param log_alpha: ``log(alpha)`` of the mechanism, broadcastable to the counts.
    :param naive: take the release, truncated at zero, as the exact counts.
    :param updates: the model's :class:`CountUpdates`, or ``None`` (NUTS updates the rest).
    :param conjugate: ``Gamma`` sites whose value is the Poisson rate of these counts and that
        enter no other factor (:func:`poisson_gamma_sites`): drawn from their conjugate full
        conditional ``Gamma(a + sum counts, b + number of counts)`` after the counts.
    """

    source: str
    release: str
    noise_rates: str | None
    log_alpha: Any
    naive: bool = False
    updates: CountUpdates | None = None
    conjugate: tuple[str, ...] = ()

    @property
    def sites(self) -> tuple[str, ...]:
        own = (self.source,) if self.naive else (self.source, self.noise_rates)
        return own + (tuple(self.updates.sites) if self.updates is not None else ()) + self.conjugate


class CountGibbsState(NamedTuple):
    """
    - **z** - current values of the sites owned by the kernel.
    - **rng_key** - random key for the next sweep.
    - **num_failures** - counts kept at their previous value in the last sweep because the Bessel
      sampler ran out of proposals (probability below 1e-25 per count; should stay 0).
    - **stalls** - sweeps in a row with such a failure; the run fails at ``max_stalls``.
    """

    z: dict[str, Array]
    rng_key: Array
    num_failures: Array
    stalls: Array


def _poisson(fn: dist.Distribution) -> dist.Poisson:
    while isinstance(fn, (MaskedDistribution, ExpandedDistribution, Independent)):
        fn = fn.base_dist
    if not isinstance(fn, dist.Poisson):
        raise NotApplicable(f"the counts are {type(fn).__name__}, not Poisson.")
    return fn


class CountGibbs(ConstrainedGibbsKernel):
    """Gibbs kernel for Poisson counts released through the geometric mechanism (seed 002).

    One sweep: for each :class:`CountBlock`, the counts and the noise rates given the Poisson
    rates and the release (:func:`sample_true_counts`; naive blocks: the truncated release), then
    the block's :class:`CountUpdates` given the counts. Works on the augmented model of
    :class:`augment_counts`; standalone it must own every latent site, as a block of
    :class:`numpyro.infer.Gibbs` (next to NUTS) it reads the other sites from the conditioning.
    Built by ``private_posterior(..., method="gibbs" | "naive")``. A chain whose Bessel draws
    fail ``max_stalls`` sweeps in a row (non-finite rates) fails the run
    (``PrivatePosterior(..., max_stalls=...)`` sets it; default 20).

    **Example**

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import private_posterior
    >>> from d3pext.handlers.privatize import privatize_counts
    >>> from d3pext.releases.counts import limited_precision_mechanism
    >>> def model(n):
    ...     rate = numpyro.sample("rate", dist.Gamma(2.0, 0.2))
    ...     with numpyro.plate("cells", n):
    ...         numpyro.sample("y", dist.Poisson(rate))
    >>> private = privatize_counts(model, site="y", mechanism=limited_precision_mechanism(1.0))
    >>> mcmc = private_posterior(private, {"y_dp": jnp.array([9, 12, -1, 8, 15])},
    ...                          num_warmup=200, num_samples=300, progress_bar=False)
    >>> mcmc.run(random.key(0), 5)
    >>> sorted(mcmc.get_samples())
    ['rate', 'y', 'y_dp_noise_rates']
    >>> mcmc.sampler.inner.blocks[0].conjugate  # the gamma rate: conjugate update, no NUTS
    ('rate',)
    """

    def __init__(self, model: Callable, blocks: Sequence[CountBlock], max_stalls: int = DEFAULT_MAX_STALLS) -> None:
        if not blocks:
            raise ValueError("CountGibbs needs at least one CountBlock.")
        if int(max_stalls) < 1:
            raise ValueError(f"CountGibbs: max_stalls must be at least 1, got {max_stalls}.")
        self._model = model
        self._blocks = tuple(blocks)
        self._max_stalls = int(max_stalls)

    @property
    def blocks(self) -> tuple[CountBlock, ...]:
        return self._blocks

    @property
    def sites(self) -> tuple[str, ...]:
        """Latent sites updated by one sweep."""
        return tuple(name for blk in self._blocks for name in blk.sites)

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else dict(model_kwargs)
        rng_key, key_trace = random.split(rng_key)
        model = substitute(
            seed(conditioned(self._model), key_trace), substitute_fn=init_to_uniform_but_confidential
        )
        tr = trace(model).get_trace(*model_args, **model_kwargs)
        latent = [n for n, s in tr.items() if s["type"] == "sample" and not s["is_observed"]]
        unknown = [n for n in self.sites if n not in latent]
        if unknown:
            raise ValueError(f"Sites {unknown} are not latent sites of the augmented model.")
        if self._standalone:
            left = [n for n in latent if n not in self.sites]
            if left:
                raise ValueError(
                    f"CountGibbs cannot update the latent sites {left} (the model declares no "
                    "count_updates for them); use it as a block of numpyro.infer.Gibbs with NUTS."
                )
        z = {name: jnp.asarray(tr[name]["value"]) for name in self.sites}
        if init_params:  # only the model's parameters: the counts start from the release
            own = {n for blk in self._blocks for n in (blk.source, blk.noise_rates)}
            z.update({k: jnp.asarray(v) for k, v in init_params.items() if k in z and k not in own})
        for blk in self._blocks:
            y_t = jnp.asarray(tr[blk.release]["value"])
            z[blk.source] = jnp.maximum(y_t, 0).astype(z[blk.source].dtype)
            if not blk.naive:
                alpha = jnp.exp(jnp.asarray(blk.log_alpha, _float()))
                mean = jnp.broadcast_to(alpha / (1 - alpha), jnp.shape(y_t))
                z[blk.noise_rates] = jnp.stack([mean, mean], axis=-1)
        zero = jnp.zeros((), jnp.int32)
        return CountGibbsState(z, rng_key, zero, zero)

    def sample(self, state, model_args, model_kwargs):
        model_kwargs = {} if model_kwargs is None else model_kwargs
        rng_key, key_trace, key_sweep = random.split(state.rng_key, 3)
        z = dict(state.z)
        tr = trace(substitute(seed(conditioned(self._model), key_trace), data=z)).get_trace(
            *model_args, **model_kwargs
        )
        failures = jnp.zeros((), jnp.int32)
        keys = random.split(key_sweep, 2 * len(self._blocks))
        for i, blk in enumerate(self._blocks):
            y_t = jnp.asarray(tr[blk.release]["value"])
            new = None  # the model's updates, where drawn together with the counts
            if blk.naive:
                counts = jnp.maximum(y_t, 0).astype(z[blk.source].dtype)
            else:
                mu = jnp.broadcast_to(_poisson(tr[blk.source]["fn"]).rate, jnp.shape(y_t))
                if isinstance(blk.updates, FactorizationUpdates):
                    values = {name: z[name] for name in blk.updates.sites}
                    counts, z[blk.noise_rates], ok, new = _factorization_sweep(
                        keys[2 * i], blk.updates, values, y_t, mu, z[blk.noise_rates], blk.log_alpha,
                        z[blk.source],
                    )
                else:
                    counts, lam, ok = sample_true_counts(keys[2 * i], y_t, mu, z[blk.noise_rates], blk.log_alpha)
                    counts = jnp.where(ok, counts, z[blk.source]).astype(z[blk.source].dtype)
                    z[blk.noise_rates] = jnp.where(ok[..., None], lam, z[blk.noise_rates])
                failures = failures + jnp.sum(~ok).astype(jnp.int32)
            z[blk.source] = counts
            for j, name in enumerate(blk.conjugate):
                z[name] = _conjugate_gamma_draw(
                    random.fold_in(keys[2 * i + 1], 2**20 + j), tr[name]["fn"], counts, z[name]
                )
            if blk.updates is not None:
                if new is None:
                    new = blk.updates(keys[2 * i + 1], {name: z[name] for name in blk.updates.sites}, counts)
                z.update({name: new[name].astype(z[name].dtype) for name in blk.updates.sites})
        stalls = jnp.where(failures > 0, state.stalls + 1, 0)
        # a chain whose Bessel draws fail sweep after sweep is stuck (non-finite rates): fail loudly
        failures = failures + _fail_if_stuck(stalls, self._max_stalls).astype(jnp.int32)
        return CountGibbsState(z, rng_key, failures, stalls)

    def get_diagnostics_str(self, state) -> str:
        return f"{int(state.num_failures)} Bessel failures" if state.num_failures.ndim == 0 else ""


def _fail_if_stuck(stalls: Array, max_stalls: int) -> Array:
    failed = "had a Bessel draw run out of proposals"
    advice = (
        "That happens with probability below 1e-25 per count for finite rates, so the Poisson rates or "
        "the noise rates of the chain are likely NaN or infinite: check the model's rate for values "
        "that overflow, and report it if they are finite."
    )
    return raise_if_stuck(stalls[..., None], max_stalls, "CountGibbs", ("count update",), failed, advice)


def _gamma(fn: dist.Distribution) -> dist.Gamma | None:
    """The ``Gamma`` under expand/to_event wrappers (not under a mask), or ``None``."""
    while isinstance(fn, (ExpandedDistribution, Independent)):
        fn = fn.base_dist
    return fn if type(fn) is dist.Gamma else None


def _sum_to_shape(x: Array, shape: tuple[int, ...]) -> Array:
    """Sum ``x`` over the axes along which ``shape`` was broadcast to ``x.shape``."""
    lead = x.ndim - len(shape)
    x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, (d, e) in enumerate(zip(shape, x.shape)) if d == 1 and e != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _conjugate_gamma_draw(rng_key: Array, prior: dist.Distribution, counts: Array, value: Array) -> Array:
    """Draw of a Poisson rate from ``Gamma(a + sum counts, b + number of counts)`` (the sums over
    the counts that share one rate); ``prior`` is the traced ``Gamma`` site."""
    gamma = _gamma(prior)
    shape = jnp.shape(value)
    dtype = jnp.result_type(value)
    counts = jnp.asarray(counts, dtype)
    a = jnp.broadcast_to(gamma.concentration, shape) + _sum_to_shape(counts, shape)
    b = jnp.broadcast_to(gamma.rate, shape) + _sum_to_shape(jnp.ones_like(counts), shape)
    draw = random.gamma(rng_key, a, shape, dtype) / b
    return jnp.maximum(draw, jnp.finfo(dtype).tiny)


def poisson_gamma_sites(pm: PrivateModel, source: str, candidates: Sequence[str]) -> tuple[str, ...]:
    """The sites among ``candidates`` that :class:`CountGibbs` can update conjugately given the
    counts of ``source``: ``Gamma`` sites (unmasked, under expand/to_event at most) whose value
    *is* the rate of the (unmasked) Poisson counts of ``source`` (the same traced value, no
    operation between: :attr:`~d3pext.inference.structure.PrivateModel.parameter_sites`; a rate
    passed on through a function, e.g. ``2 * rate`` or ``jnp.minimum(rate, 50.0)``, keeps NUTS)
    and is a parameter of no other site of the model (compared by value in the concrete trace of
    ``pm``), neither it nor the counts weighted by a ``mask`` or ``scale`` handler
    (:attr:`~d3pext.inference.structure.Site.weighted`). Then the rate's full conditional given
    the counts ``y_1..y_n`` is ``Gamma(a + sum y, b + n)``; otherwise (no such site) NUTS keeps it.
    """
    site = pm.sites[source]
    fn = site.fn
    while isinstance(fn, (ExpandedDistribution, Independent)):
        fn = fn.base_dist
    if not isinstance(fn, dist.Poisson) or type(fn) is not dist.Poisson:
        return ()
    count_shape = np.shape(site.value)
    found = []
    for name in candidates:
        cand = pm.sites[name]
        value = np.asarray(cand.value)
        if cand.is_observed or _gamma(cand.fn) is None or value.size == 0:
            continue
        try:
            if np.broadcast_shapes(value.shape, count_shape) != count_shape:
                continue
        except ValueError:
            continue
        if pm.parameter_sites.get(f"{source}:rate") != name:
            continue
        # the rate must enter no other factor: no other site has it as a parameter
        used = False
        for other_name, other in pm.sites.items():
            if other_name in (name, source) or other_name in pm.releases:
                continue
            for leaf in jax.tree.leaves(other.fn):
                leaf = np.asarray(leaf)
                try:
                    shape = np.broadcast_shapes(leaf.shape, value.shape)
                except ValueError:
                    continue
                if leaf.size and shape == leaf.shape and np.array_equal(leaf, np.broadcast_to(value, shape)):
                    used = True
        if not used:
            found.append(name)
    return tuple(found)


# ---------------------------------------------------------------------------------------------
# The augmented model and the backends
# ---------------------------------------------------------------------------------------------


def noise_rate_site(release: str) -> str:
    """Name of the latent noise-rate site ``(lambda+, lambda-)`` of a release."""
    return f"{release}_noise_rates"


class augment_counts(Messenger):
    """The analyst's model for :class:`CountGibbs`: the confidential counts stay latent (their
    Poisson factor is what NUTS sees for the other parameters), each release is masked (given
    the counts it carries no information on the parameters) and, unless ``naive``, is followed
    by the latent noise rates ``f"{release}_noise_rates"`` with their exponential prior of
    mean ``alpha / (1 - alpha)`` (Theorem 2), shape ``counts.shape + (2,)``.
    """

    def __init__(self, fn: Callable, releases: Mapping[str, ReleaseInfo], naive: bool = False) -> None:
        self.releases = dict(releases)
        self.naive = naive
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or msg["name"] not in self.releases:
            return
        info = self.releases[msg["name"]]
        fn = msg["fn"]
        msg["fn"] = fn.mask(False)
        if not self.naive:
            alpha = jnp.exp(jnp.asarray(info.mechanism.log_alpha, _float()))
            rate = jnp.broadcast_to((1 - alpha) / alpha, fn.batch_shape)
            numpyro.sample(
                noise_rate_site(msg["name"]),
                dist.Exponential(jnp.stack([rate, rate], -1)).to_event(1),
            )


def _count_blocks(pm: PrivateModel, naive: bool) -> list[CountBlock]:
    blocks = []
    for name, info in pm.releases.items():
        if info.statistic != "records":
            raise NotApplicable(
                f"release {name!r}: the count augmentation needs one release per count "
                f"(statistic='records', e.g. privatize_counts), not {info.statistic!r}."
            )
        mech = info.mechanism
        if getattr(mech, "kind", None) != "geometric" or not hasattr(mech, "log_alpha"):
            raise NotApplicable(f"release {name!r}: the count augmentation needs geometric noise.")
        if info.bounds is not None:
            # the augmentation's likelihood is that of count + noise: a count clamped into the
            # bounds, or dropped (zero) outside them, is another release, which it would misread
            raise NotApplicable(
                f"release {name!r}: the counts were released with bounds={info.bounds} "
                f"(bounds_method={info.bounds_method!r}), which the count augmentation does not "
                "model (it takes the release as count + noise). Release the counts without bounds "
                "(privatize_counts), or use a simulation-based method (method='sppe' or 'sple')."
            )
        site = pm.sites[info.source]
        shape = jnp.shape(site.value)
        _poisson(site.fn)
        value = pm.sites[name].value
        check_counts(value, f"The release {name!r}", nonnegative=False)
        if jnp.shape(value) != shape:
            raise ValueError(
                f"The release {name!r} has shape {jnp.shape(value)}, but the counts of "
                f"{info.source!r} have shape {shape}."
            )
        log_alpha = np.asarray(mech.log_alpha, np.float64)
        try:
            np.broadcast_to(log_alpha, shape)
        except ValueError:
            raise ValueError(
                f"release {name!r}: alpha of shape {log_alpha.shape} does not broadcast to the "
                f"counts of shape {shape}."
            ) from None
        updates = site.infer.get("count_updates")
        if updates is not None and not isinstance(updates, CountUpdates):
            raise TypeError(f"infer['count_updates'] of {info.source!r} must be a CountUpdates.")
        blocks.append(
            CountBlock(
                source=info.source,
                release=name,
                noise_rates=None if naive else noise_rate_site(name),
                log_alpha=log_alpha,
                naive=naive,
                updates=updates,
            )
        )
    return blocks


def count_kernel(pm: PrivateModel, options: dict, naive: bool) -> MCMCKernel:
    """:class:`CountGibbs` for the count releases of ``pm``, with NUTS for the latent sites that
    neither a declared :class:`CountUpdates` nor a conjugate gamma update
    (:func:`poisson_gamma_sites`; ``options["conjugate"] = False`` turns it off) owns."""
    blocks = _count_blocks(pm, naive)
    if options.get("conjugate", True):
        owned = {name for blk in blocks for name in blk.sites}
        for i, blk in enumerate(blocks):
            rest = [name for name in pm.latent if name not in owned]
            conj = poisson_gamma_sites(pm, blk.source, rest)
            if conj:
                blocks[i] = dataclasses.replace(blk, conjugate=conj)
                owned.update(conj)
    aug = augment_counts(pm.model, pm.releases, naive=naive)
    kernel = CountGibbs(aug, blocks, max_stalls=options.get("max_stalls", DEFAULT_MAX_STALLS))
    owned = set(kernel.sites)
    rest = [name for name in pm.latent if name not in owned]
    if not rest:
        return kernel
    nuts = NUTS(aug, **options.get("nuts_kwargs", {}))
    return Gibbs([(kernel, list(kernel.sites)), (nuts, None)])


def schein_bessel_kernel(pm: PrivateModel, options: dict) -> MCMCKernel:
    """The ``"gibbs"`` backend: the Bessel/Skellam augmentation of the counts."""
    return count_kernel(pm, options, naive=False)


def truncated_counts_kernel(pm: PrivateModel, options: dict) -> MCMCKernel:
    """The ``"naive"`` backend: negative releases truncated at zero, taken as the counts."""
    return count_kernel(pm, options, naive=True)
