"""Writes the API reference pages (``docs/api/*.rst``) from the package itself.

Called by ``conf.py`` at every build, so that a new module or a new name in an ``__all__`` is
documented without editing the docs. Each page holds one subpackage: its docstring, a table of
the names it re-exports (linking to the module that defines each), and every module with the names
of its ``__all__`` (documented or not). Files are rewritten only when their content changes.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

# (page, heading, package); pages appear in this order, new subpackages after them.
SUBPACKAGES = [
    ("handlers", "Effect handlers", "d3pext.handlers"),
    ("releases", "Releases", "d3pext.releases"),
    ("training", "Private training", "d3pext.training"),
    ("inference", "Inference from releases", "d3pext.inference"),
    ("simulation", "Simulation-based inference", "d3pext.simulation"),
    ("distributions", "Distributions", "d3pext.distributions"),
    ("accountants", "Accountants", "d3pext.accountants"),
    ("models", "Models", "d3pext.models"),
]
# Modules shown first within their page (the rest follow alphabetically).
FIRST = {
    "d3pext.handlers": ["privatize", "posterior"],
    "d3pext.releases": ["mechanisms", "exact", "counts", "info"],
    "d3pext.training": ["svi", "clipping", "ghost", "minibatch", "noise"],
    "d3pext.inference": ["structure", "registry", "gibbs_base", "draws", "expfam_backend", "expfam_gibbs"],
    "d3pext.simulation": ["sbi", "flows", "rqmc", "abc"],
    "d3pext.accountants": ["fourier", "ledger"],
}
SKIP_MODULES = {"d3pext.__main__"}
MAX_VALUE_REPR = 80  # constants with a longer repr are shown without their value


def _title(text: str, char: str = "=") -> str:
    return f"{text}\n{char * len(text)}\n"


def _public_modules(package: str) -> list[str]:
    pkg = importlib.import_module(package)
    names = [m.name for m in pkgutil.iter_modules(pkg.__path__) if not m.name.startswith("_")]
    first = [n for n in FIRST.get(package, []) if n in names]
    return [f"{package}.{n}" for n in first + sorted(set(names) - set(first))]


def _defining_module(module: str, name: str) -> str | None:
    """The module (of the package) whose ``__all__`` lists ``name`` and that defines it."""
    obj = getattr(importlib.import_module(module), name)
    home = getattr(obj, "__module__", None)
    if isinstance(home, str) and home.startswith("d3pext") and (inspect.isclass(obj) or callable(obj)):
        if name in getattr(importlib.import_module(home), "__all__", [name]):
            return home
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):  # a constant re-exported by a package: find the submodule
        for sub in _public_modules(module):
            submod = importlib.import_module(sub)
            if name in getattr(submod, "__all__", []) and getattr(submod, name) is obj:
                return sub
    return None


def _module_block(module: str) -> list[str]:
    mod = importlib.import_module(module)
    out = [_title(f"``{module}``", "-")]
    names = getattr(mod, "__all__", None)
    if names is None:  # no __all__: autodoc's default (documented public members defined here)
        return out + [f".. automodule:: {module}\n"]
    own, data, elsewhere = [], [], []
    for name in names:
        obj = getattr(mod, name)
        if inspect.isclass(obj) or inspect.isroutine(obj) or callable(obj):
            home = _defining_module(module, name)
            (own if home in (None, module) else elsewhere).append((name, home))
        else:
            data.append(name)
    out.append(f".. automodule:: {module}\n   :no-members:\n")
    # one directive per name: documented or not, each is described exactly once
    for name, _ in own:
        obj = getattr(mod, name)
        if inspect.isclass(obj):
            directive = "autoclass"
        elif inspect.isroutine(obj) or inspect.isroutine(inspect.unwrap(obj)):
            directive = "autofunction"  # functions, also wrapped ones (jax.jit, functools.wraps)
        else:
            directive = "autodata"  # a callable instance
        out.append(f".. {directive}:: {module}.{name}\n")
    for name in data:
        value = repr(getattr(mod, name))
        out.append(f".. autodata:: {module}.{name}")
        if len(value) > MAX_VALUE_REPR or "\n" in value:
            out.append("   :no-value:")
        out.append("")
    if elsewhere:
        links = ", ".join(f":py:obj:`~{home}.{name}`" for name, home in elsewhere)
        out.append(f"Also importable from ``{module}``: {links}.\n")
    return out


def _package_page(heading: str, package: str) -> str:
    pkg = importlib.import_module(package)
    out = [_title(f"{heading}: ``{package}``"), f".. automodule:: {package}\n   :no-members:\n"]
    names = getattr(pkg, "__all__", None)
    if names:
        out += [
            ".. currentmodule:: None\n",
            _title(f"Names in ``{package}``", "-"),
            f"Importable as ``from {package} import ...``; each links to the module that defines it.\n",
            ".. autosummary::\n   :nosignatures:\n",
        ]
        out += [f"   ~{_defining_module(package, n) or package}.{n}" for n in names]
        out.append("")
    for module in _public_modules(package):
        out += _module_block(module)
    return "\n".join(out)


def _index_page(pages: list[str]) -> str:
    import d3pext

    out = [
        _title("API reference"),
        "Every public name: the top-level names of ``d3pext`` and the ``__all__`` of each module. The",
        "docstrings are the reference; the :doc:`guides <../guides/index>` show how the pieces fit.",
        "These pages are generated from the package at build time (``docs/_api.py``).\n",
        _title("Top-level names (``from d3pext import ...``)", "-"),
        "They import lazily (``import d3pext`` loads nothing heavy); each links to the module that",
        "defines it.\n",
        ".. autosummary::\n   :nosignatures:\n",
    ]
    out += [f"   ~{module}.{name}" for name, module in d3pext._LAZY.items()]
    out += [
        "",
        ".. autodata:: d3pext.MOVED_MODULES\n   :no-value:\n",
        "``d3pext.__version__`` is the version string (|release|).\n",
        _title("Modules", "-"),
        ".. toctree::\n   :maxdepth: 2\n",
    ]
    out += [f"   {p}" for p in pages]
    return "\n".join(out) + "\n"


def generate(docs: Path) -> None:
    api = docs / "api"
    api.mkdir(exist_ok=True)
    pages: dict[str, str] = {}
    known = {package for _, _, package in SUBPACKAGES}
    extra = [
        (name, name.capitalize(), f"d3pext.{name}")
        for _, name, ispkg in pkgutil.iter_modules(importlib.import_module("d3pext").__path__)
        if ispkg and not name.startswith("_") and f"d3pext.{name}" not in known
    ]
    for page, heading, package in SUBPACKAGES + extra:
        pages[page] = _package_page(heading, package)
    leaves = [
        f"d3pext.{m.name}"
        for m in pkgutil.iter_modules(importlib.import_module("d3pext").__path__)
        if not m.ispkg and not m.name.startswith("_") and f"d3pext.{m.name}" not in SKIP_MODULES
    ]
    if "d3pext.audit" in leaves:
        leaves.remove("d3pext.audit")
        pages["audit"] = "\n".join([_title("Privacy audits: ``d3pext.audit``")] + _module_block("d3pext.audit")[1:])
    pages["utilities"] = "\n".join(
        [_title("Other modules"), "Shared leaves of the engine and the ``d3pext`` command.\n"]
        + [line for m in sorted(leaves) for line in _module_block(m)]
    )
    pages["index"] = _index_page([p for p in pages if p != "index"])
    for page, text in pages.items():
        path = api / f"{page}.rst"
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    for stale in api.glob("*.rst"):
        if stale.stem not in pages:
            stale.unlink()
