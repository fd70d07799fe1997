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
    exited 0 (showing the ends of its stdout and stderr otherwise) and returns the finished process."""

    def run(argv: Sequence[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
        result = subprocess.run(
            [sys.executable, *argv],
            cwd=repo_root,
            env=subprocess_env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        # both streams: a script's table (with its failed targets) goes to stdout
        assert result.returncode == 0, f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"
        return result

    return run


@pytest.fixture
def refused_flags(
    repo_root, subprocess_env
) -> Callable[[Sequence[str], Sequence[tuple[list[str], str]]], None]:
    """Factory: ``refused_flags(["benchmarks/x.py", *common], [(flags, message), ...])``
    runs the script once per case and asserts that it stopped with exit 2 and ``message``
    on stderr (a bad flag is refused before anything starts)."""

    def check(argv: Sequence[str], cases: Sequence[tuple[list[str], str]]) -> None:
        for flags, message in cases:
            result = subprocess.run(
                [sys.executable, *argv, *flags],
                cwd=repo_root,
                env=subprocess_env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert result.returncode == 2, (flags, result.stderr)
            assert message in result.stderr, (flags, result.stderr)

    return check
