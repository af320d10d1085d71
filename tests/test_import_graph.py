"""The import graph of draftline/ and benchmarks/, read from the source with ast: it has no cycle, and the library
imports neither Prefect nor anything that stands above it (tasks, flows, infra, benchmarks, tests).

Every import statement counts, wherever it stands (module level, inside a function, under `if TYPE_CHECKING:`):
a cycle through an import inside a function still breaks when that function first runs on a half-imported module.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("draftline", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for source in SOURCES for p in sorted((ROOT / source).rglob("*.py"))}


def imported_names(tree: ast.AST, module: str, is_package: bool, script_dir: str | None) -> list[str]:
    """Every dotted name an import in `tree` may load, relative imports made absolute. `from x import y` gives
    both x and x.y (y may be a submodule). A script's sibling files (benchmarks/ runs its files as scripts, so
    their folder is first on sys.path) are named with the folder's prefix: `import decode` there is benchmarks.decode."""
    names: list[str] = []

    def absolute(name: str) -> list[str]:
        # Both readings: which one exists is decided against the known modules later.
        return [f"{script_dir}.{name}", name] if script_dir else [name]

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names += absolute(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                bases = [f"{package}.{node.module}" if node.module else package]
            else:
                bases = absolute(node.module)
            for base in bases:
                names.append(base)
                names += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, list[str]]]:
    """(edges between our modules, every dotted name each module imports). An import of a.b.c runs the packages
    a and a.b first, so those count as well, except the importer's own enclosing packages (already importing)."""
    modules = source_modules()
    edges: dict[str, set[str]] = {}
    names: dict[str, list[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        # benchmarks/ and benchmarks/probes/ are folders of scripts, not packages.
        script_dir = None if (path.parent / "__init__.py").is_file() else module_name(path.parent / "__init__.py")
        tree = ast.parse(path.read_text(), filename=str(path))
        names[module] = imported_names(tree, module, is_package, script_dir)
        own_packages = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        targets: set[str] = set()
        for name in names[module]:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in modules and prefix not in own_packages and prefix != module:
                    targets.add(prefix)
        edges[module] = targets
    return edges, names


def find_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) for every strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(root: str) -> None:
        # Tarjan's algorithm, iterative: a long chain of imports cannot reach Python's recursion limit.
        work = [(root, iter(sorted(edges.get(root, ()))))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return [_cycle_in(group, edges) for group in groups]


def _cycle_in(group: list[str], edges: dict[str, set[str]]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start, members = group[0], set(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle in the strongly connected group {group}")


def test_the_graph_reader_sees_every_kind_of_import():
    source = """
import a.b
from . import sibling
from ..pkg import thing as alias
from x.y import z, w

def lazy():
    from benchmarks.extract_vllm import bench_vllm
"""
    names = imported_names(ast.parse(source), "draftline.sub.mod", False, None)
    assert {"a.b", "draftline.sub", "draftline.sub.sibling", "draftline.pkg", "draftline.pkg.thing", "x.y",
            "x.y.z", "x.y.w", "benchmarks.extract_vllm", "benchmarks.extract_vllm.bench_vllm"} == set(names)
    assert "benchmarks.decode" in imported_names(ast.parse("from decode import measure"), "benchmarks.eval_gpu",
                                                 False, "benchmarks")
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_in_draftline_or_benchmarks():
    edges, _ = import_graph()
    assert "draftline.extract" in edges and "benchmarks.extract" in edges, "the graph missed the source folders"
    cycles = find_cycles(edges)
    assert not cycles, "import cycles (move what the modules share into a module of its own):\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_the_library_never_imports_prefect():
    _, names = import_graph()
    offenders = sorted(
        f"{module} imports {name}" for module, imported in names.items() if module.split(".")[0] == "draftline"
        for name in imported if name.split(".")[0] == "prefect" or name.startswith("prefect_")
    )
    assert not offenders, "draftline/ is the library below Prefect's tasks and flows:\n" + "\n".join(offenders)


def test_the_library_imports_nothing_above_it():
    _, names = import_graph()
    above = {"tasks", "flows", "infra", "benchmarks", "tests"}
    offenders = sorted(
        f"{module} imports {name}" for module, imported in names.items() if module.split(".")[0] == "draftline"
        for name in imported if name.split(".")[0] in above
    )
    assert not offenders, ("imports go one way, flows -> tasks -> draftline (infra and benchmarks may import "
                           "draftline, never the reverse):\n" + "\n".join(offenders))
