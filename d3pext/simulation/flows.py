"""Conditional neural spline flows and a compiled training loop, for SPPE and SPLE (seed 000).

Library choice. Three options were weighed:

- **flowjax** (chosen, ``pip install d3pext[flows]``): conditional coupling and autoregressive
  flows with rational-quadratic spline transformers (Durkan et al. 2019), tested against
  reference densities upstream, written in equinox (plain pytrees: they ``jit``/``vmap``/``scan``
  and train with optax), actively maintained.
- NumPyro's own flows: inverse-autoregressive and block-neural-autoregressive transforms only, no
  spline transformer and no conditioning input; a spline would have to be written here.
- A small module of our own: a spline coupling layer is about 200 lines, but its numerics (bin
  search, tails, inverse) are exactly what a mature library has already debugged.

Architecture: the paper's network (S3) is an nflows neural spline flow with 8 layers, each
conditioner two residual blocks of 50 units, 10 bins, tail bound 5. flowjax's closest is
:func:`flowjax.flows.coupling_flow` with a :class:`~flowjax.bijections.RationalQuadraticSpline`
(``knots=10``, ``interval=5``: identity tails outside ``[-5, 5]``) and a plain MLP conditioner of
depth 2 and width 50 (no residual connections); the flows alternate with random permutations.
A one-dimensional target (no coupling split) uses a masked autoregressive spline flow.

Training (:class:`FlowTrainer`): Adam with L2 weight decay as PyTorch's ``Adam(weight_decay=)``
(learning rate 5e-4, decay 1e-4), gradient norm clipped at 5 (as sbi does), batches of 100, early
stopping when the validation loss has not improved for 20 epochs (the best parameters are kept).
One epoch is one compiled ``lax.scan`` over batches; a step whose loss or gradient is not finite is
skipped and counted. Data live in fixed-capacity buffers so that the epoch compiles once per
shape and never again as rounds add simulations; batches holding only padding are skipped, in
training and in validation (one compiled pass over the buffer per epoch).

Cost (measured, ``benchmarks/bench_sbi.py --profile``): a step costs about 45 us per flow
evaluation (loss and gradient, paper-size flow, this 2-core CPU), linear in the number of
evaluations: ``batch * M`` for maximum likelihood, ``batch * M * atoms`` for the atomic loss.
An own feature-major evaluation of the coupling spline flow (knots found by comparisons instead of
``searchsorted``) gave the same densities but was not faster on CPU: XLA already fuses flowjax's
vectorised spline, and the conditioner's matrix products are about half of the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
import functools
import math
from typing import Any

import jax
from jax import lax, random
import jax.numpy as jnp

__all__ = ["FlowTrainer", "TrainingReport", "conditional_spline_flow", "require_flowjax"]


def require_flowjax():
    """Import flowjax (and equinox, paramax), or say how to install them."""
    try:
        import equinox  # noqa: F401
        import flowjax  # noqa: F401
        import paramax  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Normalizing flows need flowjax: install the extra with `pip install d3pext[flows]`."
        ) from e
    return flowjax


def conditional_spline_flow(
    rng_key: jax.Array,
    dim: int,
    cond_dim: int,
    *,
    layers: int = 8,
    width: int = 50,
    depth: int = 2,
    knots: int = 10,
    tail_bound: float = 5.0,
):
    """A conditional neural spline flow ``q(y | c)`` on ``R^dim`` (standard normal base).

    Defaults are the paper's setting (see the module docstring for what differs).

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> flow = conditional_spline_flow(random.key(0), 2, 3, layers=2, width=8)
    >>> flow.log_prob(jnp.zeros((5, 2)), jnp.ones((5, 3))).shape
    (5,)
    """
    require_flowjax()
    from flowjax.bijections import RationalQuadraticSpline
    from flowjax.distributions import Normal
    from flowjax.flows import coupling_flow, masked_autoregressive_flow

    for name, v in (("dim", dim), ("cond_dim", cond_dim), ("layers", layers), ("width", width),
                    ("depth", depth), ("knots", knots)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}.")
    if not tail_bound > 0:
        raise ValueError(f"tail_bound must be > 0, got {tail_bound}.")
    # one transformer template per setting: flows built from it share their compiled programs
    transformer = _spline_template(RationalQuadraticSpline, int(knots), float(tail_bound))
    base = Normal(jnp.zeros(int(dim)))
    common = dict(base_dist=base, transformer=transformer, cond_dim=int(cond_dim),
                  flow_layers=int(layers), nn_width=int(width), nn_depth=int(depth))
    if dim == 1:
        return _shared_constructors(masked_autoregressive_flow(rng_key, **common))
    return _shared_constructors(coupling_flow(rng_key, **common))


_CONSTRUCTORS: dict = {}


@functools.cache
def _spline_template(cls, knots: int, interval: float):
    """The spline transformer with these settings, built once (an immutable template: its static
    part holds a closure, which would otherwise differ between flows)."""
    return cls(knots=knots, interval=interval)


def _is_constructor(leaf: Any) -> bool:
    return callable(leaf) and getattr(leaf, "__qualname__", "").endswith(
        "get_ravelled_pytree_constructor.<locals>.constructor"
    )


def _shared_constructors(flow):
    """``flow`` with each layer's transformer constructor replaced by the first one built for the
    same transformer.

    flowjax's coupling and autoregressive layers keep a closure that rebuilds the transformer from
    the conditioner's output. A new flow gets new closures, and ``jax.jit`` (through
    ``equinox.filter_jit``) keys compiled programs on them by identity: the training epoch, the
    validation pass, ``sample`` and ``log_prob`` compiled again for every flow, even of the same
    architecture (an SPPE sweep over epsilon: seconds per fit). Two constructors that close over the
    same transformer template (its static part, and equal initial parameters of the same layout)
    compute the same function, so the first stands for both.
    """

    def shared(leaf):
        if not _is_constructor(leaf):
            return leaf
        cells = dict(zip(leaf.__code__.co_freevars, (c.cell_contents for c in leaf.__closure__)))
        try:
            init, static, unravel = cells["init"], cells["static"], cells["unravel"]
            template = jax.eval_shape(unravel, init)
            static_leaves, static_def = jax.tree.flatten(static)
            key = (
                static_def, tuple(static_leaves), jax.tree.structure(template),
                tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(template)),
                str(init.dtype), tuple(init.shape), bytes(jax.device_get(init).tobytes()),
            )
            return _CONSTRUCTORS.setdefault(key, leaf)
        except (KeyError, TypeError, AttributeError):  # another flowjax version: keep its own
            return leaf

    return jax.tree.map(shared, flow, is_leaf=_is_constructor)


@dataclass
class TrainingReport:
    """What one call of :meth:`FlowTrainer.fit` did."""

    epochs: int
    best_epoch: int
    best_valid_loss: float
    train_losses: list[float] = field(default_factory=list)
    valid_losses: list[float] = field(default_factory=list)
    nonfinite_steps: int = 0
    stopped_early: bool = False


def _partition(flow):
    import equinox as eqx
    import paramax

    return eqx.partition(
        flow, eqx.is_inexact_array, is_leaf=lambda leaf: isinstance(leaf, paramax.NonTrainable)
    )


class FlowTrainer:
    """Compiled minibatch training of a flow on a per-example loss, with early stopping.

    :param loss_fn: ``(flow, batch, key) -> losses`` of shape ``(batch_size,)``; ``batch`` is
        the data pytree indexed by a batch of rows; ``flow`` is unwrapped (ready to use).
    :param learning_rate, weight_decay, batch_size, patience, max_epochs, clip_norm: as named.

    >>> import jax.numpy as jnp
    >>> from jax import random
    >>> flow = conditional_spline_flow(random.key(0), 2, 1, layers=2, width=8)
    >>> y = random.normal(random.key(1), (400, 2)) + 1.0
    >>> c = jnp.zeros((400, 1))
    >>> trainer = FlowTrainer(lambda f, b, k: -f.log_prob(b["y"], b["c"]), max_epochs=5)
    >>> flow, report = trainer.fit(flow, {"y": y[:360], "c": c[:360]}, 360,
    ...                            {"y": y[360:], "c": c[360:]}, 40, random.key(2))
    >>> report.epochs
    5
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any, jax.Array], jax.Array],
        *,
        learning_rate: float = 5e-4,
        weight_decay: float = 1e-4,
        batch_size: int = 100,
        patience: int = 20,
        max_epochs: int = 1000,
        clip_norm: float | None = 5.0,
    ) -> None:
        require_flowjax()
        import optax

        if batch_size < 1 or patience < 1 or max_epochs < 1:
            raise ValueError("batch_size, patience and max_epochs must be >= 1.")
        if not learning_rate > 0 or weight_decay < 0:
            raise ValueError("learning_rate must be > 0 and weight_decay >= 0.")
        self.loss_fn = loss_fn
        self.batch_size = int(batch_size)
        self.patience = int(patience)
        self.max_epochs = int(max_epochs)
        parts = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
        parts += [optax.add_decayed_weights(weight_decay), optax.adam(learning_rate)]
        self.optimizer = optax.chain(*parts)
        self._epoch = None
        self._valid = None

    def _unwrap(self, params, static):
        import equinox as eqx
        import paramax

        return paramax.unwrap(eqx.combine(params, static))

    def _build(self):
        import equinox as eqx

        batch_size, optimizer = self.batch_size, self.optimizer

        def batch_loss(params, static, batch, key):
            losses = self.loss_fn(self._unwrap(params, static), batch, key)
            return jnp.mean(losses)

        @eqx.filter_jit
        def epoch(params, static, opt_state, data, count, key):
            capacity = jax.tree.leaves(data)[0].shape[0]
            num_batches = capacity // batch_size
            key_perm, key_steps = random.split(key)
            # valid rows first, in random order; the tail is padding
            order = jnp.argsort(random.uniform(key_perm, (capacity,)) + (jnp.arange(capacity) >= count))
            idx = order[: num_batches * batch_size].reshape(num_batches, batch_size)
            used = count // batch_size

            def step(carry, inputs):
                params, opt_state, total, bad = carry
                i, rows, k = inputs

                def run(args):
                    params, opt_state, total, bad = args
                    batch = jax.tree.map(lambda a: a[rows], data)
                    loss, grads = jax.value_and_grad(batch_loss)(params, static, batch, k)
                    finite = jnp.isfinite(loss) & jnp.all(
                        jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)])
                    )
                    grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
                    updates, new_state = optimizer.update(grads, opt_state, params)
                    new_params = eqx.apply_updates(params, updates)
                    keep = lambda new, old: jax.tree.map(  # noqa: E731
                        lambda a, b: jnp.where(finite, a, b), new, old
                    )
                    return (keep(new_params, params), keep(new_state, opt_state),
                            total + jnp.where(finite, loss, 0.0), bad + (~finite))

                return lax.cond(i < used, run, lambda a: a, (params, opt_state, total, bad)), None

            keys = random.split(key_steps, num_batches)
            init = (params, opt_state, jnp.zeros(()), jnp.zeros((), jnp.int32))
            (params, opt_state, total, bad), _ = lax.scan(
                step, init, (jnp.arange(num_batches), idx, keys)
            )
            return params, opt_state, total / jnp.maximum(used - bad, 1), bad

        @eqx.filter_jit
        def valid(params, static, data, count, key):
            capacity = jax.tree.leaves(data)[0].shape[0]
            num_batches = -(-capacity // batch_size)
            pad = num_batches * batch_size - capacity
            idx = jnp.concatenate([jnp.arange(capacity), jnp.zeros(pad, int)]).reshape(num_batches, batch_size)
            weight = (jnp.arange(num_batches * batch_size) < jnp.minimum(count, capacity)).reshape(
                num_batches, batch_size
            )
            flow = self._unwrap(params, static)

            def one(_, inputs):
                i, rows, w, k = inputs

                def run(_):
                    batch = jax.tree.map(lambda a: a[rows], data)
                    losses = self.loss_fn(flow, batch, k)
                    return (jnp.sum(jnp.where(w, losses, 0.0)),
                            jnp.sum(w * ~jnp.isfinite(losses)).astype(jnp.int32))

                # batches of padding only (early rounds of a fixed-capacity buffer) are skipped
                empty = lambda _: jax.tree.map(  # noqa: E731
                    lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(run, None))
                return None, lax.cond(i * batch_size < count, run, empty, None)

            _, (sums, bad) = lax.scan(
                one, None, (jnp.arange(num_batches), idx, weight, random.split(key, num_batches))
            )
            return jnp.sum(sums) / jnp.maximum(count, 1), jnp.sum(bad)

        self._epoch, self._valid = epoch, valid

    def fit(
        self,
        flow,
        train: Any,
        train_count: int,
        valid: Any,
        valid_count: int,
        rng_key: jax.Array,
        progress_bar: bool = False,
        description: str = "epochs",
        opt_state: Any = None,
    ) -> tuple[Any, TrainingReport]:
        """Train ``flow`` on the first ``train_count`` rows of the pytree ``train`` (the rest is
        padding), early-stopping on the first ``valid_count`` rows of ``valid``.

        Returns the flow at its best validation loss and a :class:`TrainingReport`.
        """
        if train_count < self.batch_size:
            raise ValueError(
                f"Need at least one batch of training data ({self.batch_size}), got {train_count}."
            )
        if valid_count < 1:
            raise ValueError("Need at least one validation example.")
        if self._epoch is None:
            self._build()
        params, static = _partition(flow)
        if opt_state is None:
            opt_state = self.optimizer.init(params)
        count, vcount = jnp.asarray(train_count), jnp.asarray(valid_count)
        best_params, best_loss, best_epoch = params, math.inf, 0
        report = TrainingReport(epochs=0, best_epoch=0, best_valid_loss=math.inf)
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.max_epochs, desc=description, leave=False)
        key_valid = random.fold_in(rng_key, 1)
        for epoch in range(1, self.max_epochs + 1):
            key = random.fold_in(rng_key, epoch + 1)
            params, opt_state, train_loss, bad = self._epoch(params, static, opt_state, train, count, key)
            vloss, vbad = self._valid(params, static, valid, vcount, key_valid)
            vloss = float(vloss)
            report.epochs = epoch
            report.train_losses.append(float(train_loss))
            report.valid_losses.append(vloss)
            report.nonfinite_steps += int(bad)
            if math.isfinite(vloss) and vloss < best_loss:
                best_params, best_loss, best_epoch = params, vloss, epoch
            if bar is not None:
                bar.update(1)
                bar.set_postfix(valid=f"{vloss:.3f}", best=f"{best_loss:.3f}")
            if epoch - best_epoch >= self.patience:
                report.stopped_early = True
                break
        if bar is not None:
            bar.close()
        report.best_epoch, report.best_valid_loss = best_epoch, best_loss
        import equinox as eqx

        return eqx.combine(best_params, static), report
