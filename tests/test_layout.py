"""The source tree keeps the shape docs/design.md describes: no file-to-file import cycle (imports
inside functions count), no source file over 550 lines outside tests/ and the generated gRPC stubs,
and the product imports none of its benchmarks (no Ray, no server)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("verifiers", "actors", "cluster", "protos", "benchmarks", "models")
GENERATED = {"protos/specserve_pb2.py", "protos/specserve_pb2_grpc.py", "protos/specserve_pb2.pyi"}
MAX_LINES = 550


def source_files() -> list[pathlib.Path]:
    """Every Python file of the packages, generated stubs left out."""
    files = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() not in GENERATED:
                files.append(path)
    return files


def module_name(path: pathlib.Path) -> str:
    """``actors/model/batch.py`` -> ``actors.model.batch``; a package's ``__init__`` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (``from a.b import c`` counts ``a.b.c``
    when that is a module, else ``a.b``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (a package's own ``__init__`` edges left out)."""
    files = source_files()
    known = {module_name(path) for path in files}
    graph = {}
    for path in files:
        name = module_name(path)
        graph[name] = {other for other in imported_modules(path, known) if other != name and not name.startswith(other + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_files():
    assert cycles(import_graph()) == []


def test_no_source_file_over_550_lines():
    long_files = {}
    for path in source_files():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_LINES:
            long_files[path.relative_to(ROOT).as_posix()] = lines
    assert long_files == {}


def test_the_product_imports_no_benchmark():
    script = "import sys, cluster.cli; print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
    assert done.stdout.strip() == "[]"
