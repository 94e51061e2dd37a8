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

JAX's cache finds a program by its lowered form, so a new process still traces and lowers each one
before it can look it up. d3pext's own programs (DPSVI's init, record-isolation check and steps, and
the demo's non-private fit) are also kept in the ``d3pext-programs`` folder of the directory, keyed
by their traced program, and read back without lowering (:func:`compile_traced`); use
:func:`cached_jit` for your own. That folder holds at most :data:`PROGRAMS_MAX_SIZE` bytes.

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

__all__ = [
    "enable_compile_cache", "default_cache_dir", "cached_jit", "compile_traced", "program_digest", "DEFAULT_MAX_SIZE",
    "MIN_COMPILE_TIME_SECS", "PROGRAMS_MAX_SIZE",
]

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


PROGRAMS_MAX_SIZE = 1 << 28
"""Bytes d3pext's own program store may hold (256 MiB; see :func:`compile_traced`); ``d3pext demo``
writes 4 programs, about 2 MB."""

_programs_dir: Optional[Path] = None  # set by enable_compile_cache: where compile_traced keeps programs


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
    global _programs_dir
    _programs_dir = directory / PROGRAMS_SUBDIR  # JAX's eviction looks only at the files of its directory
    return directory


# ------------------------------------------------------------------ d3pext's program store

PROGRAMS_SUBDIR = "d3pext-programs"
_FORMAT = "d3pext-program-1"
_build: Optional[str] = None


def _environment_key() -> str:
    """Everything besides the traced program that decides what XLA builds from it: versions, the
    backend and its devices, XLA's flags, d3pext's CPU lowering of Threefry (its only lowering rule;
    the rest of d3pext shapes programs through their jaxprs, so its version is left out and an
    upgrade finds the programs it did not change) and JAX's configuration (read on every call: it
    can change during a process, or within a ``with`` block)."""
    global _build
    if _build is None:
        import hashlib
        import platform

        import jax
        import jaxlib

        from d3pext import _threefry_cpu

        device = jax.devices()[0]
        lowering = hashlib.sha256(Path(_threefry_cpu.__file__).read_bytes()).hexdigest()
        _build = repr((
            _FORMAT, jax.__version__, jaxlib.__version__, sys.version, platform.machine(),
            jax.default_backend(), device.client.platform_version, device.device_kind, jax.device_count(),
            os.environ.get("XLA_FLAGS", ""), _threefry_cpu.installed(), lowering,
        ))  # fmt: skip
    import jax

    return _build + repr(sorted((name, repr(value)) for name, value in jax.config.values.items()))


def _primitive_names(jaxpr, found: set) -> set:
    for eqn in jaxpr.eqns:
        found.add(eqn.primitive.name)
        for param in eqn.params.values():
            for value in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(value, "jaxpr", value)
                if hasattr(inner, "eqns"):
                    _primitive_names(inner, found)
    return found


def program_digest(closed) -> Optional[str]:
    """A digest of a traced program (a ``ClosedJaxpr``): its printed form, with every equation, its
    parameters and nested programs, the values of its constants and its argument types; ``None`` for a
    program that cannot be told apart this way (host callbacks or effects, which are bound to this
    process's Python objects; a printed form that names objects by their address; object constants).

    Under the same JAX configuration and lowering rules (one process, say), two programs with equal
    digests compute the same function of their arguments.

    >>> import jax, jax.numpy as jnp
    >>> a = program_digest(jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(3)))
    >>> a == program_digest(jax.make_jaxpr(lambda y: y * 2.0)(jnp.ones(3)))
    True
    >>> a == program_digest(jax.make_jaxpr(lambda x: x * 3.0)(jnp.ones(3)))
    False
    """
    import hashlib
    import re

    import jax
    import numpy as np

    if closed.effects or any("callback" in name for name in _primitive_names(closed.jaxpr, set())):
        return None
    text = str(closed)
    if re.search(r" at 0x[0-9a-fA-F]+", text):
        return None
    digest = hashlib.sha256()
    digest.update(text.encode())
    digest.update(str([(aval.str_short(), aval.weak_type) for aval in closed.in_avals]).encode())
    for const in closed.consts:
        if jax.dtypes.issubdtype(getattr(const, "dtype", None), jax.dtypes.prng_key):
            digest.update(str(jax.random.key_impl(const)).encode())
            const = jax.random.key_data(const)
        value = np.asarray(const)
        if value.dtype == object:
            return None
        digest.update(f"{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def _program_key(traced) -> Optional[str]:
    """The store's key of a traced program: its :func:`program_digest`, its argument and result trees,
    the options of the ``jit`` that traced it (donation, shardings, layouts, ``keep_unused``, compiler
    options: a donating executable served to a caller that asked for none deletes its arguments) and
    its environment; ``None`` for a program that is not stored."""
    import hashlib
    import re

    program = program_digest(traced.jaxpr)
    params = getattr(traced, "_params", None)
    if program is None or not isinstance(params, dict):
        return None
    options = repr(sorted((k, repr(v)) for k, v in params.items() if k not in ("jaxpr", "name")))
    if re.search(r" at 0x[0-9a-fA-F]+", options):  # an option known only by its address
        return None
    digest = hashlib.sha256()
    for part in (_environment_key(), program, options, traced.in_tree, traced.out_tree):
        digest.update(str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


_hits = None  # per thread: JAX cache hits seen while compile_traced compiles


def _count_hit(event: str, **kwargs) -> None:
    if event == "/jax/compilation_cache/cache_hits" and getattr(_hits, "count", None) is not None:
        _hits.count += 1


# A compile option that changes JAX's cache key and nothing XLA builds (it only affects dumps).
_AGAIN = {"xla_dump_large_constants": False}


def _compile(traced) -> tuple:
    """``(executable, fresh)``: lowered and compiled, and whether XLA built it here.

    An executable that JAX read back from its own cache does not serialise whole on a CPU (its
    kernels are missing when it is loaded again, and it fails only when run). After such a hit, for
    example for a program that a run before d3pext kept programs compiled, it is compiled once more
    under another JAX key; if that is a hit as well (the store lost its entry), it is used unstored.
    """
    global _hits
    if _hits is None:
        import threading

        import jax

        _hits = threading.local()
        jax.monitoring.register_event_listener(_count_hit)
    lowered = traced.lower()
    try:
        for options in (None, _AGAIN):
            _hits.count = 0
            with _without_jax_cache_writes():  # the store keeps it: no second copy in JAX's cache
                executable = lowered.compile(compiler_options=options)
            if _hits.count == 0:
                return executable, True
        return executable, False
    finally:
        _hits.count = None


def _without_jax_cache_writes():
    """A context in which JAX reads its cache but writes nothing to it (this thread only), where this
    JAX has the setting as a context manager; else no change."""
    import contextlib
    import math

    try:
        from jax._src import config as jax_config

        return jax_config.persistent_cache_min_compile_time_secs(math.inf)
    except Exception:
        return contextlib.nullcontext()


def _store(directory: Path, path: Path, payload: bytes) -> None:
    """Write ``path`` whole or not at all, then drop the least recently used other programs beyond
    :data:`PROGRAMS_MAX_SIZE`."""
    import hashlib
    import tempfile

    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(hashlib.sha256(payload).digest() + payload)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    entries = []
    for entry in directory.glob("*.xla"):
        try:
            stat = entry.stat()
        except OSError:  # removed by another process meanwhile
            continue
        entries.append((stat.st_mtime, stat.st_size, entry))
    total = sum(size for _, size, _ in entries)
    for _, size, entry in sorted(entries, key=lambda e: e[0]):
        if total <= PROGRAMS_MAX_SIZE:
            break
        if entry != path:  # the program just written stays, whatever its size
            entry.unlink(missing_ok=True)
            total -= size


def compile_traced(traced):
    """``traced.lower().compile()``; where :func:`enable_compile_cache` is on, the executable is kept
    by d3pext, keyed by the traced program, and read back in later processes without lowering.

    JAX's own cache keys a program by its lowered form, so a new process must trace and lower every
    program before it can look one up: for the demo's private fit that is more time than reading the
    executable back. Here the key is a digest of the printed jaxpr (every equation, its parameters and
    nested programs), the values of its constants, the argument types and tree structures, and the
    environment that turns a jaxpr into an executable: the JAX, jaxlib and Python versions, the backend
    and its devices, ``XLA_FLAGS``, JAX's configuration and d3pext's CPU lowering of Threefry. A
    lowering rule registered by your own code is not part of the key: after changing one, delete the
    ``d3pext-programs`` folder of the cache directory.

    Programs with host callbacks or side effects are never stored. An entry that cannot be read back
    (damaged, or from an incompatible build) is compiled again and replaced. A program stored here is
    not written to JAX's cache as well.

    >>> import jax, jax.numpy as jnp
    >>> compile_traced(jax.jit(jnp.sin).trace(jnp.zeros(3)))(jnp.zeros(3))
    Array([0., 0., 0.], dtype=float32)
    """
    directory = _programs_dir
    key = _program_key(traced) if directory is not None else None
    if key is None:
        return traced.lower().compile()
    import hashlib

    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    path = directory / f"{key}.xla"
    try:
        stored = path.read_bytes()
    except OSError:
        stored = None
    if stored is not None and hashlib.sha256(stored[32:]).digest() == stored[:32]:
        try:
            compiled = deserialize_and_load(stored[32:], traced.in_tree, traced.out_tree)
        except Exception:  # e.g. written by a build that cannot be told apart by the key
            compiled = None
        if compiled is not None:
            try:
                os.utime(path)  # the store evicts by modification time
            except OSError:
                pass
            return compiled
    compiled, fresh = _compile(traced)
    if not fresh:
        return compiled
    try:
        payload = serialize(compiled)[0]
    except Exception:  # a program JAX cannot serialise (e.g. with constants passed as arguments): not kept
        return compiled
    try:
        _store(directory, path, payload)
    except OSError as e:  # a full disk or a read-only directory costs the next process a compile, no more
        warnings.warn(f"d3pext could not store a compiled program in {directory}: {e}", RuntimeWarning, stacklevel=2)
    return compiled


class _CachedJit:
    """``jax.jit(fun)`` whose executables go through :func:`compile_traced` where the program store is on
    (one device, arguments on it, called outside any trace); elsewhere it is ``jax.jit(fun)`` itself."""

    def __init__(self, fun, **jit_kwargs):
        import jax

        self._jit = jax.jit(fun, **jit_kwargs)
        self._compiled = {}

    def __call__(self, *args):
        import jax

        if _programs_dir is None or jax.config.jax_disable_jit:
            return self._jit(*args)
        leaves, treedef = jax.tree.flatten(args)
        device = jax.devices()[0]
        for leaf in leaves:
            if isinstance(leaf, jax.core.Tracer) or (
                isinstance(leaf, jax.Array) and (leaf.committed and leaf.sharding.device_set != {device})
            ):
                return self._jit(*args)
        # with JAX's configuration, as jit's own cache: a ``with jax.default_matmul_precision(...)``
        # block or another default device builds another program
        signature = (treedef, tuple(jax.typeof(leaf) for leaf in leaves), tuple(jax.config.values.items()))
        try:
            compiled = self._compiled.get(signature)
        except TypeError:  # a configuration value that cannot be hashed
            return self._jit(*args)
        if compiled is None:
            compiled = self._compiled[signature] = compile_traced(self._jit.trace(*args))
        return compiled(*args)

    def trace(self, *args, **kwargs):
        return self._jit.trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jit.lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Executables held, jit's and the store's (as ``jax.jit(...)._cache_size``)."""
        return self._jit._cache_size() + len(self._compiled)


def cached_jit(fun, **jit_kwargs) -> _CachedJit:
    """``jax.jit(fun, **jit_kwargs)``, its programs kept by d3pext across processes where
    :func:`enable_compile_cache` is on (see :func:`compile_traced`).

    >>> import jax.numpy as jnp
    >>> cached_jit(lambda x: 2.0 * x)(jnp.ones(2))
    Array([2., 2.], dtype=float32)
    """
    return _CachedJit(fun, **jit_kwargs)
