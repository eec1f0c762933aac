"""No import circle among kvbridge's modules and its plugins' modules; the library never imports its tools.

Read statically with `ast` (nothing is imported, so optional dependencies need not be installed),
from the installed packages: kvbridge and every top-level `kvbridge_*` package on the path (the
plugins' distributions). Every import counts, a function-level one too (a lazy import hides a
circle, it does not remove it), and one under `if TYPE_CHECKING:` too (a circle of types is still a circle: the
two modules cannot be read apart). Importing `a.b.c` is an edge to `a.b.c` alone, not to the packages above it,
as import linters count it.
"""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import kvbridge


def _packages() -> dict[str, Path]:
    roots = {"kvbridge": Path(kvbridge.__file__).parent}
    for found in pkgutil.iter_modules():
        if found.name.startswith("kvbridge_") and found.ispkg:
            spec = importlib.util.find_spec(found.name)
            if spec is not None and spec.submodule_search_locations:
                roots[found.name] = Path(next(iter(spec.submodule_search_locations)))
    return roots


def _modules(roots: dict[str, Path]) -> dict[str, Path]:
    modules = {}
    for top, root in roots.items():
        for path in root.rglob("*.py"):
            parts = [top, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` imports the module a.b where there is one, else a name from a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules(_packages())
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component (Tarjan, iterative), shortest path back to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_circle(graph, c) for c in components]


def _circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth-first inside the component: the shortest way back to `start`
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return [*paths[node], start]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"{component} is not strongly connected")


def test_the_graph_covers_kvbridge_and_its_plugins() -> None:
    graph = import_graph()
    assert {
        "kvbridge.plugin.registry",
        "kvbridge.transport.contract",
        "kvbridge_mooncake.plugin",
        "kvbridge_cuda.plugin",
    } <= set(graph)
    assert "kvbridge_tools.bench.pair" in graph  # the tools are read too (their circles count)
    assert "kvbridge.plugin.hookspecs" in graph["kvbridge.plugin.builtins"]  # edges are read
    assert "kvbridge.transport.tcp" in graph["kvbridge.plugin.builtins"]  # a function-level import counts


def test_cycle_finder_finds_a_planted_circle() -> None:
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving the shared piece down a layer):\n" + "\n".join(
        " -> ".join(c) for c in found
    )


def tools_references(path: Path) -> list[str]:
    """Where a module names `kvbridge_tools` as code: an import (lazy ones too) or a string naming one of its modules.

    Such a string is `importlib.import_module("kvbridge_tools...")`'s, or a child process's `-m`.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        found += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "kvbridge_tools"]
    return found


def test_tools_references_are_found(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import kvbridge.transport.contract\n"
        "def f():\n"
        "    from kvbridge_tools.bench import pair\n"
        "    return importlib.import_module('kvbridge_tools.cli.bench')\n"
        '"""kvbridge_tools in a sentence is prose"""\n'
    )
    assert tools_references(planted) == [
        "planted.py:3: kvbridge_tools.bench",
        "planted.py:4: kvbridge_tools.cli.bench",
    ]


def test_the_library_never_imports_its_tools() -> None:
    """`pip install kvbridge` works without kvbridge-tools: the CLI finds the tools' subcommands by entry point."""
    root = Path(kvbridge.__file__).parent
    found = [ref for path in sorted(root.rglob("*.py")) for ref in tools_references(path)]
    assert not found, "kvbridge imports kvbridge_tools (move the shared piece into kvbridge):\n" + "\n".join(found)
