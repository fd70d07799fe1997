"""One client request sent on to the first engine that answers it, as `kvstash proxy` (to a
consumer) and `kvstash router` (to a replica) both do.

An engine that does not answer (connection refused or reset, a timeout, or 502/503/504
before any of its answer) is taken out for a while (``EnginePool.failed``), counted and
logged, and the next engine the caller chooses is tried: a request fails only when no
engine answers it. The answer that comes goes to the client unchanged: a non-streaming
one whole, a stream passed through as its bytes arrive. An engine lost mid-stream ends
the stream with an error event and ``data: [DONE]`` (its tokens so far cannot be resent
elsewhere); a client that goes away closes the engine's stream (the engine aborts).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import httpx
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Counter

from engine.server.responses import error_body
from engine.server.upstream.pool import Engine, EnginePool

log = logging.getLogger("kvstash.upstream")

#: an engine answering these cannot serve now: it is taken out and the next one tried
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
#: request headers passed on to the engines (besides the engines' API key)
FORWARDED_HEADERS = ("x-request-id",)

#: ``choose(tried)``: the next engine to try (none of ``tried``), or None to give up
Chooser = Callable[[Sequence[Engine]], Engine | None]


class Forwarder:
    """Sends requests to the engines of pools through one HTTP client (its connections are
    kept across requests). ``failures`` (labels ``role``, ``url``) counts engines that did
    not answer; ``on_failed(engine)`` is told of each too (the router drops its index)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        failures: Counter,
        engine_api_key: str | None,
        on_failed: Callable[[Engine], None] | None = None,
    ) -> None:
        self.client = client
        self.failures = failures
        self.engine_api_key = engine_api_key
        self.on_failed = on_failed

    def headers(self, incoming: Mapping[str, str]) -> dict[str, str]:
        """What goes to an engine: the forwarded headers and the engines' API key."""
        headers = {name: incoming[name] for name in FORWARDED_HEADERS if name in incoming}
        if self.engine_api_key is not None:
            headers["authorization"] = f"Bearer {self.engine_api_key}"
        return headers

    def failed(self, pool: EnginePool, engine: Engine, error: str) -> None:
        """``engine`` did not answer: out for the pool's ``retry_after_s``, counted, logged."""
        pool.failed(engine, error)
        self.failures.labels(role=pool.role, url=engine.url).inc()
        log.warning(
            "%s engine %s did not answer (%s); out for %.1f s",
            pool.role,
            engine.url,
            error,
            pool.retry_after_s,
        )
        if self.on_failed is not None:
            self.on_failed(engine)

    async def send(
        self,
        pool: EnginePool,
        choose: Chooser,
        path: str,
        body: dict,
        headers: dict[str, str],
        tokens_at: Callable[[Engine], float] | None = None,
    ) -> tuple[Response, Engine] | None:
        """POST ``body`` to ``path`` of the engines ``choose`` names in turn until one
        answers; (its answer for the client, the engine), or None when none did. The
        engine's in-flight count (and ``tokens_at(engine)``, the prompt tokens it computes
        there) covers the request until its answer (or stream) ends."""
        streamed = body.get("stream") is True
        tried: list[Engine] = []
        while (engine := choose(tried)) is not None:
            tried.append(engine)
            tokens = tokens_at(engine) if tokens_at is not None else 0.0
            pool.started(engine, tokens)
            request = self.client.build_request("POST", engine.url + path, json=body, headers=headers)
            try:
                response = await self.client.send(request, stream=True)
                if response.status_code in UNAVAILABLE_STATUSES:
                    await response.aclose()
                    raise _Unavailable(f"HTTP {response.status_code}")
                if not (streamed and response.status_code == 200):
                    content = await response.aread()
                    await response.aclose()
            except (httpx.TransportError, _Unavailable) as error:
                pool.ended(engine, tokens)
                self.failed(pool, engine, f"{type(error).__name__}: {error}")
                continue
            pool.answered(engine)
            if streamed and response.status_code == 200:
                events = self._events(pool, response, engine, tokens)
                media_type = response.headers.get("content-type", "text/event-stream")
                return StreamingResponse(events, status_code=200, media_type=media_type), engine
            pool.ended(engine, tokens)
            return relayed(response.status_code, content, response.headers), engine
        return None

    async def get_first(self, pool: EnginePool, path: str, headers: dict[str, str]) -> Response | None:
        """GET ``path`` from the first live engine that answers (``/v1/models``); None if none."""
        for engine in pool.live():
            try:
                answer = await self.client.get(engine.url + path, headers=headers)
            except httpx.TransportError as error:
                self.failed(pool, engine, f"{type(error).__name__}: {error}")
                continue
            if answer.status_code not in UNAVAILABLE_STATUSES:
                return relayed(answer.status_code, answer.content, answer.headers)
        return None

    async def _events(
        self, pool: EnginePool, response: httpx.Response, engine: Engine, tokens: float
    ) -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as error:
            self.failed(pool, engine, f"{type(error).__name__}: {error}")
            lost = error_body(f"the {pool.role} engine was lost mid-stream", "server_error")
            yield f"\n\ndata: {json.dumps(lost)}\n\ndata: [DONE]\n\n".encode()
        finally:
            pool.ended(engine, tokens)
            await response.aclose()


class _Unavailable(Exception):
    """An engine answered 502/503/504."""


def relayed(status: int, content: bytes, headers: Mapping[str, str]) -> Response:
    """An engine's answer as the client gets it."""
    return Response(content, status_code=status, media_type=headers.get("content-type", "application/json"))
