"""The import graph between pylon's modules, read from the source (the AST; nothing is imported).

Every import counts, wherever it sits: at the top of a module, inside a function (a lazy import
still ties the two modules together) and under `if TYPE_CHECKING:` (a reader, and mypy, follow
it all the same). An edge goes to each imported name that is a pylon module, so
`from pylon.routing import build` and `import pylon.routing.build` both point at
`pylon.routing.build`; relative imports are resolved against the importing module's package.

    python scripts/import_graph.py                       # the cycles; exit 1 when there is one
    python scripts/import_graph.py --edges               # every edge, `importer -> imported`
    python scripts/import_graph.py --importers-of pylon.settings.Settings

`--importers-of NAME` lists the modules that import NAME (a module, or a name in one), e.g. to
check that only the assembly layer reads Settings. `--root DIR` reads another checkout.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PACKAGE = "pylon"

Graph = Mapping[str, frozenset[str]]


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of `package` under `root`, by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Each dotted name `module` imports: `a.b` for `import a.b`, and both `a.b` and `a.b.c`
    for `from a.b import c` (c may be a module or a name in one)."""
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(root: Path) -> dict[str, frozenset[str]]:
    """Each pylon module -> the pylon modules it imports (itself excluded)."""
    modules = module_files(root)
    return {
        module: frozenset(
            name for name in imported_names(module, path) if name in modules and name != module
        )
        for module, path in modules.items()
    }


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    as one concrete cycle through its first module, `a -> ... -> a`. (A few hundred modules
    at most: the recursion stays shallow.)"""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:  # `node` roots a component: the stack down to it
            component = set(stack[stack.index(node) :])
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(_one_cycle(graph, component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _one_cycle(graph: Graph, component: set[str]) -> list[str]:
    """The shortest way from the component's first module back to itself, inside it."""
    first = min(component)
    came_from: dict[str, str] = {}
    queue = deque([first])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & component):
            if nxt == first:
                path = [node]
                while path[-1] != first:
                    path.append(came_from[path[-1]])
                return [*reversed(path), first]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    raise AssertionError(f"no cycle through {first} in its own component")


def importers_of(root: Path, name: str) -> list[str]:
    """The pylon modules that import `name` (a module, or a name in one)."""
    return sorted(
        module
        for module, path in module_files(root).items()
        if module != name and name in set(imported_names(module, path))
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--edges", action="store_true", help="print every edge")
    parser.add_argument("--importers-of", metavar="NAME", help="who imports NAME")
    args = parser.parse_args(argv)
    if args.importers_of:
        print("\n".join(importers_of(args.root, args.importers_of)))
        return 0
    graph = import_graph(args.root)
    if args.edges:
        for module in sorted(graph):
            for imported in sorted(graph[module]):
                print(f"{module} -> {imported}")
        return 0
    found = cycles(graph)
    for cycle in found:
        print("import cycle: " + " -> ".join(cycle))
    if found:
        return 1
    print(f"no import cycle between the {len(graph)} {PACKAGE} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main())
