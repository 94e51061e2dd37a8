"""DP-VI on data larger than memory: minibatches read from memory-mapped ``.npy`` files.

:class:`MemmapBatches` draws each step's record indices with a minibatch sampler
(:class:`~d3pext.training.minibatch.PoissonSampler` or
:class:`~d3pext.training.minibatch.FixedSizeSampler`) and reads only those rows from a
memory-mapped array on disk, in file order; :func:`fit_streaming` runs :class:`DPSVI` in batch
mode over them while a background thread (:func:`prefetch`) reads the next step's batch, so
the peak memory depends on the batch size, not on the number of records ``N``.

The batches are exactly those of :func:`~d3pext.training.minibatch.poisson_batchify_data`
(and :func:`~d3pext.training.minibatch.subsample_batchify_data`) over the same records with
the same key: step ``i`` uses the sampler's own draw ``sampler(fold_in(key, i))``, padded to
the sampler's static size, with the rows past the mask zeroed. The accountant's assumptions
therefore hold as they do in memory, including the Poisson sampler's truncation of oversized
batches and its :meth:`~d3pext.training.minibatch.PoissonSampler.extra_delta`.

One file (or one tuple of files) holds the records of one process: ``N`` is its number of
rows, and the sampler must be built for that ``N``.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Optional, TypeVar, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.util import is_prng_key

from d3pext.prng import secure_key
from d3pext.training.minibatch import FixedSizeSampler, PoissonSampler
from d3pext.training.parallel import agreed_key
from d3pext.training.svi import DPSVI, DPSVIRunResult, DPSVIState

__all__ = ["MemmapBatches", "fit_streaming", "prefetch"]

T = TypeVar("T")
Source = Union[str, "os.PathLike[str]", np.ndarray]

# Steps whose indices are drawn by one call of the compiled sampler (one dispatch, one transfer).
_DRAW_AHEAD = 16


@partial(jax.jit, static_argnums=0)
def _draw(
    sampler: FixedSizeSampler | PoissonSampler, rng_key: jax.Array, first: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Indices and masks of steps ``first, ..., first + 15``: ``sampler(fold_in(rng_key, i))``,
    one step after the other (``lax.map``; ``vmap`` would compile the Feistel walk far slower)."""
    steps = first + jnp.arange(_DRAW_AHEAD, dtype=jnp.uint32)
    return lax.map(lambda i: sampler(jax.random.fold_in(rng_key, i)), steps)


def _open(source: Source, name: str) -> np.ndarray:
    if isinstance(source, (str, os.PathLike)):
        try:
            array = np.load(source, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{name}: cannot memory-map {os.fspath(source)!r} as a .npy array: {e}") from e
        if not isinstance(array, np.ndarray):
            raise ValueError(f"{name}: {os.fspath(source)!r} is an archive (.npz), not one .npy array")
        return array
    if isinstance(source, np.ndarray):
        return source
    raise TypeError(
        f"{name} must be a path to a .npy file or a numpy array (e.g. np.load(path, mmap_mode='r') or "
        f"np.memmap), got {type(source).__name__}"
    )


# Rows are read in runs spanning at most this many bytes of the file, each run's pages unmapped
# from the process (not from the page cache) right after it is read: the resident memory a read
# adds is then bounded by one run, whatever the file's size.
_RUN_BYTES = 16 << 20
# A fault can map a whole large folio of the page cache (up to the PMD size, 2 MiB on x86-64):
# each run's release reaches this far beyond its rows.
_FOLIO_BYTES = 2 << 20


class _Rows:
    """Reads rows of one array: from a shared memory map, run by run (see ``_RUN_BYTES``),
    each run's pages released after it is read; from any other array, at once."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.mapping: Optional[mmap.mmap] = None
        mapping = getattr(array, "_mmap", None)  # numpy's mmap.mmap behind an np.memmap and its views
        # Only shared maps (np.memmap modes "r", "r+", "w+"): in a copy-on-write one ("c") releasing
        # pages would discard the caller's changes. C order: each row is one contiguous span.
        if (
            isinstance(array, np.memmap)
            and getattr(array, "mode", None) in ("r", "r+", "w+")
            and isinstance(mapping, mmap.mmap)
            and hasattr(mmap, "MADV_DONTNEED")
            and array.flags.c_contiguous
            and array.size
        ):
            try:
                view = np.frombuffer(mapping, np.uint8)
            except (TypeError, ValueError):  # a closed map: read rows as from any array
                return
            self.start = array.ctypes.data - view.ctypes.data  # the byte of row 0 in the map
            del view
            self.row_bytes = array.strides[0]
            if 0 <= self.start and self.start + array.nbytes <= len(mapping):
                self.mapping = mapping

    def read(self, rows: np.ndarray) -> np.ndarray:
        """``array[rows]`` for sorted ``rows``."""
        if self.mapping is None or not len(rows):
            return self.array[rows]
        begin = self.start + rows.astype(np.int64) * self.row_bytes
        cuts = np.flatnonzero(np.diff(begin // _RUN_BYTES)) + 1
        out = np.empty((len(rows),) + self.array.shape[1:], self.array.dtype)
        size = len(self.mapping)
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)]):
            out[lo:hi] = self.array[rows[lo:hi]]
            first = max(0, int(begin[lo]) // _FOLIO_BYTES * _FOLIO_BYTES - _FOLIO_BYTES)
            last = min(size, -(-(int(begin[hi - 1]) + self.row_bytes) // _FOLIO_BYTES) * _FOLIO_BYTES + _FOLIO_BYTES)
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED, first, last - first)
            except (OSError, ValueError):  # closed or unsupported: the pages stay mapped, nothing breaks
                pass
        return out


class MemmapBatches:
    """Minibatches of a sampler, read from memory-mapped arrays on disk.

    Step ``i``'s batch is ``sampler(fold_in(rng_key, i))``: the sampler's own indices and mask
    (for a :class:`~d3pext.training.minibatch.PoissonSampler`, ``K ~ Binomial(N, q)`` records
    padded to ``max_batch_size`` slots, oversized batches truncated or suppressed as the sampler
    does), exactly as :func:`~d3pext.training.minibatch.poisson_batchify_data` draws them in
    memory. Only the rows in the mask are read, sorted by position in the file, and padding rows
    are zero, so every batch has the same shape and dtype and a jitted update never recompiles.
    The indices are drawn on the device, 16 steps per call of the compiled sampler. From a
    read-only (or shared) memory map in C order, rows are read in runs of at most 16 MiB of the
    file, and each run's pages are unmapped from the process right after (they stay in the OS
    page cache): the resident memory stays bounded by about one run and one batch, whatever the
    size of the file.

    Args:
        data: a path to a ``.npy`` file, opened with ``np.load(path, mmap_mode="r")``, or an array
            (``np.memmap``, or any numpy array); or a tuple of them with the same number of rows
            (e.g. features and labels), one batch array each.
        sampler: the :class:`~d3pext.training.minibatch.PoissonSampler` or
            :class:`~d3pext.training.minibatch.FixedSizeSampler` that the accountant is told about
            (``DPSVI(..., sampler=batches.sampler)``); its ``num_records`` must be the number of rows.
        rng_key: the key of the batch draws; ``None`` draws a ChaCha20 key from OS entropy
            (:func:`d3pext.prng.secure_key`). It must differ from the key given to DPSVI. Across
            processes it must be the same on every one (``fit_streaming`` checks it).
        dtype: the dtype(s) every array must have (one for all, or one per array); ``None`` accepts
            any numeric dtype. A mismatch is an error, not a silent cast.

    Indexing gives one step's batch, iterating gives the batches of steps ``0, 1, 2, ...``; both
    as ``(*arrays, mask)`` on the host (numpy), ``mask`` the sampler's ``bool[padded_size]``.

    >>> import os, tempfile, numpy as np
    >>> from d3pext.training.minibatch import PoissonSampler
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.arange(2000, dtype=np.float32).reshape(1000, 2))
    >>> batches = MemmapBatches(path, PoissonSampler(1000, 0.05), rng_key=jax.random.key(0))
    >>> xb, mask = batches[0]
    >>> xb.shape == (batches.sampler.max_batch_size, 2), bool((xb[~mask] == 0).all())
    (True, True)
    """

    def __init__(
        self,
        data: Source | Sequence[Source],
        sampler: PoissonSampler | FixedSizeSampler,
        rng_key: Optional[jax.Array] = None,
        *,
        dtype: Any = None,
    ):
        if not isinstance(sampler, (PoissonSampler, FixedSizeSampler)):
            raise TypeError(f"sampler must be a PoissonSampler or a FixedSizeSampler, got {type(sampler).__name__}")
        if rng_key is None:
            rng_key = secure_key()
        elif not is_prng_key(rng_key):
            raise TypeError(
                "rng_key must be a JAX PRNG key such as jax.random.key(0) (or None for a secure key from OS "
                f"entropy), got {type(rng_key).__name__}"
            )
        self.single = not isinstance(data, (tuple, list))
        sources = (data,) if self.single else tuple(data)
        if not sources:
            raise ValueError("data must be a path or an array, or a non-empty tuple of them")
        names = [
            os.fspath(s) if isinstance(s, (str, os.PathLike)) else f"data[{i}]" for i, s in enumerate(sources)
        ]
        arrays = tuple(_open(s, n) for s, n in zip(sources, names))
        dtypes = dtype if isinstance(dtype, (tuple, list)) else (dtype,) * len(arrays)
        if len(dtypes) != len(arrays):
            raise ValueError(f"{len(dtypes)} dtypes for {len(arrays)} arrays")
        for array, name, expected in zip(arrays, names, dtypes):
            if array.ndim == 0:
                raise ValueError(f"{name} is a scalar: records must lie along axis 0")
            if not (np.issubdtype(array.dtype, np.number) or array.dtype == np.bool_):
                raise ValueError(f"{name} has dtype {array.dtype}: batches must be numeric arrays")
            if expected is not None and array.dtype != np.dtype(expected):
                raise ValueError(
                    f"{name} holds {array.dtype} records, but {np.dtype(expected)} was expected: rewrite the file "
                    "in that dtype (a silent cast would change what the model sees)"
                )
            if array.shape[0] != sampler.num_records:
                raise ValueError(
                    f"{name} has {array.shape[0]} rows, but the sampler draws from num_records="
                    f"{sampler.num_records}: the sampler (and with it the sampling rate the accountant uses) "
                    "must be built for the number of records in the file"
                )
        self.arrays = arrays
        self.sampler = sampler
        self.rng_key = rng_key
        self._readers = tuple(map(_Rows, arrays))
        self._drawn: Optional[tuple[int, np.ndarray, np.ndarray]] = None

    @property
    def padded_size(self) -> int:
        """The static number of slots of every batch (``sampler.padded_size``)."""
        return self.sampler.padded_size

    def indices(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The sampler's draw for ``step``, ``sampler(fold_in(rng_key, step))``, on the host:
        ``(int32[padded_size], bool[padded_size])``."""
        if isinstance(step, bool) or not 0 <= int(step) < 2**32:
            raise ValueError(f"step must be an int in [0, 2**32), got {step!r}")
        step = int(step)
        first = step - step % _DRAW_AHEAD
        drawn = self._drawn  # (first step, indices, masks) of the last call: one tuple, thread-safe
        if drawn is None or drawn[0] != first:
            indices, masks = _draw(self.sampler, self.rng_key, np.uint32(first))
            drawn = self._drawn = (first, np.asarray(indices), np.asarray(masks))
        return drawn[1][step - first], drawn[2][step - first]

    def gather(self, indices: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, ...]:
        """The rows ``indices[mask]`` of every array in their slots, zeros elsewhere; the rows are
        read in file order."""
        slots = np.flatnonzero(mask)
        rows = np.asarray(indices)[slots]
        order = np.argsort(rows, kind="stable")
        slots, rows = slots[order], rows[order]
        out = []
        for array, reader in zip(self.arrays, self._readers):
            batch = np.zeros((len(mask),) + array.shape[1:], array.dtype)
            batch[slots] = reader.read(rows)
            out.append(batch)
        return tuple(out)

    def __getitem__(self, step: int) -> tuple[np.ndarray, ...]:
        indices, mask = self.indices(step)
        return (*self.gather(indices, mask), mask)

    def steps(self, start: int = 0, stop: Optional[int] = None) -> Iterator[tuple[np.ndarray, ...]]:
        """The batches ``(*arrays, mask)`` of steps ``start, start + 1, ...`` (before ``stop``)."""
        step = start
        while stop is None or step < stop:
            yield self[step]
            step += 1

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        return self.steps(0)


def prefetch(iterable: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Iterate over ``iterable`` in a background thread, up to ``depth`` items ahead.

    An exception raised by the iterable is raised here, at the item where it occurred. Closing
    the returned generator (or leaving a ``for`` loop over it) stops the thread.

    >>> list(prefetch(range(5)))
    [0, 1, 2, 3, 4]
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be a positive int, got {depth!r}")
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in iterable:
                if not put((item, None)):
                    return
        except BaseException as error:  # handed to the consumer, which raises it
            put((None, error))
            return
        put((end, None))

    thread = threading.Thread(target=produce, name="d3pext-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = items.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def fit_streaming(
    svi: DPSVI,
    batches: MemmapBatches,
    num_steps: int,
    rng_key: Optional[jax.Array] = None,
    *,
    init_state: Optional[DPSVIState] = None,
    stable_update: bool = False,
    prefetch_depth: int = 2,
    **kwargs: Any,
) -> DPSVIRunResult:
    """Run ``num_steps`` steps of :class:`DPSVI` in batch mode on batches read from disk.

    A background thread reads (and moves to the device) the next batches while the device runs
    the current step; at most ``prefetch_depth`` batches wait and ``prefetch_depth + 1`` steps are
    in flight, so memory does not grow with ``N`` or with ``num_steps``. Step ``t`` of the run
    (counted over resumed runs, from ``state.num_steps``) uses batch ``t`` of ``batches``: a
    resumed run draws fresh batches, never those of earlier steps.

    ``svi`` must be built for batch mode with the batches' sampler: a model whose data plate has
    size ``N`` and ``subsample_size`` the sampler's ``padded_size``, and
    ``DPSVI(..., sampler=batches.sampler)``, so that the privacy is accounted for the sampling
    that is really done (for a Poisson sampler the mask is passed to every step).

    Args:
        svi: the :class:`DPSVI` to run.
        batches: the :class:`MemmapBatches` to read.
        num_steps: the number of steps.
        rng_key: the key of :meth:`DPSVI.init` (noise and variational samples); ``None`` draws a
            ChaCha20 key from OS entropy. Must differ from ``batches.rng_key``.
        init_state: a state to continue from (then ``rng_key`` is unused).
        stable_update: use :meth:`DPSVI.stable_update`.
        prefetch_depth: how many batches are read ahead; ``0`` reads each batch in the loop, with
            no thread (on a machine whose cores are all busy, thread hand-offs can cost more than
            the reads they hide).
        **kwargs: keyword arguments of the model and guide.

    Returns:
        :class:`~d3pext.training.svi.DPSVIRunResult`: parameters, state, the (non-private) losses
        and the privacy spent.

    >>> import os, tempfile, numpy as np, numpyro, numpyro.distributions as dist
    >>> from numpyro.infer.autoguide import AutoNormal
    >>> from d3pext import DPSVI
    >>> from d3pext.training.minibatch import PoissonSampler
    >>> path = os.path.join(tempfile.mkdtemp(), "x.npy")
    >>> np.save(path, np.random.default_rng(0).normal(1.0, 1.0, 5000).astype(np.float32))
    >>> sampler = PoissonSampler(5000, 0.02)
    >>> def model(xb, num_obs_total=None):
    ...     mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    ...     with numpyro.plate("data", num_obs_total, subsample_size=xb.shape[0]):
    ...         numpyro.sample("x", dist.Normal(mu, 1.0), obs=xb)
    >>> svi = DPSVI(model, AutoNormal(model), numpyro.optim.Adam(0.05), clipping_threshold=2.0,
    ...             dp_scale=1.0, delta=1e-5, num_obs_total=5000, sampler=sampler)
    >>> batches = MemmapBatches(path, sampler, rng_key=jax.random.key(1))
    >>> result = fit_streaming(svi, batches, 300, jax.random.key(2))
    >>> result.losses.shape, result.privacy.relation, abs(float(result.params["mu_auto_loc"]) - 1.0) < 0.3
    ((300,), 'add_remove', True)
    """
    if not isinstance(svi, DPSVI):
        raise TypeError(f"svi must be a DPSVI, got {type(svi).__name__}")
    if not isinstance(batches, MemmapBatches):
        raise TypeError(f"batches must be MemmapBatches, got {type(batches).__name__}")
    if isinstance(num_steps, bool) or int(num_steps) != num_steps or num_steps < 1:
        raise ValueError(f"num_steps must be a positive integer, got {num_steps}")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be an int >= 0, got {prefetch_depth!r}")
    num_steps = int(num_steps)
    poisson = isinstance(batches.sampler, PoissonSampler)
    # across processes every one must draw the same batches (and DPSVI the same noise)
    agreed_key(batches.rng_key, svi.mesh, "batch key (give MemmapBatches the same key on every process)")
    if init_state is None:
        if rng_key is None:
            rng_key = agreed_key(None, svi.mesh)
        elif not is_prng_key(rng_key):
            raise TypeError(f"rng_key must be a JAX PRNG key or None, got {type(rng_key).__name__}")
        elif jax.random.key_impl(rng_key) == jax.random.key_impl(batches.rng_key) and bool(
            jnp.all(jax.random.key_data(rng_key) == jax.random.key_data(batches.rng_key))
        ):
            raise ValueError(
                "rng_key is the key of the batches: give DPSVI and MemmapBatches different keys (e.g. the two "
                "halves of jax.random.split(key)), or None for secure keys"
            )
        *first, mask = batches[0]
        state = svi.init(rng_key, *first, **({"mask": mask} if poisson else {}), **kwargs)
    else:
        svi.check_resumable(init_state)
        state = init_state
    if svi.structure is None or svi.structure.plate_mode:
        raise ValueError(
            "fit_streaming feeds batches (batch mode): the model's data plate must have size N and "
            "subsample_size=xb.shape[0], with DPSVI(..., num_obs_total=N) if the plate does not know N"
        )
    if svi.sampler != batches.sampler:
        raise ValueError(
            f"DPSVI accounts for {svi.sampler!r}, but the batches are drawn by {batches.sampler!r}: create "
            "DPSVI(..., sampler=batches.sampler) so that the privacy is accounted for the sampling really done"
        )
    start = int(state.num_steps)
    if svi.planned_steps is not None and start + num_steps > svi.planned_steps:
        raise ValueError(
            f"{num_steps} more step(s) after {start} exceed the planned num_steps={svi.planned_steps}; "
            "call svi.extend_plan(new_num_steps) to go on knowingly"
        )
    update = svi.stable_update if stable_update else svi.update
    on_device = (tuple(jax.device_put(a) for a in batch) for batch in batches.steps(start, start + num_steps))
    in_flight = max(prefetch_depth, 1)
    losses: list[jax.Array] = []
    for *arrays, mask in prefetch(on_device, prefetch_depth) if prefetch_depth else on_device:
        state, loss = update(state, *arrays, **({"mask": mask} if poisson else {}), **kwargs)
        losses.append(loss)
        if len(losses) > in_flight:  # bound the steps in flight (each holds its batch)
            losses[-in_flight - 1].block_until_ready()
    losses_array = jnp.stack(losses)
    return svi.run_result(state, losses_array, svi.privacy_spent(state))
