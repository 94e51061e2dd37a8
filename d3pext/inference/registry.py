"""The backend registry: which inference a method runs for which privatized model.

A *backend* turns a privatized model into an inference. There are two kinds:

- ``"kernel"``: ``build(private_model, options) -> MCMCKernel``, given the concrete
  :class:`~d3pext.inference.structure.PrivateModel`; it raises
  :class:`~d3pext.inference.structure.NotApplicable` with a reason when the model is outside its
  reach, and the next backend of the method is tried. The result runs as an ordinary
  ``numpyro.infer.MCMC``.
- ``"estimator"``: ``build(model, data, **options)`` returns a fitted estimator with
  ``.run(rng_key, *model_args)`` (simulation-based SPPE/SPLE).

:data:`BUILTIN_BACKENDS` is the one ordered table of the built-in backends: within a method the
first that applies wins. Each is named by ``"module:function"`` and imported on first use, so
``import d3pext`` stays cheap and optional dependencies (flowjax) load only when asked for.
:func:`register_backend` adds a user's backend after the built-in ones (or replaces a backend of
the same name in place).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import importlib
from typing import Any, Literal

from d3pext.inference.structure import NotApplicable, PrivateModel

__all__ = [
    "BUILTIN_BACKENDS",
    "Backend",
    "available_methods",
    "backends",
    "build_kernel",
    "method_kind",
    "register_backend",
    "select_backend",
    "unregister_backend",
]

Kind = Literal["kernel", "estimator"]


@dataclass(frozen=True)
class Backend:
    """One registered backend.

    :param method: the method it implements (``"gibbs"``, ``"naive"``, ...).
    :param name: its name, unique within the method.
    :param target: the builder, or ``"module:function"`` naming it (imported on first use).
    :param kind: ``"kernel"`` or ``"estimator"`` (see the module docstring).
    """

    method: str
    name: str
    target: Callable | str
    kind: Kind = "kernel"

    @property
    def build(self) -> Callable:
        if callable(self.target):
            return self.target
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


def _builtin(method: str, name: str, target: str, kind: Kind = "kernel") -> Backend:
    return Backend(method, name, f"d3pext.{target}", kind)


BUILTIN_BACKENDS: tuple[Backend, ...] = (
    _builtin("gibbs", "bernstein-sheldon", "inference.expfam_backend:bernstein_sheldon_kernel"),
    _builtin("gibbs", "kazan-reiter", "inference.bounded:kazan_reiter_kernel"),
    _builtin("gibbs", "schein-bessel", "inference.counts:schein_bessel_kernel"),
    _builtin("gibbs", "bernstein-sheldon-regression", "inference.regression:regression_kernel"),
    _builtin("naive", "exponential-family", "inference.expfam_backend:naive_kernel"),
    _builtin("naive", "kazan-reiter", "inference.bounded:naive_bounded_kernel"),
    _builtin("naive", "truncated-counts", "inference.counts:truncated_counts_kernel"),
    _builtin("naive", "bernstein-sheldon-regression", "inference.regression:naive_regression_kernel"),
    _builtin("clt", "normal-approximation", "inference.expfam_backend:clt_kernel"),
    _builtin("sppe", "sppe", "simulation.sbi:SPPE", "estimator"),
    _builtin("sple", "sple", "simulation.sbi:SPLE", "estimator"),
)
"""The built-in backends, in priority order within each method."""

_REGISTRY: dict[str, list[Backend]] = {}
for _backend in BUILTIN_BACKENDS:
    _REGISTRY.setdefault(_backend.method, []).append(_backend)
del _backend


def register_backend(
    method: str, name: str | None = None, *, kind: Kind = "kernel"
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as a backend of ``method``, tried after the ones already there.

    Registering a name again replaces that backend in place. All backends of a method are of
    one kind.

    >>> @register_backend("my-method")
    ... def my_backend(private_model, options):
    ...     raise NotApplicable("covers nothing yet")
    >>> "my-method" in available_methods()
    True
    >>> unregister_backend("my-method", "my_backend")
    """
    if kind not in ("kernel", "estimator"):
        raise ValueError(f"kind must be 'kernel' or 'estimator', got {kind!r}.")

    def decorator(fn: Callable) -> Callable:
        entries = _REGISTRY.setdefault(method, [])
        if entries and entries[0].kind != kind:
            raise ValueError(
                f"method {method!r} has {entries[0].kind} backends; a {kind} backend cannot join it."
            )
        backend = Backend(method, name or fn.__name__, fn, kind)
        names = [b.name for b in entries]
        if backend.name in names:
            entries[names.index(backend.name)] = backend
        else:
            entries.append(backend)
        return fn

    return decorator


def unregister_backend(method: str, name: str) -> None:
    """Remove a backend (a method left without backends is removed too)."""
    entries = _REGISTRY.get(method, [])
    _REGISTRY[method] = [b for b in entries if b.name != name]
    if not _REGISTRY[method]:
        del _REGISTRY[method]


def available_methods() -> tuple[str, ...]:
    """The methods with at least one backend."""
    return tuple(_REGISTRY)


def backends(method: str) -> tuple[Backend, ...]:
    """The backends of ``method`` in priority order; ``ValueError`` for an unknown method."""
    if method not in _REGISTRY:
        raise ValueError(f"Unknown method {method!r}; registered methods: {available_methods()}.")
    return tuple(_REGISTRY[method])


def method_kind(method: str) -> Kind:
    """``"kernel"`` or ``"estimator"``: what the backends of ``method`` build."""
    return backends(method)[0].kind


def build_kernel(pm: PrivateModel, method: str, options: dict | None = None) -> Any:
    """The kernel of the first backend of ``method`` that covers ``pm``."""
    return select_backend(pm, method, options)[1]


def select_backend(pm: PrivateModel, method: str, options: dict | None = None) -> tuple[Backend, Any]:
    """The first backend of ``method`` that covers ``pm``, and the kernel it builds."""
    options = dict(options or {})
    reasons = []
    for backend in backends(method):
        try:
            return backend, backend.build(pm, options)
        except NotApplicable as e:
            reasons.append(f"{backend.name}: {e}")
    raise ValueError(
        f"No augmentation registered for method {method!r} covers this model:\n  " + "\n  ".join(reasons)
    )
