"""Simulation-based inference from private releases: SPPE and SPLE (Xiong, Ju & Zhang, seed 000).

The simulator is the privatized NumPyro model itself: run forward (vmapped over simulations) it
draws the parameters from their prior (or from the current proposal, by substitution), the
confidential data, and the released statistic *before* noise (``infer["statistic"]`` of each
release site). The mechanism is then integrated out of the loss by randomized quasi-Monte Carlo
(:mod:`d3pext.simulation.rqmc`, eq. 11): ``M`` releases per simulated data set, from a scrambled Sobol set
mapped through the mechanism's inverse CDF.

- **SPPE** (Algorithm 1): a conditional flow ``q(theta | s_dp)``; round 1 (prior proposal) by
  maximum likelihood (eq. 7), later rounds by the atomic APT loss of Greenberg et al. (2019)
  (eq. 8): for each pair the contrasting parameters are ``num_atoms - 1`` others of the batch, and
  ``log q~(theta_i | s) = log q(theta_i | s) / p(theta_i) - log sum_k q(theta_k | s) / p(theta_k)``
  (the proposal densities cancel for an atomic proposal). Proposal for the next round:
  ``q(theta | s_obs)``.
- **SPLE** (Algorithm 2): a conditional flow ``q(s_dp | theta)`` trained by maximum likelihood
  (eq. 5) on all rounds; proposal and posterior ``p(theta) q(s_obs | theta)`` sampled by NUTS.

Parameters are handled in NumPyro's unconstrained space (``biject_to`` of each prior's support)
and standardized with the first round's statistics, as are the noisy releases (SPLE must be
standardized with the statistics of the noisy releases, not of the clean ones).

Use it through the front door::

    post = private_posterior(model, {"x_dp": s_obs}, method="sppe", rounds=10,
                             simulations_per_round=1000)
    post.run(rng_key, *model_args)
    draws = post.sample(rng_key, 1000)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
import dataclasses
from dataclasses import dataclass
import hashlib
import time
from typing import Any
import warnings

import numpy as np

import jax
from jax import lax, random
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from jax.scipy.special import logsumexp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from numpyro.distributions import biject_to
from numpyro.handlers import condition, seed, substitute, trace
from numpyro.ops.provenance import eval_provenance

from d3pext._backend import by_backend
from d3pext._threads import one_model_at_a_time
from d3pext.compile_cache import program_digest
from d3pext.simulation import rqmc
from d3pext.simulation.flows import FlowTrainer, conditional_spline_flow, require_flowjax
from d3pext.inference.structure import conditioned_releases, site_log_density
from d3pext.releases.info import ReleaseInfo, check_made_as_analysed, release_sites
from d3pext.validation import check_int

__all__ = ["SPLE", "SPPE", "SequentialEstimator", "Simulator"]


# ---------------------------------------------------------------------------------------------
# The privatized model as a simulator.


class Simulator:
    """A privatized model run forward: parameters, confidential statistic, releases.

    :param model: a privatized model (possibly conditioned on its releases).
    :param data: ``{release site: observed value}``.
    :param parameters: the latent sites to infer (default: every latent sample site that is
        neither a confidential source of a release nor a release). The prior of each may depend
        on the others only (and on the model's arguments): a latent site left out is drawn given
        them, so it must not be an ancestor of one (:meth:`log_prior` is their marginal prior).
    :param devices: devices over which a batch of simulations (and of RQMC releases) is split,
        along a one-dimensional mesh (default: all local devices; ``devices=jax.devices()[:1]``
        keeps one). The batch is padded to a multiple of the device count and the padding
        dropped: the results do not depend on the number of devices.

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression
    >>> sim = Simulator(private_linear_regression(100, 10.0), {"records_dp": jnp.array(PAPER_S_DP)},
    ...                 (100,))
    >>> z, stat = sim.simulate(random.key(0), 5)
    >>> z.shape, stat.shape, sim.parameters
    ((5, 3), (5, 9), ('beta',))
    """

    @one_model_at_a_time
    def __init__(
        self,
        model: Callable,
        data: Mapping[str, Any] | None,
        model_args: tuple = (),
        model_kwargs: dict | None = None,
        parameters: tuple[str, ...] | None = None,
        devices: Sequence[jax.Device] | None = None,
    ) -> None:
        self.devices = tuple(jax.local_devices() if devices is None else devices)
        if not self.devices:
            raise ValueError("devices must name at least one device.")
        self._sharding = (
            NamedSharding(Mesh(np.asarray(self.devices), ("batch",)), PartitionSpec("batch"))
            if len(self.devices) > 1 else None
        )
        self.model_args = tuple(model_args)
        self.model_kwargs = dict(model_kwargs or {})
        given = {**conditioned_releases(model), **dict(data or {})}
        self.model = condition(model, data=dict(data)) if data else model
        # run forward, each release site takes its statistic: the observed releases play no part,
        # so the compiled simulation programs depend on the model, its arguments and mechanisms only
        self._forward = model
        box = {}

        def run(key):
            tr = trace(seed(substitute(self._forward, substitute_fn=_statistic_of), key)).get_trace(
                *self.model_args, **self.model_kwargs
            )
            box["trace"] = tr
            return {n: s["value"] for n, s in tr.items() if s["type"] == "sample"}

        try:
            # the structure, shapes and dtypes only: an abstract trace compiles nothing (compiling the
            # model's forward run took 1-6 s per estimator, every time); its jaxpr keys the programs
            forward, values = jax.make_jaxpr(run, return_shape=True)(random.key(0))
        except NotImplementedError as e:
            raise ValueError(
                "The model cannot be simulated forward (a sample site has no sampler): "
                f"SPPE/SPLE need a generative model. ({e})"
            ) from e
        tr = box["trace"]
        releases = release_sites(tr)
        if not releases:
            raise ValueError("The model has no release sites: wrap it with privatize(...).")
        unknown = sorted(set(given) - set(releases))
        if unknown:
            raise ValueError(
                f"Conditioning on {unknown}, which are not release sites of the model; its "
                f"release sites are {sorted(releases)}."
            )
        missing = sorted(set(releases) - set(given))
        if missing:
            raise ValueError(
                f"No observed value for the release sites {missing}: pass data={{{missing[0]!r}: value}}."
            )
        for name, value in given.items():
            check_made_as_analysed(name, value, releases[name])
        self.releases: dict[str, ReleaseInfo] = releases
        sources = {info.source for info in releases.values()}
        for name, info in releases.items():
            if tr[info.source]["is_observed"]:
                raise ValueError(
                    f"The confidential site {info.source!r} of release {name!r} is observed; the "
                    "analyst's model must leave it latent (pass no confidential data): the "
                    "simulations would all hold the real records."
                )
        observed = [
            n for n, s in tr.items()
            if s["type"] == "sample" and s["is_observed"] and n not in releases
        ]
        if observed:
            raise ValueError(
                f"The model observes {observed}, which are not releases (numpyro.factor sites "
                "included): simulation-based inference (SPPE, SPLE, ABC) conditions on the releases "
                "only and would drop their likelihood. Use an MCMC method of private_posterior "
                "(e.g. the default 'gibbs'), which conditions on every observed site, or leave "
                "these sites unobserved."
            )
        if parameters is None:
            parameters = tuple(
                n for n, s in tr.items()
                if s["type"] == "sample" and not s["is_observed"] and n not in sources
                and n not in releases
            )
        parameters = tuple(parameters)
        if not parameters:
            raise ValueError("The model has no latent parameters to infer.")
        for name in parameters:
            if name not in tr or tr[name]["type"] != "sample" or name in releases or name in sources:
                raise ValueError(f"{name!r} is not a latent parameter site of the model.")
        _check_prior_closed(self._forward, self.model_args, self.model_kwargs, tr, values, parameters,
                            sources | set(releases))
        self.parameters = parameters
        self.sources = sources
        self.transforms = {n: biject_to(tr[n]["fn"].support) for n in parameters}
        # a point of each parameter's support, for the layout of the flat unconstrained vector
        layout = {n: jax.eval_shape(self.transforms[n].inv, values[n]) for n in parameters}
        unconstrained = {n: jnp.zeros(u.shape, u.dtype) for n, u in layout.items()}
        flat, self._unravel = ravel_pytree(unconstrained)
        self.dim = int(flat.shape[0])
        # placeholders for the confidential sources in log_prior, which sums the parameters' terms only
        self._source_values = {n: jnp.zeros(values[n].shape, values[n].dtype) for n in sources}
        # observed releases, flattened in release order
        obs, self._release_slices, offset = [], {}, 0
        for name, info in releases.items():
            expected = np.shape(values[name])
            value = jnp.asarray(given[name], dtype=jnp.result_type(float))
            if value.shape != expected:
                raise ValueError(
                    f"The observed release {name!r} has shape {value.shape}; the model releases "
                    f"shape {expected}."
                )
            size = int(np.prod(expected, dtype=int))
            self._release_slices[name] = (offset, size, expected)
            obs.append(value.reshape(-1))
            offset += size
        self.observed = jnp.concatenate(obs)
        self.release_dim = offset
        # the mechanisms enter no forward run: they key the release-point programs
        key = (model, self.model_args, self.model_kwargs, parameters, tuple(releases.items()))
        self.programs = _programs_of(self, key, forward)
        self._simulate_prior = self.programs.simulate_prior
        self._simulate_given = self.programs.simulate_given
        self._noisy = self.programs.noisy

    # -- parameter spaces
    def constrain(self, z: jax.Array) -> dict:
        """Constrained parameter values of the unconstrained flat vector ``z`` (one draw)."""
        u = self._unravel(z)
        return {n: self.transforms[n](u[n]) for n in self.parameters}

    def unconstrain(self, params: Mapping[str, Any]) -> jax.Array:
        """The flat unconstrained vector of one draw of ``params``."""
        u = {n: self.transforms[n].inv(jnp.asarray(params[n])) for n in self.parameters}
        return ravel_pytree(u)[0]

    def log_abs_det_jacobian(self, z: jax.Array) -> jax.Array:
        """``log |d constrain / dz|`` at ``z`` (one draw)."""
        u = self._unravel(z)
        total = jnp.zeros(())
        for n in self.parameters:
            t = self.transforms[n]
            x = t(u[n])
            ladj = t.log_abs_det_jacobian(u[n], x)
            total = total + jnp.sum(ladj)
        return total

    @one_model_at_a_time
    def log_prior(self, z: jax.Array) -> jax.Array:
        """Prior log density of the unconstrained ``z`` (one draw), Jacobian included."""
        values = {**self.constrain(z), **self._source_values}

        def fn(msg):
            if msg["name"] in values:
                return values[msg["name"]]
            return _statistic_of(msg)

        tr = trace(seed(substitute(self._forward, substitute_fn=fn), random.key(0))).get_trace(
            *self.model_args, **self.model_kwargs
        )
        lp = sum(jnp.sum(tr[n]["fn"].log_prob(tr[n]["value"])) for n in self.parameters)
        return lp + self.log_abs_det_jacobian(z)

    # -- simulation
    def _simulate_one(self, key, z):
        values = {} if z is None else self.constrain(z)

        def fn(msg):
            if msg["name"] in values:
                return values[msg["name"]]
            return _statistic_of(msg)

        tr = trace(seed(substitute(self._forward, substitute_fn=fn), key)).get_trace(
            *self.model_args, **self.model_kwargs
        )
        u = {n: self.transforms[n].inv(tr[n]["value"]) for n in self.parameters}
        stat = jnp.concatenate(
            [jnp.reshape(tr[n]["infer"]["statistic"], -1).astype(jnp.result_type(float))
             for n in self.releases]
        )
        return ravel_pytree(u)[0], stat

    def _over_devices(self, fn: Callable, *batch: jax.Array):
        """``fn(*batch)`` with the leading axis of ``batch`` split over :attr:`devices`: padded
        (by repeating rows) to a multiple of the device count, the padding dropped."""
        if self._sharding is None:
            return fn(*batch)
        num = batch[0].shape[0]
        rows = jnp.arange(num + (-num % len(self.devices))) % num
        out = fn(*jax.device_put([b[rows] for b in batch], self._sharding))
        # back on one device, so that later (unsharded) computations mix freely with it
        return jax.device_put(jax.tree.map(lambda o: o[:num], out), self.devices[0])

    @one_model_at_a_time
    def simulate(self, rng_key: jax.Array, num: int, z: jax.Array | None = None):
        """``num`` forward runs: unconstrained parameters ``(num, dim)`` (drawn from the prior,
        or the given ``z``) and confidential statistics ``(num, release_dim)``, split over
        :attr:`devices`."""
        keys = random.split(rng_key, num)
        if z is None:
            return self._over_devices(self._simulate_prior, keys)
        return self._over_devices(self._simulate_given, keys, jnp.asarray(z))

    def release_points(
        self, rng_key: jax.Array, stat: jax.Array, num_points: int, method: str = "rqmc"
    ) -> jax.Array:
        """``num_points`` releases of each statistic: ``(num, num_points, release_dim)``, split
        over :attr:`devices`. With RQMC or MC (mechanisms with an inverse CDF) row ``i`` does not
        depend on the number of rows (JAX's threefry is partitionable, and each release's uniforms
        come from one call for all rows), so the padding leaves the results unchanged."""
        key = (num_points, method)
        if key not in self._noisy:
            def noisy(k, stat):
                parts = []
                for i, (name, info) in enumerate(self.releases.items()):
                    offset, size, shape = self._release_slices[name]
                    parts.append(
                        rqmc.release_points(  # parameters per count (alpha per row) raveled with the counts
                            info.mechanism.flattened(shape), random.fold_in(k, i), stat[:, offset : offset + size],
                            num_points, method,
                        ).astype(stat.dtype)
                    )
                return jnp.concatenate(parts, -1)

            self._noisy[key] = jax.jit(noisy)
        fn = self._noisy[key]
        return self._over_devices(lambda s: fn(rng_key, s), jnp.asarray(stat))


class SimulationPrograms:
    """The compiled programs of one model with its arguments, shared by every :class:`Simulator`
    (and estimator) of that model: a second fit (another release, seed or method) compiles none
    of them again. ``simulate_prior`` and ``simulate_given`` run the model forward; ``noisy`` holds
    the release-point programs by ``(num_points, method)``; ``extra`` holds the estimators' own.

    They are shared only where the model function, its arguments, its releases (mechanisms
    included: their noise enters no forward run) *and* its traced forward run (jaxpr and
    constants) are the same: a model that reads a global changed between two fits (a prior, an
    epsilon) is traced and compiled again, not served a stale program."""

    def __init__(self, sim: "Simulator") -> None:
        # the programs use only what the key fixes (the model, its arguments, the parameters and
        # the releases)
        self.simulate_prior = jax.jit(jax.vmap(lambda k: sim._simulate_one(k, None)))
        self.simulate_given = jax.jit(jax.vmap(sim._simulate_one))
        self.noisy: dict = {}
        self.extra: dict = {}


_PROGRAMS: "OrderedDict[tuple, SimulationPrograms]" = OrderedDict()
_MAX_PROGRAMS = 16  # models whose programs are kept (least recently used first out)


def _programs_of(sim: "Simulator", key: tuple, forward: jax.core.ClosedJaxpr) -> SimulationPrograms:
    """The shared programs of ``key`` = (model, args, kwargs, parameters, releases) with the forward run
    ``forward`` (by its :func:`~d3pext.compile_cache.program_digest`); programs of its own where an
    argument has no faithful hashable form (e.g. a large or traced array) or the run no digest."""
    digest = program_digest(forward)
    if digest is None:  # a forward run that cannot be told apart by its digest (host callbacks, ...)
        return SimulationPrograms(sim)
    try:
        key = (_hashable(key), digest)
        hash(key)
    except TypeError:
        return SimulationPrograms(sim)
    programs = _PROGRAMS.pop(key, None) or SimulationPrograms(sim)
    _PROGRAMS[key] = programs
    while len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return programs


def _hashable(value: Any) -> Any:
    """A hashable form of a model argument that equals another's only for equal arguments of the
    same type (floats by ``repr``: ``0.0`` and ``-0.0`` differ); ``TypeError`` where there is none."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError("a traced value")
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(value)
        if a.dtype == object or a.nbytes > 1 << 28:
            raise TypeError("an object array, or one over 256 MiB")
        digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).hexdigest()
        return (type(value).__name__, a.shape, a.dtype.str, digest)
    if isinstance(value, float):
        return (float, repr(value))
    if value is None or isinstance(value, (bool, int, complex, str, bytes)):
        return (type(value), value)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(_hashable(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((_hashable(k), _hashable(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # ReleaseInfo, mechanisms
        return (type(value), tuple((f.name, _hashable(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if callable(value):
        return ("callable", value)  # a function: by identity
    raise TypeError(f"no hashable form for {type(value).__name__}")


def _check_prior_closed(
    model: Callable, model_args: tuple, model_kwargs: dict, tr: Mapping[str, dict],
    values: Mapping[str, Any], parameters: tuple[str, ...], data_sites: set[str],
) -> None:
    """Refuse parameters whose prior depends on a sample site that is not one of them
    (``data_sites``: the confidential sources and the releases).

    The simulations draw every other site given the parameters, and :meth:`Simulator.log_prior`
    sums the parameters' own terms: both are right exactly when the parameters' priors depend on
    the parameters alone (the other sites then follow ``p(rest | parameters)`` by ancestral
    sampling, and the terms multiply to the marginal ``p(parameters)``). A left-out ancestor
    would get a draw from its prior whatever the parameters (an unlisted ``mu`` of
    ``theta ~ N(mu, s)``). The dependences are the data flow of the traced run (NumPyro's
    provenance tracking): they may include too much, never too little."""
    names = [n for n, s in tr.items() if s["type"] == "sample"]
    last = max(names.index(p) for p in parameters)
    if set(names[:last]) <= set(parameters):
        return  # only parameters come before them: no other site can be an ancestor

    def priors(**sampled):
        run = trace(seed(substitute(model, data=sampled), random.key(0))).get_trace(*model_args, **model_kwargs)
        flows = {n: [leaf for leaf in jax.tree.leaves(run[n]["fn"]) if isinstance(leaf, jax.Array)]
                 for n in names[: last + 1]}
        # and the log densities: a user distribution without arg_constraints keeps its parameters
        # as plain attributes, no pytree leaves; a mask or scale handler may compute from a site
        for n in flows:
            if n not in data_sites:
                flows[n].append(site_log_density(run[n]))
        return flows

    try:
        flows = eval_provenance(priors, **{n: values[n] for n in names})
    except Exception as e:
        raise ValueError(
            f"Could not trace on which sites the priors of parameters={parameters} depend ({e}); "
            f"sites {sorted(set(names[:last]) - set(parameters))} come before them. Sample the "
            "parameters first in the model, or name every latent site they depend on as a parameter."
        ) from e
    deps = {n: frozenset().union(*flows[n]) - {n} for n in flows}
    ancestors, todo = set(), list(parameters)
    while todo:
        for u in deps.get(todo.pop(), ()):
            if u not in ancestors:
                ancestors.add(u)
                todo.append(u)
    outside = [n for n in names if n in ancestors and n not in parameters]
    if not outside:
        return
    blocked = [n for n in outside if n in data_sites]
    if blocked:
        raise ValueError(
            f"The prior of parameters={parameters} depends on {blocked}, the confidential data or a "
            "release: simulation-based inference needs parameters whose prior comes before the data."
        )
    suggested = tuple(n for n in names if n in parameters or n in outside)
    raise ValueError(
        f"The prior of parameters={parameters} depends on the latent sites {outside}, which are not "
        "parameters: the simulations would draw them from their prior whatever the parameters, and "
        "log_prior would not be the parameters' marginal prior. Infer them too "
        f"(parameters={suggested}) and ignore their draws."
    )


def _statistic_of(msg: dict):
    """Substitute a release site by its statistic (no noise is drawn while simulating)."""
    infer = msg.get("infer") or {}
    return infer.get("statistic") if "privatize" in infer else None


# ---------------------------------------------------------------------------------------------
# The sequential estimators.


@dataclass(frozen=True)
class _Scaler:
    theta_mean: jax.Array
    theta_std: jax.Array
    s_mean: jax.Array
    s_std: jax.Array


def _std(x, axis):
    s = jnp.std(x, axis)
    return jnp.where(s > 0, s, 1.0)


# The bookkeeping of a round, compiled: op by op, each of its small steps compiled a program of its
# own in every new process (a second of each fit).
@jax.jit
def _round_keys(rng_key: jax.Array, i: jax.Array) -> tuple:
    """Round ``i``'s keys: proposal, simulation, release noise, split, training."""
    return tuple(random.split(random.fold_in(rng_key, i), 5))


@jax.jit
def _split_two(rng_key: jax.Array) -> tuple:
    return tuple(random.split(rng_key))


@jax.jit
def _scale_of(z: jax.Array, s: jax.Array) -> tuple:
    return jnp.mean(z, 0), _std(z, 0), jnp.mean(s, (0, 1)), _std(s, (0, 1))


class SequentialEstimator:
    """Common machinery of :class:`SPPE` and :class:`SPLE` (not used directly).

    :param model: a privatized model; :param data: ``{release site: observed value}``.
    :param int rounds: ``R``; :param int simulations_per_round: ``N``.
    :param int num_points: ``M`` releases per simulated data set (a power of two for RQMC).
    :param str integration: ``"rqmc"`` (default) or ``"mc"``.
    :param float validation_fraction: share of each round's simulations held out (5%).
    :param dict flow_kwargs: arguments of :func:`~d3pext.simulation.flows.conditional_spline_flow`.
    :param learning_rate, weight_decay, batch_size, patience, max_epochs: training (paper S3).
    :param parameters: latent sites to infer (default: all but the confidential data), with every
        latent site their prior depends on.
    :param bool progress_bar: bars over rounds and epochs.
    :param devices: devices over which each round's simulations and RQMC releases are split
        (default: all local devices; ``jax.devices()[:1]`` for one); same results for the same key.
    """

    method = ""

    def __init__(
        self,
        model: Callable,
        data: Mapping[str, Any] | None = None,
        *,
        rounds: int = 10,
        simulations_per_round: int = 1000,
        num_points: int = 32,
        integration: str = "rqmc",
        validation_fraction: float = 0.05,
        flow_kwargs: dict | None = None,
        learning_rate: float = 5e-4,
        weight_decay: float = 1e-4,
        batch_size: int = 100,
        patience: int = 20,
        max_epochs: int = 1000,
        parameters: tuple[str, ...] | None = None,
        progress_bar: bool = True,
        num_warmup: int = 300,
        num_samples: int = 1000,
        num_chains: int = 4,
        devices: Sequence[jax.Device] | None = None,
        **unused: Any,
    ) -> None:
        unused.pop("chain_method", None)
        unused.pop("sections", None)
        unused.pop("nuts_kwargs", None)
        if unused:
            raise TypeError(f"{self.method}: unexpected arguments {sorted(unused)}.")
        require_flowjax()
        self.model, self.data = model, dict(data or {})
        self.rounds = check_int("rounds", rounds)
        self.simulations_per_round = check_int("simulations_per_round", simulations_per_round)
        self.num_points = check_int("num_points", num_points)
        if integration not in ("rqmc", "mc"):
            raise ValueError(f"integration must be 'rqmc' or 'mc', got {integration!r}.")
        self.integration = integration
        if not 0 < validation_fraction < 1:
            raise ValueError(f"validation_fraction must lie in (0, 1), got {validation_fraction}.")
        self.num_valid = max(1, int(round(validation_fraction * self.simulations_per_round)))
        self.num_train = self.simulations_per_round - self.num_valid
        self.batch_size = check_int("batch_size", batch_size)
        if self.num_train < self.batch_size:
            raise ValueError(
                f"simulations_per_round={self.simulations_per_round} leaves {self.num_train} "
                f"training examples per round, fewer than batch_size={self.batch_size}."
            )
        self.flow_kwargs = dict(flow_kwargs or {})
        self.train_kwargs = dict(learning_rate=learning_rate, weight_decay=weight_decay,
                                 batch_size=self.batch_size, patience=patience, max_epochs=max_epochs)
        self.parameters = parameters
        self.devices = None if devices is None else tuple(devices)
        self.progress_bar = progress_bar
        self.num_warmup = check_int("num_warmup", num_warmup, 0)
        self.num_samples = check_int("num_samples", num_samples)
        self.num_chains = check_int("num_chains", num_chains)
        self.diagnostics: list[dict] = []
        self.simulator: Simulator | None = None
        self.flow = None
        self.scaler: _Scaler | None = None
        self._last_parameters: jax.Array | None = None  # of the last round's simulations

    # subclasses: _make_flow, _losses, _propose, _round_summary
    @one_model_at_a_time
    def run(self, rng_key: jax.Array, *model_args: Any, **model_kwargs: Any) -> "SequentialEstimator":
        """Run the ``R`` rounds of simulation and training; returns ``self``."""
        self.simulator = sim = Simulator(self.model, self.data, model_args, model_kwargs,
                                         self.parameters, self.devices)
        if self.integration == "rqmc":
            for info in sim.releases.values():
                if not rqmc.has_inverse_cdf(info.mechanism):
                    warnings.warn(
                        f"release {info.name!r}: {type(info.mechanism).__name__} has no inverse "
                        "CDF; integrating it by plain Monte Carlo.", stacklevel=2)
        R, N, M = self.rounds, self.simulations_per_round, self.num_points
        d, r = sim.dim, sim.release_dim
        cap_t, cap_v = R * self.num_train, R * self.num_valid
        fdt = np.dtype(jnp.result_type(float))
        train = {"z": np.zeros((cap_t, d), fdt), "s": np.zeros((cap_t, M, r), fdt),
                 "logp": np.zeros((cap_t,), fdt)}
        valid = {k: np.zeros((cap_v, *v.shape[1:]), fdt) for k, v in train.items()}
        prepare = sim.programs.extra.get(("prepare", N))
        if prepare is None:
            @jax.jit
            def prepare(z, s, scale, key):
                """Which simulations are finite; the standardized parameters and releases, the log
                prior and the random permutation that splits them into training and validation rows."""
                ok = jnp.all(jnp.isfinite(s), (1, 2)) & jnp.all(jnp.isfinite(z), 1)
                zs, ss = (z - scale[0]) / scale[1], (s - scale[2]) / scale[3]
                return ok, zs, ss, jax.vmap(sim.log_prior)(z), random.permutation(key, N)

            sim.programs.extra["prepare", N] = prepare

        key_flow, rng_key = _split_two(rng_key)
        self.diagnostics = []
        rounds = range(R)
        if self.progress_bar:
            from tqdm.auto import tqdm

            rounds = tqdm(rounds, desc=f"{self.method} rounds")
        for i in rounds:
            k_prop, k_sim, k_noise, k_split, k_train = _round_keys(rng_key, np.int32(i))
            t0 = time.perf_counter()
            z = None if i == 0 else self._propose(k_prop, N)
            t1 = time.perf_counter()
            z, stat = sim.simulate(k_sim, N, z)
            self._last_parameters = z
            s = sim.release_points(k_noise, stat, M, self.integration)
            s.block_until_ready()
            t2 = time.perf_counter()
            sc = _Scaler(*_scale_of(z, s)) if i == 0 else self.scaler
            ok, zs, ss, lp, perm = jax.device_get(
                prepare(z, s, (sc.theta_mean, sc.theta_std, sc.s_mean, sc.s_std), k_split)
            )
            if not ok.all():
                raise ValueError(f"round {i + 1}: {int((~ok).sum())} simulations are not finite.")
            if i == 0:
                self.scaler = sc
                self.flow = self._make_flow(key_flow, d, r)
            vi, ti = perm[: self.num_valid], perm[self.num_valid :]
            for buf, rows, start in ((train, ti, i * self.num_train), (valid, vi, i * self.num_valid)):
                buf["z"][start : start + len(rows)] = zs[rows]
                buf["s"][start : start + len(rows)] = ss[rows]
                buf["logp"][start : start + len(rows)] = lp[rows]
            trainer = self._trainer(i)
            self.flow, report = trainer.fit(
                self.flow, jax.device_put(train), (i + 1) * self.num_train,
                jax.device_put(valid), (i + 1) * self.num_valid, k_train,
                progress_bar=self.progress_bar, description=f"round {i + 1} epochs",
            )
            t3 = time.perf_counter()
            self.diagnostics.append({
                "round": i + 1, "simulations": (i + 1) * N, "propose_s": t1 - t0,
                "simulate_s": t2 - t1, "train_s": t3 - t2, "epochs": report.epochs,
                "best_valid_loss": report.best_valid_loss, "nonfinite_steps": report.nonfinite_steps,
                "stopped_early": report.stopped_early,
            })
        self._finish(random.fold_in(rng_key, R))
        return self

    def _make_flow(self, key, d, r):
        raise NotImplementedError

    def _trainer(self, round_index: int) -> FlowTrainer:
        raise NotImplementedError

    def _propose(self, key, num):
        raise NotImplementedError

    def _finish(self, key):
        pass

    def _check_run(self):
        if self.flow is None:
            raise RuntimeError(f"{self.method}: call .run(rng_key, *model_args) first.")

    def _constrain_batch(self, z: jax.Array) -> dict:
        return jax.vmap(self.simulator.constrain)(z)

    def _unconstrain_batch(self, params: Mapping[str, Any]) -> jax.Array:
        return jax.vmap(self.simulator.unconstrain)(dict(params))

    @property
    def observed_standardized(self) -> jax.Array:
        return (self.simulator.observed - self.scaler.s_mean) / self.scaler.s_std

    def sample_unconstrained(self, rng_key: jax.Array, num_samples: int) -> jax.Array:
        raise NotImplementedError

    def sample(self, rng_key: jax.Array, num_samples: int) -> dict:
        """Posterior draws, ``{site: (num_samples, ...)}`` in the model's (constrained) space."""
        self._check_run()
        return self._constrain_batch(self.sample_unconstrained(rng_key, check_int("num_samples", num_samples)))

    def get_samples(self) -> dict:
        """``num_samples`` posterior draws (as ``MCMC.get_samples``), with a fixed key."""
        return self.sample(random.key(0), self.num_samples)

    def to_inference_data(self, num_samples: int | None = None, rng_key: jax.Array | None = None):
        """Posterior draws as an ArviZ ``InferenceData`` (needs ``pip install -e ".[arviz]"``).

        Groups: ``posterior``, one chain of ``num_samples`` draws (default ``self.num_samples``,
        key default ``random.key(0)``, the draws of :meth:`get_samples`); ``observed_data``, the
        observed releases by release site. ``attrs["inference_method"]`` is ``"sppe"`` or ``"sple"``.
        """
        try:
            import arviz as az
        except ImportError as e:
            raise ImportError(
                f"{type(self).__name__}.to_inference_data needs ArviZ: pip install -e \".[arviz]\" "
                "(or pip install arviz)."
            ) from e
        self._check_run()
        num = self.num_samples if num_samples is None else num_samples
        draws = jax.device_get(self.sample(random.key(0) if rng_key is None else rng_key, num))
        sim = self.simulator
        observed = np.asarray(sim.observed)
        releases = {
            name: observed[offset : offset + size].reshape(shape)
            for name, (offset, size, shape) in sim._release_slices.items()
        }
        return az.from_dict(
            posterior={k: np.asarray(v)[None] for k, v in draws.items()},
            observed_data=releases,
            attrs={"inference_library": "d3pext", "inference_method": self.method},
        )


_JITTED: dict = {}


def _jitted(name: str) -> Callable:
    """Module-level compiled flow methods. Called eagerly, flowjax's ``sample`` and ``log_prob``
    compile their inner ``scan`` anew on every call (a fresh closure each time: seconds per
    proposal round); compiled once here, they are cached by shape and the flow's structure."""
    if name not in _JITTED:
        import equinox as eqx

        fns = {
            "sample": lambda flow, key, num, cond: flow.sample(key, (num,), condition=cond),
            "log_prob": lambda flow, x, cond: flow.log_prob(x, cond),
            # NUTS's init and step kernels each differentiate the potential: jitted, the flow is
            # traced once for both (a tenth of the sampler's tracing)
            "sple_potential": lambda sim, flow, z, *args: -_sple_log_target(sim, flow, z, *args),
        }
        _JITTED[name] = eqx.filter_jit(fns[name])
    return _JITTED[name]


_TRAINERS: dict = {}


def _shared_trainer(kind: tuple, train_kwargs: dict, make_loss: Callable) -> FlowTrainer:
    """Trainers are shared between runs with the same loss and settings, so that a second run
    with flows of the same shapes (e.g. a sweep over epsilon) does not compile again."""
    key = (*kind, tuple(sorted(train_kwargs.items())))
    if key not in _TRAINERS:
        _TRAINERS[key] = FlowTrainer(make_loss(), **train_kwargs)
    return _TRAINERS[key]


def _flatten_atoms(theta, s):
    """Pairs ``(theta (B, K, d), s (B, M, r))`` -> broadcast flat ``(B*M*K, d), (B*M*K, r)``."""
    B, K, d = theta.shape
    M, r = s.shape[1], s.shape[2]
    th = jnp.broadcast_to(theta[:, None], (B, M, K, d)).reshape(-1, d)
    ss = jnp.broadcast_to(s[:, :, None], (B, M, K, r)).reshape(-1, r)
    return th, ss


class SPPE(SequentialEstimator):
    """Sequential private posterior estimation (seed 000, Algorithm 1).

    Extra option: ``num_atoms`` (atoms of the APT loss, default 10, at most ``batch_size``).
    After :meth:`run`: :meth:`sample`, :meth:`log_prob` (normalized posterior density),
    :attr:`diagnostics` (one dict per round).

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> from d3pext.handlers import private_posterior
    >>> from d3pext.models.linear_regression import PAPER_S_DP, private_linear_regression
    >>> post = private_posterior(private_linear_regression(100, 10.0, sensitivity=0.13),
    ...                          {"records_dp": jnp.array(PAPER_S_DP)}, method="sppe", rounds=2,
    ...                          simulations_per_round=300, num_points=4, max_epochs=10,
    ...                          flow_kwargs=dict(layers=2, width=8), progress_bar=False)
    >>> post = post.run(random.key(0), 100)  # doctest: +SKIP
    >>> post.sample(random.key(1), 1000)["beta"].shape  # doctest: +SKIP
    (1000, 3)
    """

    method = "sppe"

    def __init__(self, model, data=None, *, num_atoms: int = 10, **kwargs):
        super().__init__(model, data, **kwargs)
        self.num_atoms = check_int("num_atoms", num_atoms, 2)
        if self.num_atoms > self.batch_size:
            raise ValueError(f"num_atoms={num_atoms} exceeds batch_size={self.batch_size}.")

    def _make_flow(self, key, d, r):
        return conditional_spline_flow(key, d, r, **self.flow_kwargs)

    def _trainer(self, i):
        if i == 0:
            return _shared_trainer(("sppe-mle",), self.train_kwargs, lambda: _sppe_mle_loss)
        return _shared_trainer(("sppe-atomic", self.num_atoms), self.train_kwargs,
                               lambda: _make_atomic_loss(self.num_atoms))

    def _propose(self, key, num):
        return self.sample_unconstrained(key, num)

    def sample_unconstrained(self, rng_key, num_samples):
        self._check_run()
        zs = _jitted("sample")(self.flow, rng_key, int(num_samples), self.observed_standardized)
        return zs * self.scaler.theta_std + self.scaler.theta_mean

    def log_prob(self, params: Mapping[str, Any]) -> jax.Array:
        """Log posterior density of a batch of draws ``{site: (n, ...)}`` (constrained space);
        compiled once per batch shape."""
        self._check_run()
        sim = self.simulator
        if "sppe-log-prob" not in sim.programs.extra:
            import equinox as eqx

            @eqx.filter_jit
            def log_prob(flow, params, theta_mean, theta_std, observed):
                z = jax.vmap(sim.unconstrain)(params)
                cond = jnp.broadcast_to(observed, (z.shape[0], observed.shape[0]))
                lq = flow.log_prob((z - theta_mean) / theta_std, cond) - jnp.sum(jnp.log(theta_std))
                return lq - jax.vmap(sim.log_abs_det_jacobian)(z)

            sim.programs.extra["sppe-log-prob"] = log_prob
        sc = self.scaler
        return sim.programs.extra["sppe-log-prob"](self.flow, dict(params), sc.theta_mean, sc.theta_std,
                                          self.observed_standardized)


def _sppe_mle_loss(flow, batch, key):
    z, s = batch["z"], batch["s"]
    th, ss = _flatten_atoms(z[:, None], s)
    return -flow.log_prob(th, ss).reshape(s.shape[0], s.shape[1]).mean(1)


def _make_atomic_loss(num_atoms: int):
    def loss(flow, batch, key):
        z, s, logp = batch["z"], batch["s"], batch["logp"]
        B = z.shape[0]
        keys = random.split(key, B)
        offsets = jax.vmap(lambda k: random.choice(k, B - 1, (num_atoms - 1,), replace=False))(keys)
        idx = jnp.concatenate([jnp.arange(B)[:, None], (jnp.arange(B)[:, None] + 1 + offsets) % B], 1)
        th, ss = _flatten_atoms(z[idx], s)
        lq = flow.log_prob(th, ss).reshape(B, s.shape[1], num_atoms)
        logits = lq - logp[idx][:, None, :]
        return -(logits[..., 0] - logsumexp(logits, -1)).mean(1)

    return loss


class SPLE(SequentialEstimator):
    """Sequential private likelihood estimation (seed 000, Algorithm 2).

    After :meth:`run`: :meth:`log_likelihood` (the likelihood estimator ``q(s | theta)``),
    :meth:`sample` (NUTS on ``p(theta) q(s_obs | theta)``, ``num_chains`` chains after
    ``num_warmup`` steps), :meth:`log_prob` (the *unnormalized* log posterior),
    :attr:`diagnostics`. Option ``max_tree_depth`` (NUTS, default 6).
    """

    method = "sple"

    def __init__(self, model, data=None, *, max_tree_depth: int = 6, **kwargs):
        super().__init__(model, data, **kwargs)
        self.max_tree_depth = check_int("max_tree_depth", max_tree_depth)
        self._last_draws = None

    def _make_flow(self, key, d, r):
        return conditional_spline_flow(key, r, d, **self.flow_kwargs)

    def _trainer(self, i):
        return _shared_trainer(("sple",), self.train_kwargs, lambda: _sple_loss)

    def _target_args(self):
        sc = self.scaler
        return sc.theta_mean, sc.theta_std, self.observed_standardized

    def _run_nuts(self, key, num_chains, per_chain, init, num_warmup):
        programs = self.simulator.programs.extra
        name = ("sple-nuts", num_chains, per_chain, num_warmup, self.max_tree_depth)
        if name not in programs:
            programs[name] = _compile_nuts(self.simulator, *name[1:])
        return programs[name](self.flow, key, init, *self._target_args())

    def _init_points(self, key, num_chains):
        # start the chains at the candidates with the highest target density: the parameters of the
        # last round's simulations (drawn from its proposal, and of a shape whose programs exist),
        # or, where they are too few, prior draws
        sim = self.simulator
        z = self._last_parameters
        if z is None or z.shape[0] < 4 * num_chains:
            z, _ = sim.simulate(key, max(200, 4 * num_chains))
        if "sple-init" not in sim.programs.extra:
            import equinox as eqx

            sim.programs.extra["sple-init"] = eqx.filter_jit(
                lambda flow, z, *args: jax.vmap(lambda v: _sple_log_target(sim, flow, v, *args))(z))
        target = sim.programs.extra["sple-init"](self.flow, z, *self._target_args())
        return z[jnp.argsort(-target)[:num_chains]]

    def _draw(self, key, num, num_chains, num_warmup):
        k_init, k_run = random.split(key)
        per_chain = -(-num // num_chains)
        init = self._init_points(k_init, num_chains)
        draws = self._run_nuts(k_run, num_chains, per_chain, init, num_warmup)
        # interleave chains so that a prefix mixes all of them
        return jnp.swapaxes(draws, 0, 1).reshape(-1, self.simulator.dim)[:num]

    def _propose(self, key, num):
        return self._draw(key, num, 10, min(self.num_warmup, 200))

    @one_model_at_a_time  # NUTS on the model's prior
    def sample_unconstrained(self, rng_key, num_samples):
        self._check_run()
        return self._draw(rng_key, num_samples, self.num_chains, self.num_warmup)

    def log_likelihood(self, params: Mapping[str, Any], release: jax.Array | None = None) -> jax.Array:
        """``log q(release | theta)`` for a batch of draws (release default: the observed one),
        in the release's own scale."""
        self._check_run()
        z = self._unconstrain_batch(params)
        sc = self.scaler
        s = self.simulator.observed if release is None else jnp.asarray(release).reshape(-1, self.simulator.release_dim)
        ss = jnp.broadcast_to((s - sc.s_mean) / sc.s_std, (z.shape[0], self.simulator.release_dim))
        zs = (z - sc.theta_mean) / sc.theta_std
        return _jitted("log_prob")(self.flow, ss, zs) - jnp.sum(jnp.log(sc.s_std))

    @one_model_at_a_time
    def log_prob(self, params: Mapping[str, Any]) -> jax.Array:
        """Unnormalized log posterior ``log p(theta) + log q(s_obs | theta)`` (constrained space)."""
        z = self._unconstrain_batch(params)
        lp = jax.vmap(self.simulator.log_prior)(z) - jax.vmap(self.simulator.log_abs_det_jacobian)(z)
        return lp + self.log_likelihood(params)


def _sple_log_target(sim: Simulator, flow, z, theta_mean, theta_std, observed):
    """``log p(z) + log q(s_obs | z)`` at the unconstrained ``z`` (one draw; SPLE's posterior)."""
    return sim.log_prior(z) + flow.log_prob(observed, (z - theta_mean) / theta_std)


def _compile_nuts(sim: Simulator, num_chains: int, per_chain: int, num_warmup: int, depth: int):
    """NUTS chains on :func:`_sple_log_target`, compiled once per model and chain layout (the flow,
    the standardization and the observed release are arguments)."""
    import equinox as eqx
    from numpyro.infer.hmc import hmc

    @eqx.filter_jit
    def run(flow, key, init, *target_args):
        potential = lambda z: _jitted("sple_potential")(sim, flow, z, *target_args)  # noqa: E731
        init_kernel, sample_kernel = hmc(potential_fn=potential, algo="NUTS")

        def chain(k, z0):
            k_init, k_run = random.split(k)
            state = init_kernel(z0, num_warmup, max_tree_depth=depth, rng_key=k_init)

            def body(state, _):
                state = sample_kernel(state)
                return state, state.z

            _, zs = lax.scan(body, state, None, length=num_warmup + per_chain)
            return zs[num_warmup:]

        # on a CPU the chains run one after another: vectorised, NUTS's data-dependent tree
        # building took a third more tracing and compiling (3.5 + 4.0 s against 2.3 + 3.2 s for 4
        # chains of the notebook's flow) and ran no faster
        return by_backend(
            lambda keys, init: lax.map(lambda a: chain(*a), (keys, init)),
            jax.vmap(chain),
            random.split(key, num_chains), init,
        )

    return run


def _sple_loss(flow, batch, key):
    z, s = batch["z"], batch["s"]
    th, ss = _flatten_atoms(z[:, None], s)
    return -flow.log_prob(ss, th).reshape(s.shape[0], s.shape[1]).mean(1)

