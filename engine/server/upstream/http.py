"""The HTTP pieces a proxy's or router's FastAPI app shares: the client to the engines, the
app with its guards and ``/metrics``, and the generation routes (the client's body read as a
JSON object, the answers counted)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter

from engine.metrics import CONTENT_TYPE
from engine.server.guards import ApiKeyMiddleware, BodySizeLimitMiddleware
from engine.server.responses import error_body

#: connecting to an engine; reading its answer may take as long as generating does
ENGINE_TIMEOUT = httpx.Timeout(connect=5.0, read=600.0, write=60.0, pool=60.0)


@contextlib.asynccontextmanager
async def engine_client() -> AsyncIterator[httpx.AsyncClient]:
    """One client for all requests to the engines (connections kept, no limit on them)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=ENGINE_TIMEOUT, limits=limits) as client:
        yield client


async def json_object(request: Request) -> dict | JSONResponse:
    """The request's body as a JSON object, or the 400 to answer when it is none."""
    try:
        body = json.loads(await request.body())
    except ValueError:
        body = None
    if not isinstance(body, dict):
        return JSONResponse(
            error_body("the request body must be a JSON object", "invalid_request_error"), status_code=400
        )
    return body


#: the routes a proxy or router sends on to its engines
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")


def front_app(
    title: str,
    lifespan: Callable,
    *,
    api_key: str | None,
    max_request_bytes: int,
    render_metrics: Callable[[], bytes],
) -> FastAPI:
    """The app of a proxy or router: the body size limit and the API key of `kvstash serve`
    (`engine.server.guards`; the key checked first) and ``GET /metrics``."""
    app = FastAPI(title=title, lifespan=lifespan)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(render_metrics(), media_type=CONTENT_TYPE)

    return app


def add_generation_routes(
    app: FastAPI, handle: Callable[[str, dict, Mapping[str, str]], Awaitable[Response]], requests: Counter
) -> None:
    """``POST`` each of `GENERATION_ROUTES` to ``handle(route, body, headers)`` with the body
    read as a JSON object (else 400); ``requests`` (labels ``route``, ``status``) counts the
    answers."""

    def endpoint(route: str) -> Callable[[Request], Awaitable[Response]]:
        async def send_on(request: Request) -> Response:
            body = await json_object(request)
            response = await handle(route, body, request.headers) if isinstance(body, dict) else body
            requests.labels(route=route, status=str(response.status_code)).inc()
            return response

        return send_on

    for route in GENERATION_ROUTES:
        app.add_api_route(route, endpoint(route), methods=["POST"])
