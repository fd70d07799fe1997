"""The OpenAI-compatible HTTP server of `kvstash serve` (docs/architecture.md, Serving and
the main job): an async front end over the engine loop (`async_engine`), request models
(`protocol`), response bodies (`responses`) and the FastAPI app (`app`).

Nothing is imported here: FastAPI and uvicorn load only when a server starts, so
`kvstash` commands that serve nothing run without them (e.g. on GPU machines).
"""
