"""Differentially private stochastic variational inference (DP-VI), a drop-in for :class:`numpyro.infer.SVI`.

One step of :class:`DPSVI` (seed 003, section 2.3, after Jälkö et al.):

1. draw a minibatch of records (a Feistel fixed-size batch without replacement, or a Poisson batch);
2. draw the variational sample(s) theta ~ q(theta | psi), shared by every record of the batch;
3. for each record, the gradient of its *unscaled* ELBO term (its log-likelihood and, for local latent
   variables, their prior and guide terms), computed with ``vmap`` and clipped to L2 norm ``C`` over the
   whole parameter tree; for large models the weights of matrix products never get per-record gradients:
   their per-record norms and the clipped sum come from each record's layer inputs and output gradients
   ("ghost" clipping, :mod:`d3pext.training.ghost`), so that B copies of the gradient are never held;
4. sum, add Gaussian noise of standard deviation ``sigma * C`` once, and rescale by ``N / B``;
5. add the gradient of the data-independent terms (global prior and guide entropy), which needs neither
   clipping nor noise, and update the parameters with the optimizer.

Keeping the data-independent terms out of the clipped part is a deliberate choice (d3p clips the full
per-example ELBO, prior and entropy included, divided by the plate scale). Out of the clipped part, they
are exact and noise-free; the clipping budget ``C`` is spent on the likelihood alone.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import warnings
import weakref
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random
from jax.extend.core import jaxpr_as_fun

from numpyro.distributions import Unit
from numpyro.handlers import Messenger, replay, seed, substitute, trace
from numpyro.primitives import _PYRO_STACK, plate
from numpyro.infer import SVI, Trace_ELBO
from numpyro.util import is_prng_key

from d3pext import accountants
from d3pext._backend import by_backend
from d3pext._threefry_cpu import is_threefry_key
from d3pext.accountants import Relation
from d3pext.compile_cache import cached_jit, compile_traced
from d3pext.training.clipping import CLIPPED_SUMS, choose_clipping
from d3pext.training.dependence import dependent_outputs, jaxpr_dependence
from d3pext.training.minibatch import FixedSizeSampler, PoissonSampler
from d3pext.training.noise import noise_tail_delta, standard_normal
from d3pext._threads import one_model_at_a_time
from d3pext.training.parallel import agreed_key, check_data, check_mesh, data_parallel_clipped_sum, host_value
from d3pext.prng import threefry_key

__all__ = ["DPSVI", "DPSVIState", "DPSVIRunResult", "PrivacyReport"]

CHUNK_STEPS = 128
"""Steps per compiled call of ``DPSVI.run``: one program of this size serves every number of steps
(a call runs as many of them as asked), and the per-call dispatch is small beside 128 steps."""


class DPSVIState(NamedTuple):
    """State of :class:`DPSVI`: NumPyro's ``SVIState`` fields, the number of private steps taken,
    and the number of sampled records left out of a step because their loss or gradient was not
    finite (a NaN or infinite entry, or a norm beyond float range; like the losses, that count is
    computed on the data and is not private)."""

    optim_state: Any
    mutable_state: Any
    rng_key: Any
    num_steps: Any
    num_dropped: Any = 0
    #: a digest of the privacy settings its steps were taken with (noise multiplier, clipping
    #: threshold, sampler, number of noisy coordinates): a run resumed from the state by another
    #: DPSVI accounts its earlier steps only where these are the same
    settings_digest: Any = None


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy spent by a DP-VI run, as the accountant computed it.

    ``delta`` includes the extra terms that the accountant's analysis leaves out: the sampler's (e.g. the
    truncation of Poisson batches) and the noise's finite range (:func:`~d3pext.training.noise.noise_tail_delta`).
    """

    epsilon: float
    delta: float
    noise_multiplier: float
    clipping_threshold: float
    sampling_rate: float
    num_steps: int
    relation: str
    sampler: str

    def __str__(self) -> str:
        return (
            f"({self.epsilon:.4g}, {self.delta:.3g})-DP after {self.num_steps} steps "
            f"[noise multiplier sigma={self.noise_multiplier:.4g}, clipping C={self.clipping_threshold:.4g}, "
            f"sampling rate q={self.sampling_rate:.4g}, {self.sampler}, {self.relation} neighbours]"
        )


class DPSVIRunResult(NamedTuple):
    """What :meth:`DPSVI.run` returns: ``SVIRunResult``'s fields plus the privacy report."""

    params: dict
    state: DPSVIState
    losses: jnp.ndarray
    privacy: PrivacyReport


class _StepDraws(NamedTuple):
    """What a step draws from its key: the ELBO's keys (one per particle), the batch's indices and
    mask (plate mode; ``None`` in batch mode) and standard normals shaped like the parameters."""

    elbo_keys: jax.Array
    batch: Optional[tuple]
    noise: list


@dataclass(frozen=True)
class _Structure:
    """What :meth:`DPSVI.init` learns from tracing the model once."""

    plate_name: str
    num_records: int  # N: the size of the data plate
    batch_size: int  # B: the (expected) number of records per step
    plate_mode: bool  # True: full data is passed and DPSVI draws the indices


class _RecordScope(Messenger):
    """Runs the model or guide on one record.

    Sets the data plate's indices to ``indices`` (the record's index in plate mode; a placeholder in batch
    mode, where the data passed in is already that one record), and gives every sample site inside the data
    plate a key of its own record. Global sites keep the keys of the enclosing ``seed``, so every record of a
    batch sees the same variational sample of the global latent variables, while local latent variables
    (e.g. a VAE's ``z``) get independent noise per record. Must be applied inside ``seed``.

    The model and the guide of one record share ``rng_key`` and take its even (``stream=0``) and odd
    (``stream=1``) folds: a latent site of the model alone then draws independently of the guide's.
    ``numpyro.prng_key()`` inside the data plate takes the record's stream as a sample site does.
    """

    def __init__(self, fn, plate_name: str, rng_key, indices, stream: int):
        self.plate_name = plate_name
        self.rng_key = rng_key
        self.indices = indices
        self.stream = stream
        self._count = 0
        super().__init__(fn)

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["name"] == self.plate_name:
            msg["value"] = self.indices
            msg["args"] = (msg["args"][0], self.indices.shape[0])
        elif (
            msg["type"] == "sample"
            and msg["value"] is None
            and msg["kwargs"].get("rng_key") is None
            and any(f.name == self.plate_name for f in msg["cond_indep_stack"])
        ):
            msg["kwargs"]["rng_key"] = self._next_key()
        elif msg["type"] == "prng_key" and msg["kwargs"].get("rng_key") is None and self._in_data_plate():
            # numpyro.prng_key() inside the plate (dropout in an encoder): the record's own stream too
            msg["kwargs"]["rng_key"] = self._next_key()

    def _next_key(self) -> jax.Array:
        key = random.fold_in(self.rng_key, 2 * self._count + self.stream)
        self._count += 1
        return key

    def _in_data_plate(self) -> bool:
        # prng_key messages carry no plate frames: look for the data plate among the active handlers
        return any(isinstance(h, plate) and h.name == self.plate_name for h in _PYRO_STACK)


class _WithoutLikelihood(Messenger):
    """Observed sites inside a plate (the records' likelihood) add nothing to the model's log density;
    unplated ones (a ``numpyro.factor`` on the global parameters) still do."""

    def process_message(self, msg):
        if msg["type"] == "sample" and msg["is_observed"] and msg["cond_indep_stack"]:
            msg["fn"] = msg["fn"].mask(False)


def _setup_autoguide_without_data(guide, rng_key, args, kwargs) -> None:
    """Set up an AutoGuide's prototype (its sites and initial point) from the model without its
    likelihood, and with the records (the positional arguments) replaced by zeros. NumPyro redraws the
    initial point until the model's log density and its gradient are finite, and its ``init_loc_fn``
    (``init_to_median``, ``init_to_sample``, ...) draws local latent sites from their priors, which may
    read the record (``t ~ Normal(c_i, 1)``): on the data, the starting parameters, and so the released
    fit, would be a function of the data outside the clipped and noised gradient."""
    if not hasattr(guide, "_setup_prototype") or getattr(guide, "prototype_trace", True) is not None:
        return
    model = guide.model
    guide.model = _WithoutLikelihood(model)
    # device_put, not jnp.zeros: an eager jnp call compiles a program; traced or not, these are constants
    zeros = jax.tree.map(lambda a: jax.device_put(np.zeros(np.shape(a), a.dtype)), args)
    try:
        seed(_FirstIndices(guide._setup_prototype), rng_key)(*zeros, **kwargs)
    except RuntimeError as error:
        if "valid initial param" not in str(error):
            raise
        raise ValueError(
            f"{type(guide).__name__}: no valid initial point of the model with its records replaced by zeros. DPSVI "
            "sets an AutoGuide up on data of zeros, so that no record reaches its initial parameters (its "
            "init_loc_fn draws local latent sites from priors that may read the record); make the model's priors "
            "valid there, or use a hand-written guide whose initial parameters do not depend on the data."
        ) from error
    finally:
        guide.model = model


class _FirstIndices(Messenger):
    """Subsampled plates take their first indices: tracing for structure needs no random subsample."""

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            msg["value"] = jnp.arange(msg["args"][1])


def _check_plate_sizes(site: dict) -> None:
    """A plate's subsample size must lie in [1, size] (whether the JAX at hand fails on it elsewhere
    first depends on its version)."""
    size, subsample_size = site["args"]
    if subsample_size is not None and not 1 <= subsample_size <= size:
        raise ValueError(
            f"plate {site['name']!r}: subsample_size={subsample_size} must be between 1 and the plate's size {size}"
        )


class _PlateCheck(Messenger):
    """Raises a clear error for a plate whose sizes cannot be right or an observed site whose
    records do not match its plate (run only to explain why the model failed to initialise)."""

    def process_message(self, msg):
        if msg["type"] == "plate":
            _check_plate_sizes(msg)
        elif msg["type"] == "sample" and msg["is_observed"]:
            shape = jnp.shape(msg["value"])
            event_dim = len(getattr(msg["fn"], "event_shape", ()))
            for frame in msg["cond_indep_stack"]:
                axis = len(shape) - event_dim + frame.dim
                if 0 <= axis < len(shape) and shape[axis] not in (1, frame.size):
                    raise ValueError(
                        f"observed site {msg['name']!r} has {shape[axis]} records along plate {frame.name!r} of size "
                        f"{frame.size}: the data plate's size must be the number of records N (or, with "
                        "subsample_size, the data must have N records in plate mode or one batch in batch mode)"
                    )


def _in_plate(site, plate_name: str) -> bool:
    return any(f.name == plate_name for f in site["cond_indep_stack"])


def _site_log_prob(site) -> jnp.ndarray:
    log_prob = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


def _standard_normals(key: jax.Array, like: list) -> list:
    """Independent standard normals shaped like each array of ``like``, from one draw per dtype (one
    draw compiles one copy of the key's hash, however many parameter arrays there are), with the full
    tails of :func:`~d3pext.training.noise.standard_normal`."""
    out = [None] * len(like)
    dtypes = list(dict.fromkeys(jnp.dtype(x.dtype) for x in like))
    # several dtypes: a key of its own per group (a group drawing with `key` itself hashes counter
    # pairs that another's fold_in(key, i) can equal)
    group_keys = [key] if len(dtypes) == 1 else list(random.split(key, len(dtypes)))
    for dtype, group_key in zip(dtypes, group_keys):
        members = [i for i, x in enumerate(like) if jnp.dtype(x.dtype) == dtype]
        sizes = [int(np.prod(like[i].shape)) for i in members]
        z = standard_normal(group_key, (sum(sizes),), dtype)
        for i, start, size in zip(members, np.cumsum([0] + sizes[:-1]), sizes):
            out[i] = z[start:start + size].reshape(like[i].shape)
    return out


def _particle_keys(rng_key: jax.Array, num_particles: int) -> jax.Array:
    """One key per particle, split from ``rng_key`` (or already split: a 1-D array of keys); a single
    particle takes ``rng_key`` itself, which has no other use (a split would compile a hash loop)."""
    typed = jax.dtypes.issubdtype(rng_key.dtype, jax.dtypes.prng_key)
    if jnp.ndim(rng_key) == (1 if typed else 2):  # raw keys carry their words in a last axis
        return rng_key
    if num_particles == 1:
        return rng_key[None]
    return random.split(rng_key, num_particles)


def _elbo_keys(rng_key: jax.Array, num_particles: int) -> jax.Array:
    """The keys of the ELBO's variational samples, as a step makes them from one of its keys: Threefry,
    one per particle."""
    if not is_threefry_key(rng_key):
        rng_key = threefry_key(rng_key)
    return _particle_keys(rng_key, num_particles)


def _step_draws(keys, like: list, sampler, num_particles: int) -> _StepDraws:
    """A step's draws from its three keys (batch, ELBO, noise): the batch of ``sampler`` (``None`` in batch
    mode), the ELBO's keys and standard normals shaped like ``like``, the parameters. They depend on the keys,
    the sampler and the parameters' shapes alone, not on the model, the data or the parameters' values."""
    batch_key, elbo_key, noise_key = keys
    # The batch and the noise carry the privacy guarantee and use the caller's (e.g. ChaCha20) key. The
    # variational samples do not: a Threefry key keeps every JAX sampler (gamma, poisson) fast and available.
    # split once for the record terms and the global terms: inside run's loop XLA does not merge
    # the two copies of the split (it does in a step compiled on its own)
    batch = None if sampler is None else sampler(batch_key)
    return _StepDraws(_elbo_keys(elbo_key, num_particles), batch, _standard_normals(noise_key, like))


def _next_key_and_draws(rng_key: jax.Array, params, sampler, num_particles: int) -> tuple:
    """The next state's key and a step's :func:`_step_draws` from the state's key."""
    keys = random.split(rng_key, 4)  # one split: each split compiles its own copy of the hash
    return keys[0], _step_draws(keys[1:], jax.tree.leaves(params), sampler, num_particles)


@lru_cache(maxsize=64)
def _draws_program(sampler, num_particles: int):
    """:func:`_next_key_and_draws` compiled, shared by the DPSVI objects of one sampler and number of
    particles (a sweep over epsilons, a refit): whatever their model, its programs are the same."""
    return cached_jit(partial(_next_key_and_draws, sampler=sampler, num_particles=num_particles))


def _split_kwargs(kwargs: dict) -> tuple[dict, tuple]:
    """Arrays are traced under jit, everything else is a static (hashable) argument."""
    dynamic = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in dynamic))
    try:
        hash(static)
    except TypeError as e:
        raise TypeError(
            "keyword arguments of DPSVI must be arrays or hashable values (they are static under jit); "
            f"got {e}"
        ) from None
    return dynamic, static


def _num_records(args) -> Optional[int]:
    """The common number of records of the positional (data) arguments."""
    lengths = {jnp.shape(a)[0] if jnp.ndim(a) > 0 else None for a in args}
    if None in lengths:
        raise ValueError("positional arguments of DPSVI are data: arrays with the records on axis 0")
    if len(lengths) > 1:
        raise ValueError(f"data arrays have different numbers of records: {sorted(lengths)}")
    return lengths.pop() if lengths else None


def _check_keyword_arrays(
    args, kwargs: dict, static_kwargs: Optional[dict] = None, num_records: Optional[int] = None,
    public: frozenset = frozenset(),
) -> None:
    """Refuse a keyword array that is almost surely record data: one with as many rows as the positional
    data (all N records, or a batch of them), or with any axis of the N records (``num_records``, where
    known: record data laid out (features, records) is record data too). DPSVI treats keyword arrays as
    public: only positional data is subsampled by its sampler, kept apart record by record, and proven
    not to reach the unclipped global terms; a record array passed by keyword (to a call, or to the
    constructor: ``static_kwargs``) would escape all three (a global prior reading ``jnp.mean(y)`` would
    leak, unclipped). Names in ``public`` (``DPSVI(public_kwargs=...)``) were declared public by the
    user and are not checked."""
    length = _num_records(args)
    if length is None and num_records is None:
        return
    given = [(name, value, "") for name, value in kwargs.items()]
    given += [(name, value, " given to DPSVI's constructor") for name, value in (static_kwargs or {}).items()]
    for name, value, where in given:
        if name == "mask" or name in public or not isinstance(value, (jax.Array, np.ndarray)) or jnp.ndim(value) == 0:
            continue
        shape = tuple(jnp.shape(value))
        if shape[0] == length:
            what = f"{length} rows, as many as the data"
        elif num_records is not None and num_records in shape:
            what = f"an axis of {num_records} (shape {shape}), as many as the data's records"
        else:
            continue
        raise ValueError(
            f"keyword argument {name!r}{where} has {what}: DPSVI treats keyword arrays as public (not clipped, "
            "and the global terms may use them), so record data must be passed positionally, e.g. "
            f"run(key, num_steps, x, {name}) for model(x, {name}=None). If {name!r} is public (it holds no "
            f"record's data and only happens to have that size), declare it: DPSVI(..., "
            f"public_kwargs=({name!r},))."
        )


def _array_leaves(obj, depth: int = 0) -> list:
    """The arrays held by ``obj`` (a constraint: a pytree in NumPyro, or any object, through its
    attributes)."""
    found = []
    for leaf in jax.tree.leaves(obj):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            found.append(leaf)
        elif depth < 4 and hasattr(leaf, "__dict__"):
            found += _array_leaves(vars(leaf), depth + 1)
    return found


def _accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)


def _default_delta(num_records: int) -> float:
    return min(1e-5, 0.1 / num_records)


class DPSVI(SVI):
    """Differentially private SVI: a drop-in for :class:`numpyro.infer.SVI` (seed 003).

    The argument order of d3p's ``DPSVI(model, guide, optim, per_example_loss, clipping_threshold, dp_scale)``
    is kept. Give either the noise multiplier ``dp_scale`` (sigma: the noise standard deviation is
    ``sigma * C`` on the sum of clipped per-record gradients) or a privacy target ``epsilon``, ``delta``
    with the planned ``num_steps``, from which sigma is calibrated at :meth:`init` once the sampling rate is
    known from the model.

    The model must put every record-dependent site inside one data plate. Two ways of feeding data:

    - *plate mode* (recommended): pass the full data and declare ``numpyro.plate("data", N,
      subsample_size=B)``, reading records with ``numpyro.subsample`` or the plate's indices. DPSVI draws
      the batch itself with ``sampler`` (``"fixed"``: Feistel batches of exactly B without replacement,
      substitute neighbours; ``"poisson"``: each record independently with probability ``sampling_rate``,
      add/remove neighbours), and the accountant uses exactly that scheme.
    - *batch mode* (d3p style): pass a batch of B records (positional arguments, records on axis 0) to a
      model whose plate has size N and ``subsample_size=B``; the accountant then assumes the batches are
      uniformly random fixed-size batches without replacement (as from
      :func:`d3pext.training.minibatch.subsample_batchify_data`).

    Positional arguments are data; keyword arguments are passed to the model unchanged (arrays traced,
    other values static). The losses reported by :meth:`update` and :meth:`run` are computed on the
    confidential data and are **not** private; only the parameters are.

    :param model: NumPyro model with a data plate.
    :param guide: guide (hand-written or an autoguide) with reparameterizable latent sites.
    :param optim: a ``numpyro.optim`` optimizer or an optax ``GradientTransformation``.
    :param loss: :class:`numpyro.infer.Trace_ELBO` (its ``num_particles`` is used); ``None`` means the default.
    :param clipping_threshold: C, the bound on each record's gradient norm.
    :param dp_scale: sigma, the noise multiplier.
    :param epsilon: target epsilon (instead of ``dp_scale``).
    :param delta: target delta; also the delta at which privacy is reported. Default ``min(1e-5, 0.1 / N)``
        for the fixed-size sampler (substitute neighbours: N is public); Poisson sampling needs it given,
        since its add/remove neighbours keep N private.
    :param num_steps: planned number of steps (required with ``epsilon``); :meth:`run` refuses to go beyond it.
    :param sampler: ``"fixed"`` or ``"poisson"`` (plate mode).
    :param sampling_rate: q of ``sampler="poisson"``. Under add/remove neighbours the number of records N
        is private, and each step is scaled by ``1 / q``: q must not be computed from the data, so state it
        (from a public bound on N or a private release of it); ``sampler="poisson"`` refuses to run without it.
    :param data_plate: name of the data plate, if it cannot be inferred.
    :param num_obs_total: N, for batch-mode models whose plate does not know the total number of records.
    :param clipping: how the clipped sum is computed; all give the same sum. ``"materialize"``: per-record
        gradients by ``vmap``, clipped and summed (one pass; memory B x parameters). ``"ghost"``: one pass
        in which each weight of a matrix product (found in the traced loss, see :mod:`d3pext.training.ghost`) keeps
        only the record's inputs ``A`` and output gradients ``G`` of its product; its per-record norm is
        ``|A^T G|`` by Gram matrices and its clipped sum ``sum_i w_i A_i^T G_i``; other leaves get per-record
        gradients. ``"reweight"``: ghost norms first, then one batched backward pass of the loss weighted by
        ``min(1, C / norm)`` (two passes; nothing per record is kept). ``"auto"`` (default) is ``"ghost"``
        when B x parameters exceeds ``2**22``, where memory traffic dominates, else ``"materialize"``.
    :param mesh: a :class:`jax.sharding.Mesh` to split each batch's records over (data parallelism,
        :mod:`d3pext.training.parallel`): each device of the axis ``data_axis`` computes the clipped
        per-record gradients of about B / D records, and the clipped sum is added across devices by one
        all-reduce of the parameters' size per step. The sampler, the noise (drawn once, from the same key)
        and the accountant are those of one device, so a key gives the same fit up to float rounding.
        The data may be sharded by rows over ``data_axis`` (``jax.device_put(x, NamedSharding(mesh,
        P("data")))``); in plate mode only the batch's rows then move between devices. Data on devices
        outside the mesh, or split otherwise (by columns, over another axis), is refused. Several hosts
        (``jax.distributed``): each loads its rows and builds the global array with
        :func:`~d3pext.training.parallel.shard_records`. Other mesh axes replicate the work. ``None``
        (default): no explicit split (the batch is computed where XLA puts it).
    :param data_axis: the name of the mesh axis the records are split over.
    :param public_kwargs: names of keyword arguments that are public arrays (they hold no record's data),
        for the rare one that has as many rows as the data or the batch, or an axis of N: DPSVI refuses such
        keyword arrays as likely record data passed by keyword (which would escape clipping) unless named
        here. Declaring an array public that holds record data voids the guarantee. Each record's term
        gets the whole array, so it is read through a positional index column (``group_features[group]``),
        never row by row with the batch (such a model is refused).

    **Example**

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import Trace_ELBO
        >>> from numpyro.infer.autoguide import AutoDiagonalNormal
        >>> from d3pext import DPSVI
        >>> def model(x, y):
        ...     w = numpyro.sample("w", dist.Normal(0, 2).expand([x.shape[1]]).to_event(1))
        ...     with numpyro.plate("data", x.shape[0], subsample_size=100):
        ...         xb, yb = numpyro.subsample(x, event_dim=1), numpyro.subsample(y, event_dim=0)
        ...         numpyro.sample("y", dist.Bernoulli(logits=xb @ w), obs=yb)
        >>> x = jax.random.normal(jax.random.key(0), (2000, 3)); y = (x @ jnp.array([1., -1., .5]) > 0) * 1.
        >>> svi = DPSVI(model, AutoDiagonalNormal(model), numpyro.optim.Adam(0.05), Trace_ELBO(),
        ...             clipping_threshold=1.0, epsilon=1.0, delta=1e-5, num_steps=500)
        >>> result = svi.run(jax.random.key(1), 500, x, y, progress_bar=False)
        >>> result.privacy.epsilon <= 1.0
        True
    """

    def __init__(
        self,
        model: Callable,
        guide: Callable,
        optim,
        loss: Optional[Trace_ELBO] = None,
        clipping_threshold: Optional[float] = None,
        dp_scale: Optional[float] = None,
        *,
        epsilon: Optional[float] = None,
        delta: Optional[float] = None,
        num_steps: Optional[int] = None,
        sampler: str = "fixed",
        sampling_rate: Optional[float] = None,
        data_plate: Optional[str] = None,
        num_obs_total: Optional[int] = None,
        clipping: str = "auto",
        mesh: Optional[jax.sharding.Mesh] = None,
        data_axis: str = "data",
        public_kwargs: Sequence[str] = (),
        **static_kwargs,
    ):
        if "rng_suite" in static_kwargs:
            raise TypeError(
                "rng_suite= is d3p's choice of random number generator; d3pext has none to choose: release noise "
                "and batches always come from the key given to init/run, and run(None, ...) draws a ChaCha20 key "
                "from OS entropy (d3pext.prng.secure_key). Drop the argument."
            )
        loss = Trace_ELBO() if loss is None else loss
        if type(loss) is not Trace_ELBO:
            raise NotImplementedError(
                f"DPSVI supports numpyro.infer.Trace_ELBO; got {type(loss).__name__}. "
                "Per-record clipping needs the ELBO split into per-record terms, which is implemented for Trace_ELBO."
            )
        super().__init__(model, guide, optim, loss, **static_kwargs)
        if clipping_threshold is None:
            raise TypeError("clipping_threshold (C, the bound on each record's gradient norm) is required")
        clipping_threshold = float(clipping_threshold)
        if not math.isfinite(clipping_threshold) or clipping_threshold <= 0:
            raise ValueError(f"clipping_threshold must be finite and > 0, got {clipping_threshold}")
        if (dp_scale is None) == (epsilon is None):
            raise ValueError("give exactly one of dp_scale (the noise multiplier sigma) or a target epsilon")
        if dp_scale is not None:
            dp_scale = float(dp_scale)
            if not math.isfinite(dp_scale) or dp_scale <= 0:
                raise ValueError(f"dp_scale must be finite and > 0, got {dp_scale}")
        if epsilon is not None:
            epsilon = float(epsilon)
            if not math.isfinite(epsilon) or epsilon <= 0:
                raise ValueError(f"epsilon must be finite and > 0, got {epsilon}")
            if num_steps is None:
                raise ValueError("a target epsilon needs num_steps, the planned number of steps, to calibrate sigma")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"delta must be in (0, 1), got {delta}")
        if num_steps is not None and (int(num_steps) != num_steps or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps}")
        if not (sampler in ("fixed", "poisson") or isinstance(sampler, (FixedSizeSampler, PoissonSampler))):
            raise ValueError(
                f"sampler must be 'fixed', 'poisson', a FixedSizeSampler or a PoissonSampler, got {sampler!r}"
            )
        poisson_plate_mode = isinstance(sampler, str) and sampler == "poisson"
        if poisson_plate_mode and delta is None and sampling_rate is None:
            raise ValueError(
                "sampler='poisson' needs its rate and delta: DPSVI(..., sampler='poisson', sampling_rate=q, "
                "delta=...), both chosen without looking at the data. Under add/remove neighbours the number of "
                "records N is private: each step is scaled by 1 / q, so a rate taken as B / N would reveal N, and "
                "so would the default delta min(1e-5, 0.1 / N). Choose q and delta from a public bound on N."
            )
        if delta is None and (isinstance(sampler, PoissonSampler) or poisson_plate_mode):
            raise ValueError(
                "Poisson sampling needs delta=: its add/remove neighbours keep the number of records N private, "
                "and the default delta, min(1e-5, 0.1 / N), would publish N with the privacy report. Choose delta "
                "from a public bound on N, well below 1 / N (e.g. delta=1e-6 for up to 100,000 records)."
            )
        if sampling_rate is not None:
            if sampler != "poisson":
                raise ValueError(
                    "sampling_rate= is the rate of sampler='poisson' in plate mode; a FixedSizeSampler's rate is B / N "
                    "of its public N, and a PoissonSampler carries its own sampling_rate"
                )
            sampling_rate = float(sampling_rate)
            if not 0 < sampling_rate <= 1:
                raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate}")
        elif isinstance(sampler, str) and sampler == "poisson":
            # q = B / N would come from N, which add/remove neighbours keep private (each step is scaled by 1 / q)
            raise ValueError(
                "sampler='poisson' needs its rate: DPSVI(..., sampler='poisson', sampling_rate=q), with q chosen "
                "without looking at the data. Under add/remove neighbours the number of records N is private, and "
                "each step's gradient is scaled by 1 / q, so a rate taken as B / N of the data would reveal N. If N "
                "is public, sampling_rate=B / N is the usual choice."
            )
        self.sampling_rate = sampling_rate
        if isinstance(public_kwargs, str) or not all(isinstance(name, str) for name in public_kwargs):
            raise TypeError(
                f"public_kwargs must be a sequence of keyword argument names, e.g. public_kwargs=('group_features',); "
                f"got {public_kwargs!r}"
            )
        self.public_kwargs = frozenset(public_kwargs)
        if num_obs_total is not None and (int(num_obs_total) != num_obs_total or num_obs_total < 1):
            raise ValueError(f"num_obs_total must be a positive integer, got {num_obs_total}")
        if clipping not in ("auto", "materialize", "ghost", "reweight"):
            raise ValueError(f"clipping must be 'auto', 'materialize', 'ghost' or 'reweight', got {clipping!r}")
        if mesh is not None:
            check_mesh(mesh, data_axis)
        elif data_axis != "data":
            raise ValueError(f"data_axis={data_axis!r} names an axis of a mesh, but no mesh= was given")
        self.mesh, self.data_axis = mesh, data_axis
        self.clipping = clipping
        self.clipping_threshold = clipping_threshold
        self.dp_scale = dp_scale
        self.target_epsilon = epsilon
        self.delta = None if delta is None else float(delta)
        self.planned_steps = None if num_steps is None else int(num_steps)
        self.sampler_kind = sampler
        self.data_plate = data_plate
        self.num_obs_total = None if num_obs_total is None else int(num_obs_total)
        if self.num_obs_total is not None and _accepts(model, "num_obs_total") and _accepts(guide, "num_obs_total"):
            # d3p passed num_obs_total on to the model and guide; scripts written for it rely on that
            self.static_kwargs.setdefault("num_obs_total", self.num_obs_total)
        self.structure: Optional[_Structure] = None
        self.sampler = None
        self._noise_size = 0  # parameters noised per step: the noise's extra delta counts them
        self._steps = {}
        self._chunks = {}
        self._isolation_checks = {}
        self._independence_proofs = set()  # signatures whose global part was proven independent of the data
        self._global_programs = {}  # step signature -> (jaxpr, output tree) of the proven global part
        self._inits = {}
        self._replicate = None  # with a mesh: the compiled identity that replicates a state over it
        self._op_by_op_init = False  # set for good once tracing init changed the model or guide
        self._known_steps: dict[int, int] = {}  # id(state.num_steps) -> its value, known on the host

    # ------------------------------------------------------------------ structure and privacy

    def _find_structure(self, model_trace, guide_trace, args) -> _Structure:
        plates = {s["name"]: s for s in model_trace.values() if s["type"] == "plate"}
        for site in plates.values():
            _check_plate_sizes(site)
        for name, site in model_trace.items():
            if site["type"] == "mutable":
                raise ValueError(
                    f"DPSVI does not support mutable state (site {name!r}): it would carry data-dependent values "
                    "across steps outside the privacy mechanism."
                )
        observed = [s for s in model_trace.values() if s["type"] == "sample" and s["is_observed"]]
        if not observed:
            raise ValueError("the model has no observed sites: there is nothing private to fit")
        if self.data_plate is not None:
            if self.data_plate not in plates:
                raise ValueError(f"data_plate {self.data_plate!r} is not a plate of the model; plates: {sorted(plates)}")
            name = self.data_plate
        else:
            common = set.intersection(*[{f.name for f in s["cond_indep_stack"]} for s in observed])
            if not common:
                raise ValueError(
                    "no data plate: every observed site must be inside one numpyro.plate over the records "
                    f"(observed sites: {[s['name'] for s in observed]}). DPSVI clips per record, so it must know "
                    "which dimension indexes records."
                )
            several = sorted(n for n in common if plates[n]["args"][0] > 1)
            if len(several) > 1:
                # which plate indexes individuals is the user's to say (as privatize's record_plate): picked by
                # subsampling, a subsampled "genes" plate whose size matched the batch had been taken for the records
                raise ValueError(
                    f"the observed sites are all in the plates {several}: name the plate whose index is one record "
                    "(the individual that is clipped and protected) with DPSVI(..., data_plate=...)"
                )
            subsampled = [n for n in common if plates[n]["args"][1] not in (None, plates[n]["args"][0])]
            candidates = subsampled or sorted(common)
            if len(candidates) > 1:
                raise ValueError(f"several candidate data plates {candidates}: name one with data_plate=...")
            name = candidates[0]
        size, subsample_size = plates[name]["args"]
        subsample_size = size if subsample_size is None else subsample_size
        subsampled_plates = {n for n, p in plates.items() if p["args"][1] not in (None, p["args"][0])}
        for s in model_trace.values():
            nested = {f.name for f in s.get("cond_indep_stack", [])} & subsampled_plates - {name}
            if s["type"] == "sample" and nested:
                raise ValueError(f"site {s['name']!r} is in a second subsampled plate {sorted(nested)}: not supported")
        scales = {float(np.asarray(s["scale"] if s["scale"] is not None else 1.0)) for s in observed if _in_plate(s, name)}
        if len(scales) > 1:
            raise ValueError(
                f"observed sites in the data plate {name!r} have different scales {sorted(scales)}: one record's "
                "contribution would not be comparable across sites, so the clipping bound would be ill-defined"
            )
        length = _num_records(args)
        if length == size and subsample_size < size:
            plate_mode, num_records, batch_size = True, size, subsample_size
        elif length is None or length == subsample_size:
            plate_mode = False
            num_records = self.num_obs_total if self.num_obs_total is not None else size
            batch_size = subsample_size
        else:
            raise ValueError(
                f"data with {length} records does not match the data plate {name!r} (size {size}, "
                f"subsample_size {subsample_size}): pass either all N records (plate mode) or one batch"
            )
        if batch_size > num_records:
            raise ValueError(f"batch size {batch_size} is larger than the number of records {num_records}")
        if not plate_mode and self.sampler_kind == "poisson":
            raise ValueError(
                "sampler='poisson' in batch mode: pass the sampler that draws the batches, e.g. "
                "DPSVI(..., sampler=get_batch.sampler) for poisson_batchify_data, and update(state, *batch, mask=mask); "
                "or use plate mode (pass the full data; DPSVI then draws the Poisson batches itself)"
            )
        extra = [scale / (size / subsample_size) for scale in scales]
        if extra and abs(extra[0] - 1.0) > 1e-6:
            warnings.warn(
                f"the observed sites of the data plate {name!r} carry a scale of {extra[0]:.4g} on top of the plate's "
                f"N / B (a numpyro.handlers.scale wrapper?): clipping_threshold then bounds the gradient of "
                f"{extra[0]:.4g} x each record's log-likelihood, not of the log-likelihood itself. DPSVI rescales the "
                "clipped sum by N / B already; remove the wrapper to clip the per-record gradient d3pext documents.",
                UserWarning,
                stacklevel=4,
            )
        for s in guide_trace.values():
            if s["type"] == "sample" and not s["is_observed"] and not s["fn"].has_rsample:
                raise NotImplementedError(
                    f"guide site {s['name']!r} is not reparameterizable; DPSVI needs reparameterized guides"
                )
        return _Structure(name, int(num_records), int(batch_size), plate_mode)

    def _make_sampler(self, structure: _Structure, args):
        given = self.sampler_kind
        if isinstance(given, (FixedSizeSampler, PoissonSampler)):
            if given.num_records != structure.num_records:
                raise ValueError(
                    f"the sampler draws from {given.num_records} records, but the data plate "
                    f"{structure.plate_name!r} has N = {structure.num_records}"
                )
            length = _num_records(args)
            if not structure.plate_mode and length is not None and length != given.padded_size:
                raise ValueError(
                    f"batches of {length} records, but the sampler's batches have {given.padded_size} slots"
                )
            return given
        if structure.plate_mode and given == "poisson":
            return PoissonSampler(structure.num_records, self.sampling_rate)
        return FixedSizeSampler(structure.num_records, structure.batch_size)

    def _report_delta(self) -> float:
        return self.delta if self.delta is not None else _default_delta(self.structure.num_records)

    def _calibrate(self) -> None:
        if self.target_epsilon is None or self.dp_scale is not None:
            return
        delta = self._report_delta()
        margin = self._extra_delta(self.target_epsilon, self.planned_steps)
        if margin >= 0.1 * delta:
            raise ValueError(
                f"the extra delta of the sampler and the noise's range, {margin:.3g}, is not small against delta={delta:.3g}"
            )
        result = accountants.approximate_sigma(
            self.target_epsilon, delta - margin, self.sampler.q, self.planned_steps, self.sampler.relation
        )
        self.dp_scale = float(result.sigma)

    def _extra_delta(self, epsilon: float, num_steps: int) -> float:
        """What the accountant's exact-Gaussian, exact-sampling analysis leaves out: the sampler's term
        (e.g. truncated Poisson batches) and the noise's finite range (:func:`~d3pext.training.noise.noise_tail_delta`)."""
        return self.sampler.extra_delta(epsilon, num_steps) + noise_tail_delta(epsilon, num_steps, self._noise_size)

    def privacy_spent(self, num_steps, delta: Optional[float] = None) -> PrivacyReport:
        """The (epsilon, delta) spent after ``num_steps`` steps (an int or a :class:`DPSVIState`)."""
        if self.structure is None:
            raise RuntimeError("call init (or run) first: the sampling rate comes from the model's data plate")
        if isinstance(num_steps, DPSVIState):
            self.check_resumable(num_steps)  # steps taken by another DPSVI are not this one's to account
            num_steps = int(num_steps.num_steps)
        delta = self._report_delta() if delta is None else float(delta)
        eps = float(self._epsilon(np.array([num_steps]), delta)[0]) if num_steps else 0.0
        return self._report(eps, delta, num_steps)

    def _epsilon(self, steps: np.ndarray, delta: float) -> np.ndarray:
        """Epsilon after each entry of ``steps``; ``inf`` (with a warning) where it is beyond any accountant's reach."""
        try:
            eps = accountants.epsilon(self.dp_scale, self.sampler.q, steps, delta, self.sampler.relation)
        except accountants.AccountingError as e:
            warnings.warn(f"privacy spent is reported as epsilon=inf: {e}", stacklevel=3)
            return np.full(len(steps), np.inf)
        return np.atleast_1d(np.asarray(eps, dtype=float))

    def get_epsilon(self, delta: float, num_steps=None, num_epochs: Optional[float] = None, *, q=None) -> float:
        """The epsilon for which ``num_steps`` steps are ``(epsilon, delta)``-DP, the extra delta of the
        sampler and of the noise's finite range included (``privacy_spent`` reports it added to delta
        instead). d3p's ``get_epsilon(delta, q, num_epochs=E)`` form counts ``E N / B`` steps (``E / q``
        for Poisson batches), rounded up, after checking that ``q`` is this run's sampling rate."""
        if num_epochs is not None:
            if q is None and num_steps is not None:  # d3p's positional form get_epsilon(delta, q, num_epochs)
                q, num_steps = num_steps, None
            if num_steps is not None:
                raise ValueError("give num_steps or num_epochs, not both")
            if self.sampler is None:
                raise RuntimeError("call init (or run) first: the sampling rate comes from the model's data plate")
            q = self.sampler.q if q is None else float(q)
            if not math.isclose(q, self.sampler.q, rel_tol=1e-6):
                raise ValueError(
                    f"q={q} is not this run's sampling rate {self.sampler.q:.6g} (from the data plate and sampler): "
                    "the accountant must use the rate the batches are actually drawn with"
                )
            if not (math.isfinite(num_epochs) and num_epochs > 0):
                raise ValueError(f"num_epochs must be finite and > 0, got {num_epochs}")
            num_steps = self._steps_of_epochs(num_epochs)
        if num_steps is None:
            raise TypeError("get_epsilon needs num_steps (or num_epochs)")
        if isinstance(num_steps, DPSVIState):
            num_steps = int(num_steps.num_steps)
        delta = float(delta)
        eps = self.privacy_spent(num_steps, delta).epsilon
        # delta_acct(eps) + extra(eps) <= delta: extra grows with eps, so evaluate it a little above the
        # epsilon sought and stop once the accountant's answer stays below that point
        for _ in range(100):
            if not num_steps or not math.isfinite(eps):
                return eps
            ceiling = eps * (1 + 1e-3) + 1e-9
            extra = self._extra_delta(ceiling, num_steps)
            if not extra < delta:
                raise ValueError(
                    f"the extra delta of the sampler and the noise's range, {extra:.3g}, is not below delta={delta:.3g}: "
                    "no epsilon holds at this delta"
                )
            eps = float(self._epsilon(np.array([num_steps]), delta - extra)[0])
            if eps <= ceiling:
                return eps
        raise ValueError(f"no epsilon found for delta={delta:.3g}: the extra delta grows faster than the accountant's")

    def _steps_of_epochs(self, num_epochs: float) -> int:
        """``E`` epochs in steps, rounded up, and to the nearest whole number within float rounding:
        ``E N / B`` for fixed-size batches (``E / q`` in floats gave 7199.999... for 3 epochs of 25 of
        60,000 records, and ``int`` counted a step too few), ``E / q`` for Poisson batches."""
        sampler = self.sampler
        if isinstance(sampler, FixedSizeSampler):
            steps = num_epochs * sampler.num_records / sampler.batch_size
        else:
            steps = num_epochs / sampler.q
        nearest = round(steps)
        return int(nearest) if abs(steps - nearest) <= 1e-9 * steps else math.ceil(steps)

    def _report(self, eps: float, delta: float, num_steps: int) -> PrivacyReport:
        extra = self._extra_delta(eps, num_steps) if num_steps and math.isfinite(eps) else 0.0
        return PrivacyReport(
            epsilon=eps,
            delta=delta + extra,
            noise_multiplier=self.dp_scale,
            clipping_threshold=self.clipping_threshold,
            sampling_rate=self.sampler.q,
            num_steps=int(num_steps),
            relation=Relation(self.sampler.relation).value,
            # in batch mode the batches come from the caller: the accountant assumes the sampler drew them
            sampler=type(self.sampler).__name__ + ("" if self.structure.plate_mode else " (assumed: batch mode)"),
        )

    # ------------------------------------------------------------------ the loss split

    def _run_traces(self, params, rng_key, args, kwargs, position, indices):
        """Traces of the model and guide run on the record at batch ``position`` (0 for the global terms)."""
        params = self.constrain_fn(params)
        kwargs = {**kwargs, **self.static_kwargs}
        name = self.structure.plate_name
        # The records' keys come from a key of their own: JAX's fold_in(k, i) is split(k)[i], so records
        # keyed fold_in(rng_key, position) would have drawn with the model's and the guide's keys.
        model_key, guide_key, records_key = random.split(rng_key, 3)
        record_key = random.fold_in(records_key, position)
        guide = seed(_RecordScope(substitute(self.guide, params), name, record_key, indices, 0), guide_key)
        guide_trace = trace(guide).get_trace(*args, **kwargs)
        model = seed(
            _RecordScope(substitute(replay(self.model, guide_trace), params), name, record_key, indices, 1), model_key
        )
        model_trace = trace(model).get_trace(*args, **kwargs)
        return model_trace, guide_trace

    def _elbo_terms(self, params, rng_key, args, kwargs, position, indices):
        """(record term, global terms by site) of one particle's negative ELBO, from a run on a
        single record.

        The record term is unscaled: the data plate's N / 1 scale is divided out. The global terms
        are keyed ``"model site 'w'"`` / ``"guide site 'w'"``.
        """
        model_trace, guide_trace = self._run_traces(params, rng_key, args, kwargs, position, indices)
        name = self.structure.plate_name
        plate_site = model_trace[name]
        plate_scale = plate_site["args"][0] / plate_site["args"][1]
        local, global_ = 0.0, {}
        for sign, role, tr in ((-1.0, "model", model_trace), (1.0, "guide", guide_trace)):
            for site in tr.values():
                if site["type"] != "sample":
                    continue
                term = sign * _site_log_prob(site)
                if _in_plate(site, name):
                    local = local + term / plate_scale
                else:
                    global_[f"{role} site {site['name']!r}"] = term
        return local, global_

    def _particle_keys(self, rng_key):
        return _particle_keys(rng_key, self.loss.num_particles)

    def _record_loss(self, params, rng_key, args, kwargs, record, isolate: bool = True):
        """Unscaled negative ELBO term of one record, averaged over particles."""
        index, position = record
        if self.structure.plate_mode and not isolate:
            indices, rec_args = jnp.reshape(index, (1,)), args
        elif self.structure.plate_mode:
            # The model sees N copies of this record in place of the data: whatever it computes, the
            # term can depend on no other record, so clipping bounds each record's influence.
            indices = jnp.reshape(index, (1,))
            rec_args = jax.tree.map(lambda a: jnp.broadcast_to(a[index], jnp.shape(a)), args)
        else:
            indices, rec_args = jnp.zeros((1,), jnp.int32), jax.tree.map(lambda a: a[None], args)

        def one(key):
            return self._elbo_terms(params, key, rec_args, kwargs, position, indices)[0]

        return jnp.mean(jax.vmap(one)(self._particle_keys(rng_key)))

    def _global_terms(self, params, rng_key, args, kwargs, record_index):
        """Data-independent terms of the negative ELBO (global prior and guide terms) by site,
        averaged over particles."""
        if self.structure.plate_mode:
            indices, rec_args = jnp.reshape(record_index, (1,)), args
        else:
            indices, rec_args = jnp.zeros((1,), jnp.int32), jax.tree.map(lambda a: a[record_index][None], args)

        def one(key):
            return self._elbo_terms(params, key, rec_args, kwargs, 0, indices)[1]

        return jax.tree.map(jnp.mean, jax.vmap(one)(self._particle_keys(rng_key)))

    def _global_loss(self, params, rng_key, args, kwargs, record_index):
        """Data-independent part of the negative ELBO, averaged over particles."""
        return sum(self._global_terms(params, rng_key, args, kwargs, record_index).values(), jnp.zeros(()))

    def _diagnose(self, rng_key, args, kwargs, error: Exception) -> None:
        """Explain a model that failed to initialise by its plates and data, if they are the cause."""
        full = {**kwargs, **self.static_kwargs}
        try:
            trace(seed(_PlateCheck(self.model), rng_key)).get_trace(*args, **full)
        except ValueError as found:
            if "plate" in str(found):
                raise found from error
        except Exception:
            pass

    def _elbo_keys(self, rng_key):
        return _elbo_keys(rng_key, self.loss.num_particles)

    def _check_global_independence(self, params, rng_key, args, kwargs) -> None:
        """Refuse a model whose global (unclipped, noise-free) part can depend on the data.

        Proven on the traced program (:mod:`d3pext.training.dependence`), not tested on examples:
        the value and gradient of every global term, and the initial value and the constraint's
        bounds of every ``param`` site, are followed back through the jaxpr to the data arguments
        and, in plate mode, to the index of the batch's record that the global terms are computed
        with (the batch is secret too: the subsampling's amplification assumes it). In the same
        trace, the data plate's observed values in the run on one record must come from the data
        (:meth:`_check_record_observations`). The proven program of the global part is
        kept and is what the compiled steps run (:meth:`_global_value_and_grad`). A proof holds for
        every later init with the same structure and the same types of data, parameters, keyword
        arrays and key, so it is kept and not repeated.
        """
        dyn, static = _split_kwargs(kwargs)
        leaves, treedef = jax.tree.flatten((args, params, dyn, rng_key))
        proof = None
        if all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves):
            proof = (static, treedef, tuple(jax.typeof(leaf) for leaf in leaves))
            if proof in self._independence_proofs:
                return
        kw = {**dyn, **dict(static)}

        def param_inits(data, params, rng_key):  # params and key abstract too: no op runs eagerly
            full = {**kw, **self.static_kwargs}
            inits, bounds = {}, {}
            for role, fn in (("guide", self.guide), ("model", self.model)):
                tr = trace(seed(_FirstIndices(fn), rng_key)).get_trace(*data, **full)
                for n, s in tr.items():
                    if s["type"] == "param":
                        inits[f"{role} param {n!r}"] = s["value"]
                        # the constraint becomes a transform of the parameters, its bounds baked in
                        bounds[f"{role} param {n!r}"] = _array_leaves(s["kwargs"].get("constraint"))
            return inits, bounds, self._record_observations(params, rng_key, data, kw, found)

        found = {}
        marks, bound_marks, obs_marks = dependent_outputs(param_inits, args, params, rng_key)
        self._check_record_observations(obs_marks, found)
        bound_leaks = [name for name, m in bound_marks.items() if any(m)]
        if bound_leaks:
            raise ValueError(
                f"the constraint of {', '.join(bound_leaks)} can depend on the data (e.g. interval(jnp.min(x), "
                "jnp.max(x))): the parameter's transform would carry it into every step and into the released "
                "parameters, without clipping or noise. Give the constraint data-free bounds (public constants, "
                "or a private release passed as a keyword argument)."
            )
        self._prove_global_part(
            args, params, dyn, static, jax.eval_shape(self._elbo_keys, rng_key),  # abstract: no split op by op
            np.zeros((), np.int32) if self.structure.plate_mode else None,  # a step's first sampled record
            keep=proof is not None,
            leaks=[name for name, m in marks.items() if any(jax.tree.leaves(m))],
        )
        if proof is not None:
            self._independence_proofs.add(proof)

    def _record_observations(self, params, rng_key, args, kwargs, found: dict) -> dict:
        """The observed values of the data plate's sites in a step's run on one record (record 0), and
        (into ``found``) each one's number of values along the data plate."""
        name = self.structure.plate_name
        indices = jnp.zeros((1,), jnp.int32)
        if self.structure.plate_mode:
            rec_args = jax.tree.map(lambda a: jnp.broadcast_to(a[0], jnp.shape(a)), args)
        else:
            rec_args = jax.tree.map(lambda a: a[:1], args)
        model_trace, _ = self._run_traces(params, self._elbo_keys(rng_key)[0], rec_args, kwargs, 0, indices)
        values = {}
        for site in model_trace.values():
            if site["type"] != "sample" or not site["is_observed"] or not _in_plate(site, name):
                continue
            if isinstance(site["fn"], Unit):  # numpyro.factor: its value is an empty placeholder
                continue
            shape = jnp.shape(site["value"])
            frame = next(f for f in site["cond_indep_stack"] if f.name == name)
            axis = len(shape) - len(getattr(site["fn"], "event_shape", ())) + frame.dim
            batch = tuple(getattr(site["fn"], "batch_shape", ()))
            fn_axis = len(batch) + frame.dim
            found[site["name"]] = (
                shape[axis] if 0 <= axis < len(shape) else 1,
                batch[fn_axis] if 0 <= fn_axis < len(batch) else 1,
            )
            values[site["name"]] = site["value"]
        return values

    def _check_record_observations(self, marks: dict, extents: dict) -> None:
        """Each observed site of the data plate must observe the record's own data: a value that does
        not come from the positional data (given by ``numpyro.handlers.condition``, or an array the
        model closes over) is not kept apart record by record, nor subsampled: every record's term
        would read all of it, outside the clipping bound."""
        plate_name = self.structure.plate_name
        for site, (extent, fn_extent) in extents.items():
            if not marks[site]:
                raise ValueError(
                    f"observed site {site!r} in the data plate {plate_name!r} does not take its observed value from "
                    "the positional data (observations given by numpyro.handlers.condition, or an array the model "
                    "closes over?): DPSVI keeps only the positional data apart record by record, so each record's "
                    "clipped term would read all of these observations. Pass them positionally and observe the "
                    "record's own, e.g. obs=numpyro.subsample(y, event_dim=0) in model(x, y)."
                )
            if extent != 1:
                raise ValueError(
                    f"observed site {site!r} has {extent} values along the data plate {plate_name!r} in the run on "
                    "one record: its term would read other records' data, outside the clipping bound. Observe the "
                    "record's own data (obs=numpyro.subsample(y, event_dim=0), or y[idx] with the plate's indices)."
                )
            if fn_extent != 1:
                raise ValueError(
                    f"observed site {site!r} has a distribution with {fn_extent} rows along the data plate "
                    f"{plate_name!r} in the run on one record: an array with a row per record of the batch (a "
                    "keyword argument, public_kwargs=?) reaches its parameters. DPSVI computes each record's term "
                    "alone and slices only the positional data, so such an array would be broadcast against every "
                    "record. Pass arrays with a row per record positionally; a public array is read through a "
                    "positional index column (group_features[group])."
                )

    def _prove_global_part(self, args, params, dyn, static, keys, index, keep: bool, leaks=()) -> tuple:
        """The global part's value and gradient traced as a program of ``(args, params, dyn, keys,
        index)``, with its output tree; refused (with ``leaks``, names found already) where an output
        can depend on the data or on the sampled record ``index``. Kept for the steps if ``keep``."""

        def traced(fn):
            closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(args, params, dyn, keys, index)
            counts = [len(jax.tree.leaves(part)) for part in (args, params, dyn, keys, index)]
            secret = [True] * counts[0] + [False] * sum(counts[1:4]) + [True] * counts[4]
            out_tree = jax.tree.structure(out_shape)
            return jax.tree.unflatten(out_tree, jaxpr_dependence(closed, secret)), closed, out_tree

        def global_part(data, params, dyn, keys, index):
            kw = {**dyn, **dict(static)}
            return jax.value_and_grad(self._global_loss)(params, keys, data, kw, 0 if index is None else index)

        def global_sites(data, params, dyn, keys, index):
            kw = {**dyn, **dict(static)}
            return self._global_terms(params, keys, data, kw, 0 if index is None else index)

        marks, program, out_tree = traced(global_part)
        leaks = list(leaks)
        if any(jax.tree.leaves(marks)):
            leaks = [name for name, m in traced(global_sites)[0].items() if m] + leaks or ["the global terms"]
        if leaks:
            raise ValueError(
                f"{', '.join(leaks)} outside the data plate {self.structure.plate_name!r} can depend on the data "
                "or on which records the batch holds (found in the traced program): DPSVI would use it without "
                "clipping or noise. Move every use of the records, and of the plate's indices, inside the data "
                "plate, or compute such statistics with a private release and pass them as keyword arguments."
            )
        if keep:
            treedef = jax.tree.structure((args, params, dyn, keys, index))
            self._global_programs[(static, treedef, tuple(program.in_avals))] = program, out_tree
        return program, out_tree

    def _global_value_and_grad(self, params, keys, args, kwargs, index):
        """Value and gradient of the global loss (``index``: the batch's first record in plate mode, else
        ``None``), by the program that was proven independent of the data and the batch: the one init
        kept for these types, else one proven here (types init did not see, e.g. ``update`` on data of
        another shape). The steps run what was proven, and do not trace the model again for it."""
        dyn, static = _split_kwargs(kwargs)
        leaves, treedef = jax.tree.flatten((args, params, dyn, keys, index))
        kept = self._global_programs.get((static, treedef, tuple(jax.typeof(leaf) for leaf in leaves)))
        if kept is None:
            kept = self._prove_global_part(args, params, dyn, static, keys, index, keep=False)
        program, out_tree = kept
        return jax.tree.unflatten(out_tree, jaxpr_as_fun(program)(*leaves))

    def _position_terms(self, params, rng_key, args, kwargs, indices) -> jax.Array:
        """The terms (model and guide log densities, site by site) of the records at positions 0 and 1 of
        a batch of ``indices`` (plate mode; in batch mode the two rows of ``args``), ``[2, sites]``,
        computed as NumPyro computes a batch: the whole batch in one run of the model and the guide."""
        model_trace, guide_trace = self._run_traces(params, rng_key, args, kwargs, 0, indices)
        name = self.structure.plate_name
        terms = []
        for tr in (model_trace, guide_trace):
            for site in tr.values():
                if site["type"] != "sample" or not _in_plate(site, name):
                    continue
                log_prob = site["fn"].log_prob(site["value"])
                if site["scale"] is not None:
                    log_prob = site["scale"] * log_prob
                dim = next(f.dim for f in site["cond_indep_stack"] if f.name == name)
                if jnp.ndim(log_prob) < -dim:  # no axis of the plate: the same for every record
                    continue
                log_prob = jnp.moveaxis(log_prob, dim, 0)
                rows = jnp.broadcast_to(log_prob, (2,) + jnp.shape(log_prob)[1:]) if jnp.shape(log_prob)[0] == 1 else log_prob[:2]
                terms.append(jnp.sum(jnp.reshape(rows, (2, -1)), axis=1))
        return jnp.stack(terms, axis=1) if terms else jnp.zeros((2, 0))

    def _check_record_isolation(self, params, rng_key, args, kwargs) -> None:
        """Each record's term is computed from that record alone (in plate mode from copies of it in
        place of the data), in a batch of one. Refuse a model whose record term changes under that
        instead of silently fitting a different model: one that reads other records inside the data plate
        (``jnp.mean(x)``), or computes across the records of its batch (``xb - jnp.mean(xb, 0)`` after
        ``numpyro.subsample``, batch normalization), which in a batch of one sees the record alone."""
        dyn, static = _split_kwargs(kwargs)
        plate_mode = self.structure.plate_mode
        last = (self.structure.num_records if plate_mode else _num_records(args)) - 1
        if last < 1:
            return
        losses = self._isolation_checks.get(static)
        if losses is None:  # one compiled check per structure: op-by-op it costs seconds of dispatch

            @cached_jit
            def losses(params, key, args, dyn):
                key = threefry_key(key)
                kw = {**dyn, **dict(static)}
                same = []
                if plate_mode:

                    def loss(case):
                        # isolated: the data replaced by N copies of the record (as each step computes its
                        # term); given: the data as they are. One traced model for both cases (traced per
                        # case, the model was traced twice: 0.25 s to trace and lower instead of 0.19 s, in
                        # every process); lax.map keeps one copy of the data at a time.
                        index, isolated = case
                        data = jax.tree.map(lambda a: jnp.where(isolated, jnp.broadcast_to(a[index], jnp.shape(a)), a), args)
                        return self._record_loss(params, key, data, kw, (index, 0), isolate=False)

                    cases = (jnp.array([0, last, 0, last]), jnp.array([True, True, False, False]))
                    own, given = jnp.reshape(lax.map(loss, cases), (2, 2))
                    same += [jnp.isclose(own, given, rtol=1e-4, atol=1e-5, equal_nan=True)]

                # two records a, b (b one that differs from a, where one does) in a batch together, and each in
                # a batch with a copy of itself: the same terms unless the model computes across the batch
                leaves = jax.tree.leaves(args)
                differs = [jnp.reshape(leaf != leaf[:1], (jnp.shape(leaf)[0], -1)).any(1) for leaf in leaves]
                b = jnp.argmax(jnp.any(jnp.stack(differs), axis=0)) if differs else jnp.int32(0)
                pairs = jnp.stack([jnp.stack([0, b]), jnp.stack([0, 0]), jnp.stack([b, b])]).astype(jnp.int32)

                def batch_terms(pair):
                    if plate_mode:
                        return self._position_terms(params, key, args, kw, pair)
                    rows = jax.tree.map(lambda a: a[pair], args)
                    return self._position_terms(params, key, rows, kw, jnp.arange(2, dtype=jnp.int32))

                together, a_alone, b_alone = lax.map(batch_terms, pairs)  # one traced model
                alone = jnp.stack([a_alone[0], b_alone[1]])
                same += [jnp.all(jnp.isclose(together, alone, rtol=1e-4, atol=1e-5, equal_nan=True))[None]]
                return jnp.concatenate(same)

            self._isolation_checks[static] = losses
        same = np.asarray(losses(params, rng_key, args, dyn))  # one compiled check, one read
        if plate_mode:
            for index, same_loss in zip((0, last), same[:2]):
                if not same_loss:
                    raise ValueError(
                        f"the loss of record {index} changes when the other records change: the model reads more "
                        f"than one record inside the data plate {self.structure.plate_name!r} (a statistic of the "
                        "whole data, such as jnp.mean(x)?). DPSVI bounds each record's influence by clipping its own "
                        "term, so a record's term may depend only on that record; compute such statistics with a "
                        "private release and pass them as keyword arguments."
                    )
        if not same[-1]:
            raise ValueError(
                "the terms of a record change with the other records of its batch: the model computes "
                f"across the records of a batch inside the data plate {self.structure.plate_name!r} (a batch "
                "statistic such as xb - jnp.mean(xb, 0) after numpyro.subsample, or batch normalization). DPSVI "
                "computes each record's term in a batch of its own, to clip it, so such a model would be fitted as "
                "another model (a batch of one record centred to zero) without any error. Make each record's "
                "term depend on that record only (centre with a constant, or a private release passed as a "
                "keyword argument; per-record normalization instead of batch normalization)."
            )

    # ------------------------------------------------------------------ SVI interface

    @one_model_at_a_time
    def init(self, rng_key, *args, init_params=None, **kwargs) -> DPSVIState:
        """Trace the model, find its data plate and sampling rate, calibrate sigma if a target was given."""
        state = self._init(rng_key, args, kwargs, init_params)
        if self._split_update():
            self._update_draws(state)  # update's draws compile here, or are found compiled (see _update_draws)
        return state

    def _init(self, rng_key, args, kwargs, init_params) -> DPSVIState:
        kwargs.pop("mask", None)  # d3p's Poisson-batch mask is DPSVI's, not the model's (see update)
        _num_records(args)
        self._check_inputs(args, kwargs)
        if rng_key is not None and not is_prng_key(rng_key):
            raise TypeError(
                f"rng_key must be a JAX PRNG key such as jax.random.key(0) (or None for a secure key from OS "
                f"entropy), got {type(rng_key).__name__} {rng_key!r}"
            )
        rng_key = agreed_key(rng_key, self.mesh)  # None: a secure key (process 0's, across processes)
        compiled = self._compiled_init(rng_key, args, kwargs, init_params)
        if compiled is not None:
            state, init_key, (model_trace, guide_trace) = compiled
        else:
            state, init_key, model_trace, guide_trace = self._eager_init(rng_key, args, kwargs, init_params)
        try:
            structure = self._find_structure(model_trace, guide_trace, args)
        except jax.errors.JAXTypeError:  # the compiled traces hold tracers where the model needs values
            self._op_by_op_init = True
            state, init_key, model_trace, guide_trace = self._eager_init(rng_key, args, kwargs, init_params)
            structure = self._find_structure(model_trace, guide_trace, args)
        # with the number of records known: record data by keyword in another layout (features, records)
        _check_keyword_arrays(args, kwargs, self.static_kwargs, structure.num_records, self.public_kwargs)
        sampler = self._make_sampler(structure, args)
        unconstrained = self.optim.get_params(state.optim_state)
        noise_size = sum(int(np.size(leaf)) for leaf in jax.tree.leaves(unconstrained))
        if (structure, sampler, noise_size) != (self.structure, self.sampler, self._noise_size):
            self._steps.clear()  # compiled steps hold the structure and the sampler (sigma is an argument)
            self._chunks.clear()
            self._isolation_checks.clear()
            self._independence_proofs.clear()
            self._global_programs.clear()
            self.structure, self.sampler, self._noise_size = structure, sampler, noise_size
            if self.target_epsilon is not None:
                self.dp_scale = None
        self._calibrate()
        self._check_global_independence(unconstrained, init_key, args, kwargs)
        self._check_record_isolation(unconstrained, init_key, args, kwargs)
        # device_put, not jnp.zeros: an eager jnp call compiles a program in every new process
        zero = lambda: jax.device_put(np.zeros((), np.int32))  # noqa: E731
        digest = jax.device_put(self._settings_digest())
        return self._on_mesh(DPSVIState(state.optim_state, state.mutable_state, state.rng_key, zero(), zero(), digest))

    def _settings_digest(self) -> np.ndarray:
        """32 bits of a hash of what the accounting of a step depends on."""
        settings = repr((float(self.dp_scale), float(self.clipping_threshold), self.sampler, self._noise_size))
        return np.frombuffer(hashlib.sha256(settings.encode()).digest()[:4], np.uint32).reshape(())

    def check_resumable(self, state: DPSVIState) -> None:
        """Refuse a state whose steps were taken with other privacy settings than this object's: their
        privacy spent would be accounted at this object's noise, clipping and sampling rate."""
        self._check_ready()
        done = int(host_value(state.num_steps))
        if not done:
            return
        digest = state.settings_digest
        if digest is None or int(host_value(digest)) != int(self._settings_digest()):
            raise ValueError(
                f"the state's {done} step(s) were taken with other privacy settings (noise multiplier, clipping "
                f"threshold, sampler or number of parameters) than this DPSVI's (sigma={self.dp_scale:.4g}, "
                f"C={self.clipping_threshold:g}, {self.sampler!r}): it would account them at its own. Go on with "
                "the DPSVI that took them (extend_plan for more steps)"
            )

    def _on_mesh(self, state: DPSVIState) -> DPSVIState:
        """With a mesh, the state replicated over it, as the compiled step returns it: a state placed
        otherwise has other input types, and the second step (or chunk of ``run``) compiled again."""
        if self.mesh is None:
            return state
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        if all(
            isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(replicated, leaf.ndim)
            for leaf in jax.tree.leaves(state)
        ):
            return state  # e.g. the state of an earlier run
        if self._replicate is None:
            # a compiled identity, not device_put: across processes the mesh has devices this one cannot address
            self._replicate = jax.jit(lambda s: s, out_shardings=replicated)
        return self._replicate(state)

    def _init_traces(self, rng_key, args, kwargs, init_params):
        """NumPyro's init, then the traces of guide and model that show the structure.

        NumPyro draws the plates' random subsamples while it traces for the parameters; DPSVI draws its
        batches itself, and tracing with the first indices compiles nothing (NumPyro's CPU subsample is
        an eager scan, compiled again on every init).
        """
        model, guide = self.model, self.guide
        _setup_autoguide_without_data(guide, random.fold_in(rng_key, 2), args, {**kwargs, **self.static_kwargs})
        self.model, self.guide = _FirstIndices(model), _FirstIndices(guide)
        try:
            state = super().init(rng_key, *args, init_params=init_params, **kwargs)
        finally:
            self.model, self.guide = model, guide
        init_key = random.fold_in(state.rng_key, 1)
        params = self.constrain_fn(self.optim.get_params(state.optim_state))
        kw = {**kwargs, **self.static_kwargs}
        guide_trace = trace(seed(_FirstIndices(substitute(guide, params)), init_key)).get_trace(*args, **kw)
        model = _FirstIndices(substitute(replay(model, guide_trace), params))
        model_trace = trace(seed(model, init_key)).get_trace(*args, **kw)
        return state, init_key, model_trace, guide_trace

    def _refuse_structure_early(self, traces, args) -> None:
        """Raise the structure error of the traced init's model and guide, if there is one, before
        anything is compiled: the op-by-op init of an AutoGuide (seconds of small compilations) or the
        compiled init would reach the same error only after that."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the structure's warnings come once, after the init
            try:
                self._find_structure(*traces, args)
            except (ValueError, NotImplementedError):
                raise
            except Exception:  # needs concrete values: the op-by-op init decides
                pass

    def _eager_init(self, rng_key, args, kwargs, init_params):
        try:
            return self._init_traces(rng_key, args, kwargs, init_params)
        except Exception as error:
            self._diagnose(rng_key, args, kwargs, error)
            raise

    def _compiled_init(self, rng_key, args, kwargs, init_params):
        """``_init_traces`` as one compiled program, kept per argument shapes; ``None`` where it cannot be.

        Run op by op, init makes every primitive of the model a small program of its own, traced,
        lowered and compiled again in each new process (about 40 for logistic regression, nearly all of
        a first init); compiled, it is one program, and the persistent compilation cache keeps it. Falls
        back (``None``) for a mesh, for a model that needs concrete values while it is traced, and where
        a constraint of a ``param`` site would hold a traced value.
        """
        if self.mesh is not None or self._op_by_op_init:
            return None
        dyn, static = _split_kwargs(kwargs)
        inputs = (rng_key, args, dyn, init_params)
        leaves, treedef = jax.tree.flatten(inputs)
        if not all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves):
            return None
        signature = (static, treedef, tuple((jax.typeof(leaf), getattr(leaf, "sharding", None)) for leaf in leaves))
        if signature not in self._inits:
            found = {}

            def init(rng_key, args, dyn, init_params):
                state, init_key, model_trace, guide_trace = self._init_traces(
                    rng_key, args, {**dyn, **dict(static)}, init_params
                )
                found.update(constrain_fn=self.constrain_fn, traces=(model_trace, guide_trace))
                return state, init_key

            # A model or guide that keeps state on itself (an AutoGuide sets up its prototype on the first
            # call) would keep traced values: then its state is put back and init runs op by op, from then
            # on (the compiled and the op-by-op init may round differently: one object, one form).
            owners = [f for f in (self.model, self.guide) if hasattr(f, "__dict__")]
            before = [dict(vars(f)) for f in owners]
            try:
                traced = jax.jit(init).trace(*inputs)
            except Exception:  # the op-by-op init runs the model as NumPyro does, and explains its errors
                traced = None
            changed = False
            for f, saved in zip(owners, before):
                now = vars(f)
                if now.keys() != saved.keys() or any(now[k] is not v for k, v in saved.items()):
                    changed = True
                    now.clear()
                    now.update(saved)
            if changed:
                self._op_by_op_init = True
            if traced is None:
                return None
            self._refuse_structure_early(found["traces"], args)
            transforms = found["constrain_fn"].args[0]
            if changed or any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(transforms)):
                return None  # decided on the trace: nothing is compiled only to be thrown away
            try:
                executable = compile_traced(traced)
            except Exception:
                return None
            self._inits[signature] = executable, found["constrain_fn"], found["traces"]
        executable, self.constrain_fn, traces = self._inits[signature]
        state, init_key = executable(*inputs)
        return state, init_key, traces

    def _batch_sampler(self):
        """The sampler that draws each step's batch: ``None`` in batch mode, where the caller draws them."""
        return self.sampler if self.structure.plate_mode else None

    def _private_grad(self, params, rng_key, args, kwargs, stable: bool, batch_mask=None, noise_std=None):
        """Noisy, clipped and rescaled gradient of the negative ELBO, the (non-private) loss estimate
        and the number of sampled records dropped for a non-finite loss or gradient.

        ``rng_key`` is one key, or the draws made from a step's key (:func:`_step_draws`). ``noise_std`` is
        sigma C (default: this object's), an argument of the compiled step (see :meth:`_settings`)."""
        structure = self.structure
        draws = rng_key
        if not isinstance(draws, _StepDraws):
            keys = random.split(rng_key, 3)
            draws = _step_draws(keys, jax.tree.leaves(params), self._batch_sampler(), self.loss.num_particles)
        elbo_key = draws.elbo_keys
        if structure.plate_mode:
            indices, mask = draws.batch
            records = (indices, jnp.arange(indices.shape[0]))
        else:
            n = jnp.shape(args[0])[0]
            indices = jnp.arange(n)
            mask = jnp.ones(n, bool) if batch_mask is None else jnp.asarray(batch_mask, bool)
            records = (indices, indices)
        if structure.plate_mode:
            per_record = lambda fn, p, recs, a: jax.vmap(fn, in_axes=(None, None, None, None, 0))(p, elbo_key, a, kwargs, recs)
        else:
            per_record = lambda fn, p, recs, a: jax.vmap(lambda rec, ra: fn(p, elbo_key, ra, kwargs, rec))(recs, a)
        c = self.clipping_threshold
        clipped_sum = CLIPPED_SUMS[self._clipping_mode(params)]
        # A record whose loss or gradient is not finite is left out of the sum: like clipping, a
        # decision on that record alone, so the sum still changes by at most C per record.
        if self.mesh is None:
            clipped, losses, kept = clipped_sum(
                self._record_loss, per_record, params, args, records, mask, c, True, structure.plate_mode
            )
        else:  # the records split over the mesh's data axis, one all-reduce of the clipped sum
            clipped, losses, kept = data_parallel_clipped_sum(
                clipped_sum, self._record_loss, params, elbo_key, args, kwargs, records, mask, c, True,
                structure.plate_mode, mesh=self.mesh, axis=self.data_axis,
            )
        dropped = jnp.sum(mask & ~kept, dtype=jnp.int32)
        mask = kept
        leaves, treedef = jax.tree.flatten(clipped)
        scale = 1.0 / self.sampler.q  # N / B for fixed-size batches, 1 / q for Poisson ones
        if noise_std is None:
            noise_std = self.dp_scale * c
        noisy = [(g + noise_std * z) * scale for g, z in zip(leaves, draws.noise)]
        global_loss, global_grads = self._global_value_and_grad(
            params, elbo_key, args, kwargs, indices[0] if structure.plate_mode else None
        )
        grads = jax.tree.map(jnp.add, jax.tree.unflatten(treedef, noisy), global_grads)
        loss = scale * jnp.sum(jnp.where(mask, losses, 0.0)) + global_loss
        return loss, grads, dropped

    def _clipping_mode(self, params) -> str:
        """How the clipped sum is computed (decided at trace time from static shapes)."""
        return choose_clipping(self.clipping, self.structure.batch_size, params)

    def _settings(self) -> tuple:
        """What the compiled step takes as arguments rather than constants: the noise's standard deviation
        sigma C and the planned number of steps, as Python scalars (weakly typed: the noise keeps the
        parameters' dtype). Objects that differ only in these, such as a sweep over epsilons, then compile
        the same programs, which the persistent compilation cache finds."""
        return self.dp_scale * self.clipping_threshold, self.planned_steps

    def _step(self, state: DPSVIState, args, dyn_kwargs, batch_mask, settings, draws=None, *, static_kwargs,
              stable: bool):
        """One private step; ``draws``: :func:`_next_key_and_draws` of the state's key, made by the caller
        (``update``, where a program of their own compiles in ``init``), or here (``run``'s loop, a caller's
        jit)."""
        kwargs = {**dyn_kwargs, **dict(static_kwargs)}
        noise_std, planned_steps = settings
        params = self.optim.get_params(state.optim_state)
        if draws is None:
            draws = _next_key_and_draws(state.rng_key, params, self._batch_sampler(), self.loss.num_particles)
        rng_key, draws = draws
        loss, grads, dropped = self._private_grad(params, draws, args, kwargs, stable, batch_mask, noise_std)
        # optax transformations may ask for the loss value (``update_with_value``); the loss is not private,
        # so they get NaN: value-driven schedules (line searches, reduce-on-plateau) cannot be used with DPSVI.
        value = jnp.nan if self.optim.update_with_value else None

        def update(grads, optim_state):
            new_optim_state = self.optim.update(grads, optim_state, value=value)
            if stable:
                ok = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
                new_optim_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_optim_state, optim_state)
            return new_optim_state

        num_steps = state.num_steps + 1
        if planned_steps is None:
            new_optim_state = update(grads, state.optim_state)
        else:
            # Under a caller's own jit the host-side refusal cannot run: a step past the plan then
            # changes nothing and is not counted (its noisy gradient is discarded unused).
            within = state.num_steps < planned_steps

            def on_cpu(grads, optim_state):
                # a branch: the gradient is then one buffer that the update reads, where XLA's CPU
                # fusion recomputed its terms (the guide's draw, the global part) in each of the
                # optimizer's outputs (the step's program 8% smaller); past the plan nothing is updated
                return lax.cond(within, update, lambda grads, optim_state: optim_state, grads, optim_state)

            def on_accelerator(grads, optim_state):  # a branch would wait for the host to read `within`
                return jax.tree.map(lambda new, old: jnp.where(within, new, old), update(grads, optim_state), optim_state)

            new_optim_state = by_backend(on_cpu, on_accelerator, grads, state.optim_state)
            num_steps = jnp.where(within, num_steps, state.num_steps)
            dropped = jnp.where(within, dropped, 0)
        new_state = DPSVIState(
            new_optim_state, state.mutable_state, rng_key, num_steps, state.num_dropped + dropped, state.settings_digest
        )
        return new_state, loss

    def _jitted_step(self, static_kwargs: tuple, stable: bool):
        key = (static_kwargs, stable)
        if key not in self._steps:
            self._steps[key] = jax.jit(partial(self._step, static_kwargs=static_kwargs, stable=stable))
        return self._steps[key]

    def _update_draws(self, state: DPSVIState) -> tuple:
        """:func:`_next_key_and_draws` of ``state``'s key, as the compiled program of their own that ``update``
        runs before the step, two programs where ``run``'s loop has one: the batch sampler and the full-tailed
        noise are about half of the step's compile in XLA (an ablation, benchmarks/RESULTS.md, session 26),
        and they depend only on the key, the sampler and the parameters' shapes, so ``init`` compiles them
        (:func:`_draws_program`, shared by objects) and the first ``update`` compiles the rest. The draws are
        the same as the one program's."""
        program = _draws_program(self._batch_sampler(), self.loss.num_particles)
        return program(state.rng_key, self.optim.get_params(state.optim_state))

    def _split_update(self) -> bool:
        """Whether ``update`` runs the draws as a program of their own: not over a mesh, where the one
        program keeps its sharding of the step."""
        return self.mesh is None

    def _check_ready(self):
        if self.structure is None:
            raise RuntimeError("call DPSVI.init before update")

    def _check_inputs(self, args, kwargs) -> None:
        """Refuse record data passed by keyword (:func:`_check_keyword_arrays`) and, with a mesh, data
        placed where the split step cannot take it (a clear error instead of XLA's): on devices outside
        the mesh or split otherwise than by rows over its data axis."""
        num_records = self.structure.num_records if self.structure is not None else self.num_obs_total
        _check_keyword_arrays(args, kwargs, self.static_kwargs, num_records, self.public_kwargs)
        if self.mesh is not None:
            check_data(args, self.mesh, self.data_axis)
            check_data(kwargs, self.mesh, self.data_axis)

    def _check_records(self, args) -> None:
        """A step's data must be what init traced the structure for: the N records in plate mode (the
        sampler's indices lie in [0, N); on fewer rows JAX would clamp them to the last one, a record then
        sampled several times per batch), or a batch of the sampler's length in batch mode."""
        rows = _num_records(args)
        structure = self.structure
        expected = structure.num_records if structure.plate_mode else self.sampler.padded_size
        if rows != expected:
            raise ValueError(
                f"the data have {rows} records, but this DPSVI was initialised for "
                + (f"N={expected} records (plate mode)" if structure.plate_mode else f"batches of {expected} (batch mode)")
                + ": its sampler and privacy accounting are for those. Call init with the new data (a new "
                "DPSVI for another data set)"
            )

    def _check_plan(self, state: DPSVIState, num_steps: int) -> None:
        """Refuse a state whose steps were taken with other privacy settings (:meth:`check_resumable`),
        and steps beyond the planned ``num_steps`` for which sigma was calibrated."""
        if isinstance(state.num_steps, jax.core.Tracer):
            return
        done = self._known_steps.get(id(state.num_steps))
        if done is None:  # a state this object did not return: read the count (waits for the device)
            self.check_resumable(state)
            done = int(state.num_steps)
            self._remember_steps(state.num_steps, done)
        if self.planned_steps is not None and done + num_steps > self.planned_steps:
            raise ValueError(
                f"{num_steps} more step(s) after {done} exceed the planned num_steps={self.planned_steps} for which "
                f"sigma={self.dp_scale:.4g} was calibrated: the privacy target would be exceeded. To go on knowingly, "
                "call extend_plan(new_num_steps), which reports the epsilon of the longer run."
            )

    def _batch_mask(self, kwargs: dict):
        """Pop d3p's ``mask=`` (Poisson-padded batches in batch mode) and check it fits the sampler."""
        mask = kwargs.pop("mask", None)
        poisson_batches = not self.structure.plate_mode and isinstance(self.sampler, PoissonSampler)
        if mask is not None and not poisson_batches:
            raise ValueError(
                "mask= marks the records of Poisson-padded batches; they must be accounted as Poisson sampling: "
                "create DPSVI(..., sampler=get_batch.sampler) with the PoissonSampler of poisson_batchify_data"
                if not self.structure.plate_mode
                else "mask= is for batch mode; in plate mode DPSVI draws the batches (and their mask) itself"
            )
        if poisson_batches:
            if mask is None:
                raise ValueError("batches from a PoissonSampler carry a mask: update(state, *batch, mask=mask)")
            if jnp.shape(mask) != (self.sampler.padded_size,):
                raise ValueError(f"mask of shape {jnp.shape(mask)} for batches of {self.sampler.padded_size} slots")
        return mask

    def extend_plan(self, num_steps: int) -> PrivacyReport:
        """Allow ``num_steps`` steps in all, beyond the plan sigma was calibrated for, and return
        the privacy report of the longer run (its epsilon exceeds the original target)."""
        self._check_ready()
        if int(num_steps) != num_steps or self.planned_steps is not None and num_steps < self.planned_steps:
            raise ValueError(f"the new plan must be an integer >= the current one ({self.planned_steps}), got {num_steps}")
        self.planned_steps = int(num_steps)  # an argument of the compiled steps: nothing compiles again
        return self.privacy_spent(self.planned_steps)

    evaluate = one_model_at_a_time(SVI.evaluate)

    @one_model_at_a_time
    def update(self, svi_state: DPSVIState, *args, **kwargs):
        """One private step; returns ``(state, loss)``. The loss is not a private output.

        Batch mode with Poisson-padded batches takes d3p's ``mask=`` keyword (see ``sampler``).
        """
        self._check_ready()
        self._check_plan(svi_state, 1)
        self._check_inputs(args, kwargs)
        self._check_records(args)
        return self._update(svi_state, args, kwargs, False)

    @one_model_at_a_time
    def stable_update(self, svi_state: DPSVIState, *args, **kwargs):
        """Like :meth:`update`, but robust to numerical failures without breaking privacy.

        A record whose gradient or loss is not finite contributes zero (a per-record decision, like clipping);
        a step whose noisy gradient is not finite leaves the parameters unchanged (post-processing). Either way
        the step counts towards the privacy spent.
        """
        self._check_ready()
        self._check_plan(svi_state, 1)
        self._check_inputs(args, kwargs)
        self._check_records(args)
        return self._update(svi_state, args, kwargs, True)

    def _update(self, svi_state: DPSVIState, args, kwargs, stable: bool):
        mask = self._batch_mask(kwargs)
        dyn, static = _split_kwargs(kwargs)
        inputs = (svi_state, args, dyn, mask, self._settings())
        if self._split_update():
            inputs += (self._update_draws(svi_state),)
        return self._counted(svi_state, self._jitted_step(static, stable)(*inputs))

    def _counted(self, old: DPSVIState, out: tuple) -> tuple:
        """Remember the step count of a state returned by update, so that the plan check of the next
        update needs no device-to-host read (which would wait for this step to finish)."""
        done = self._known_steps.get(id(old.num_steps))
        if done is not None:
            self._remember_steps(out[0].num_steps, done + 1 if self.planned_steps is None else min(done + 1, self.planned_steps))
        return out

    def _remember_steps(self, count: jax.Array, value: int) -> None:
        if not isinstance(count, jax.core.Tracer) and id(count) not in self._known_steps:
            self._known_steps[id(count)] = value
            weakref.finalize(count, self._known_steps.pop, id(count), None)

    @one_model_at_a_time
    def run(
        self,
        rng_key,
        num_steps: int,
        *args,
        progress_bar: bool = True,
        stable_update: bool = False,
        init_state: Optional[DPSVIState] = None,
        init_params: Optional[dict] = None,
        **kwargs,
    ) -> DPSVIRunResult:
        """Run ``num_steps`` private steps and report the privacy spent.

        ``rng_key=None`` draws the key from OS entropy (a ChaCha20 key, :func:`d3pext.prng.secure_key`); a
        fixed key makes the run, and its noise, reproducible: use one only for experiments.
        Steps run in compiled chunks (``lax.scan``); the progress bar shows the (non-private) loss and the
        epsilon spent so far.
        """
        if int(num_steps) != num_steps or num_steps < 1:
            raise ValueError(f"num_steps must be a positive integer, got {num_steps}")
        num_steps = int(num_steps)
        if init_state is None:
            # not init: run's loop draws inside its one program, update's draws would compile for nothing
            state = self._init(rng_key, args, {k: v for k, v in kwargs.items() if k != "mask"}, init_params)
        else:
            self._check_ready()
            self._check_inputs(args, kwargs)
            self._check_records(args)
            agreed_key(init_state.rng_key, self.mesh, "state key")
            self.check_resumable(init_state)
            state = self._on_mesh(init_state)
        self._refuse_one_batch_for_all_steps()
        done = int(state.num_steps)
        self._check_plan(state, num_steps)
        mask = self._batch_mask(kwargs)
        dyn, static = _split_kwargs(kwargs)
        chunk = self._jitted_chunk(static, stable_update)
        settings = self._settings()

        num_chunks = min(num_steps, 50) if progress_bar else 1
        bounds = np.linspace(0, num_steps, num_chunks + 1).round().astype(int)
        delta = self._report_delta()
        eps_curve = self._epsilon(done + bounds[1:], delta)
        losses = []
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=num_steps, desc="DPSVI", unit="step")
        try:
            for i in range(num_chunks):
                length = int(bounds[i + 1] - bounds[i])
                segment = []
                for start in range(0, length, CHUNK_STEPS):
                    count = min(CHUNK_STEPS, length - start)
                    state, chunk_losses, params = chunk(state, args, dyn, mask, settings, np.int32(count))
                    segment.append((chunk_losses, count))
                # on the host: slicing on the device would compile a program per new count
                segment = [np.asarray(chunk_losses)[:count] for chunk_losses, count in segment]
                losses.extend(segment)
                if bar is not None:
                    bar.set_postfix(loss=f"{np.mean(np.concatenate(segment)):.4g}", epsilon=f"{eps_curve[i]:.3g}")
                    bar.update(length)
        finally:
            if bar is not None:
                bar.close()
        losses = jax.device_put(np.concatenate(losses))  # (jnp.asarray compiles a program per new length)
        report = self._report(float(eps_curve[-1]), delta, done + num_steps)
        return self.run_result(state, losses, report, params=params)

    def _refuse_one_batch_for_all_steps(self) -> None:
        """In batch mode the data passed are one batch: a run would take it in every step, while the
        accountant counts a fresh sample of B of the N records per step."""
        structure = self.structure
        if not structure.plate_mode and structure.batch_size < structure.num_records:
            raise ValueError(
                f"run() got one batch of {structure.batch_size} of the {structure.num_records} records (batch mode: "
                "the model's data plate is as large as the data passed), and would take that batch in every step, "
                "while the privacy accounting assumes a fresh random batch per step. Pass all N records with the "
                "data plate subsampling them (plate mode: numpyro.plate(name, N, subsample_size=B)), or call "
                "update() with a new batch from DPSVI's sampler in each step (poisson_batchify_data, fit_streaming)."
            )

    def run_result(
        self, state: DPSVIState, losses: jax.Array, report: PrivacyReport, params: Optional[dict] = None
    ) -> DPSVIRunResult:
        """The result of a run that ended in ``state`` (whose constrained parameters are ``params``, by
        default ``get_params(state)``); warns if records were dropped on the way."""
        dropped = int(state.num_dropped)
        if dropped:
            warnings.warn(
                f"{dropped} sampled record(s) had a non-finite loss or gradient and were left out of their steps "
                "(privacy holds: each was a per-record decision, like clipping; the count itself is not private)",
                UserWarning,
                stacklevel=3,
            )
        return DPSVIRunResult(self.get_params(state) if params is None else params, state, losses, report)

    def _jitted_chunk(self, static_kwargs: tuple, stable: bool):
        """Up to ``CHUNK_STEPS`` steps in one compiled loop, ``count`` of them run; compiled once per model
        structure and kept across runs, whatever their numbers of steps. Returns the state, the losses and
        the constrained parameters (``get_params`` op by op would compile a small program of its own in
        every new process)."""
        key = (static_kwargs, stable)
        if key not in self._chunks:
            # the jitted step: traced once for the loss's shape and kept for the loop body (a plain
            # function would be traced twice, a fifth of a warm demo's time)
            step = self._jitted_step(static_kwargs, stable)

            def chunk(state, args, dyn, mask, settings, count):
                loss_shape = jax.eval_shape(step, state, args, dyn, mask, settings)[1]

                def body(i, carry):
                    state, losses = carry
                    state, loss = step(state, args, dyn, mask, settings)
                    return state, losses.at[i].set(loss)

                losses = jnp.full((CHUNK_STEPS,), jnp.nan, loss_shape.dtype)
                state, losses = lax.fori_loop(0, count, body, (state, losses))
                return state, losses, self.constrain_fn(self.optim.get_params(state.optim_state))

            self._chunks[key] = cached_jit(chunk)
        return self._chunks[key]
