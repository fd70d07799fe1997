"""kvstash's inference engine: `LLM`, `SamplingParams`, `EngineArgs` (docs/architecture.md, Engine).

The names below are imported on first use (PEP 562), not when the package is: the
``kvstash`` CLI root lives in this package, and ``kvstash --help``, ``kvstash admin``
and ``kvstash cache-server`` must start without importing torch (issue 35).
``from engine import LLM`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from connector.config import OffloadConfig
    from engine.config import EngineArgs, SamplingParams
    from engine.engine_core import EngineCore
    from engine.llm import LLM
    from engine.request import RequestMetrics, RequestOutput

#: public name -> the module that defines it
_LAZY_NAMES = {
    "LLM": "engine.llm",
    "EngineArgs": "engine.config",
    "EngineCore": "engine.engine_core",
    "OffloadConfig": "connector.config",
    "RequestMetrics": "engine.request",
    "RequestOutput": "engine.request",
    "SamplingParams": "engine.config",
}

__all__ = [
    "LLM",
    "EngineArgs",
    "EngineCore",
    "OffloadConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines the public ``name`` and return it; AttributeError otherwise."""
    module = _LAZY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
