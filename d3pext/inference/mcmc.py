"""``CachedMCMC``: ``numpyro.infer.MCMC`` whose later runs with the same shapes do not compile.

NumPyro's ``fori_collect`` wraps its loop body in a fresh ``jax.jit`` object on every
``MCMC.run`` and hands that object to the jitted ``_fori_collect_loop`` as a *static* argument.
A new object is a new static argument, so every run traces the loop again and hands XLA a new
module: the whole sampler (seconds to minutes for a Gibbs sweep with rejection loops) is
compiled again although nothing changed. :class:`CachedMCMC` replaces that one step (the
collection loop, without a progress bar) by a module-level jitted function whose static
arguments are the kernel's cached sample and postprocess functions
(``MCMC._get_cached_fns``, keyed on the model arguments) and the collection settings; the
chain state (keys included) is an ordinary argument. A second ``run`` with the same shapes and
arguments, whatever its key, reuses the compiled loop. Everything else (initialisation,
warmup/sampling phases, ``chain_method``, ``extra_fields``, thinning) is ``MCMC``'s own.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from operator import attrgetter
from typing import Callable

import jax
from jax import lax
import jax.numpy as jnp

from numpyro.infer import MCMC
from numpyro.infer.mcmc import _sample_fn_jit_args, _sample_fn_nojit_args

from d3pext._threads import one_model_at_a_time

__all__ = ["CachedMCMC"]


class _StatePostprocess:
    """Post-processing of whole states, by the sampler's ``postprocess_state_fn`` (shared loops)."""

    def __init__(self, sampler, args: tuple | None = None, kwargs: dict | None = None) -> None:
        self.sampler, self.args, self.kwargs = sampler, args, kwargs

    def __call__(self, state, *model):
        args, kwargs = model if model else (self.args, self.kwargs)
        return self.sampler.postprocess_state_fn(args, kwargs)(state)


def _collect_transform(postprocess_fn: Callable, collect_fields: tuple, remove_sites: tuple):
    """The fields collected from a loop value ``(state, *model args)`` (as NumPyro collects them)."""

    def transform(val):
        state = val[0]
        fields = [attrgetter(f)(state) for f in collect_fields]
        if isinstance(postprocess_fn, _StatePostprocess):
            fields[0] = postprocess_fn(state, *val[1:])
        else:
            fields[0] = postprocess_fn(fields[0], *val[1:])
        if remove_sites:
            fields[0] = {k: v for k, v in fields[0].items() if k not in remove_sites}
        return fields[0] if len(collect_fields) == 1 else fields

    return transform


@partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _collect_loop(
    body_fun, postprocess_fn, collect_fields, remove_sites, lower, upper, thinning, size, init_val
):
    """``upper`` steps of ``body_fun`` from ``init_val``; every ``thinning``-th value from
    ``lower`` on is collected (the last ``(upper - lower) // thinning``), padded with zeros to
    ``size``. Returns ``(collection, last value)``.

    The sweep appears once in the program, in an inner loop whose trip count is ``start`` for the
    first block and ``thinning`` after it: a loop for the steps before the first kept one and
    another for the kept ones would hand XLA two copies of the sweep to compile (for a Gibbs
    sweep with rejection loops, seconds each).
    """
    transform = _collect_transform(postprocess_fn, collect_fields, remove_sites)
    count = (upper - lower) // thinning
    start = lower + (upper - lower) % thinning

    def steps(num, val):
        return lax.fori_loop(0, num, lambda _, v: body_fun(v), val)

    template = jax.eval_shape(transform, init_val)
    collection = jax.tree.map(lambda t: jnp.zeros((max(size, count), *t.shape), t.dtype), template)
    if not count:
        return collection, steps(upper, init_val)

    def block(j, carry):
        # block 0 runs the first `start` steps (its value lands in slot 0, which block 1
        # overwrites); block j >= 1 runs `thinning` steps and keeps the value in slot j - 1
        val, collection = carry
        val = steps(jnp.where(j == 0, start, thinning), val)
        slot = jnp.maximum(j - 1, 0)
        collection = jax.tree.map(
            lambda c, x: lax.dynamic_update_index_in_dim(c, x, slot, 0), collection, transform(val)
        )
        return val, collection

    # (NumPyro's convention: the entries past the collected ones, up to `size`, are zeros)
    val, collection = lax.fori_loop(0, count + 1, block, (init_val, collection))
    return collection, val


_SHARED_LOOPS: OrderedDict = OrderedDict()
_SHARED_LOOPS_SIZE = 16


class CachedMCMC(MCMC):
    """``numpyro.infer.MCMC`` whose collection loop is compiled once per kernel, arguments and
    shapes: a second ``run`` (new key, same shapes) does not compile the sampler again.

    NumPyro compiles the loop again on every ``run`` (see the module docstring). The arguments
    are those of ``MCMC``; with ``progress_bar=True`` the loop is NumPyro's own.

    >>> import jax, jax.numpy as jnp
    >>> import numpyro, numpyro.distributions as dist
    >>> from numpyro.infer import NUTS
    >>> def model():
    ...     numpyro.sample("x", dist.Normal(0.0, 1.0))
    >>> mcmc = CachedMCMC(NUTS(model), num_warmup=50, num_samples=100, progress_bar=False)
    >>> mcmc.run(jax.random.key(0))
    >>> mcmc.run(jax.random.key(1))  # reuses the compiled loop
    >>> mcmc.get_samples()["x"].shape
    (100,)
    """

    @one_model_at_a_time
    def run(self, *args, **kwargs):
        return super().run(*args, **kwargs)

    def _single_chain_mcmc(self, init, args, kwargs, collect_fields, remove_sites):
        if self.progress_bar:
            return super()._single_chain_mcmc(init, args, kwargs, collect_fields, remove_sites)
        rng_key, init_state, init_params = init
        if init_state is None or getattr(self.sampler, "_sample_fn", None) is None:
            new_state = self.sampler.init(
                rng_key, self.num_warmup, init_params, model_args=args, model_kwargs=kwargs
            )
            init_state = new_state if init_state is None else init_state
        sample_fn, postprocess_fn = self._loop_fns()
        init_val = (init_state, args, kwargs) if self._jit_model_args else (init_state,)
        params = self._collection_params
        lower, upper = params["lower"], params["upper"]
        size = params["collection_size"]
        count = (upper - lower) // self.thinning
        size = count if size is None else max(size // self.thinning, count)
        collection, last_val = _collect_loop(
            sample_fn, postprocess_fn, tuple(collect_fields), tuple(remove_sites),
            lower, upper, self.thinning, size, init_val,
        )
        # wait here: on a GPU an error raised by a host callback in the sampler (an exhausted rejection
        # loop) would otherwise surface only when the draws are first read, not from run
        jax.block_until_ready((collection, last_val))
        states = (collection,) if len(collect_fields) == 1 else tuple(collection)
        return dict(zip(collect_fields, states)), last_val[0]

    def _loop_fns(self) -> tuple[Callable, Callable]:
        """``(sample_fn, postprocess_fn)`` of the collection loop (static arguments of its jit).

        NumPyro's are made per ``MCMC`` object. A sampler that names its structure
        (``structure_key``, after ``init``) and post-processes whole states
        (``postprocess_state_fn``: a state carries its data, e.g. a
        :class:`~d3pext.handlers.posterior.ReleaseState`) gets ones shared by every
        ``CachedMCMC`` of that structure, so that a new object for other data of the same shapes
        reuses the compiled loop.
        """
        key_of = getattr(self.sampler, "structure_key", None)
        if key_of is None or self.postprocess_fn is not None:
            return self._get_cached_fns()
        structure = key_of(self._args, self._kwargs)
        if structure is None:
            return self._get_cached_fns()
        key = (structure, self.chain_method, self.num_chains, self._jit_model_args)
        if key in _SHARED_LOOPS:
            _SHARED_LOOPS.move_to_end(key)
            return _SHARED_LOOPS[key]
        if self._jit_model_args:
            fns = partial(_sample_fn_jit_args, sampler=self.sampler), _StatePostprocess(self.sampler)
        else:
            fns = (
                partial(_sample_fn_nojit_args, sampler=self.sampler, args=self._args, kwargs=self._kwargs),
                _StatePostprocess(self.sampler, self._args, self._kwargs),
            )
        _SHARED_LOOPS[key] = fns
        while len(_SHARED_LOOPS) > _SHARED_LOOPS_SIZE:
            _SHARED_LOOPS.popitem(last=False)
        return fns
