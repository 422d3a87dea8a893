"""The package's layers: each imports only the layers below it, and no module imports itself back.

    core < data < methods < studies < exercises < top (benchmark, notebook, viz, train_distributed)

Every `import` and `from ... import` in course_lib counts, at module level or inside a function (a
function-level import still ties the two modules together), relative ones resolved. The graph is
read from the source (ast), so the test needs no import to succeed and names the line at fault.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "course_lib"
# lowest first; anything else is the top
LAYERS = ("core", "data", "methods", "studies", "exercises")
TOP = len(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """0 for course_lib.core..., 1 for data, ...; TOP for course_lib's own top-level modules."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else TOP


def imports_of(path: Path, modules: set[str]) -> list[tuple[str, int]]:
    """(imported course_lib module, line) for every import in the file, relative ones resolved;
    `from package import name` counts as importing package.name when that is a module."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.append((child if child in modules else source, node.lineno))
    return [(name, line) for name, line in found
            if name == "course_lib" or name.startswith("course_lib.")]


@pytest.fixture(scope="module")
def graph() -> dict[str, list[tuple[str, int]]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(files)) for name, path in files.items()}


def test_every_module_sits_in_a_layer_package_or_on_top(graph):
    loose = [m for m in graph if layer_of(m) == TOP and m.count(".") > 1]
    assert not loose, f"modules in a package that is not a layer {LAYERS}: {loose}"


def test_no_import_reaches_a_higher_layer(graph):
    upward = [f"{m} (layer {LAYERS[layer_of(m)] if layer_of(m) < TOP else 'top'}) line {line} "
              f"imports {target}"
              for m, targets in graph.items() for target, line in targets
              if target != "course_lib" and layer_of(target) > layer_of(m)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_no_import_cycle(graph):
    edges = {m: sorted({t for t, _ in targets if t in graph and t != m})
             for m, targets in graph.items()}
    # a package's __init__ is imported with each of its modules: an edge into the package is not a
    # cycle by itself, so only module-to-module edges count (course_lib itself imports nothing)
    state, cycles = {}, []

    def visit(node, path):
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_imports_of_every_kind(tmp_path):
    """The walker resolves relative imports and finds function-level ones (a test that cannot fail
    is no test: here a planted upward import and a planted cycle must be reported)."""
    root = tmp_path / "course_lib"
    for folder in ("core", "methods"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "core" / "a.py").write_text("def f():\n    from ..methods import b\n")
    (root / "methods" / "b.py").write_text("from course_lib.core.a import f\n")
    modules = {"course_lib.core.a", "course_lib.methods.b", "course_lib.core", "course_lib.methods"}
    global PACKAGE
    saved, PACKAGE = PACKAGE, root
    try:
        assert imports_of(root / "core" / "a.py", modules) == [("course_lib.methods.b", 2)]
        assert imports_of(root / "methods" / "b.py", modules) == [("course_lib.core.a", 1)]
        assert layer_of("course_lib.methods.b") > layer_of("course_lib.core.a")
    finally:
        PACKAGE = saved


def test_only_the_core_calls_backward():
    """One training loop: every gradient step is the Trainer's (core.train) or a core primitive's,
    so no method, study or script has a loop of its own (`.backward()` outside course_lib/core)."""
    outside = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "backward"):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert outside == [], f".backward() outside course_lib/core: {outside}"


def test_every_module_imports():
    """Every module of the package imports, the ones no test or notebook reaches included."""
    import importlib
    import pkgutil

    import course_lib

    names = [info.name for info in pkgutil.walk_packages(course_lib.__path__, prefix="course_lib.")]
    for name in names:
        importlib.import_module(name)
    assert len(names) > 100
