"""No class over 400 lines and no function over 80 in the library and the proxy; the tools' exceptions are listed.

A class or function past these sizes holds more than one job (docs/architecture.md). Read statically with `ast`;
a nested function or class counts on its own and inside its parent. kvbridge-tools (benches, chaos, the harness)
is exempt, but each of its oversized pieces is named below with its size, so that one that grows, or a new one,
is seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvbridge
import kvbridge_proxy
import kvbridge_tools

CLASS_LINES, FUNCTION_LINES = 400, 80

# kvbridge-tools' pieces over the limits: "module path:qualified name" -> lines at most
TOOLS_OVERSIZED = {
    "bench/connector.py:ConnectorBench.run": 202,
    "bench/connector_rank.py:Rank.setup": 112,
    "bench/pair.py:_measure": 158,
    "bench/vllm_idle.py:run": 88,
    "bench/vllm_layerwise.py:run": 134,
}


def oversized(root: Path) -> Iterator[tuple[str, int]]:
    """("path:qualified name", lines) of each class over CLASS_LINES and function over FUNCTION_LINES under `root`."""

    def visit(node: ast.AST, path: str, prefix: str) -> Iterator[tuple[str, int]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                limit = CLASS_LINES if isinstance(child, ast.ClassDef) else FUNCTION_LINES
                name = prefix + child.name
                if lines > limit:
                    yield f"{path}:{name}", lines
                yield from visit(child, path, name + ".")
            else:
                yield from visit(child, path, prefix)

    for file in sorted(root.rglob("*.py")):
        yield from visit(ast.parse(file.read_text(), str(file)), file.relative_to(root).as_posix(), "")


def test_no_class_or_function_of_the_library_or_the_proxy_is_oversized() -> None:
    found = [
        f"{pkg.__name__}/{where}: {lines} lines"
        for pkg in (kvbridge, kvbridge_proxy)
        for where, lines in oversized(Path(pkg.__file__).parent)
    ]
    assert not found, (
        f"over {CLASS_LINES} lines a class or {FUNCTION_LINES} a function: split each into parts with one job:\n"
        + "\n".join(found)
    )


def test_the_tools_oversized_pieces_are_the_listed_ones_and_grow_no_more() -> None:
    found = dict(oversized(Path(kvbridge_tools.__file__).parent))
    grown = {k: (v, TOOLS_OVERSIZED.get(k)) for k, v in found.items() if v > TOOLS_OVERSIZED.get(k, 0)}
    gone = sorted(set(TOOLS_OVERSIZED) - set(found))
    assert not grown, f"kvbridge_tools pieces (lines, listed) new or grown past the list in {__file__}: {grown}"
    assert not gone, f"no longer oversized, take them off TOOLS_OVERSIZED in {__file__}: {gone}"


def test_the_size_check_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"class A:\n    def f(self):\n{body.replace('    ', '        ')}\n")
    assert list(oversized(tmp_path)) == [("m.py:A.f", FUNCTION_LINES + 1)]
