"""JAX's persistent compilation cache, in the user's cache directory.

Most of the wall time of a short d3pext run (the ``d3pext demo`` command, a notebook at its small
size) is XLA compilation, not computation. JAX can keep compiled programs on disk and reuse them
in the next process; :func:`enable_compile_cache` turns that on. The ``d3pext`` command and the
notebooks call it; importing the library does not (a library should not write to the user's disk
behind their back), so call it yourself at the top of a script if you want it::

    import d3pext
    d3pext.enable_compile_cache()

Environment variables:

- ``D3PEXT_NO_COMPILE_CACHE=1`` turns the cache off (the function then does nothing);
- ``D3PEXT_CACHE_DIR`` names the directory to use instead of the default.

The default directory is ``$XDG_CACHE_HOME/d3pext/jax`` (``~/.cache/d3pext/jax``) on Linux,
``~/Library/Caches/d3pext/jax`` on macOS and ``%LOCALAPPDATA%\\d3pext\\Cache\\jax`` on Windows. A
directory already configured through JAX itself (``JAX_COMPILATION_CACHE_DIR`` or
``jax.config.update("jax_compilation_cache_dir", ...)``) is kept, unless a directory is passed
explicitly or set by ``D3PEXT_CACHE_DIR``.

A program is found again only if the next process builds exactly the same program. DPSVI's are (a
test checks this for the demo's). They take sigma and the planned number of steps as arguments, not
constants, so ``DPSVI.run`` and ``update`` at another epsilon, sigma or number of steps find the
programs of an earlier fit of the same model and data shapes (except where ``update`` is traced
inside your own ``jax.jit``: there these values are constants of your program).

NumPyro's ``Trace_ELBO`` is not deterministic in this sense: it sums its per-site terms in the order
of a Python set of site names, which changes with each process's string hashing, so a plain ``SVI``
with it often misses the cache. Run such scripts with a fixed ``PYTHONHASHSEED`` (e.g.
``PYTHONHASHSEED=0 python fit.py``), or use ``TraceMeanField_ELBO`` where its closed-form KL applies
(the demo's non-private fit does).

Processes running at once (two notebooks, a script beside ``d3pext demo``) can share the directory:
the cache holds at most :data:`DEFAULT_MAX_SIZE` bytes, and with a size limit JAX locks the directory
around each read and write (``filelock``) and evicts the least recently used entries. Without a limit
it writes entries in place, unlocked, so that another process could read one half written (JAX then
warns and compiles again).

As JAX warns, the cache is trusted code: do not point it at a directory that others can write to.
Delete the directory to clear the cache.

>>> import d3pext
>>> d3pext.enable_compile_cache  # doctest: +ELLIPSIS
<function enable_compile_cache at ...>
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional, Union

__all__ = ["enable_compile_cache", "default_cache_dir", "DEFAULT_MAX_SIZE", "MIN_COMPILE_TIME_SECS"]

DISABLE_ENV = "D3PEXT_NO_COMPILE_CACHE"
DIR_ENV = "D3PEXT_CACHE_DIR"

MIN_COMPILE_TIME_SECS = 0.1
"""Programs that compile faster than this are not written to the cache (JAX's default is 1 s).

Measured on ``d3pext demo`` (2 CPU cores): of its 27 s of compilation, 21 s go to three programs
of over a second each and 3.5 s to a dozen more of 0.1 s to 1 s; reading an entry back takes
about 20 ms, so programs under about 0.05 s are not worth keeping.
"""


DEFAULT_MAX_SIZE = 1 << 30
"""Bytes the cache may hold (1 GiB); ``d3pext demo`` writes 4 entries, under 0.5 MB."""


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def default_cache_dir() -> Path:
    """The directory where :func:`enable_compile_cache` keeps compiled programs by default.

    ``D3PEXT_CACHE_DIR`` if set, otherwise the platform's user cache directory plus ``d3pext/jax``.
    """
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
        return base / "d3pext" / "Cache" / "jax"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "d3pext" / "jax"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "d3pext" / "jax"


def enable_compile_cache(
    path: Union[str, os.PathLike, None] = None,
    *,
    min_compile_time_secs: float = MIN_COMPILE_TIME_SECS,
    max_size: Optional[int] = DEFAULT_MAX_SIZE,
) -> Optional[Path]:
    """Turn on JAX's persistent compilation cache for this process; returns its directory.

    Returns ``None``, and changes nothing, if ``D3PEXT_NO_COMPILE_CACHE`` is set (to anything but
    ``0``/``false``/``no``/``off``) or if the directory cannot be created (with a warning).

    Args:
        path: the cache directory; default ``D3PEXT_CACHE_DIR``, else a directory already set in
            JAX's configuration, else :func:`default_cache_dir`.
        min_compile_time_secs: programs compiled faster than this are not cached.
        max_size: bytes the cache may hold, least recently used entries evicted first; a limit also
            makes JAX lock the directory around each read and write, so that processes running at
            once never read an entry that another is writing. ``None`` leaves JAX's setting (by
            default no limit and no lock). A limit already set through JAX is kept.

    Call it before the programs you want cached are compiled; programs compiled earlier in the
    process are not written back. If JAX's cache was already in use with another directory in
    this process, JAX keeps using that one.
    """
    if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, int)
                                 or max_size <= 0):
        raise ValueError(f"max_size must be a positive number of bytes or None, got {max_size!r}.")
    if _truthy(os.environ.get(DISABLE_ENV)):
        return None
    import jax

    if path is None and not os.environ.get(DIR_ENV) and jax.config.jax_compilation_cache_dir:
        directory = Path(jax.config.jax_compilation_cache_dir)
    else:
        directory = Path(path).expanduser() if path is not None else default_cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache disabled: cannot create {directory}: {e}", RuntimeWarning, stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_secs))
    # Cache every entry that took long enough to compile, however small (-1: no size floor; 0 would
    # let JAX pick a floor of its own).
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if max_size is not None and jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", max_size)
    return directory
