"""Default dtypes that follow JAX's x64 setting."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
import numpy as np

__all__ = ["float_dtype", "int_dtype"]


def int_dtype() -> np.dtype:
    """The default integer dtype (``int64`` under ``jax_enable_x64``, else ``int32``)."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


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
