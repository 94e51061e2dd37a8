"""Names of a package that import their module on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_attributes(package: str, table: Mapping[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps each name to the module that defines it.

    A name, once loaded, is stored in ``namespace`` (the package's ``globals()``), so later lookups do not
    come back here; a submodule is also reachable as an attribute before it was imported.
    """

    def __getattr__(name: str):
        if name in table:
            value = getattr(importlib.import_module(table[name]), name)
            namespace[name] = value
            return value
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"{package}.{name}":
                raise
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted([*namespace, *table])

    return __getattr__, __dir__
