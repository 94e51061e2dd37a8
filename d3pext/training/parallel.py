"""Data-parallel clipped sums: the records of a DP-VI batch split over the devices of a mesh axis.

``DPSVI(..., mesh=mesh, data_axis="data")`` computes each step's clipped sum with
:func:`data_parallel_clipped_sum`: the batch (of ``B`` records, padded with masked-out slots to a
multiple of the axis size ``D``) is split into ``D`` blocks, and each device computes the clipped
per-record gradients of its ``B / D`` records with any clipping strategy
(:data:`~d3pext.training.clipping.CLIPPED_SUMS`, ghost included) inside :func:`jax.shard_map`.
The partial sums are added by one ``psum`` over the data axis: one all-reduce of the parameters'
size per step. What stays outside, unchanged, is everything that carries the privacy guarantee or
does not scale with the batch: the sampler draws the batch indices as on one device, the Gaussian
noise is drawn once from the same key (so a key gives the same noise, hence the same fit up to
float rounding, whatever the number of devices), and the accountant sees the same sampling scheme.

Each record's terms use the same random keys as on one device (the ELBO key is shared, the
record's own key is folded in from its position in the batch), so per-record values, and thus
clipping decisions, do not depend on the device count either.

In plate mode the full data may be sharded by rows over the data axis
(``jax.device_put(x, NamedSharding(mesh, P("data")))``): the ``B`` rows of the batch are gathered
from their owners (XLA partitions the gather: each device picks the rows it holds, and the blocks
are exchanged; only batch rows move, never the full data), and each device then works on copies of
its own records, as on one device.

Several hosts (``jax.distributed``): every process runs the same script; each loads only its own
rows of the data (:func:`process_slice` says which) and :func:`shard_records` assembles the global,
row-sharded array from them (``jax.make_array_from_process_local_data``). The fit is then the
one-process fit, as above. Data placed where a step over the mesh cannot take it (on a device outside
the mesh, or split otherwise than by rows over the data axis) is refused by :func:`check_data`.

>>> import jax, jax.numpy as jnp
>>> from jax.sharding import Mesh
>>> mesh = Mesh(jax.devices()[:1], ("data",))
>>> check_mesh(mesh, "data")
1
"""

from __future__ import annotations

from collections.abc import Callable
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = [
    "agreed_key", "check_data", "check_mesh", "communication", "data_parallel_clipped_sum", "host_value",
    "padded_size", "process_slice", "shard_records",
]


def check_mesh(mesh: Any, axis: Any) -> int:
    """Validate a data-parallel ``mesh`` and its ``axis``; return the axis size ``D``.

    Raises :class:`ValueError` for anything but a concrete :class:`jax.sharding.Mesh` with a named
    axis ``axis``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (e.g. Mesh(jax.devices(), ('data',))), got {type(mesh).__name__}"
        )
    if not isinstance(axis, str):
        raise ValueError(f"data_axis must be the name (a str) of one axis of the mesh, got {axis!r}")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"the mesh has no axis {axis!r} to split the records over; its axes are {tuple(mesh.axis_names)}: "
            f"name one with data_axis=..."
        )
    return int(mesh.shape[axis])


def _where(name: str) -> str:
    return f"data argument {name}" if name else "the data"


def check_data(data: Any, mesh: Mesh, axis: str = "data") -> None:
    """Refuse data that a step split over the ``axis`` devices of ``mesh`` cannot take as placed.

    Each array of ``data`` (a pytree; NumPy arrays, uncommitted JAX arrays and tracers pass) must be
    either replicated over the mesh or split by rows over ``axis`` (``NamedSharding(mesh, P(axis))``,
    as :func:`shard_records` builds it). Raises :class:`ValueError` naming the argument for an array on
    a device outside the mesh, committed to some of its devices only, or split another way (by columns,
    over another axis).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> check_data((jax.device_put(jnp.ones((4, 2)), NamedSharding(mesh, P("data"))), jnp.zeros(4)), mesh)
    """
    check_mesh(mesh, axis)
    devices = set(mesh.devices.flat)
    rows, whole = NamedSharding(mesh, P(axis)), NamedSharding(mesh, P())
    fix = (
        f"place it on the mesh: jax.device_put(x, NamedSharding(mesh, P({axis!r}))) to split the records by rows "
        "(several processes: d3pext.training.parallel.shard_records), or NamedSharding(mesh, P()) to replicate it"
    )
    for path, leaf in jax.tree_util.tree_leaves_with_path(data):
        if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer) or not leaf.committed:
            continue
        name, sharding = jax.tree_util.keystr(path), leaf.sharding
        outside = sharding.device_set - devices
        if outside:
            raise ValueError(
                f"{_where(name)} is on {sorted(outside, key=lambda d: d.id)}, outside the mesh given to DPSVI "
                f"(its devices: {sorted(devices, key=lambda d: d.id)}): {fix}"
            )
        if leaf.ndim == 0 or sharding.is_equivalent_to(whole, leaf.ndim) or sharding.is_equivalent_to(rows, leaf.ndim):
            continue
        if sharding.device_set != devices:
            raise ValueError(
                f"{_where(name)} is committed to {sorted(sharding.device_set, key=lambda d: d.id)}, only part of the "
                f"mesh's {len(devices)} devices: {fix}"
            )
        spec = getattr(sharding, "spec", sharding)
        raise ValueError(
            f"{_where(name)} of shape {leaf.shape} is split as {spec}, but DPSVI splits the records by rows over the "
            f"mesh axis {axis!r} (mesh axes {dict(mesh.shape)}): {fix}"
        )


def _local_blocks(mesh: Mesh, axis: str) -> list[int]:
    """This process's positions along ``axis`` (those of its devices), in order."""
    where = mesh.axis_names.index(axis)
    me = jax.process_index()
    return sorted({int(np.unravel_index(i, mesh.devices.shape)[where])
                   for i, d in enumerate(mesh.devices.flat) if d.process_index == me})


def process_slice(num_records: int, mesh: Mesh, axis: str = "data") -> slice:
    """The rows of ``num_records`` that this process holds when they are split by rows over the
    ``axis`` devices of ``mesh``: what it loads and passes to :func:`shard_records`.

    With ``Mesh(jax.devices(), ("data",))`` over ``P`` processes of equal device counts, process ``p``
    holds rows ``p N / P`` to ``(p + 1) N / P``. Raises :class:`ValueError` if ``num_records`` is not a
    multiple of the axis size ``D`` (each device holds ``N / D`` rows: drop ``N mod D`` records before
    sharding, and state the new ``N``, or keep the data replicated), or if this process's rows are not
    contiguous (order the mesh's devices by process, as ``jax.make_mesh`` does).

    >>> import jax
    >>> from jax.sharding import Mesh
    >>> process_slice(1000, Mesh(jax.devices()[:1], ("data",)))
    slice(0, 1000, None)
    """
    size = check_mesh(mesh, axis)
    if int(num_records) != num_records or num_records < 1:
        raise ValueError(f"num_records must be a positive integer, got {num_records!r}")
    if num_records % size:
        raise ValueError(
            f"{num_records} records cannot be split by rows over the {size} devices of mesh axis {axis!r} "
            f"({num_records} mod {size} = {num_records % size}): each device holds the same number of rows. Drop "
            f"{num_records % size} records (N is then {num_records - num_records % size}: the accountant's sampling "
            "rate uses it), or keep the data replicated (the batch is split over the devices all the same)"
        )
    per_device = num_records // size
    blocks = _local_blocks(mesh, axis)
    if not blocks:
        raise ValueError(f"process {jax.process_index()} has no device on the mesh: every process needs one")
    if blocks != list(range(blocks[0], blocks[0] + len(blocks))):
        raise ValueError(
            f"process {jax.process_index()} holds the non-contiguous positions {blocks} of mesh axis {axis!r}: order "
            "the mesh's devices by process (jax.make_mesh or Mesh(jax.devices(), ...) does) so that each process "
            "loads one contiguous slice of the records"
        )
    return slice(blocks[0] * per_device, (blocks[-1] + 1) * per_device)


def shard_records(local: Any, mesh: Mesh, axis: str = "data") -> Any:
    """The global data, split by rows over the ``axis`` devices of ``mesh``, from the rows this
    process holds (every process calls it, with its own rows; a pytree of arrays or one array).

    Process ``p`` passes rows :func:`process_slice` ``(N, mesh, axis)`` of each array (on one process,
    all of them); the result is ``jax.make_array_from_process_local_data(NamedSharding(mesh, P(axis)),
    local)``, the array of all ``N`` rows that ``DPSVI(..., mesh=mesh, data_axis=axis)`` takes. Checked
    first, across processes, with clear errors: each process holds the same number of rows per device
    of the axis (so ``N`` is a multiple of the axis size), with the same trailing shape.

    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh
    >>> mesh = Mesh(jax.devices()[:1], ("data",))
    >>> x = np.arange(12.0).reshape(6, 2)[process_slice(6, mesh)]   # this process's rows
    >>> shard_records(x, mesh).shape
    (6, 2)
    """
    size = check_mesh(mesh, axis)
    blocks = len(_local_blocks(mesh, axis))
    if not blocks:
        raise ValueError(f"process {jax.process_index()} has no device on the mesh: every process needs one")
    leaves, treedef = jax.tree.flatten(local)
    shapes = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(local):
        shape = np.shape(leaf)
        if not shape or shape[0] % blocks:
            raise ValueError(
                f"process {jax.process_index()} holds {shape[0] if shape else 'no'} rows of {_where(jax.tree_util.keystr(path))} "
                f"(shape {shape}) for its {blocks} device(s) of mesh axis {axis!r}: each device holds the same number "
                f"of rows, so give each process a multiple of {blocks} rows (its process_slice(N, mesh))"
            )
        shapes.append((shape[0] // blocks,) + shape[1:])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        width = max((len(s) for s in shapes), default=0) + 1
        mine = np.array([[len(s), *s, *[0] * (width - 1 - len(s))] for s in shapes], np.int64).reshape(len(shapes), width)
        every = np.asarray(multihost_utils.process_allgather(mine))  # (processes, leaves, width)
        for i, leaf_shapes in enumerate(np.swapaxes(every, 0, 1)):
            if (leaf_shapes != leaf_shapes[0]).any():
                described = [f"process {p}: {tuple(int(v) for v in row[1:1 + row[0]])}" for p, row in enumerate(leaf_shapes)]
                raise ValueError(
                    f"the processes hold rows of different shapes for leaf {i} of the data (rows per device of axis "
                    f"{axis!r}, then the trailing shape): {'; '.join(described)}. Each device of the axis holds "
                    "N / D rows: load each process's process_slice(N, mesh)"
                )
    sharding = NamedSharding(mesh, P(axis))
    arrays = [
        jax.make_array_from_process_local_data(sharding, leaf, (s[0] * size,) + s[1:]) for leaf, s in zip(leaves, shapes)
    ]
    return jax.tree.unflatten(treedef, arrays)


def padded_size(batch_size: int, num_devices: int) -> int:
    """The batch length rounded up to a multiple of the number of devices.

    >>> padded_size(30, 4)
    32
    """
    return int(math.ceil(batch_size / num_devices)) * num_devices


def _pad(x: jax.Array, extra: int, fill: jax.Array) -> jax.Array:
    if not extra:
        return x
    fill = jnp.broadcast_to(fill, (extra,) + jnp.shape(x)[1:]).astype(x.dtype)
    return jnp.concatenate([x, fill])


def data_parallel_clipped_sum(
    clipped_sum: Callable,
    record_loss: Callable,
    params: Any,
    rng_key: jax.Array,
    args: tuple,
    kwargs: dict,
    records: tuple[jax.Array, jax.Array],
    mask: jax.Array,
    threshold: float,
    drop_nonfinite: bool,
    plate_mode: bool,
    *,
    mesh: Mesh,
    axis: str = "data",
) -> tuple[Any, jax.Array, jax.Array]:
    """``clipped_sum`` (one of :data:`~d3pext.training.clipping.CLIPPED_SUMS`) with the batch's
    records split over the ``axis`` devices of ``mesh``; returns ``(clipped_sum, losses, mask)``
    as ``clipped_sum`` does on one device.

    :param record_loss: ``record_loss(params, rng_key, args, kwargs, record)``, one record's loss.
    :param args: the data: in plate mode all ``N`` records (possibly sharded by rows); in batch
        mode the batch, one row per record.
    :param records: ``(indices, positions)`` of the batch's records, each of length ``B``: the
        records' indices in the data (plate mode; ignored in batch mode, where row ``i`` of the
        data is record ``i``) and their positions in the batch (which key each record gets).
    :param mask: which of the ``B`` slots hold a record.
    :param plate_mode: whether ``args`` holds all records (rows are gathered by ``indices``).
    """
    num_devices = check_mesh(mesh, axis)
    indices, positions = records
    batch = int(jnp.shape(mask)[0])
    extra = padded_size(batch, num_devices) - batch
    if plate_mode:
        # Only the batch's rows travel: the gather from row-sharded data is partitioned by XLA.
        rows = jax.tree.map(lambda a: a[indices], args)
        shapes = jax.tree.map(jnp.shape, args)
    else:
        rows, shapes = args, None
    # Padding slots are masked out (the clipping functions select them away) and hold copies of the
    # first slot, so they compute on ordinary values; their positions are past the batch's.
    rows = jax.tree.map(lambda a: _pad(a, extra, a[0]), rows)
    indices = _pad(indices, extra, indices[0])
    positions = _pad(positions, extra, batch + jnp.arange(extra, dtype=jnp.result_type(positions)))
    mask = _pad(mask, extra, False)
    # shard_map takes arrays; other keyword values (static under jit) are closed over
    dynamic = {k: v for k, v in kwargs.items() if isinstance(v, (jax.Array, np.ndarray))}
    static = {k: v for k, v in kwargs.items() if k not in dynamic}
    split, whole = P(axis), P()
    rows = jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, split))

    def local(params, key, dynamic, rows, indices, positions, mask):
        kw = {**dynamic, **static}
        if plate_mode:
            # A record's loss sees N copies of its row in place of the data, as on one device.
            def one(fn, p, rec, row):
                full = jax.tree.map(lambda r, s: jnp.broadcast_to(r, s), row, shapes)
                return fn(p, key, full, kw, rec)
        else:
            def one(fn, p, rec, row):
                return fn(p, key, row, kw, rec)

        def per_record(fn, p, recs, a):
            return jax.vmap(lambda rec, row: one(fn, p, rec, row))(recs, a)

        # The rows are in ``args`` here in both modes: plate_mode=False tells the clipping
        # functions so (``reweight`` then substitutes rows along with records).
        clipped, losses, kept = clipped_sum(
            record_loss, per_record, params, rows, (indices, positions), mask, threshold, drop_nonfinite, False
        )
        return jax.lax.psum(clipped, axis), losses, kept

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(whole, whole, whole, split, split, split, split),
        out_specs=(whole, split, split),
        check_vma=False,
    )
    clipped, losses, kept = sharded(params, rng_key, dynamic, rows, indices, positions, mask)
    return clipped, losses[:batch], kept[:batch]


_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>.+?)\s+(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


def communication(hlo_text: str) -> dict[str, int]:
    """Bytes per device that each kind of collective of a compiled program produces, by op
    (``all-reduce``, ``all-gather``, ...), read from its HLO text
    (``jax.jit(f).lower(...).compile().as_text()``); a collective inside a loop counts once.

    >>> communication("%ar = (f32[64,50]{1,0}, f32[64]{0}) all-reduce(%a, %b), channel_id=1")
    {'all-reduce': 13056}
    """
    volume: dict[str, int] = {}
    for match in _COLLECTIVE.finditer(hlo_text):
        arrays = _ARRAY.findall(match["shape"])
        if match["start"] and match["op"] in ("all-gather", "collective-permute"):
            arrays = arrays[len(arrays) // 2:]  # async starts return (operands, results)
        size = 0
        for dtype, dims in arrays:
            bits = _BITS.get(dtype) or int(dtype[1:])
            size += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
        volume[match["op"]] = volume.get(match["op"], 0) + size
    return volume


def host_value(x) -> np.ndarray:
    """The value of a (replicated) array on the host, also where it spans devices of other processes.

    >>> host_value(jax.numpy.arange(3))
    array([0, 1, 2], dtype=int32)
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return np.asarray(x)


def _spans_processes(mesh: Mesh | None) -> bool:
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


def agreed_key(rng_key: jax.Array | None, mesh: Mesh | None, what: str = "rng_key") -> jax.Array:
    """The key every process of ``mesh`` uses: ``rng_key``, checked to be the same on all of them, or for
    ``None`` a secure key drawn on process 0 and sent to the others.

    The batch, the noise and the replicated parameters of a step come from its key: processes holding
    different keys would each add their own noise to one clipped sum, and their parameters would drift
    apart, while the accountant counts one release per step. On one process it is ``rng_key`` (a
    secure key for ``None``).

    >>> import jax
    >>> key = jax.random.key(0)
    >>> agreed_key(key, None) is key
    True
    """
    from d3pext.prng import secure_key

    if not _spans_processes(mesh):
        return secure_key() if rng_key is None else rng_key
    from jax.experimental import multihost_utils

    if rng_key is None:
        rng_key = secure_key()
        words = multihost_utils.broadcast_one_to_all(np.asarray(jax.random.key_data(rng_key)))
        rng_key = jax.random.wrap_key_data(np.asarray(words), impl=jax.random.key_impl(rng_key))
    typed = jax.dtypes.issubdtype(rng_key.dtype, jax.dtypes.prng_key)
    words = host_value(jax.random.key_data(rng_key) if typed else rng_key)  # also a state replicated over the mesh
    every = np.asarray(multihost_utils.process_allgather(words))
    if (every != every[0]).any():
        raise ValueError(
            f"the processes of the mesh hold different {what}s: each would add its own noise to the same clipped "
            "sum (and draw other batches), while the accountant counts one release per step. Give every process "
            "the same key, or None for a secure key that process 0 draws and sends to the others"
        )
    return rng_key
