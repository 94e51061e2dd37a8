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

import math
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax, random

from numpyro.handlers import Messenger, replay, seed, substitute, trace
from numpyro.infer import SVI, Trace_ELBO

from d3pext import accountants
from d3pext.accountants import Relation
from d3pext.training.clipping import CLIPPED_SUMS, choose_clipping
from d3pext.training.minibatch import FixedSizeSampler, PoissonSampler
from d3pext.prng import secure_key, threefry_key

__all__ = ["DPSVI", "DPSVIState", "DPSVIRunResult", "PrivacyReport"]


class DPSVIState(NamedTuple):
    """State of :class:`DPSVI`: NumPyro's ``SVIState`` fields plus the number of private steps taken."""

    optim_state: Any
    mutable_state: Any
    rng_key: Any
    num_steps: Any


@dataclass(frozen=True)
class PrivacyReport:
    """The privacy spent by a DP-VI run, as the accountant computed it.

    ``delta`` includes any extra term of the sampler (e.g. the truncation of Poisson batches).
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
    """

    def __init__(self, fn, plate_name: str, rng_key, indices):
        self.plate_name = plate_name
        self.rng_key = rng_key
        self.indices = indices
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
            msg["kwargs"]["rng_key"] = random.fold_in(self.rng_key, self._count)
            self._count += 1


class _FirstIndices(Messenger):
    """Subsampled plates take their first indices: tracing for structure needs no random subsample."""

    def process_message(self, msg):
        if msg["type"] == "plate" and msg["value"] is None:
            msg["value"] = jnp.arange(msg["args"][1])


def _in_plate(site, plate_name: str) -> bool:
    return any(f.name == plate_name for f in site["cond_indep_stack"])


def _site_log_prob(site) -> jnp.ndarray:
    log_prob = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


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
      substitute neighbours; ``"poisson"``: each record independently with q = B / N, add/remove
      neighbours), and the accountant uses exactly that scheme.
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
    :param delta: target delta; also the delta at which privacy is reported. Default ``min(1e-5, 0.1 / N)``.
    :param num_steps: planned number of steps (required with ``epsilon``); :meth:`run` refuses to go beyond it.
    :param sampler: ``"fixed"`` or ``"poisson"`` (plate mode).
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
        data_plate: Optional[str] = None,
        num_obs_total: Optional[int] = None,
        clipping: str = "auto",
        **static_kwargs,
    ):
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
        if sampler not in ("fixed", "poisson"):
            raise ValueError(f"sampler must be 'fixed' or 'poisson', got {sampler!r}")
        if num_obs_total is not None and (int(num_obs_total) != num_obs_total or num_obs_total < 1):
            raise ValueError(f"num_obs_total must be a positive integer, got {num_obs_total}")
        if clipping not in ("auto", "materialize", "ghost", "reweight"):
            raise ValueError(f"clipping must be 'auto', 'materialize', 'ghost' or 'reweight', got {clipping!r}")
        self.clipping = clipping
        self.clipping_threshold = clipping_threshold
        self.dp_scale = dp_scale
        self.target_epsilon = epsilon
        self.delta = None if delta is None else float(delta)
        self.planned_steps = None if num_steps is None else int(num_steps)
        self.sampler_kind = sampler
        self.data_plate = data_plate
        self.num_obs_total = None if num_obs_total is None else int(num_obs_total)
        self.structure: Optional[_Structure] = None
        self.sampler = None
        self._steps = {}

    # ------------------------------------------------------------------ structure and privacy

    def _find_structure(self, model_trace, guide_trace, args) -> _Structure:
        plates = {s["name"]: s for s in model_trace.values() if s["type"] == "plate"}
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
        if not plate_mode and self.sampler_kind != "fixed":
            raise ValueError(
                "sampler='poisson' needs plate mode (pass the full data; DPSVI then draws the Poisson batches "
                "itself, which the accountant must be able to rely on)"
            )
        for s in guide_trace.values():
            if s["type"] == "sample" and not s["is_observed"] and not s["fn"].has_rsample:
                raise NotImplementedError(
                    f"guide site {s['name']!r} is not reparameterizable; DPSVI needs reparameterized guides"
                )
        return _Structure(name, int(num_records), int(batch_size), plate_mode)

    def _make_sampler(self, structure: _Structure):
        if structure.plate_mode and self.sampler_kind == "poisson":
            return PoissonSampler(structure.num_records, structure.batch_size / structure.num_records)
        return FixedSizeSampler(structure.num_records, structure.batch_size)

    def _report_delta(self) -> float:
        return self.delta if self.delta is not None else _default_delta(self.structure.num_records)

    def _calibrate(self) -> None:
        if self.target_epsilon is None or self.dp_scale is not None:
            return
        delta = self._report_delta()
        margin = self.sampler.extra_delta(self.target_epsilon, self.planned_steps)
        if margin >= 0.1 * delta:
            raise ValueError(f"the sampler's extra delta {margin:.3g} is not small against delta={delta:.3g}")
        result = accountants.approximate_sigma(
            self.target_epsilon, delta - margin, self.sampler.q, self.planned_steps, self.sampler.relation
        )
        self.dp_scale = float(result.sigma)

    def privacy_spent(self, num_steps, delta: Optional[float] = None) -> PrivacyReport:
        """The (epsilon, delta) spent after ``num_steps`` steps (an int or a :class:`DPSVIState`)."""
        if self.structure is None:
            raise RuntimeError("call init (or run) first: the sampling rate comes from the model's data plate")
        if isinstance(num_steps, DPSVIState):
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

    def get_epsilon(self, delta: float, num_steps) -> float:
        """d3p-style shortcut for ``privacy_spent(num_steps, delta).epsilon``."""
        return self.privacy_spent(num_steps, delta).epsilon

    def _report(self, eps: float, delta: float, num_steps: int) -> PrivacyReport:
        extra = self.sampler.extra_delta(eps, num_steps) if num_steps and math.isfinite(eps) else 0.0
        return PrivacyReport(
            epsilon=eps,
            delta=delta + extra,
            noise_multiplier=self.dp_scale,
            clipping_threshold=self.clipping_threshold,
            sampling_rate=self.sampler.q,
            num_steps=int(num_steps),
            relation=Relation(self.sampler.relation).value,
            sampler=type(self.sampler).__name__,
        )

    # ------------------------------------------------------------------ the loss split

    def _run_traces(self, params, rng_key, args, kwargs, record_key, indices):
        params = self.constrain_fn(params)
        kwargs = {**kwargs, **self.static_kwargs}
        name = self.structure.plate_name
        model_key, guide_key = random.split(rng_key)
        guide = seed(_RecordScope(substitute(self.guide, params), name, record_key, indices), guide_key)
        guide_trace = trace(guide).get_trace(*args, **kwargs)
        model = seed(_RecordScope(substitute(replay(self.model, guide_trace), params), name, record_key, indices), model_key)
        model_trace = trace(model).get_trace(*args, **kwargs)
        return model_trace, guide_trace

    def _elbo_terms(self, params, rng_key, args, kwargs, record_key, indices):
        """(record term, global term) of one particle's negative ELBO, from a run on a single record.

        The record term is unscaled: the data plate's N / 1 scale is divided out.
        """
        model_trace, guide_trace = self._run_traces(params, rng_key, args, kwargs, record_key, indices)
        name = self.structure.plate_name
        plate_site = model_trace[name]
        plate_scale = plate_site["args"][0] / plate_site["args"][1]
        local, global_ = 0.0, 0.0
        for sign, tr in ((-1.0, model_trace), (1.0, guide_trace)):
            for site in tr.values():
                if site["type"] != "sample":
                    continue
                term = sign * _site_log_prob(site)
                if _in_plate(site, name):
                    local = local + term / plate_scale
                else:
                    global_ = global_ + term
        return local, global_

    def _particle_keys(self, rng_key):
        return random.split(rng_key, self.loss.num_particles)

    def _record_loss(self, params, rng_key, args, kwargs, record):
        """Unscaled negative ELBO term of one record, averaged over particles."""
        index, position = record
        if self.structure.plate_mode:
            indices, rec_args = jnp.reshape(index, (1,)), args
        else:
            indices, rec_args = jnp.zeros((1,), jnp.int32), jax.tree.map(lambda a: a[None], args)

        def one(key):
            return self._elbo_terms(params, key, rec_args, kwargs, random.fold_in(key, position), indices)[0]

        return jnp.mean(jax.vmap(one)(self._particle_keys(rng_key)))

    def _global_loss(self, params, rng_key, args, kwargs, record_index):
        """Data-independent part of the negative ELBO (global prior and guide terms), averaged over particles."""
        if self.structure.plate_mode:
            indices, rec_args = jnp.reshape(record_index, (1,)), args
        else:
            indices, rec_args = jnp.zeros((1,), jnp.int32), jax.tree.map(lambda a: a[record_index][None], args)

        def one(key):
            return self._elbo_terms(params, key, rec_args, kwargs, random.fold_in(key, 0), indices)[1]

        return jnp.mean(jax.vmap(one)(self._particle_keys(rng_key)))

    def _check_global_independence(self, params, rng_key, args, kwargs) -> None:
        """Refuse models whose global (unclipped) part depends on the data: it would bypass the mechanism."""
        if self.structure.plate_mode:
            first = jax.tree.map(lambda a: jnp.broadcast_to(a[:1], a.shape), args)
            last = jax.tree.map(lambda a: jnp.broadcast_to(a[-1:], a.shape), args)
            pairs = ((first, 0), (last, self.structure.num_records - 1))
        else:
            n = jnp.shape(args[0])[0] if args else 1
            pairs = ((args, 0), (args, n - 1))
        dyn, static = _split_kwargs(kwargs)

        @jax.jit
        def global_value_and_grad(args, dyn, index):
            return jax.value_and_grad(self._global_loss)(params, rng_key, args, {**dyn, **dict(static)}, index)

        values = [global_value_and_grad(a, dyn, i) for a, i in pairs]
        same = jax.tree.map(lambda u, v: bool(jnp.allclose(u, v, rtol=1e-5, atol=1e-6)), values[0], values[1])
        if not all(jax.tree.leaves(same)):
            raise ValueError(
                "sites outside the data plate depend on the data: DPSVI would use them without clipping or noise. "
                f"Move every use of the records inside numpyro.plate({self.structure.plate_name!r}, ...)."
            )

    # ------------------------------------------------------------------ SVI interface

    def init(self, rng_key, *args, init_params=None, **kwargs) -> DPSVIState:
        """Trace the model, find its data plate and sampling rate, calibrate sigma if a target was given."""
        _num_records(args)
        if rng_key is None:
            rng_key = secure_key()
        state = super().init(rng_key, *args, init_params=init_params, **kwargs)
        init_key = random.fold_in(state.rng_key, 1)
        params = self.constrain_fn(self.optim.get_params(state.optim_state))
        kw = {**kwargs, **self.static_kwargs}
        guide_trace = trace(seed(_FirstIndices(substitute(self.guide, params)), init_key)).get_trace(*args, **kw)
        model = _FirstIndices(substitute(replay(self.model, guide_trace), params))
        model_trace = trace(seed(model, init_key)).get_trace(*args, **kw)
        self.structure = self._find_structure(model_trace, guide_trace, args)
        self.sampler = self._make_sampler(self.structure)
        self._calibrate()
        self._check_global_independence(self.optim.get_params(state.optim_state), init_key, args, kwargs)
        return DPSVIState(state.optim_state, state.mutable_state, state.rng_key, jnp.zeros((), jnp.int32))

    def _private_grad(self, params, rng_key, args, kwargs, stable: bool):
        """Noisy, clipped and rescaled gradient of the negative ELBO, and the (non-private) loss estimate."""
        structure = self.structure
        batch_key, elbo_key, noise_key = random.split(rng_key, 3)
        # The batch and the noise carry the privacy guarantee and use the caller's (e.g. ChaCha20) key. The
        # variational samples do not: a Threefry key keeps every JAX sampler (gamma, poisson) fast and available.
        elbo_key = threefry_key(elbo_key)
        if structure.plate_mode:
            indices, mask = self.sampler(batch_key)
            records = (indices, jnp.arange(indices.shape[0]))
        else:
            n = jnp.shape(args[0])[0]
            indices, mask = jnp.arange(n), jnp.ones(n, bool)
            records = (indices, indices)
        if structure.plate_mode:
            per_record = lambda fn, p, recs, a: jax.vmap(fn, in_axes=(None, None, None, None, 0))(p, elbo_key, a, kwargs, recs)
        else:
            per_record = lambda fn, p, recs, a: jax.vmap(lambda rec, ra: fn(p, elbo_key, ra, kwargs, rec))(recs, a)
        c = self.clipping_threshold
        clipped_sum = CLIPPED_SUMS[self._clipping_mode(params)]
        clipped, losses, mask = clipped_sum(
            self._record_loss, per_record, params, args, records, mask, c, stable, structure.plate_mode
        )
        leaves, treedef = jax.tree.flatten(clipped)
        noise_keys = random.split(noise_key, len(leaves))
        scale = structure.num_records / structure.batch_size
        noisy = [(g + self.dp_scale * c * random.normal(k, g.shape, g.dtype)) * scale for g, k in zip(leaves, noise_keys)]
        global_loss, global_grads = jax.value_and_grad(self._global_loss)(params, elbo_key, args, kwargs, indices[0] if structure.plate_mode else 0)
        grads = jax.tree.map(jnp.add, jax.tree.unflatten(treedef, noisy), global_grads)
        loss = scale * jnp.sum(jnp.where(mask, losses, 0.0)) + global_loss
        return loss, grads

    def _clipping_mode(self, params) -> str:
        """How the clipped sum is computed (decided at trace time from static shapes)."""
        return choose_clipping(self.clipping, self.structure.batch_size, params)

    def _step(self, state: DPSVIState, args, dyn_kwargs, static_kwargs, stable: bool):
        kwargs = {**dyn_kwargs, **dict(static_kwargs)}
        rng_key, step_key = random.split(state.rng_key)
        params = self.optim.get_params(state.optim_state)
        loss, grads = self._private_grad(params, step_key, args, kwargs, stable)
        # optax transformations may ask for the loss value (``update_with_value``); the loss is not private,
        # so they get NaN: value-driven schedules (line searches, reduce-on-plateau) cannot be used with DPSVI.
        value = jnp.nan if self.optim.update_with_value else None
        new_optim_state = self.optim.update(grads, state.optim_state, value=value)
        if stable:
            ok = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
            new_optim_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_optim_state, state.optim_state)
        return DPSVIState(new_optim_state, state.mutable_state, rng_key, state.num_steps + 1), loss

    def _jitted_step(self, static_kwargs: tuple, stable: bool):
        key = (static_kwargs, stable)
        if key not in self._steps:
            self._steps[key] = jax.jit(partial(self._step, static_kwargs=static_kwargs, stable=stable))
        return self._steps[key]

    def _check_ready(self):
        if self.structure is None:
            raise RuntimeError("call DPSVI.init before update")

    def update(self, svi_state: DPSVIState, *args, **kwargs):
        """One private step; returns ``(state, loss)``. The loss is not a private output."""
        self._check_ready()
        dyn, static = _split_kwargs(kwargs)
        return self._jitted_step(static, False)(svi_state, args, dyn)

    def stable_update(self, svi_state: DPSVIState, *args, **kwargs):
        """Like :meth:`update`, but robust to numerical failures without breaking privacy.

        A record whose gradient or loss is not finite contributes zero (a per-record decision, like clipping);
        a step whose noisy gradient is not finite leaves the parameters unchanged (post-processing). Either way
        the step counts towards the privacy spent.
        """
        self._check_ready()
        dyn, static = _split_kwargs(kwargs)
        return self._jitted_step(static, True)(svi_state, args, dyn)

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
            state = self.init(rng_key, *args, init_params=init_params, **kwargs)
        else:
            self._check_ready()
            state = init_state
        done = int(state.num_steps)
        if self.planned_steps is not None and done + num_steps > self.planned_steps:
            raise ValueError(
                f"running {num_steps} more steps after {done} exceeds the planned num_steps={self.planned_steps} "
                "for which sigma was calibrated: the privacy target would be exceeded"
            )
        dyn, static = _split_kwargs(kwargs)
        step = partial(self._step, static_kwargs=static, stable=stable_update)

        @partial(jax.jit, static_argnums=3)
        def chunk(state, args, dyn, length):
            return lax.scan(lambda s, _: step(s, args, dyn), state, None, length=length)

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
                state, chunk_losses = chunk(state, args, dyn, length)
                losses.append(chunk_losses)
                if bar is not None:
                    bar.set_postfix(loss=f"{float(jnp.mean(chunk_losses)):.4g}", epsilon=f"{eps_curve[i]:.3g}")
                    bar.update(length)
        finally:
            if bar is not None:
                bar.close()
        losses = jnp.concatenate(losses)
        report = self._report(float(eps_curve[-1]), delta, done + num_steps)
        return DPSVIRunResult(self.get_params(state), state, losses, report)
