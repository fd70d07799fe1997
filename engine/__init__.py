"""kvstash's inference engine: `LLM`, `SamplingParams`, `EngineArgs` (DESIGN §3)."""

from connector.config import OffloadConfig
from engine.config import EngineArgs, SamplingParams
from engine.engine_core import EngineCore
from engine.llm import LLM
from engine.request import RequestMetrics, RequestOutput

__all__ = [
    "LLM",
    "EngineArgs",
    "EngineCore",
    "OffloadConfig",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
