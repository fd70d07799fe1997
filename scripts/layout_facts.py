"""Layout facts of the product code (issue 36, Borders): file sizes and the import graph.

Product files are the repository's ``.py`` files outside ``tests/`` (tracked, or new and
not ignored by git; every file below the root when it is no git checkout). The import
graph has one arrow per pair of product modules where the first imports the second,
read with ``ast``: module-level imports, type-only ones (under ``if TYPE_CHECKING:``) and
imports inside functions alike. ``from package import name`` points at
``package.name`` when that is a module, else at ``package``; a package's ``__init__``
is not counted as imported by its modules' imports (Python runs it first, but that is
no circle of the code's own making).

    python scripts/layout_facts.py          # the counts of the issue's closing note
    python scripts/layout_facts.py --json   # the same, for machines

tests/foundation/test_layout_limits.py runs the same functions: it fails on a product
file over ``MAX_LINES`` lines or on any import circle. Reads files only; imports none.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: the most lines a product file may have
MAX_LINES = 600


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` (both product modules); ``kind`` is where the first
    such import stands: "module", "type-only" (under TYPE_CHECKING) or "function"."""

    source: str
    target: str
    kind: str


def product_files(root: Path = REPO_ROOT) -> list[Path]:
    """The product ``.py`` files below ``root``, relative to it, sorted."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        paths = [Path(name) for name in listed]
    except (OSError, subprocess.CalledProcessError):  # no git, or no checkout
        paths = [
            path.relative_to(root)
            for path in root.rglob("*.py")
            if not any(part.startswith(".") for part in path.relative_to(root).parts)
        ]
    return sorted(
        {path for path in paths if path.parts[0] != "tests" and (root / path).is_file()},
        key=str,
    )


def line_count(path: Path) -> int:
    with open(path, "rb") as file:
        return sum(1 for _ in file)


def file_sizes(root: Path = REPO_ROOT) -> list[tuple[str, int]]:
    """(path, lines) of every product file, the largest first."""
    sizes = [(str(path), line_count(root / path)) for path in product_files(root)]
    return sorted(sizes, key=lambda item: (-item[1], item[0]))


def oversized_files(root: Path = REPO_ROOT, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    return [(path, lines) for path, lines in file_sizes(root) if lines > limit]


def module_name(path: Path) -> str:
    """``engine/engine_core.py`` -> ``engine.engine_core``; ``engine/__init__.py`` -> ``engine``."""
    parts = list(path.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement of ``tree`` with where it stands (see `Arrow.kind`)."""

    def visit(node: ast.AST, kind: str) -> Iterator[tuple[ast.Import | ast.ImportFrom, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, kind
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from visit(child, "function")
            elif isinstance(child, ast.If) and kind == "module" and _is_type_checking(child.test):
                for statement in child.body:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), "type-only")
                for statement in child.orelse:
                    yield from visit(ast.Module(body=[statement], type_ignores=[]), kind)
            else:
                yield from visit(child, kind)

    yield from visit(tree, "module")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]
) -> Iterator[str]:
    """The product modules one import statement of ``module`` reaches."""

    def known(name: str) -> str | None:  # the longest prefix of ``name`` that is a module
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            candidate = ".".join(parts[:end])
            if candidate in modules:
                return candidate
        return None

    if isinstance(node, ast.Import):
        for alias in node.names:
            target = known(alias.name)
            if target is not None:
                yield target
        return
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        target = known(f"{source}.{alias.name}") if alias.name != "*" else None
        target = target or known(source)
        if target is not None:
            yield target


def import_arrows(root: Path = REPO_ROOT) -> list[Arrow]:
    """One arrow per (importer, imported) pair of product modules, self-imports left out."""
    files = product_files(root)
    modules = {module_name(path) for path in files}
    arrows: dict[tuple[str, str], Arrow] = {}
    order = {"module": 0, "type-only": 1, "function": 2}
    for path in files:
        module = module_name(path)
        tree = ast.parse((root / path).read_text(), filename=str(path))
        for node, kind in _imports(tree):
            for target in _targets(node, module, path.name == "__init__.py", modules):
                if target == module:
                    continue
                known = arrows.get((module, target))
                if known is None or order[kind] < order[known.kind]:
                    arrows[(module, target)] = Arrow(module, target, kind)
    return sorted(arrows.values(), key=lambda a: (a.source, a.target))


def import_circles(arrows: list[Arrow]) -> list[list[Arrow]]:
    """One circle per strongly connected group of modules (a shortest one through the
    group's first module by name), as the arrows that close it; none when the graph has
    no cycle."""
    graph: dict[str, list[str]] = {}
    for arrow in arrows:
        graph.setdefault(arrow.source, []).append(arrow.target)
        graph.setdefault(arrow.target, [])
    by_pair = {(a.source, a.target): a for a in arrows}
    circles = []
    for group in _strongly_connected(graph):
        if len(group) < 2:
            continue
        start = min(group)
        path = _shortest_path_back(graph, start, set(group))
        circles.append([by_pair[(a, b)] for a, b in zip(path, path[1:], strict=False)])
    return sorted(circles, key=lambda circle: circle[0].source)


def _strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, without recursion."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
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
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                groups.append(sorted(group))
    return groups


def _shortest_path_back(graph: dict[str, list[str]], start: str, group: set[str]) -> list[str]:
    """start -> ... -> start inside ``group`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child not in group:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected group but reaches no way back")


def describe_circle(circle: list[Arrow]) -> str:
    """``a -> b (type-only) -> a``: each arrow's kind when it is not a module-level import."""
    text = circle[0].source
    for arrow in circle:
        text += " -> " + arrow.target + ("" if arrow.kind == "module" else f" ({arrow.kind})")
    return text


def arrows_between(arrows: list[Arrow], source_package: str, target_package: str) -> list[Arrow]:
    def inside(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    return [a for a in arrows if inside(a.source, source_package) and inside(a.target, target_package)]


def facts(root: Path = REPO_ROOT, largest: int = 10) -> dict:
    arrows = import_arrows(root)
    circles = import_circles(arrows)
    sizes = file_sizes(root)
    return {
        "max_lines": MAX_LINES,
        "num_product_files": len(sizes),
        "num_import_arrows": len(arrows),
        "engine_to_connector_arrows": [
            f"{a.source} -> {a.target}" for a in arrows_between(arrows, "engine", "connector")
        ],
        "connector_to_engine_arrows": [
            f"{a.source} -> {a.target}" for a in arrows_between(arrows, "connector", "engine")
        ],
        "import_circles": [describe_circle(circle) for circle in circles],
        "files_over_max_lines": [{"path": p, "lines": n} for p, n in sizes if n > MAX_LINES],
        "largest_files": [{"path": p, "lines": n} for p, n in sizes[:largest]],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument("--largest", type=int, default=10, help="how many of the largest files (default 10)")
    args = parser.parse_args(argv)
    result = facts(largest=args.largest)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    engine_to_connector = result["engine_to_connector_arrows"]
    connector_to_engine = result["connector_to_engine_arrows"]
    print(f"import arrows engine/ -> connector/: {len(engine_to_connector)}")
    for arrow in engine_to_connector:
        print(f"  {arrow}")
    print(f"import arrows connector/ -> engine/: {len(connector_to_engine)}")
    for arrow in connector_to_engine:
        print(f"  {arrow}")
    print(f"import circles: {len(result['import_circles'])}")
    for circle in result["import_circles"]:
        print(f"  {circle}")
    print(f"product files over {result['max_lines']} lines: {len(result['files_over_max_lines'])}")
    print(f"the {len(result['largest_files'])} largest of {result['num_product_files']} product files:")
    for entry in result["largest_files"]:
        print(f"  {entry['lines']:5d}  {entry['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
