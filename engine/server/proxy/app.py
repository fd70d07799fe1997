"""The proxy's FastAPI app: `POST /v1/completions` and `/v1/chat/completions` through a
producer then a consumer (`relay`), `GET /v1/models` from a consumer, `GET /health` and
`GET /metrics`. The API key and the body size limit are those of `kvstash serve`
(`engine.server.guards`)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.metrics import CONTENT_TYPE
from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES, ApiKeyMiddleware, BodySizeLimitMiddleware
from engine.server.proxy.metrics import ProxyMetrics
from engine.server.proxy.pool import DEFAULT_RETRY_AFTER_S, EnginePool
from engine.server.proxy.relay import UNAVAILABLE_STATUSES, Relay
from engine.server.responses import error_body

#: connecting to an engine; reading its answer may take as long as generating does
ENGINE_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)


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
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=ENGINE_TIMEOUT, limits=limits) as client:
            relay = Relay(client, prefill, decode, metrics, engine_api_key)
            yield

    app = FastAPI(title="kvstash proxy", lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some consumer is in (a request can be answered), else 503."""
        state = {"prefill": prefill.describe(), "decode": decode.describe()}
        if not any(decode.is_up(engine) for engine in decode.engines):
            return JSONResponse({"status": "no decode engine is in", **state}, status_code=503)
        return JSONResponse({"status": "ok", **state})

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for engine in decode.engines:
            if not decode.is_up(engine):
                continue
            try:
                answer = await relay.client.get(
                    f"{engine.url}/v1/models", headers=relay.headers(request.headers)
                )
            except httpx.TransportError as error:
                decode.failed(engine, f"{type(error).__name__}: {error}")
                continue
            if answer.status_code not in UNAVAILABLE_STATUSES:
                return Response(answer.content, answer.status_code, media_type="application/json")
        return JSONResponse(error_body("no decode engine answered", "server_error"), status_code=503)

    async def relayed(route: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            body = error
        if not isinstance(body, dict):
            response = JSONResponse(
                error_body("the request body must be a JSON object", "invalid_request_error"), status_code=400
            )
        else:
            response = await relay.run(route, body, request.headers)
        metrics.requests.labels(route=route, status=str(response.status_code)).inc()
        return response

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await relayed("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await relayed("/v1/chat/completions", request)

    return app
