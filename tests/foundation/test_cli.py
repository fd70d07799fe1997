"""The `kvstash` CLI root lists working subcommands."""

from __future__ import annotations

import subprocess
import sys


def test_help_lists_subcommands(repo_root, subprocess_env):
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "--help"],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "make-tiny-model" in out.stdout


def test_unknown_subcommand_fails(repo_root, subprocess_env):
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "no-such-command"],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "No such command" in out.stderr
