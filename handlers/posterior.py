"""``private_posterior``: inference from private releases as an ordinary ``numpyro.infer.MCMC`` run.

The analyst conditions a privatized model (:class:`~d3pext.handlers.privatize`) on a release and
asks for a method. The model is traced once; its release sites (``infer["privatize"]``), the
families of the confidential records and the priors of their parameters decide which registered
backend builds the kernel. A backend is a function ``(structure, options) -> MCMCKernel`` that
raises :class:`NotApplicable` with a reason when the model is outside its reach; backends are
registered per method with :func:`register_backend`, so later methods plug in without touching
this module. Built in:

- ``"gibbs"``: Bernstein & Sheldon data augmentation for exponential families
  (:class:`d3pext.gibbs.ExpFamGibbs`): conjugate parameters by conjugacy, the others by NUTS
  within :class:`numpyro.infer.Gibbs`;
- ``"naive"``: the release taken as the exact statistic (the baseline that ignores the noise);
- ``"clt"``: NUTS on the parameters and the confidential statistic, the statistic under its
  normal (random-sum) CLT approximation and the release under the mechanism's own density.

Backends work on an *augmented* model: the handler :class:`augment` replaces the confidential
record sites (masked, never sampled) and the release sites by the latent statistic sites of the
method, e.g. ``"x_dp_stat"`` and ``"x_dp_noise_var"`` for the release ``"x_dp"``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
import math
from typing import Any

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp

import numpyro
from numpyro.distributions import constraints
import numpyro.distributions as dist
from numpyro.handlers import condition, seed, trace
from numpyro.infer import MCMC, NUTS, Gibbs
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.handlers import substitute
from numpyro.primitives import Messenger
from numpyro.util import is_prng_key

from d3pext.expfam import (
    ExpFamily,
    clt_moments,
    conjugate_parameters,
    family_of,
    find_conjugate,
    random_sum_moments,
    record_distribution,
)
from d3pext.gibbs import ExpFamGibbs, StatisticBlock

from .privatize import ReleaseInfo, release_sites

__all__ = [
    "RELEASES_KWARG",
    "NotApplicable",
    "PrivateModel",
    "PrivatePosterior",
    "augment",
    "available_methods",
    "build_kernel",
    "inspect_model",
    "private_posterior",
    "register_backend",
    "register_fitter",
    "released",
    "sample_releases",
]


class NotApplicable(Exception):
    """Raised by a backend whose method does not cover the model; the message says why."""


@dataclass
class PrivateModel:
    """What a backend sees: the privatized model conditioned on the releases, traced once.

    :param model: the conditioned privatized model.
    :param trace: a trace of it, for static metadata (its values may be tracers).
    :param releases: the release sites' :class:`~d3pext.handlers.privatize.ReleaseInfo`.
    :param values: concrete values of the latent sites (drawn uniformly in the unconstrained
        space, fixed key) and of the record parameters, keyed ``"source:parameter"``.
    """

    model: Callable
    trace: dict
    releases: dict[str, ReleaseInfo]
    values: dict

    @property
    def latent(self) -> tuple[str, ...]:
        return tuple(
            name
            for name, site in self.trace.items()
            if site["type"] == "sample" and not site["is_observed"]
        )

    def declaration(self, key: str, how: str):
        """The one value that sample sites declare under ``infer[key]`` (e.g. a backend's prior
        spec); :class:`NotApplicable` saying ``how`` to declare it when there is none or several."""
        found = [
            site["infer"][key]
            for site in self.trace.values()
            if site["type"] == "sample" and key in (site.get("infer") or {})
        ]
        if len(found) != 1:
            raise NotApplicable(f"{how} (found {len(found)} declarations).")
        return found[0]


Backend = Callable[[PrivateModel, dict], MCMCKernel]
_BACKENDS: dict[str, list[tuple[str, Backend]]] = {}


def register_backend(method: str, name: str | None = None) -> Callable[[Backend], Backend]:
    """Register a backend for ``method``; backends of a method are tried in registration order.

    Registering a name again replaces that backend in place (a module imported twice, or reloaded,
    registers once).

    >>> @register_backend("my-method")
    ... def my_backend(private_model, options):
    ...     raise NotApplicable("covers nothing yet")
    >>> "my-method" in available_methods()
    True
    >>> _ = _BACKENDS.pop("my-method")
    """

    def decorator(backend: Backend) -> Backend:
        entries = _BACKENDS.setdefault(method, [])
        entry = (name or backend.__name__, backend)
        names = [n for n, _ in entries]
        if entry[0] in names:
            entries[names.index(entry[0])] = entry
        else:
            entries.append(entry)
        return backend

    return decorator


Fitter = Callable[..., Any]
_FITTERS: dict[str, Fitter] = {}


def register_fitter(method: str) -> Callable[[Fitter], Fitter]:
    """Register a *fitted* method (e.g. simulation-based SPPE/SPLE), which is not an MCMC kernel.

    :func:`private_posterior` hands such a method ``(model, data, **options)``, where the options
    are its keyword arguments (``num_warmup``, ``num_samples``, ``num_chains`` and any extra
    ones), and returns what the fitter returns (an object with ``.run(rng_key, *model_args)``).

    >>> @register_fitter("my-fitted")
    ... def my_fitter(model, data, **options):
    ...     return ("fitted", sorted(options))
    >>> "my-fitted" in available_methods()
    True
    >>> _ = _FITTERS.pop("my-fitted")
    """

    def decorator(fitter: Fitter) -> Fitter:
        _FITTERS[method] = fitter
        return fitter

    return decorator


def available_methods() -> tuple[str, ...]:
    """The methods with at least one registered backend or fitter."""
    return tuple(_BACKENDS) + tuple(m for m in _FITTERS if m not in _BACKENDS)


# ---------------------------------------------------------------------------------------------
# The augmentation handler.


def _site_names(release: str) -> dict[str, str]:
    return {
        "stat": f"{release}_stat",
        "full_stat": f"{release}_stat_full",
        "noise_var": f"{release}_noise_var",
        "loglik": f"{release}_stat_loglik",
    }


def _noise(info: ReleaseInfo) -> tuple[str, float]:
    """``("laplace" | "gaussian", scale)`` of the mechanism's additive noise."""
    noise = info.mechanism.noise_distribution()
    while isinstance(noise, dist.ExpandedDistribution):
        noise = noise.base_dist
    if isinstance(noise, dist.Laplace):
        return "laplace", float(noise.scale)
    if isinstance(noise, dist.Normal):
        return "gaussian", float(noise.scale)
    raise NotApplicable(
        f"release {info.name!r}: no scale-mixture augmentation for {type(noise).__name__} noise "
        "(Laplace and Gaussian noise are covered)."
    )


def _release_scale(info: ReleaseInfo) -> float:
    return 1.0 / info.num_records if info.statistic == "mean" else 1.0


def _support(lo: float, hi: float):
    if math.isfinite(lo) and math.isfinite(hi):
        return constraints.interval(lo, hi)
    if math.isfinite(lo):
        return constraints.greater_than(lo)
    return constraints.real


class augment(Messenger):
    """Replace the confidential records and the releases of a privatized model by the latent
    statistics of an inference method.

    :param fn: a privatized model (conditioned on its releases).
    :param releases: ``{release site: ReleaseInfo}`` to augment.
    :param str mode: ``"gibbs"`` (statistic sites, Laplace mixing variances, exact
        exponential-family factor for the parameters), ``"naive"`` (the release is the statistic)
        or ``"clt"`` (the statistic under its normal approximation, the release under the
        mechanism's density).

    >>> import jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from numpyro.handlers import condition, seed, substitute, trace
    >>> from numpyro.infer.initialization import init_to_uniform
    >>> from d3pext.handlers import privatize
    >>> from d3pext.mechanisms import LaplaceMechanism
    >>> def model(n):
    ...     theta = numpyro.sample("theta", dist.Beta(1.0, 1.0))
    ...     with numpyro.plate("records", n):
    ...         numpyro.sample("x", dist.Bernoulli(theta))
    >>> private = condition(privatize(model, site="x", mechanism=LaplaceMechanism(1.0)),
    ...                     {"x_dp": jnp.array(3.2)})
    >>> tr = trace(seed(private, 0)).get_trace(10)
    >>> augmented = augment(private, release_sites(tr), "gibbs")
    >>> aug = trace(substitute(seed(augmented, 0), substitute_fn=init_to_uniform)).get_trace(10)
    >>> [k for k, s in aug.items() if s["type"] == "sample" and not s["is_observed"]]
    ['theta', 'x_dp_stat', 'x_dp_noise_var']
    """

    def __init__(self, fn: Callable, releases: Mapping[str, ReleaseInfo], mode: str) -> None:
        if mode not in ("gibbs", "naive", "clt"):
            raise ValueError(f"mode must be 'gibbs', 'naive' or 'clt', got {mode!r}.")
        self.releases = dict(releases)
        self.sources = {info.source: info for info in self.releases.values()}
        self.mode = mode
        self._records: dict[str, dist.Distribution] = {}
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample":
            return
        if msg["name"] in self.sources:
            fn = msg["fn"]
            self._records[msg["name"]] = fn
            shape = fn.shape(msg["kwargs"].get("sample_shape", ()))
            dtype = jnp.int32 if fn.support.is_discrete else jnp.result_type(float)
            msg["fn"] = fn.mask(False)
            msg["value"] = jnp.zeros(shape, dtype)
            msg["is_observed"] = True
        elif msg["name"] in self.releases:
            info = self.releases[msg["name"]]
            record = record_distribution(self._records[info.source])
            msg["fn"] = getattr(self, f"_{self.mode}")(info, record, msg["value"])

    def _gibbs(self, info: ReleaseInfo, record, value):
        names = _site_names(info.name)
        family = family_of(record)
        n = info.num_records
        lo, hi = family.stat_range
        ndim = len(info.stat_shape)
        stat = numpyro.sample(
            names["stat"], dist.ImproperUniform(_support(n * lo, n * hi), (), info.stat_shape)
        )
        full = stat
        if info.bounds is not None:
            full = numpyro.sample(
                names["full_stat"], dist.ImproperUniform(_support(n * lo, n * hi), (), ())
            )
        eta = family.natural_params(record)
        numpyro.factor(names["loglik"], jnp.sum(eta * full) - n * family.log_partition(eta))
        kind, scale = _noise(info)
        c = _release_scale(info)
        if kind == "laplace":
            b = scale / c
            var = numpyro.sample(
                names["noise_var"],
                dist.Exponential(1.0 / (2 * b**2)).expand(info.stat_shape).to_event(ndim),
            )
            return dist.Normal(c * stat, c * jnp.sqrt(var)).to_event(ndim)
        return dist.Normal(c * stat, scale).to_event(ndim)

    def _naive(self, info: ReleaseInfo, record, value):
        names = _site_names(info.name)
        family = family_of(record)
        n = info.num_records
        lo, hi = family.stat_range
        stat = jnp.clip(jnp.asarray(value) / _release_scale(info), n * lo, n * hi)
        eta = family.natural_params(record)
        numpyro.factor(names["loglik"], jnp.sum(eta * stat) - n * family.log_partition(eta))
        return info.mechanism.release_distribution(value).mask(False)

    def _clt(self, info: ReleaseInfo, record, value):
        names = _site_names(info.name)
        family = family_of(record)
        if not family.univariate:
            raise NotApplicable(
                f"release {info.name!r}: the CLT fallback covers univariate statistics only."
            )
        n = info.num_records
        eta = family.natural_params(record)
        lo, hi = family.stat_range
        if info.bounds is None:
            mu, sigma = clt_moments(family, eta)
            mean, var = n * mu, n * sigma
        else:
            a, b = info.bounds
            mean, var = random_sum_moments(family, eta, n, a, b)
            lo, hi = min(0.0, max(a, lo)), max(0.0, min(b, hi))
        stat = numpyro.sample(
            names["stat"],
            dist.TruncatedNormal(mean, jnp.sqrt(var), low=n * lo, high=n * hi if math.isfinite(hi) else None),
        )
        return info.mechanism.release_distribution(stat * _release_scale(info))


# ---------------------------------------------------------------------------------------------
# Structure and built-in backends.


def _conditioned_releases(model: Callable) -> dict:
    """Data of the ``condition`` handlers wrapped around ``model`` (outermost first)."""
    data = {}
    fn = model
    while fn is not None:
        if isinstance(fn, condition) and fn.data is not None:
            data = {**fn.data, **data}
        fn = getattr(fn, "fn", None)
    return data


RELEASES_KWARG = "_d3pext_releases"
"""Reserved model keyword through which release values reach the conditioned model."""


def _released_model(model: Callable, *args: Any, **kwargs: Any) -> Any:
    data = kwargs.pop(RELEASES_KWARG, None)
    with condition(data=data or {}):
        return model(*args, **kwargs)


def released(model: Callable) -> Callable:
    """``model`` conditioned on the releases passed as ``model_kwargs[RELEASES_KWARG]``.

    Passing the releases as an argument rather than closing over them lets one compiled sampler
    serve many releases (:func:`sample_releases`).
    """
    if isinstance(model, partial) and model.func is _released_model:
        return model
    return partial(_released_model, model)


def inspect_model(
    model: Callable, data: Mapping[str, Any] | None, model_args: tuple, model_kwargs: dict
) -> PrivateModel:
    """Trace the privatized ``model`` conditioned on ``data`` and check the conditioning.

    The trace runs once under ``jit`` (cheap to compile, no eager dispatch); its sites are for
    static metadata (types, shapes, infer dicts), and the concrete values of the latent sites and
    of the record parameters come back in :attr:`PrivateModel.values`.
    """
    data = dict(data or {})
    conditioned_model = released(model)
    model_kwargs = {**model_kwargs, RELEASES_KWARG: data}
    box = {}

    def run():
        tr = trace(
            substitute(seed(conditioned_model, random.key(0)), substitute_fn=init_to_uniform)
        ).get_trace(*model_args, **model_kwargs)
        box["trace"] = tr
        values = {
            name: site["value"]
            for name, site in tr.items()
            if site["type"] == "sample" and not site["is_observed"]
        }
        for info in release_sites(tr).values():
            try:
                record = record_distribution(tr[info.source]["fn"])
            except ValueError:
                continue
            for param in conjugate_parameters(record):
                values[f"{info.source}:{param}"] = getattr(record, param)
        return values

    values = jax.device_get(jax.jit(run)())
    tr = box["trace"]
    releases = release_sites(tr)
    if not releases:
        raise ValueError("The model has no release sites: wrap it with privatize(...).")
    given = {**_conditioned_releases(model), **data}
    sample_sites = {name for name, site in tr.items() if site["type"] == "sample"}
    unknown = sorted(set(given) - sample_sites)
    if unknown:
        raise ValueError(
            f"Conditioning on {unknown}, which the privatized model does not have; its release "
            f"sites are {sorted(releases)}."
        )
    missing = sorted(name for name in releases if not tr[name]["is_observed"])
    if missing:
        raise ValueError(
            f"The release sites {missing} are not observed: pass the release values, "
            f"e.g. data={{{missing[0]!r}: value}}."
        )
    for name, info in releases.items():
        if tr[info.source]["is_observed"]:
            raise ValueError(
                f"The confidential site {info.source!r} of release {name!r} is observed; the "
                "analyst's model must leave it latent (pass no confidential data)."
            )
    return PrivateModel(conditioned_model, tr, releases, values)


def _expfam_release(info: ReleaseInfo, pm: PrivateModel) -> tuple[ExpFamily, Any]:
    if info.statistic not in ("sufficient", "mean"):
        raise NotApplicable(
            f"release {info.name!r}: the exponential-family augmentation needs the sufficient "
            f"statistic or its mean, not {info.statistic!r}."
        )
    if info.bounds is not None and info.bounds_method != "truncate":
        raise NotApplicable(
            f"release {info.name!r}: clamped records are not an exponential family; the "
            "Bernstein & Sheldon augmentation needs bounds_method='truncate'."
        )
    try:
        record = record_distribution(pm.trace[info.source]["fn"])
        family = family_of(record)
    except ValueError as e:
        raise NotApplicable(f"release {info.name!r}: {e}") from e
    if info.bounds is not None and (not family.univariate or family.log_interval_mass is None):
        raise NotApplicable(
            f"release {info.name!r}: truncated statistics need a univariate family with a CDF "
            f"(the {family.name} family has none registered)."
        )
    return family, record


def _conjugate_sites(
    pm: PrivateModel, info: ReleaseInfo, record, exclude: set
) -> tuple[tuple[str, str], ...]:
    """Latent sites that are exactly a parameter of ``record`` and have a conjugate prior.

    Identity is detected by value: the latent sites were drawn at random, so a record parameter
    equal to a site's value is that site (a transformed site, e.g. ``1 - theta``, is not).
    """
    pairs = []
    for param in conjugate_parameters(record):
        value = np.asarray(pm.values[f"{info.source}:{param}"])
        for name in pm.latent:
            if name in exclude or name == info.source:
                continue
            site_value = np.asarray(pm.values[name])
            if (
                site_value.shape == value.shape
                and np.array_equal(site_value, value)
                and find_conjugate(record, param, pm.trace[name]["fn"]) is not None
            ):
                pairs.append((name, param))
    return tuple(pairs)


def _blocks(pm: PrivateModel, options: dict, naive: bool) -> tuple[list[StatisticBlock], set]:
    blocks, owned = [], set()
    sources = [info.source for info in pm.releases.values()]
    for name, info in pm.releases.items():
        if sources.count(info.source) > 1:
            raise NotApplicable(f"several releases of the site {info.source!r}.")
        family, record = _expfam_release(info, pm)
        kind, scale = _noise(info)
        c = _release_scale(info)
        params = _conjugate_sites(pm, info, record, owned)
        names = _site_names(name)
        blocks.append(
            StatisticBlock(
                source=info.source,
                release=name,
                stat=None if naive else names["stat"],
                num_records=info.num_records,
                noise=kind,
                noise_scale=scale / c,
                noise_var=names["noise_var"] if kind == "laplace" and not naive else None,
                params=params,
                bounds=info.bounds,
                full_stat=names["full_stat"] if info.bounds is not None and not naive else None,
                sections=options.get("sections", "joint"),
                naive=naive,
                release_scale=c,
            )
        )
        owned |= {p for p, _ in params}
    return blocks, owned


def _gibbs_or_nuts(pm: PrivateModel, mode: str, options: dict) -> MCMCKernel:
    naive = mode == "naive"
    blocks, owned = _blocks(pm, options, naive)
    aug = augment(pm.model, pm.releases, mode)
    kernel = ExpFamGibbs(aug, blocks)
    rest = [name for name in pm.latent if name not in owned and name not in _sources(pm)]
    if not rest:
        return kernel
    nuts = NUTS(aug, **options.get("nuts_kwargs", {}))
    if naive and not owned:
        return nuts
    if naive:
        return Gibbs([(kernel, [p for b in blocks for p, _ in b.params]), (nuts, None)])
    return Gibbs([(kernel, list(kernel.sites)), (nuts, None)])


def _sources(pm: PrivateModel) -> set:
    return {info.source for info in pm.releases.values()}


@register_backend("gibbs", "bernstein-sheldon")
def _bernstein_sheldon(pm: PrivateModel, options: dict) -> MCMCKernel:
    return _gibbs_or_nuts(pm, "gibbs", options)


@register_backend("naive", "exponential-family")
def _naive(pm: PrivateModel, options: dict) -> MCMCKernel:
    return _gibbs_or_nuts(pm, "naive", options)


@register_backend("clt", "normal-approximation")
def _clt(pm: PrivateModel, options: dict) -> MCMCKernel:
    for info in pm.releases.values():
        _expfam_release(info, pm)
    aug = augment(pm.model, pm.releases, "clt")
    return NUTS(aug, **options.get("nuts_kwargs", {}))


def build_kernel(pm: PrivateModel, method: str, options: dict | None = None) -> MCMCKernel:
    """The kernel of the first backend of ``method`` that covers ``pm``."""
    options = dict(options or {})
    if method not in _BACKENDS:
        raise ValueError(f"Unknown method {method!r}; registered methods: {available_methods()}.")
    reasons = []
    for name, backend in _BACKENDS[method]:
        try:
            return backend(pm, options)
        except NotApplicable as e:
            reasons.append(f"{name}: {e}")
    raise ValueError(
        f"No augmentation registered for method {method!r} covers this model:\n  "
        + "\n  ".join(reasons)
    )


# ---------------------------------------------------------------------------------------------
# Front door.


class PrivatePosterior(MCMCKernel):
    """MCMC kernel that picks the backend of ``method`` for a privatized model at ``init``.

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
        if method not in _BACKENDS:
            raise ValueError(f"Unknown method {method!r}; registered methods: {available_methods()}.")
        if options.get("sections", "joint") not in ("joint", "independent"):
            raise ValueError(
                f"sections must be 'joint' or 'independent', got {options['sections']!r}."
            )
        self._model = model
        self._data = dict(data or {})
        self.method = method
        self.options = options
        self.inner: MCMCKernel | None = None
        self._batched = False

    @property
    def model(self) -> Callable:
        return self._model

    def prepare(self, model_args: tuple = (), model_kwargs: dict | None = None) -> MCMCKernel:
        """Trace the model, pick the backend and build its kernel (done by ``init`` if needed)."""
        pm = inspect_model(self._model, self._data, model_args, dict(model_kwargs or {}))
        self.inner = build_kernel(pm, self.method, self.options)
        return self.inner

    def _kwargs(self, model_kwargs: dict | None) -> dict:
        return {**(model_kwargs or {}), RELEASES_KWARG: self._data}

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if self.inner is None:
            self.prepare(model_args, model_kwargs)
        model_kwargs = self._kwargs(model_kwargs)
        self._batched = not is_prng_key(rng_key)

        def init(key, params):
            return self.inner.init(key, num_warmup, params, model_args, model_kwargs)

        # chain_method="vectorized" passes one key per chain
        return jax.jit(jax.vmap(init) if self._batched else init)(rng_key, init_params)

    def sample(self, state, model_args, model_kwargs):
        model_kwargs = self._kwargs(model_kwargs)
        if self._batched:
            return jax.vmap(lambda s: self.inner.sample(s, model_args, model_kwargs))(state)
        return self.inner.sample(state, model_args, model_kwargs)

    def postprocess_fn(self, model_args, model_kwargs):
        return self.inner.postprocess_fn(model_args, self._kwargs(model_kwargs))

    def get_diagnostics_str(self, state) -> str:
        return "" if self._batched else self.inner.get_diagnostics_str(state)


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
        added with :func:`register_backend`. A method added with :func:`register_fitter`
        (``"sppe"``, ``"sple"`` once :mod:`d3pext.sbi` is imported) returns its own fitted
        object instead of an ``MCMC``, and receives the extra keyword arguments.
    :param sections: covariance of the truncation sections for truncated statistics:
        ``"joint"`` (multinomial, default) or ``"independent"`` (as printed in the paper).
    :param nuts_kwargs: arguments of the NUTS blocks for non-conjugate parameters.
    :return: ``MCMC``; call ``.run(rng_key, *model_args)``.

    **Example**

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import privatize
    >>> from d3pext.mechanisms import LaplaceMechanism
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
    >>> bool(0.35 < samples["theta"].mean() < 0.47)
    True
    """
    if method in _FITTERS:
        return _FITTERS[method](
            model, data, num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
            **mcmc_kwargs,
        )
    options = {"sections": sections}
    if nuts_kwargs:
        options["nuts_kwargs"] = nuts_kwargs
    kernel = PrivatePosterior(model, data, method, **options)
    return MCMC(
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
) -> Callable:
    """The compiled ``(keys (M, chains), *releases (M, ...)) -> samples`` of :func:`sample_releases`.

    Cached (LRU) on the model object and the static arguments, so that calling
    :func:`sample_releases` again with other releases or keys (same ``M`` and number of chains)
    neither traces nor compiles again: compiling a sweep costs seconds, running one for a
    thousand chains well under a millisecond.
    """
    try:
        cache_key = (
            model, names, method, sections, model_args, tuple(sorted(model_kwargs.items())),
            num_warmup, num_samples,
        )
        hash(cache_key)
    except TypeError:  # unhashable model arguments (arrays): build without caching
        cache_key = None
    if cache_key is not None and cache_key in _SAMPLER_CACHE:
        _SAMPLER_CACHE.move_to_end(cache_key)
        return _SAMPLER_CACHE[cache_key]
    kernel = PrivatePosterior(model, first_release, method, sections=sections)
    inner = kernel.prepare(model_args, model_kwargs)

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

    @jax.jit
    def sampler(keys, *values):
        # one vmap over the flattened (data set, chain) axis: nested vmaps compile to a sweep
        # three times slower (and take twice as long to compile) on CPU
        num_sets, num_chains = keys.shape
        flat = [jnp.repeat(v, num_chains, axis=0) for v in values]
        draws = jax.vmap(run_chain)(keys.reshape(-1), *flat)
        return jax.tree.map(lambda d: d.reshape(num_sets, num_chains, *d.shape[1:]), draws)

    if cache_key is not None:
        _SAMPLER_CACHE[cache_key] = sampler
        if len(_SAMPLER_CACHE) > _SAMPLER_CACHE_SIZE:
            _SAMPLER_CACHE.popitem(last=False)
    return sampler


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
    **model_kwargs: Any,
) -> dict[str, jax.Array]:
    """Posterior samples for many independent releases in one compiled call.

    Each value of ``releases`` has a leading axis of ``M`` data sets; the result has shape
    ``(M, num_chains, num_samples, ...)`` per site. Use it for calibration studies. The
    compiled sampler is cached: a second call with the same model, settings and shapes (any
    release values and key) only runs.

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> import numpyro, numpyro.distributions as dist
    >>> from d3pext.handlers import privatize
    >>> from d3pext.mechanisms import LaplaceMechanism
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
    sampler = _release_sampler(
        model, names, {k: v[0] for k, v in zip(names, values)}, method, sections, model_args,
        model_kwargs, num_warmup, num_samples,
    )
    return sampler(random.split(rng_key, (num_sets, num_chains)), *values)
