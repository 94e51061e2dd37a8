"""Randomized quasi-Monte Carlo (RQMC) over a release mechanism (seed 000, section 3.3, eq. 11).

The inner integral of the SPPE/SPLE losses, ``I(theta, x) = int eta(s | x) g(s, theta) ds``, is
estimated by ``(1/M) sum_j g(tau(v_j; s(x)), theta)``, with ``v_1..v_M`` a scrambled Sobol point
set in ``[0, 1]^r`` and ``tau`` the mechanism's inverse CDF (coordinate-wise, the noise of each
coordinate being independent). Each simulated data set gets its own independent scramble, so the
estimator is unbiased; its RMSE decays like ``M^(-1+delta)`` for integrands of bounded variation,
against ``M^(-1/2)`` for plain Monte Carlo (:func:`release_points` with ``method="mc"``).

Scrambling is JAX-native and runs inside ``jit``/``vmap``: the unscrambled Sobol digits come from
``scipy.stats.qmc`` (computed once per ``(M, r)`` and cached), and each replicate applies a random
linear matrix scramble and a digital shift to the 32-bit integers (the scramble SciPy uses,
Matousek 1998). Uniforms are formed from the integers as ``(k + 1/2) 2^-b`` with ``b = 24`` bits in
float32 and 32 in float64, so they never equal 0 or 1 and the inverse CDFs stay finite.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
import warnings

import numpy as np

import jax
from jax import lax, random
import jax.numpy as jnp

__all__ = [
    "convergence_study",
    "has_inverse_cdf",
    "mc_uniforms",
    "release_points",
    "scrambled_sobol",
    "sobol_digits",
]


def _check_points(num_points: int) -> int:
    if int(num_points) != num_points or num_points < 1:
        raise ValueError(f"num_points must be a positive integer, got {num_points!r}.")
    num_points = int(num_points)
    if num_points > 2**24:
        raise ValueError(f"num_points must be at most 2**24, got {num_points}.")
    return num_points


@lru_cache(maxsize=64)
def _sobol_digits_np(num_points: int, dim: int) -> np.ndarray:
    from scipy.stats import qmc

    sampler = qmc.Sobol(dim, scramble=False)
    with warnings.catch_warnings():  # SciPy warns when num_points is not a power of two
        warnings.simplefilter("ignore", UserWarning)
        points = sampler.random(num_points)
    # the points are k / 2^30 (SciPy's 30-bit Sobol): exact in float64
    return np.asarray(np.round(points * 2.0**32), dtype=np.uint64).astype(np.uint32)


def sobol_digits(num_points: int, dim: int) -> jax.Array:
    """The first ``num_points`` unscrambled Sobol points in ``[0, 1)^dim`` as 32-bit integers
    (``u = k / 2^32``), shape ``(num_points, dim)``.

    >>> sobol_digits(4, 2).tolist()
    [[0, 0], [2147483648, 2147483648], [3221225472, 1073741824], [1073741824, 3221225472]]
    """
    num_points = _check_points(num_points)
    if int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim!r}.")
    return jnp.asarray(_sobol_digits_np(num_points, int(dim)))


def _float_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(dtype) if dtype is not None else jnp.result_type(float)


def _to_uniform(k: jax.Array, dtype) -> jax.Array:
    """``(k + 1/2) 2^-b`` from 32-bit integers: in ``(0, 1)`` for every ``k``."""
    dtype = _float_dtype(dtype)
    if jnp.finfo(dtype).nmant >= 32:
        return (k.astype(dtype) + 0.5) * dtype.type(2.0**-32)
    bits = jnp.finfo(dtype).nmant + 1  # 24 for float32
    return ((k >> (32 - bits)).astype(dtype) + 0.5) * dtype.type(2.0 ** (-bits))


def _scramble(raw: jax.Array, digits: jax.Array) -> jax.Array:
    """Linear matrix scramble plus digital shift of ``digits`` (M, r), uint32, one per leading
    index of ``raw`` (..., r, 33): random bits, 32 for the matrix's columns and one shift word."""
    # column l of the lower-triangular binary matrix (digit l = bit 31 - l): unit diagonal,
    # random entries below it (less significant bits)
    pos = jnp.arange(31, -1, -1, dtype=jnp.uint32)
    diag = jnp.left_shift(jnp.uint32(1), pos)
    columns = diag | (raw[..., :32] & (diag - jnp.uint32(1)))  # (..., r, 32)
    bits = (digits[..., None] >> pos) & jnp.uint32(1)  # (M, r, 32)
    terms = jnp.where(bits == 1, columns[..., None, :, :], jnp.uint32(0))  # (..., M, r, 32)
    scrambled = lax.reduce(terms, np.uint32(0), lax.bitwise_xor, (terms.ndim - 1,))
    return scrambled ^ raw[..., None, :, 32]


def scrambled_sobol(
    rng_key: jax.Array, num_points: int, dim: int, shape: tuple[int, ...] = (), dtype=None
) -> jax.Array:
    """Independently scrambled Sobol point sets: uniforms of shape ``(*shape, num_points, dim)``.

    Each of the ``prod(shape)`` point sets is a scrambled ``(t, m, dim)``-net when
    ``num_points`` is a power of two (keep it so). Works under ``jit`` and ``vmap``.

    >>> from jax import random
    >>> u = scrambled_sobol(random.key(0), 8, 3, shape=(5,))
    >>> u.shape, bool((u > 0).all() & (u < 1).all())
    ((5, 8, 3), True)
    >>> # a scrambled net has exactly one point in each of the 8 intervals [k/8, (k+1)/8)
    >>> sorted((u[0, :, 0] * 8).astype(int).tolist())
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    digits = sobol_digits(num_points, dim)
    return _scrambled(rng_key, digits, tuple(shape), _float_dtype(dtype))


@partial(jax.jit, static_argnums=(2, 3))
def _scrambled(rng_key, digits, shape, dtype):
    # all the random bits in one call (one threefry, not one per point set: 10x faster to
    # compile); with JAX's partitionable threefry, row i does not depend on the number of rows
    raw = random.bits(rng_key, (*shape, digits.shape[1], 33), jnp.uint32)
    return _to_uniform(_scramble(raw, digits), dtype)


def mc_uniforms(
    rng_key: jax.Array, num_points: int, dim: int, shape: tuple[int, ...] = (), dtype=None
) -> jax.Array:
    """Independent uniforms in ``(0, 1)``, formed like :func:`scrambled_sobol`'s (plain MC)."""
    num_points = _check_points(num_points)
    ints = random.bits(rng_key, (*tuple(shape), num_points, int(dim)), jnp.uint32)
    return _to_uniform(ints, dtype)


def has_inverse_cdf(mechanism) -> bool:
    """Whether ``mechanism.release_icdf`` is implemented (tried on a scalar)."""
    try:
        jax.eval_shape(lambda: mechanism.release_icdf(jnp.zeros(()), jnp.full((), 0.5)))
    except (NotImplementedError, AttributeError):
        return False
    return True


def release_points(
    mechanism,
    rng_key: jax.Array,
    value: jax.Array,
    num_points: int,
    method: str = "rqmc",
    dtype=None,
) -> jax.Array:
    """``num_points`` releases of each confidential ``value``: shape ``(*batch, num_points, r)``.

    :param mechanism: a mechanism of :mod:`d3pext.releases.mechanisms` (with its sensitivity set).
    :param value: confidential statistics, shape ``(*batch, r)`` (the last axis is the release).
    :param method: ``"rqmc"`` (scrambled Sobol through ``release_icdf``, one scramble per batch
        element) or ``"mc"`` (independent draws). A mechanism without an inverse CDF falls
        back to MC with a warning.

    >>> from jax import random
    >>> import jax.numpy as jnp
    >>> from d3pext.releases.mechanisms import LaplaceMechanism
    >>> m = LaplaceMechanism(1.0, sensitivity=1.0)
    >>> s = release_points(m, random.key(0), jnp.zeros((100, 3)), 64)
    >>> s.shape, abs(float(s.mean())) < 0.05
    ((100, 64, 3), True)
    """
    if method not in ("rqmc", "mc"):
        raise ValueError(f"method must be 'rqmc' or 'mc', got {method!r}.")
    value = jnp.asarray(value)
    if value.ndim < 1:
        raise ValueError("value must have a release axis (last axis); got a scalar.")
    if method == "rqmc" and not has_inverse_cdf(mechanism):
        warnings.warn(
            f"{type(mechanism).__name__} has no inverse CDF: integrating the mechanism by plain "
            "Monte Carlo instead of RQMC.",
            stacklevel=2,
        )
        method = "draw"
    if method == "draw":
        _check_points(num_points)
        return _draw(mechanism, rng_key, value, num_points)
    return mechanism.release_icdf(value[..., None, :], _release_uniforms(rng_key, value, num_points, method, dtype))


def _release_uniforms(rng_key: jax.Array, value: jax.Array, num_points: int, method: str, dtype=None) -> jax.Array:
    """The uniforms of :func:`release_points` (``"rqmc"`` or ``"mc"``): ``(*batch, num_points, r)``."""
    if dtype is None and jnp.issubdtype(value.dtype, jnp.floating):
        dtype = value.dtype
    make = scrambled_sobol if method == "rqmc" else mc_uniforms
    return make(rng_key, num_points, value.shape[-1], value.shape[:-1], _float_dtype(dtype))


def _releases_at_once(mechanism, values: list[jax.Array], uniforms: list[jax.Array]) -> list[jax.Array]:
    """``mechanism.release_icdf(value[..., None, :], u)`` for each pair, as one call over the rows of all
    of them: each call site compiles its own copy of the inverse CDF (for the binomial mechanism a
    bisection over ``betainc``, seconds each)."""
    dim = uniforms[0].shape[-1]
    rows = [jnp.broadcast_to(v[..., None, :], u.shape).reshape(-1, dim) for v, u in zip(values, uniforms)]
    flat = mechanism.release_icdf(jnp.concatenate(rows), jnp.concatenate([u.reshape(-1, dim) for u in uniforms]))
    ends = np.cumsum([r.shape[0] for r in rows])[:-1]
    return [part.reshape(u.shape) for part, u in zip(jnp.split(flat, ends), uniforms)]


def _draw(mechanism, rng_key, value, num_points):
    d = mechanism.release_distribution(value[..., None, :])
    shape = (*value.shape[:-1], num_points, value.shape[-1])
    return d.expand(shape).sample(rng_key)


def convergence_study(
    integrand: Callable[[jax.Array], jax.Array],
    mechanism,
    value: jax.Array,
    num_points: tuple[int, ...],
    rng_key: jax.Array,
    replicates: int = 200,
    reference_points: int = 2**16,
) -> dict:
    """RMSE of the MC and RQMC estimates of ``E[integrand(release)]`` against ``M`` (seed 000,
    Figure 1), with the least-squares slopes of log RMSE on log M.

    :param integrand: ``(..., r) -> (...)``, applied to releases of ``value`` (shape ``(r,)``).
    :return: ``{"num_points", "rmse_mc", "rmse_rqmc", "slope_mc", "slope_rqmc", "reference"}``.
    """
    value = jnp.asarray(value)
    key_ref, key = random.split(rng_key)
    cases = [(m, method) for m in num_points for method in ("mc", "rqmc")]
    keys = []
    for _ in cases:
        key, sub = random.split(key)
        keys.append(sub)

    # one program for the reference and every (M, method), with one inverse-CDF call: as separate
    # programs they took 1.35x as long to compile, and each call site compiles its own inverse CDF
    one_call = has_inverse_cdf(mechanism)

    @jax.jit
    def estimates(key_ref, keys, value):
        values = jnp.broadcast_to(value, (replicates, *value.shape))
        if one_call:
            uniforms = [_release_uniforms(key_ref, value[None], reference_points, "rqmc")]
            uniforms += [_release_uniforms(k, values, m, method) for k, (m, method) in zip(keys, cases)]
            points, *found = _releases_at_once(mechanism, [value[None]] + [values] * len(cases), uniforms)
        else:
            points = release_points(mechanism, key_ref, value[None], reference_points, "rqmc")
            found = [release_points(mechanism, k, values, m, method) for k, (m, method) in zip(keys, cases)]
        reference = jnp.mean(integrand(points))
        found = [jnp.mean(integrand(pts), axis=-1) for pts in found]
        return reference, [jnp.sqrt(jnp.mean((est - reference) ** 2)) for est in found]

    reference, rmse = estimates(key_ref, jnp.stack(keys), value)
    out = {"num_points": list(num_points), "rmse_mc": [], "rmse_rqmc": [], "reference": float(reference)}
    for (_, method), error in zip(cases, rmse):
        out[f"rmse_{method}"].append(float(error))
    logm = np.log(np.asarray(num_points, float))
    for method in ("mc", "rqmc"):
        out[f"slope_{method}"] = float(np.polyfit(logm, np.log(out[f"rmse_{method}"]), 1)[0])
    return out
