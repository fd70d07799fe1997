"""``benchmarks/`` imports nothing from ``tests/`` (issue 36, Borders): what both need lives in
``benchmarks/support/``. Every ``import`` of every ``benchmarks/**/*.py`` is read with ``ast``,
including imports inside functions and inside code strings run in child processes.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def imported_modules(tree: ast.AST) -> Iterator[str]:
    """The module of every import in ``tree``, and of every import in a string constant that
    parses as Python (the source of a child process)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            yield from imported_modules(inner)


def test_no_benchmark_imports_tests() -> None:
    files = sorted((REPO_ROOT / "benchmarks").rglob("*.py"))
    assert files, "no benchmarks found"
    offenders = [
        f"{path.relative_to(REPO_ROOT)}: {module}"
        for path in files
        for module in imported_modules(ast.parse(path.read_text(), filename=str(path)))
        if module == "tests" or module.startswith("tests.")
    ]
    assert offenders == []


def test_the_check_sees_imports_in_functions_and_child_sources() -> None:
    source = 'def f():\n    from tests.a import b\nCHILD = """\nimport tests.c\n"""\n'
    assert set(imported_modules(ast.parse(source))) == {"tests.a", "tests.c"}
