"""`EngineStats`: the engine's counters over its life.

Written by the engine core (`engine.engine_core`, once per step) and its step recovery
(`engine.step_recovery`, when a step fails); read by tests, benchmarks, `LLM.stats` and
the server's /metrics. Plain data: nothing here acts on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.spec_decode import SpecDecodeStats


@dataclass
class EngineStats:
    """Counters over the engine's life (read by tests, benchmarks and /metrics)."""

    num_steps: int = 0
    #: tokens the model actually ran a forward pass on (prefix hits and loads excluded)
    num_computed_tokens_total: int = 0
    num_generated_tokens_total: int = 0
    num_requests_finished: int = 0
    #: steps that raised (their requests were ended or retried, see `EngineStepError`)
    num_step_errors: int = 0
    #: requests a failed step sent back to be retried in smaller groups
    num_requests_retried: int = 0
    #: probe steps run after a request failed alone, and those of them that failed too
    num_probe_steps: int = 0
    num_probe_failures: int = 0
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    extra: dict[str, Any] = field(default_factory=dict)
