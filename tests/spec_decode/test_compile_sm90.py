"""The rejection sampler compiles for an H100 (sm_90) without a GPU, without spills and
with IEEE division (the CPU interpreter accepts code that real compilation rejects)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

REPO_ROOT = Path(__file__).resolve().parents[2]
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"

pytestmark = pytest.mark.skipif(
    not (NVIDIA_BIN / "ptxas").exists() or not (NVIDIA_BIN / "cuobjdump").exists(),
    reason="Triton's bundled ptxas/cuobjdump are missing",
)


def test_rejection_sampler_compiles_for_h100_without_spills():
    # The interpreter's patches of triton.language break real compilation: use a clean process.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    completed = subprocess.run(
        [sys.executable, "-m", "tests.spec_decode.sm90_compile"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    rows = [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 4
    for row in rows:
        assert row["stack"] == 0 and row["local"] == 0, row
        assert row["approx_divisions"] == 0, row
