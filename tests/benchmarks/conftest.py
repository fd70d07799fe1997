"""Fixtures of the benchmark smoke tests: each runs a real benchmark script end to end
in a child process (small shapes, on CPU)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest


@pytest.fixture
def run_benchmark(repo_root, subprocess_env) -> Callable[..., subprocess.CompletedProcess]:
    """Factory: ``run_benchmark(["benchmarks/x.py", *args])`` runs the script with this
    interpreter from the repository root (its packages on the path), asserts that it
    exited 0 (showing the end of its stderr otherwise) and returns the finished process."""

    def run(argv: Sequence[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, *argv],
            cwd=repo_root,
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    return run
