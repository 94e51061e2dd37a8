"""What an inference backend sees of a privatized model: :class:`PrivateModel`.

:func:`inspect_model` traces the privatized model, conditioned on its releases, once under
``jit`` and hands back only concrete metadata (:class:`Site`: distribution, value, plates and the
static ``infer`` entries of each sample site; the :class:`~d3pext.releases.info.ReleaseInfo` of
each release), never a trace of tracers. Backends build their kernels from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass, field
from functools import partial
import hashlib
from typing import Any

import numpy as np

import jax
from jax import random
import jax.numpy as jnp

from numpyro.distributions.distribution import ExpandedDistribution, Independent, MaskedDistribution
from numpyro.handlers import condition, seed, substitute, trace
from numpyro.infer.initialization import init_to_uniform
from numpyro.primitives import CondIndepStackFrame

from d3pext.compile_cache import program_digest
from d3pext.distributions.expfam import conjugate_parameters, record_distribution
from d3pext.releases.info import CONFIDENTIAL, ReleaseInfo, check_made_as_analysed, release_sites

__all__ = [
    "RELEASES_KWARG",
    "NotApplicable",
    "PrivateModel",
    "Site",
    "conditioned_releases",
    "init_to_uniform_but_confidential",
    "inspect_model",
    "model_fingerprint",
    "released",
]


class NotApplicable(Exception):
    """Raised by a backend whose method does not cover the model; the message says why."""


@dataclass(frozen=True)
class Site:
    """Concrete metadata of one sample site of a privatized model.

    :param name: the site name.
    :param fn: its distribution, with concrete parameters.
    :param value: its value (the data for observed sites; a draw for latent ones).
    :param is_observed: whether the site is observed.
    :param infer: the site's static ``infer`` entries (array-valued ones are dropped).
    :param plates: the site's plates, innermost first.
    :param weighted: whether a ``mask`` or ``scale`` handler weights the site's log density (one
        not concretely ``True`` or ``1``) or its distribution is masked (``fn.mask(...)``): then
        the unmasked distribution is not its factor of the joint.
    """

    name: str
    fn: Any
    value: Any
    is_observed: bool
    infer: Mapping[str, Any] = field(default_factory=dict)
    plates: tuple[CondIndepStackFrame, ...] = ()
    weighted: bool = False


@dataclass(frozen=True)
class PrivateModel:
    """What a backend sees: the privatized model conditioned on the releases, and its sites.

    :param model: the conditioned privatized model (release values arrive through
        ``model_kwargs[RELEASES_KWARG]``, see :func:`released`).
    :param sites: the sample sites, by name (:class:`Site`).
    :param releases: the release sites' :class:`~d3pext.releases.info.ReleaseInfo`.
    :param values: concrete values of the latent sites (drawn uniformly in the unconstrained
        space, fixed key) and of the record parameters, keyed ``"source:parameter"``.
    :param fingerprint: digest of the traced model run (:func:`model_fingerprint`), the release
        values its arguments: equal for every release of the same shapes, and different wherever
        the model computes something else, builds other distributions or declares other static
        metadata (a global it reads changed, say); ``None`` where the run cannot be told apart
        that way.
    :param parameter_sites: ``{"source:parameter": latent site}`` for the parameters of the
        release sources' distributions (masks, plate expansions and ``to_event`` removed) that
        *are* the value of a latent site: the same traced value, no operation between (so
        ``dist.Bernoulli(theta)`` names ``theta``, ``dist.Bernoulli(jnp.minimum(theta, 0.95))``
        does not), that enter no other factor of the joint (no other site's log density, mask or
        scale computes from them) and whose site and source are not :attr:`Site.weighted`.
        Conjugate updates rely on it.
    """

    model: Callable
    sites: Mapping[str, Site]
    releases: Mapping[str, ReleaseInfo]
    values: Mapping[str, Any]
    fingerprint: str | None = None
    parameter_sites: Mapping[str, str] = field(default_factory=dict)

    @property
    def latent(self) -> tuple[str, ...]:
        return tuple(name for name, site in self.sites.items() if not site.is_observed)

    def declaration(self, key: str, how: str) -> Any:
        """The one value that sample sites declare under ``infer[key]`` (e.g. a backend's prior
        spec); :class:`NotApplicable` saying ``how`` to declare it when there is none or several."""
        found = [site.infer[key] for site in self.sites.values() if key in site.infer]
        if len(found) != 1:
            raise NotApplicable(f"{how} (found {len(found)} declarations).")
        return found[0]


def conditioned_releases(model: Callable) -> dict:
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
    serve many releases (:func:`~d3pext.handlers.sample_releases`).
    """
    if isinstance(model, partial) and model.func is _released_model:
        return model
    return partial(_released_model, model)


def _is_static(value: Any) -> bool:
    return not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(value))


def init_to_uniform_but_confidential(msg: dict) -> jax.Array | None:
    """NumPyro's ``init_to_uniform``, except at the confidential discrete sites of the releases:
    zeros of their shape and dtype, which the backends replace (the counts start from their
    releases). Drawing them would cost only a compilation (2-3 s for a Poisson draw on a CPU)."""
    infer = msg.get("infer") or {}
    if msg["type"] == "sample" and not msg["is_observed"] and infer.get(CONFIDENTIAL):
        fn = msg["fn"]
        if getattr(fn.support, "is_discrete", False):
            sample_shape = tuple(msg["kwargs"].get("sample_shape", ()))
            draw = jax.eval_shape(lambda key: fn.sample(key, sample_shape), random.key(0))
            return jnp.zeros(draw.shape, draw.dtype)
    return init_to_uniform(msg)


def _is_weighted(site: dict) -> bool:
    """Whether a handler ``mask`` or ``scale`` applies to the sample site ``site`` (one that is
    traced, or concretely not all ``True`` / all ``1``), or its distribution is masked."""
    mask, scale = site.get("mask"), site.get("scale")
    fn = site["fn"]
    while isinstance(fn, (MaskedDistribution, ExpandedDistribution, Independent)):
        if isinstance(fn, MaskedDistribution) and fn._mask is not True:
            return True
        fn = fn.base_dist

    def concretely(value: Any, neutral: Any) -> bool:
        if isinstance(value, jax.core.Tracer):
            return False
        try:
            return bool(np.all(np.asarray(value) == neutral))
        except Exception:  # not an array of numbers
            return False

    return not (
        (mask is None or concretely(mask, True)) and (scale is None or concretely(scale, 1))
    )


def site_log_density(site: dict) -> jax.Array:
    """The summed log density of the sample site ``site`` as the joint sees it: ``mask`` and
    ``scale`` applied (what a site computes, from parameters that need not be pytree leaves of its
    distribution: a user class without ``arg_constraints`` keeps them as plain attributes)."""
    log_prob = site["fn"].log_prob(site["value"])
    if site.get("mask") is not None:
        log_prob = jnp.where(site["mask"], log_prob, 0.0)
    if site.get("scale") is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


def _base_distribution(fn: Any) -> Any:
    while isinstance(fn, (MaskedDistribution, ExpandedDistribution, Independent)):
        fn = fn.base_dist
    return fn


def _traced_run(
    model: Callable, data: Mapping[str, Any], model_args: tuple, model_kwargs: dict
) -> tuple[Callable, Callable, Any, dict]:
    """The conditioned ``model``, its jitted run (sites' distributions and values), the run's trace
    (``jax.jit(...).trace``: nothing compiled) and the static metadata read while tracing."""
    conditioned_model = released(model)
    static = {}

    def run(data):
        tr = trace(
            substitute(
                seed(conditioned_model, random.key(0)), substitute_fn=init_to_uniform_but_confidential
            )
        ).get_trace(*model_args, **{**model_kwargs, RELEASES_KWARG: data})
        samples = {name: site for name, site in tr.items() if site["type"] == "sample"}
        static["sites"] = {
            name: (
                bool(site["is_observed"]),
                {k: v for k, v in (site.get("infer") or {}).items() if _is_static(v)},
                tuple(site["cond_indep_stack"]),
                _is_weighted(site),
            )
            for name, site in samples.items()
        }
        values = {name: site["value"] for name, site in samples.items() if not site["is_observed"]}
        latent = dict(values)
        candidates = {}
        for info in release_sites(tr).values():
            base = _base_distribution(tr[info.source]["fn"])
            for param in getattr(base, "arg_constraints", {}):
                value = base.__dict__.get(param)
                owner = _sole_parameter_site(samples, latent, info.source, value)
                if owner is not None and not (
                    static["sites"][owner][3] or static["sites"][info.source][3]
                ):
                    candidates[f"{info.source}:{param}"] = (owner, info.source)
            try:
                record = record_distribution(tr[info.source]["fn"])
            except ValueError:
                continue
            for param in conjugate_parameters(record):
                values[f"{info.source}:{param}"] = getattr(record, param)
        fns = {name: (site["fn"], site["value"]) for name, site in samples.items()}
        # every site's log density is an output, so that the liveness pass below sees each use of
        # a candidate; where one cannot be computed, no candidate is safe
        log_densities = {}
        if candidates:
            try:
                log_densities = {name: site_log_density(site) for name, site in samples.items()}
            except Exception:
                candidates = {}
        leaves = jax.tree.leaves((fns, values))
        n = len(leaves)
        static["log_densities"] = {name: n + i for i, name in enumerate(sorted(log_densities))}
        static["candidates"] = {
            key: (name, source, next(i for i, leaf in enumerate(leaves) if leaf is values[name]))
            for key, (name, source) in candidates.items()
        }
        return fns, values, log_densities

    # the release values are arguments, not constants: the traced program, and its digest, are those
    # of every release of the same shapes
    program = jax.jit(run)
    traced = program.trace(dict(data))
    # a candidate's value must feed no operation of the run either (a factor, another site's
    # parameter computed from it): then the record distribution is its only likelihood. Dead
    # operations do not count (numpyro's argument validation, whose result is dropped under jit).
    # The log densities of the candidate's own site and of its source (its prior and the records'
    # likelihood) are the factors a conjugate update replaces; every other output must not use it.
    jaxpr = traced.jaxpr.jaxpr

    def consumed(excluded: set[int]) -> set[int]:
        live = {id(v) for i, v in enumerate(jaxpr.outvars) if i not in excluded}
        used = {id(v) for v in jaxpr.invars}
        for eqn in reversed(jaxpr.eqns):
            if eqn.effects or any(id(v) in live for v in eqn.outvars):
                live.update(id(v) for v in eqn.invars)
                used.update(id(v) for v in eqn.invars)
        return used

    positions = static["log_densities"]
    static["parameter_sites"] = {
        key: name
        for key, (name, source, position) in static["candidates"].items()
        if id(jaxpr.outvars[position]) not in consumed({positions[name], positions[source]})
    }
    return conditioned_model, program, traced, static


def _sole_parameter_site(
    samples: Mapping[str, dict], latent: Mapping[str, Any], source: str, value: Any
) -> str | None:
    """The latent site whose traced value *is* ``value`` (a parameter of ``source``'s records)
    and that appears in no other site, as a parameter or a value: identity, not equality of values
    at one draw (``jnp.minimum(theta, 0.95)`` may equal ``theta`` there and differ elsewhere)."""
    if not isinstance(value, jax.Array):
        return None
    owners = [name for name, v in latent.items() if v is value and name != source]
    if len(owners) != 1:
        return None
    uses = sum(
        leaf is value
        for name, site in samples.items()
        if name != owners[0]
        for leaf in jax.tree.leaves((site["fn"], site["value"]))
    )
    return owners[0] if uses == 1 else None


def _qualified_name(cls: type) -> str | None:
    """``module.qualname`` of a class; ``None`` for a class defined in a function (two such classes
    may share the name and differ in what they compute)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    return None if "<locals>" in name else name


def _static_digest(value: Any, digest: Any) -> bool:
    """Feed ``value`` (static metadata: plain values, arrays, classes, dataclasses, tuples, lists,
    dicts) to ``digest``; ``False`` where it holds something else (a function, an object of another
    kind, a tracer), whose printed form may not tell two of them apart."""

    def put(*parts: Any) -> None:
        for part in parts:
            digest.update(str(part).encode())
            digest.update(b"\0")

    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        put(type(value).__name__, repr(value))
        return True
    if isinstance(value, type):
        name = _qualified_name(value)
        put("class", name)
        return name is not None
    if isinstance(value, jax.core.Tracer):
        return False
    if isinstance(value, (np.ndarray, np.generic, jax.Array)):
        array = np.asarray(value)
        if array.dtype == object:
            return False
        put("array", array.dtype, array.shape)
        digest.update(np.ascontiguousarray(array).tobytes())
        return True
    name = _qualified_name(type(value))
    if name is None:
        return False
    if dataclasses.is_dataclass(value):
        put("dataclass", name)
        for f in dataclasses.fields(value):
            put(f.name)
            if not _static_digest(getattr(value, f.name), digest):
                return False
        return True
    if isinstance(value, (tuple, list)):  # named tuples (plate frames) included
        put(name, len(value))
        return all(_static_digest(item, digest) for item in value)
    if isinstance(value, Mapping):  # in order: equal mappings in another order only miss a cache
        put(name, len(value))
        return all(_static_digest(k, digest) and _static_digest(v, digest) for k, v in value.items())
    return False


def _tree_digest(treedef: Any, digest: Any) -> bool:
    """Feed a pytree structure (classes and auxiliary data of every node) to ``digest``."""
    node = treedef.node_data()
    if node is None:
        digest.update(b"*")
        return True
    cls, aux = node
    digest.update(b"(")
    if not (_static_digest(cls, digest) and _static_digest(aux, digest)):
        return False
    if not all(_tree_digest(child, digest) for child in treedef.children()):
        return False
    digest.update(b")")
    return True


def _fingerprint(traced: Any, static: dict) -> str | None:
    """Digest of the traced run: its program (:func:`~d3pext.compile_cache.program_digest`), the
    distributions it builds (the output tree: a Laplace and a normal of the same parameters trace
    to one program) and its static metadata (release metadata, mechanisms, ``infer`` entries,
    plates), which reach the backends without being computed."""
    program = program_digest(traced.jaxpr)
    if program is None:
        return None
    digest = hashlib.sha256(program.encode())
    if not _tree_digest(traced.out_tree, digest):
        return None
    if not _static_digest((static["sites"], static["parameter_sites"]), digest):
        return None
    return digest.hexdigest()


def model_fingerprint(
    model: Callable, data: Mapping[str, Any] | None, model_args: tuple, model_kwargs: dict
) -> str | None:
    """:attr:`PrivateModel.fingerprint` of ``model`` conditioned on ``data``, from a trace alone
    (nothing compiled or run): caches of compiled samplers key on it, so that a model whose
    global changed is not given the sampler built for the old one."""
    _, _, traced, static = _traced_run(model, dict(data or {}), model_args, dict(model_kwargs))
    return _fingerprint(traced, static)


def inspect_model(
    model: Callable, data: Mapping[str, Any] | None, model_args: tuple, model_kwargs: dict
) -> PrivateModel:
    """Trace the privatized ``model`` conditioned on ``data`` and check the conditioning.

    The trace runs once under ``jit`` (cheap to compile, no eager dispatch). Its distributions
    and values come out of ``jit`` as concrete arrays; plates, observation flags, the static
    ``infer`` entries and which record parameters are latent sites are read during tracing.
    Nothing traced escapes.
    """
    data = dict(data or {})
    conditioned_model, program, traced, static = _traced_run(model, data, model_args, model_kwargs)
    fingerprint = _fingerprint(traced, static)
    found = program(data)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(found)):
        # under an outer trace (chain_method="parallel" initialises kernels inside pmap): the model
        # arguments are concrete, so the trace can run now, op by op. Not by default: every
        # primitive would then compile a program of its own (1.2 s of a Gibbs sampler's first run).
        with jax.ensure_compile_time_eval():
            found = program(data)
    fns, values, _ = jax.device_get(found)
    sites = {
        name: Site(name, fns[name][0], fns[name][1], observed, infer, plates, weighted)
        for name, (observed, infer, plates, weighted) in static["sites"].items()
    }
    releases = {
        name: site.infer["privatize"] for name, site in sites.items() if "privatize" in site.infer
    }
    if not releases:
        raise ValueError("The model has no release sites: wrap it with privatize(...).")
    given = {**conditioned_releases(model), **data}
    unknown = sorted(set(given) - set(sites))
    if unknown:
        raise ValueError(
            f"Conditioning on {unknown}, which the privatized model does not have; its release "
            f"sites are {sorted(releases)}."
        )
    missing = sorted(name for name in releases if not sites[name].is_observed)
    if missing:
        raise ValueError(
            f"The release sites {missing} are not observed: pass the release values, "
            f"e.g. data={{{missing[0]!r}: value}}."
        )
    for name, info in releases.items():
        if sites[info.source].is_observed:
            raise ValueError(
                f"The confidential site {info.source!r} of release {name!r} is observed; the "
                "analyst's model must leave it latent (pass no confidential data)."
            )
    for name, value in given.items():
        if name in releases:
            check_made_as_analysed(name, value, releases[name])
    return PrivateModel(
        conditioned_model, sites, releases, values, fingerprint, dict(static["parameter_sites"])
    )
