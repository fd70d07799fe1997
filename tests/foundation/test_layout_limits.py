"""The layout's limits (issue 36, Borders): no product file over ``MAX_LINES`` (600) lines, and
no import circle between product modules. Product files are the ``.py`` files outside
``tests/`` (``benchmarks/`` and ``scripts/`` included); every import counts, type-only ones
under ``TYPE_CHECKING`` and those inside functions too. ``scripts/layout_facts.py`` prints
the same figures.

A file over the limit is split by moving one of its jobs into a module of its own; a
circle is broken by moving what both sides need to a module both import, or by a
Protocol for what one side needs of the other.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.layout_facts import (
    MAX_LINES,
    REPO_ROOT,
    describe_circle,
    import_arrows,
    import_circles,
    oversized_files,
)


def test_no_product_file_is_over_the_line_limit() -> None:
    offenders = [f"{path}: {lines} lines" for path, lines in oversized_files(REPO_ROOT)]
    assert not offenders, f"product files over {MAX_LINES} lines: " + "; ".join(offenders)


def test_no_import_circle() -> None:
    circles = [describe_circle(circle) for circle in import_circles(import_arrows(REPO_ROOT))]
    assert not circles, "import circles: " + "; ".join(circles)


#: the worker side's modules: the tiers and the CPU tier's slab (the bytes), the cache
#: engine, the worker side, the fetcher, the movers (and the kernels)
WORKER_SIDE_MODULES = (
    "connector.tiers",
    "connector.cpu_tier",
    "connector.cache_engine",
    "connector.worker_side",
    "connector.fetcher",
    "connector.transfer",
)


def test_the_scheduler_side_reaches_no_worker_side_module() -> None:
    """The scheduler side (``OffloadScheduler`` and the ``HandoffScheduler`` the factory
    makes) is built over a ``SchedulerIndex``: none of its imports that run, direct or not,
    reaches the tiers' bytes, the cache engine, the worker side, the fetcher, the movers or
    the kernels (imports for annotations only, under ``TYPE_CHECKING``, load nothing)."""
    module_to_targets: dict[str, set[str]] = {}
    for arrow in import_arrows(REPO_ROOT):
        if arrow.kind != "type-only":
            module_to_targets.setdefault(arrow.source, set()).add(arrow.target)
    for side in ("connector.scheduler_side", "connector.handoff"):
        reached, todo = set(), [side]
        while todo:
            for target in module_to_targets.get(todo.pop(), ()):
                if target not in reached:
                    reached.add(target)
                    todo.append(target)
        assert "connector.scheduler_index" in reached  # the walk follows the imports
        offenders = sorted(m for m in reached if m in WORKER_SIDE_MODULES or m.startswith("kernels"))
        assert not offenders, f"{side} reaches {offenders}"
    # and so it is when a fresh interpreter imports them
    probe = "import sys, connector.handoff; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "connector.scheduler_side" in loaded
    assert not [m for m in loaded if m in WORKER_SIDE_MODULES or m.startswith("kernels")], loaded


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_see_every_kind_of_import(tmp_path) -> None:
    """Circles through a type-only import, a function's import and a relative import are
    found and named; a package's own ``__init__`` is no circle; files in tests/ are left out."""
    write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n",
            "pkg/b.py": "from pkg import a\nB = 2\n",
            "pkg/c.py": "def f():\n    from . import d\n",
            "pkg/d.py": "import pkg.c\n",
            "pkg/e.py": "import os\n" + "x = 1\n" * 700,
            "tests/t.py": "import pkg.a\n" + "x = 1\n" * 700,
        },
    )
    circles = [describe_circle(c) for c in import_circles(import_arrows(tmp_path))]
    assert circles == ["pkg.a -> pkg.b (type-only) -> pkg.a", "pkg.c -> pkg.d (function) -> pkg.c"]
    assert oversized_files(tmp_path) == [("pkg/e.py", 701)]


def test_the_script_prints_the_facts() -> None:
    result = subprocess.run(
        [sys.executable, "scripts/layout_facts.py"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert "import arrows engine/ -> connector/:" in result.stdout
    assert "import circles: 0" in result.stdout
