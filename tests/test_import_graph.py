"""The package's modules import each other one way only: no import cycle, lazy imports inside functions
included (a cycle that only a lazy import closes still ties the two modules together).

Read from the source with :mod:`ast`, nothing imported: an edge is any ``import`` or ``from ... import``
of a module of the package, at module level, in a function or under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

from tests.conftest import REPO

PACKAGE = "p2p_diloco"


def module_files() -> dict[str, Path]:
    """Each module of the package by dotted name (a package by its ``__init__.py``)."""
    modules = {}
    for path in (REPO / PACKAGE).rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def package_module(name: str, modules: dict[str, Path]) -> Optional[str]:
    """The package's module that importing `name` loads: `name` itself, or the module it is an attribute of."""
    while name not in modules:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """What `node`, in `module`, imports: dotted names, relative ones made absolute."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [source] + [f"{source}.{alias.name}" for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported_names(node, module, path.name == "__init__.py"):
                    target = package_module(name, modules)
                    if target is not None and target != module:
                        edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


GRAPH = import_graph()


def test_the_graph_sees_imports_at_module_level_and_in_functions():
    assert "p2p_diloco.config" in GRAPH["p2p_diloco.train.model"]  # module level
    assert "p2p_diloco.hub_publish" in GRAPH["p2p_diloco.export"]  # in run_export
    assert "p2p_diloco.run_page.server" in GRAPH["p2p_diloco.status_command"]  # in serve_status
    assert "p2p_diloco.run_page.history" in GRAPH["p2p_diloco.run_page.server"]


def test_the_package_has_no_import_cycle():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(
        " <-> ".join(component) + "\n" + "\n".join(f"    {m} -> {sorted(GRAPH[m] & set(component))}" for m in component)
        for component in found)


@pytest.mark.parametrize("one, other", [
    ("p2p_diloco.status_command", "p2p_diloco.node_runner"),
    ("p2p_diloco.status_command", "p2p_diloco.run_page.server"),
    ("p2p_diloco.export", "p2p_diloco.hub_publish"),
    ("p2p_diloco.train.data", "p2p_diloco.train.model"),
])
def test_one_way_only(one, other):
    assert not (other in reachable(GRAPH, one) and one in reachable(GRAPH, other)), f"{one} and {other} import each other"


def test_the_run_page_does_not_import_a_command():
    page = [module for module in GRAPH if module.startswith("p2p_diloco.run_page")]
    assert page
    for module in page:
        reached = reachable(GRAPH, module)
        assert "p2p_diloco.status_command" not in reached, module
        assert "p2p_diloco.node_runner" not in reached, module
