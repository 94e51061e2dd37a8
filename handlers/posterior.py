"""``private_posterior``: inference from private releases.

The analyst conditions a privatized model (:class:`~d3pext.handlers.privatize`) on a release and
asks for a method. The backends of the method come from one registry
(:mod:`d3pext.inference.registry`): kernel backends run as an ordinary ``numpyro.infer.MCMC``
(:class:`PrivatePosterior` traces the model once at ``init``, gives the backends its concrete
structure and runs the first backend that applies); estimator backends (``"sppe"``, ``"sple"``)
return their fitted estimator. :func:`sample_releases` runs one compiled sampler over many
releases at once, for calibration studies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from numpyro.infer import MCMC
from numpyro.infer.mcmc import MCMCKernel
from numpyro.primitives import Messenger
from numpyro.util import is_prng_key

from d3pext._threads import one_model_at_a_time
from d3pext.inference.mcmc import CachedMCMC
from d3pext.inference.registry import BUILTIN_BACKENDS, Backend, backends, method_kind, select_backend
from d3pext.inference.structure import RELEASES_KWARG, inspect_model, model_fingerprint

__all__ = ["PrivatePosterior", "ReleaseState", "private_posterior", "sample_releases"]

_SECTIONS = ("joint", "independent")


class _tool_view(Messenger):
    """The privatized model as post-processing tools see it (``PrivatePosterior.model``).

    ArviZ's ``from_numpyro`` traces ``mcmc.sampler.model`` (under ``jax.eval_shape``, to name
    dimensions) and computes the log-likelihood of its observed sites *without* a seed. A release
    site carries its statistic (an array) in ``infer``, which ``eval_shape`` cannot return, and
    the likelihood of a release given the parameters integrates over the confidential data, which
    are not among the draws. This view hides the release sites (given their statistic as value, so
    no noise is drawn) and the observed sites (releases conditioned on, factors of constrained
    priors), so ArviZ gets the posterior, its dimensions and no (wrong) log-likelihood.
    """

    def process_message(self, msg):
        if msg["type"] != "sample":
            return
        infer = msg.get("infer") or {}
        if msg["is_observed"] or "privatize" in infer:
            if msg["value"] is None:
                msg["value"] = infer.get("statistic")
            msg["stop"] = True


def _same_argument(a: Any, b: Any) -> bool:
    """The same array object, or equal plain values (ints, floats, strings)."""
    if a is b:
        return True
    if hasattr(a, "shape") or hasattr(b, "shape"):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:
        return False


def _frozen(value: Any) -> Any:
    """A hashable stand-in for backend options (dicts and lists of plain values)."""
    if isinstance(value, Mapping):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    return value


class ReleaseState(NamedTuple):
    """State of :class:`PrivatePosterior`: the backend's state and the release values it
    conditions on (arguments of the compiled sampler, not constants, so that another release of
    the same shapes runs the same program). Other fields (``z``, ``diverging``, ...) are read
    from the backend's state, so ``extra_fields`` work as with the backend alone.

    - **inner** - the backend kernel's state.
    - **releases** - ``{release site: value}``.
    """

    inner: Any
    releases: dict[str, jax.Array]

    @property
    def z(self) -> Any:
        return self.inner.z

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.inner, name)


_SHARED_KERNELS: OrderedDict = OrderedDict()
_SHARED_KERNELS_SIZE = 16


class PrivatePosterior(MCMCKernel):
    """MCMC kernel that picks the backend of ``method`` for a privatized model at ``init``.

    Its state is a :class:`ReleaseState`. Kernels of the same model, method, options, release
    shapes and model arguments share their backend and compiled initialisation (for built-in
    backends), and :class:`~d3pext.inference.mcmc.CachedMCMC` shares their compiled sampling loop:
    a new ``private_posterior`` for another release compiles nothing.

    :param model: a privatized model.
    :param data: release values to condition on, ``{release site: value}``.
    :param method: a registered method (``"gibbs"``, ``"naive"``, ``"clt"``, ...).
    :param options: backend options (``sections="joint" | "independent"``, ``nuts_kwargs``).
    """

    sample_field = "z"

    def __init__(
        self,
        model: Callable,
        data: Mapping[str, Any] | None = None,
        method: str = "gibbs",
        **options: Any,
    ) -> None:
        if method_kind(method) != "kernel":
            raise ValueError(
                f"method {method!r} builds an estimator, not an MCMC kernel: use private_posterior."
            )
        if options.get("sections", "joint") not in _SECTIONS:
            raise ValueError(
                f"sections must be 'joint' or 'independent', got {options['sections']!r}."
            )
        self._model = model
        self._data = dict(data or {})
        self.method = method
        self.options = options
        self.inner: MCMCKernel | None = None
        self.backend: Backend | None = None
        self._batched = False
        self._release_values: dict[str, jax.Array] | None = None
        self._fingerprint: str | None = None  # of the model's traced run (see inspect_model), set by prepare

    @property
    def model(self) -> Callable:
        """The privatized model with its release and observed sites hidden, for ArviZ's
        ``from_numpyro`` (see :class:`_tool_view`); the kernels run the model itself."""
        return _tool_view(self._model)

    def prepare(self, model_args: tuple = (), model_kwargs: dict | None = None) -> MCMCKernel:
        """Trace the model, pick the backend and build its kernel (done by ``init`` if needed)."""
        pm = inspect_model(self._model, self._data, model_args, dict(model_kwargs or {}))
        self.backend, self.inner = select_backend(pm, self.method, self.options)
        self._fingerprint = pm.fingerprint
        return self.inner

    def _kwargs(self, model_kwargs: dict | None, releases: Mapping | None = None) -> dict:
        return {**(model_kwargs or {}), RELEASES_KWARG: self._data if releases is None else releases}

    def structure_key(self, model_args: tuple, model_kwargs: dict | None) -> tuple | None:
        """Kernels with equal keys run the same sampling program given their states (the key of
        :class:`~d3pext.inference.mcmc.CachedMCMC`'s shared loops): their structure and the backend
        kernel that initialised the state. ``None`` when it cannot be shared. Valid after ``init``."""
        structure = self._structure(model_args, model_kwargs)
        return None if structure is None else (structure, self.inner)

    def _structure(self, model_args: tuple, model_kwargs: dict | None) -> tuple | None:
        """What the compiled sampler depends on besides the release values, or ``None`` when it
        cannot be shared: a backend registered by the user (which may keep release values), a model
        run that cannot be fingerprinted, or model arguments that are arrays or otherwise unhashable."""
        if self.backend not in BUILTIN_BACKENDS or self._fingerprint is None:
            return None
        releases = tuple((k, v.shape, v.dtype, v.weak_type) for k, v in sorted(self._releases().items()))
        key = (
            # the model's traced run, not only its identity: a model whose global changed since an
            # earlier kernel was built runs another program, and that kernel's sampler is not its own
            self._model, self._fingerprint, self.backend, _frozen(self.options), self._batched, releases,
            bool(jax.config.jax_enable_x64), model_args, tuple(sorted((model_kwargs or {}).items())),
        )
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if self.inner is None:
            self.prepare(model_args, model_kwargs)
        self._batched = not is_prng_key(rng_key)
        compiled = self._compiled_init(num_warmup, model_args, model_kwargs)
        return compiled(rng_key, init_params, self._releases())

    def _releases(self) -> dict[str, jax.Array]:
        """The release values as arrays (converted once: the structure key reads their types)."""
        if self._release_values is None:
            self._release_values = {k: jnp.asarray(v) for k, v in self._data.items()}
        return self._release_values

    def _compiled_init(self, num_warmup, model_args, model_kwargs) -> Callable:
        """The jitted init: shared by the kernels of one structure (which then share ``inner``),
        else kept on this kernel while the model arguments stay the same objects."""
        structure = self._structure(model_args, model_kwargs)
        if structure is not None:
            key = (structure, num_warmup)
            if key in _SHARED_KERNELS:
                _SHARED_KERNELS.move_to_end(key)
                self.inner, compiled = _SHARED_KERNELS[key]
                return compiled
        leaves, treedef = jax.tree.flatten((model_args, model_kwargs))
        cached = getattr(self, "_init_cache", None)
        stale = (
            cached is None
            or cached[:3] != (self._batched, num_warmup, treedef)
            or cached[5] is not self.inner
            or not all(map(_same_argument, cached[3], leaves))
        )
        if stale:
            inner = self.inner

            def init(key, params, releases):
                kwargs = self._kwargs(model_kwargs, releases)
                return ReleaseState(inner.init(key, num_warmup, params, model_args, kwargs), releases)

            # chain_method="vectorized" passes one key per chain
            compiled = jax.jit(jax.vmap(init, in_axes=(0, 0, None)) if self._batched else init)
            cached = self._init_cache = (self._batched, num_warmup, treedef, leaves, compiled, inner)
        if structure is not None:
            _SHARED_KERNELS[(structure, num_warmup)] = (self.inner, cached[4])
            while len(_SHARED_KERNELS) > _SHARED_KERNELS_SIZE:
                _SHARED_KERNELS.popitem(last=False)
        return cached[4]

    def sample(self, state, model_args, model_kwargs):
        def one(state):
            kwargs = self._kwargs(model_kwargs, state.releases)
            return ReleaseState(self.inner.sample(state.inner, model_args, kwargs), state.releases)

        return jax.vmap(one)(state) if self._batched else one(state)

    def postprocess_fn(self, model_args, model_kwargs):
        return self.inner.postprocess_fn(model_args, self._kwargs(model_kwargs))

    def postprocess_state_fn(self, model_args, model_kwargs) -> Callable:
        """``postprocess_fn`` that reads the release values from the state (all chains' states
        when vectorized), for a compiled loop shared by kernels of other releases."""

        def one(state):
            return self.inner.postprocess_fn(model_args, self._kwargs(model_kwargs, state.releases))(state.z)

        return jax.vmap(one) if self._batched else one

    def get_diagnostics_str(self, state) -> str:
        return "" if self._batched else self.inner.get_diagnostics_str(state.inner)


@one_model_at_a_time
def private_posterior(
    model: Callable,
    data: Mapping[str, Any] | None = None,
    *,
    method: str = "gibbs",
    num_warmup: int = 1000,
    num_samples: int = 1000,
    num_chains: int = 1,
    chain_method: str = "vectorized",
    sections: str = "joint",
    nuts_kwargs: dict | None = None,
    **mcmc_kwargs: Any,
) -> MCMC:
    """Posterior of a privatized model given its releases, as a ready-to-run ``MCMC``.

    :param model: a privatized model (:class:`~d3pext.handlers.privatize`), possibly already
        conditioned on its releases with ``numpyro.handlers.condition``.
    :param data: ``{release site: released value}``.
    :param method: ``"gibbs"`` (Bernstein & Sheldon augmentation), ``"naive"`` (release taken
        as exact), ``"clt"`` (NUTS with the statistic under its CLT approximation) or any method
        added with :func:`~d3pext.inference.registry.register_backend`. An estimator method
        (``"sppe"``, ``"sple"``) returns its fitted estimator instead of an ``MCMC`` and
        receives the extra keyword arguments.
    :param sections: covariance of the truncation sections for truncated statistics:
        ``"joint"`` (multinomial, default) or ``"independent"`` (as printed in the paper).
    :param nuts_kwargs: arguments of the NUTS blocks for non-conjugate parameters.
    :return: ``MCMC``; call ``.run(rng_key, *model_args)``. Its sampler is compiled on the first
        ``run``; the release values are arguments of the compiled program, so later runs, and new
        calls for other releases of the same shapes with the same model, method, options and
        (hashable) model arguments, compile nothing (built-in backends; a user's backend compiles
        per call). To run many releases at once use :func:`sample_releases` (one vectorised call).

    **Example**

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import privatize
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> def model(n, x=None):
    ...     theta = numpyro.sample("theta", dist.Beta(10.0, 10.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta), obs=x)
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(0.1))
    >>> mcmc = private_posterior(private, {"x_dp": jnp.array(412.3)}, num_warmup=500,
    ...                          num_samples=1000, num_chains=4, progress_bar=False)
    >>> mcmc.run(random.key(0), 1000)
    >>> samples = mcmc.get_samples()
    >>> sorted(samples)
    ['theta', 'x_dp_noise_var', 'x_dp_stat']
    >>> mcmc.last_state.releases["x_dp"].shape  # the release travels in the state, per chain
    (4,)
    >>> bool(0.35 < samples["theta"].mean() < 0.47)
    True
    """
    if method_kind(method) == "estimator":
        return backends(method)[0].build(
            model, data, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
            **mcmc_kwargs,
        )
    options = {"sections": sections}
    if nuts_kwargs:
        options["nuts_kwargs"] = nuts_kwargs
    kernel = PrivatePosterior(model, data, method, **options)
    # NumPyro's MCMC compiles its sampling loop again on every run: CachedMCMC compiles it once
    return CachedMCMC(
        kernel,
        num_warmup=num_warmup,
        num_samples=num_samples,
        num_chains=num_chains,
        chain_method=chain_method,
        **mcmc_kwargs,
    )


_SAMPLER_CACHE: OrderedDict = OrderedDict()
_SAMPLER_CACHE_SIZE = 16


def _release_sampler(
    model: Callable,
    names: tuple[str, ...],
    first_release: dict,
    method: str,
    sections: str,
    model_args: tuple,
    model_kwargs: dict,
    num_warmup: int,
    num_samples: int,
    devices: tuple,
) -> Callable:
    """The compiled ``(keys (M, chains), *releases (M, ...)) -> samples`` of :func:`sample_releases`.

    With several ``devices`` the flattened (data set, chain) axis is split over them with
    ``jax.shard_map`` (padded to a multiple of the device count, the padding dropped): each device
    runs its chains alone, with no communication.

    Cached (LRU) on the model object, the fingerprint of its traced run and the static arguments,
    so that calling :func:`sample_releases` again with other releases or keys (same ``M`` and
    number of chains) only traces the model (milliseconds) and compiles nothing: compiling a sweep
    costs seconds, running one for a thousand chains well under a millisecond. The fingerprint
    (:func:`~d3pext.inference.structure.model_fingerprint`) tells apart runs of one model object
    whose globals changed (another mechanism or epsilon, say); a model whose run has none (host
    callbacks), or a user's backend, is built afresh on every call.
    """
    cache_key = None
    fingerprint = model_fingerprint(model, first_release, model_args, model_kwargs)
    if fingerprint is not None:
        try:
            cache_key = (
                model, fingerprint, names, method, backends(method), sections, model_args,
                tuple(sorted(model_kwargs.items())), num_warmup, num_samples, devices,
                bool(jax.config.jax_enable_x64),
            )
            hash(cache_key)
        except TypeError:  # unhashable model arguments (arrays): build without caching
            cache_key = None
    if cache_key is not None and cache_key in _SAMPLER_CACHE:
        _SAMPLER_CACHE.move_to_end(cache_key)
        return _SAMPLER_CACHE[cache_key]
    kernel = PrivatePosterior(model, first_release, method, sections=sections)
    inner = kernel.prepare(model_args, model_kwargs)
    if kernel.backend not in BUILTIN_BACKENDS or kernel._fingerprint != fingerprint:
        cache_key = None  # a user's backend may keep the first release's values

    def run_chain(key, *release):
        kwargs = {**model_kwargs, RELEASES_KWARG: dict(zip(names, release))}
        state = inner.init(key, num_warmup, None, model_args, kwargs)
        draws = jax.tree.map(
            lambda v: jnp.zeros((num_samples, *jnp.shape(v)), jnp.result_type(v)), state.z
        )

        # one loop over warmup and sampling, so that the sweep is compiled once; warmup
        # sweeps write to slot 0, which the first kept sweep overwrites
        def sweep(i, carry):
            state, draws = carry
            state = inner.sample(state, model_args, kwargs)
            slot = jnp.maximum(i - num_warmup, 0)
            draws = jax.tree.map(
                lambda d, v: lax.dynamic_update_index_in_dim(d, v, slot, 0), draws, state.z
            )
            return state, draws

        _, draws = lax.fori_loop(0, num_warmup + num_samples, sweep, (state, draws))
        return jax.vmap(inner.postprocess_fn(model_args, kwargs))(draws)

    run_chains = jax.vmap(run_chain)
    if len(devices) > 1:
        mesh = Mesh(np.array(devices), ("chains",))
        run_chains = jax.shard_map(
            run_chains, mesh=mesh, in_specs=PartitionSpec("chains"), out_specs=PartitionSpec("chains"),
            check_vma=False,  # the kernels' loop carries start device-invariant
        )

    @jax.jit
    def sampler(keys, *values):
        # one vmap over the flattened (data set, chain) axis: nested vmaps compile to a sweep
        # three times slower (and take twice as long to compile) on CPU
        num_sets, num_chains = keys.shape
        total = num_sets * num_chains
        pad = -total % len(devices)
        flat = [keys.reshape(-1)] + [jnp.repeat(v, num_chains, axis=0) for v in values]
        flat = [jnp.concatenate([v, v[:pad]]) if pad else v for v in flat]
        draws = run_chains(*flat)
        return jax.tree.map(lambda d: d[:total].reshape(num_sets, num_chains, *d.shape[1:]), draws)

    if cache_key is not None:
        _SAMPLER_CACHE[cache_key] = sampler
        if len(_SAMPLER_CACHE) > _SAMPLER_CACHE_SIZE:
            _SAMPLER_CACHE.popitem(last=False)
    return sampler


@one_model_at_a_time
def sample_releases(
    model: Callable,
    releases: Mapping[str, jax.Array],
    rng_key: jax.Array,
    *model_args: Any,
    method: str = "gibbs",
    num_warmup: int = 1000,
    num_samples: int = 1000,
    num_chains: int = 1,
    sections: str = "joint",
    devices: Sequence[jax.Device] | None = None,
    **model_kwargs: Any,
) -> dict[str, jax.Array]:
    """Posterior samples for many independent releases in one compiled call.

    Each value of ``releases`` has a leading axis of ``M`` data sets; the result has shape
    ``(M, num_chains, num_samples, ...)`` per site. Use it for calibration studies. The
    compiled sampler is cached: a second call with the same model, settings and shapes (any
    release values and key) only runs. The ``M x num_chains`` chains are spread over
    ``devices`` (default: all local devices of the default backend); the draws do not depend
    on the device count.

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import privatize
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> def model(n):
    ...     theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta))
    >>> private = privatize(model, site="x", mechanism=LaplaceMechanism(1.0))
    >>> out = sample_releases(private, {"x_dp": jnp.array([10.2, 55.0, 80.7])}, random.key(0),
    ...                       100, num_warmup=100, num_samples=200, num_chains=2)
    >>> out["theta"].shape
    (3, 2, 200)
    """
    names = tuple(releases)
    values = [jnp.asarray(releases[k]) for k in names]
    num_sets = values[0].shape[0]
    if any(v.shape[0] != num_sets for v in values):
        raise ValueError("All releases must have the same leading (data set) axis.")
    devices = tuple(jax.local_devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices must name at least one device.")
    sampler = _release_sampler(
        model, names, {k: v[0] for k, v in zip(names, values)}, method, sections, model_args,
        model_kwargs, num_warmup, num_samples, devices,
    )
    # waits for the draws: on a GPU an error raised by a host callback in the sampler (an exhausted
    # rejection loop) would otherwise surface only when they are first read, not from this call
    return jax.block_until_ready(sampler(random.split(rng_key, (num_sets, num_chains)), *values))
