"""The package's layering, read from its imports (``ast``; nothing is imported).

Dependencies point one way: accountants <- engine <- handlers <- models <- CLI. The engine
never imports the front door (handlers, models), not even inside a function; no module imports
another module's underscore names; module-level imports have no cycles.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> package, as pyproject's package-dir maps them
FOLDERS = {
    "d3pext": ROOT / "d3pext",
    "d3pext.handlers": ROOT / "handlers",
    "d3pext.models": ROOT / "models",
    "d3pext.accountants": ROOT / "accountants",
}
# layer of each top package prefix; a module may import its own layer or lower ones
BASE = {"d3pext.validation", "d3pext.dtypes"}
LAYERS = {"accountants": 1, "engine": 2, "handlers": 3, "models": 4, "cli": 5}


def _modules() -> dict[str, Path]:
    modules = {}
    for package, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _layer(module: str) -> int:
    if module in BASE:
        return 0
    for prefix, layer in (
        ("d3pext.accountants", "accountants"), ("d3pext.handlers", "handlers"),
        ("d3pext.models", "models"), ("d3pext.cli", "cli"), ("d3pext.__main__", "cli"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[layer]
    if module == "d3pext":  # the lazy front package names everything, imports nothing at load
        return LAYERS["cli"]
    return LAYERS["engine"]


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, bool, int]]:
    """``(imported module, imported name or None, at module level, line)`` for d3pext imports."""
    tree = ast.parse(MODULES[module].read_text())
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, id(node) in top, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in MODULES:  # "from package import submodule"
                    found.append((sub, None, id(node) in top, node.lineno))
                else:
                    found.append((target, a.name, id(node) in top, node.lineno))
    return [f for f in found if f[0] == "d3pext" or f[0].startswith("d3pext.")]


def test_module_map_sees_the_package():
    assert {"d3pext.training.svi", "d3pext.handlers.privatize", "d3pext.accountants.ledger",
            "d3pext.models.logistic", "d3pext.inference.registry"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    layer = _layer(module)
    upward = [
        f"line {line}: {target}" for target, _, _, line in _imports(module)
        if target != "d3pext" and _layer(target) > layer
    ]
    assert not upward, f"{module} (layer {layer}) imports from a higher layer: {upward}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_underscore_names_across_modules(module):
    private = [
        f"line {line}: {target}.{name}" for target, name, _, line in _imports(module)
        if name is not None and name.startswith("_") and target != module
    ]
    assert not private, f"{module} imports private names of other modules: {private}"


def test_no_import_cycles():
    graph = {m: {t for t, _, top, _ in _imports(m) if top and t in MODULES and t != m} for m in MODULES}
    # a package's __init__ importing its own submodules is not a cycle of the code
    for m in graph:
        graph[m] = {t for t in graph[m] if not (MODULES[m].name == "__init__.py" and t.startswith(m + "."))}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_checker_catches_violations(tmp_path, monkeypatch):
    # the checks have teeth: an engine module that imports the front door and a private name
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from d3pext.handlers.posterior import _x\n")
    monkeypatch.setitem(MODULES, "d3pext.inference.bad", bad)
    with pytest.raises(AssertionError, match="higher layer"):
        test_imports_point_down("d3pext.inference.bad")
    with pytest.raises(AssertionError, match="private names"):
        test_no_underscore_names_across_modules("d3pext.inference.bad")
