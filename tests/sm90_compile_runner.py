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

REPO_ROOT = Path(__file__).resolve().parents[1]


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
