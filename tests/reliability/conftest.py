"""Fixtures of the reliability suite: the tiny model, no-offload references and the
scenario report.

Each scenario test records its figures with ``reliability_report.record(...)``.
When ``KVSTASH_RELIABILITY_OUT`` names a file, the figures of the whole run are
written there as JSON at the end of the session (``docs/reliability.md`` is
made from such a file).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability.engine_stream import Reference

REPORT_ENV = "KVSTASH_RELIABILITY_OUT"


class ReliabilityReport:
    """Per-scenario figures collected during one pytest session."""

    def __init__(self) -> None:
        self.scenarios: list[dict[str, Any]] = []

    def record(self, scenario: str, injected: str, **figures: Any) -> None:
        self.scenarios.append({"scenario": scenario, "injected": injected, **figures})

    def write(self, path: str) -> None:
        document = {
            "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "scenarios": self.scenarios,
        }
        Path(path).write_text(json.dumps(document, indent=2) + "\n")


@pytest.fixture(scope="session")
def reliability_report():
    report = ReliabilityReport()
    yield report
    path = os.environ.get(REPORT_ENV)
    if path and report.scenarios:
        report.write(path)


@pytest.fixture(scope="session")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def reference(model_dir) -> Reference:
    """No-offload float32 reference of the tiny llama."""
    return Reference(model_dir)
