"""The proxy's FastAPI app: `POST /v1/completions` and `/v1/chat/completions` through a
producer then a consumer (`relay`), `GET /v1/models` from a consumer, `GET /health` and
`GET /metrics`. The API key and the body size limit are those of `kvstash serve`
(`engine.server.guards`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES
from engine.server.proxy.metrics import ProxyMetrics
from engine.server.proxy.relay import Relay
from engine.server.responses import error_body
from engine.server.upstream.forward import Forwarder
from engine.server.upstream.http import add_generation_routes, engine_client, front_app
from engine.server.upstream.pool import DEFAULT_RETRY_AFTER_S, EnginePool


def create_proxy_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    *,
    api_key: str | None = None,
    engine_api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    retry_after_s: float = DEFAULT_RETRY_AFTER_S,
) -> FastAPI:
    """The proxy over producers at ``prefill_urls`` and consumers at ``decode_urls`` (at
    least one consumer; no producer is allowed: every consumer then computes). Clients
    need ``api_key`` when one is set; ``engine_api_key`` is sent to the engines."""
    if not decode_urls:
        raise ValueError("the proxy needs at least one decode engine (--decode URL)")
    prefill = EnginePool("prefill", prefill_urls, retry_after_s=retry_after_s)
    decode = EnginePool("decode", decode_urls, retry_after_s=retry_after_s)
    metrics = ProxyMetrics([prefill, decode])
    relay: Relay | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal relay
        async with engine_client() as client:
            forwarder = Forwarder(client, metrics.engine_failures, engine_api_key)
            relay = Relay(forwarder, prefill, decode, metrics)
            yield

    app = front_app(
        "kvstash proxy",
        lifespan,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        render_metrics=metrics.render,
    )

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some consumer is in (a request can be answered), else 503."""
        state = {"prefill": prefill.describe(), "decode": decode.describe()}
        if not any(decode.is_up(engine) for engine in decode.engines):
            return JSONResponse({"status": "no decode engine is in", **state}, status_code=503)
        return JSONResponse({"status": "ok", **state})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        forwarder = relay.forwarder
        answer = await forwarder.get_first(decode, "/v1/models", forwarder.headers(request.headers))
        if answer is not None:
            return answer
        return JSONResponse(error_body("no decode engine answered", "server_error"), status_code=503)

    async def relay_run(route: str, body: dict, headers: Mapping[str, str]) -> Response:
        return await relay.run(route, body, headers)

    add_generation_routes(app, relay_run, metrics.requests)
    return app
