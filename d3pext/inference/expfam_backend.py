"""The built-in backends for exponential families (Bernstein & Sheldon, seed 004).

The handler :class:`augment` replaces the confidential record sites (masked, never sampled) and
the release sites of a privatized model by the latent statistic sites of a method, e.g.
``"x_dp_stat"`` and ``"x_dp_noise_var"`` for the release ``"x_dp"``. Three backends build on it:

- ``"gibbs"`` (:func:`bernstein_sheldon_kernel`): data augmentation, conjugate parameters by
  conjugacy (:class:`~d3pext.inference.expfam_gibbs.ExpFamGibbs`), the others by NUTS within
  :class:`numpyro.infer.Gibbs`;
- ``"naive"`` (:func:`naive_kernel`): the release taken as the exact statistic (the baseline that
  ignores the noise);
- ``"clt"`` (:func:`clt_kernel`): NUTS on the parameters and the confidential statistic, the
  statistic under its normal (random-sum) CLT approximation and the release under the
  mechanism's own density.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import math
from typing import Any

import jax.numpy as jnp

import numpyro
from numpyro.distributions import constraints
import numpyro.distributions as dist
from numpyro.infer import NUTS, Gibbs
from numpyro.infer.mcmc import MCMCKernel
from numpyro.primitives import Messenger

from d3pext.distributions.expfam import (
    ExpFamily,
    clt_moments,
    conjugate_parameters,
    family_of,
    find_conjugate,
    random_sum_moments,
    record_distribution,
)
from d3pext.inference.expfam_gibbs import ExpFamGibbs, StatisticBlock
from d3pext.inference.structure import NotApplicable, PrivateModel
from d3pext.releases.info import ReleaseInfo

__all__ = ["augment", "bernstein_sheldon_kernel", "clt_kernel", "naive_kernel"]


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
    >>> from d3pext.releases.info import release_sites
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
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
        record = record_distribution(pm.sites[info.source].fn)
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

    Identity is structural (:attr:`~d3pext.inference.structure.PrivateModel.parameter_sites`):
    the parameter is the site's traced value, with no operation between, and the site enters no
    other factor of the model. A transformed site (``1 - theta``, ``jnp.minimum(theta, 0.95)``),
    one that other sites depend on, or one whose prior or records a ``mask`` or ``scale`` weighs,
    is left to NUTS.
    """
    pairs = []
    for param in conjugate_parameters(record):
        name = pm.parameter_sites.get(f"{info.source}:{param}")
        if (
            name is not None
            and name not in exclude
            and name != info.source
            and find_conjugate(record, param, pm.sites[name].fn) is not None
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


def bernstein_sheldon_kernel(pm: PrivateModel, options: dict) -> MCMCKernel:
    return _gibbs_or_nuts(pm, "gibbs", options)


def naive_kernel(pm: PrivateModel, options: dict) -> MCMCKernel:
    return _gibbs_or_nuts(pm, "naive", options)


def clt_kernel(pm: PrivateModel, options: dict) -> MCMCKernel:
    for info in pm.releases.values():
        _expfam_release(info, pm)
    aug = augment(pm.model, pm.releases, "clt")
    return NUTS(aug, **options.get("nuts_kwargs", {}))
