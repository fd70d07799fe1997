"""The OpenAI-compatible HTTP server of `kvstash serve` (DESIGN §8): an async front
end over the engine loop (`async_engine`), request models (`protocol`), response
bodies (`responses`) and the FastAPI app (`app`)."""

from engine.server.app import create_app
from engine.server.async_engine import AsyncEngine, EngineDeadError

__all__ = ["AsyncEngine", "EngineDeadError", "create_app"]
