"""Runs an sm_90 compile script (tests/*/sm90_compile.py) in a clean process and
returns the JSON rows it printed, one per kernel configuration.

A subprocess because the interpreter's patches of triton.language (TRITON_INTERPRET=1,
set for the CPU tests) break real compilation in the same process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO_ROOT = Path(__file__).resolve().parents[1]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
H100_SHARED_MEMORY_BYTES = 232_448

#: the mark of a module of sm_90 compile tests: they need Triton's bundled tools
requires_sm90_tools = pytest.mark.skipif(
    not (NVIDIA_BIN / "ptxas").exists() or not (NVIDIA_BIN / "cuobjdump").exists(),
    reason="Triton's bundled ptxas/cuobjdump are missing",
)


def sm90_compile_rows(module: str) -> list[dict]:
    """`python -m module` without TRITON_INTERPRET -> its JSON rows; fails the test on a non-zero exit."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    completed = subprocess.run(
        [sys.executable, "-m", module],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
