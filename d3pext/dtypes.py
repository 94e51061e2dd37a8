"""Default dtypes that follow JAX's x64 setting."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

__all__ = ["as_int_dtype", "float_dtype", "int_dtype"]


def int_dtype() -> np.dtype:
    """The default integer dtype (``int64`` under ``jax_enable_x64``, else ``int32``)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


def as_int_dtype(x: np.ndarray, what: str = "the values") -> np.ndarray:
    """Integers ``x`` in :func:`int_dtype`; a ``ValueError`` where a value would wrap around in it.

    >>> as_int_dtype(np.array([3, 2**20])).dtype
    dtype('int32')
    """
    dtype = int_dtype()
    info = np.iinfo(dtype)
    if np.size(x) and (np.min(x) < info.min or np.max(x) > info.max):
        raise ValueError(
            f"{what} reach {np.max(np.abs(np.asarray(x, np.float64))):.4g}, beyond the {dtype} range of JAX's "
            "integers (they would wrap around): enable 64-bit integers with jax.config.update('jax_enable_x64', True)."
        )
    return np.asarray(x).astype(dtype)


def float_dtype(*args: ArrayLike) -> np.dtype:
    """The floating dtype of ``args``; the default float dtype without ``args`` (Python scalars
    follow the x64 setting).

    >>> import jax.numpy as jnp
    >>> str(float_dtype(jnp.ones(2, jnp.float32)))
    'float32'
    """
    if not args:
        return jnp.result_type(float)
    dtype = jnp.result_type(*args)
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.result_type(float)
