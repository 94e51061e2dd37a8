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

__all__ = ["check_mesh", "communication", "data_parallel_clipped_sum", "padded_size"]


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
