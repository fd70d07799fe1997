"""One client request through the engines (docs/serving.md, "Disaggregated prefill/decode").

1. A producer computes the prompt: the client's body with ``max_tokens`` (and
   ``max_completion_tokens``) 1, not streamed. Its answer carries ``kv_transfer_params``:
   the prompt's KV is durable in the shared tier.
2. A consumer runs the client's body as sent, plus those ``kv_transfer_params``: it loads
   the prompt's KV instead of computing it and generates the answer, streamed or not; its
   answer goes to the client unchanged (id, usage, events).

An engine that does not answer (refused, reset, timed out, or 502/503/504) is taken out
for a while (``EnginePool.failed``) and the next one is tried. When no producer answers
(or one fails the request: 500) the consumer computes the whole prompt; when no consumer
answers the client gets 503. A producer's 4xx is the client's error (the consumer would
refuse it too): it is answered as it came.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.server.proxy.metrics import ProxyMetrics
from engine.server.proxy.pool import Engine, EnginePool
from engine.server.responses import error_body

log = logging.getLogger("kvstash.proxy")

#: an engine answering these cannot serve now: it is taken out and the next one tried
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
#: the hand-over is the proxy's: a client's own ``kv_transfer_params`` goes to no engine
HANDOVER_FIELD = "kv_transfer_params"
#: request headers passed on to the engines (besides the engines' API key)
FORWARDED_HEADERS = ("x-request-id",)


class Relay:
    """Sends requests to the engines of two pools through one HTTP client (its
    connections are kept across requests)."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        prefill: EnginePool,
        decode: EnginePool,
        metrics: ProxyMetrics,
        engine_api_key: str | None,
    ) -> None:
        self.client = client
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics
        self.engine_api_key = engine_api_key

    def headers(self, incoming: Mapping[str, str]) -> dict[str, str]:
        headers = {name: incoming[name] for name in FORWARDED_HEADERS if name in incoming}
        if self.engine_api_key is not None:
            headers["authorization"] = f"Bearer {self.engine_api_key}"
        return headers

    def _failed(self, pool: EnginePool, engine: Engine, error: str) -> None:
        pool.failed(engine, error)
        self.metrics.engine_failures.labels(role=pool.role, url=engine.url).inc()
        log.warning(
            "%s engine %s did not answer (%s); out for %.1f s",
            pool.role,
            engine.url,
            error,
            pool.retry_after_s,
        )

    async def run(self, path: str, body: dict, incoming: Mapping[str, str]) -> Response:
        """The client's request ``body`` to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``): prefill, then decode."""
        headers = self.headers(incoming)
        params, refusal = await self.prefill(path, body, headers)
        if refusal is not None:
            return refusal
        if params is None:
            self.metrics.prefill_skipped.inc()
        else:
            self.metrics.handed_over_tokens.inc(params.get("num_tokens", 0))
        return await self.decode(path, body, params, headers)

    async def prefill(
        self, path: str, body: dict, headers: dict[str, str]
    ) -> tuple[dict | None, Response | None]:
        """(the producer's ``kv_transfer_params`` or None, or the producer's refusal of a
        bad request to answer the client with)."""
        prefill_body = {
            key: value for key, value in body.items() if key not in ("stream_options", HANDOVER_FIELD)
        }
        prefill_body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        prefill_body["stream"] = False
        tried: list[Engine] = []
        pool = self.prefill_pool
        while (engine := pool.pick(tried)) is not None:
            tried.append(engine)
            pool.started(engine)
            try:
                response = await self.client.post(engine.url + path, json=prefill_body, headers=headers)
            except httpx.TransportError as error:
                self._failed(pool, engine, f"{type(error).__name__}: {error}")
                continue
            finally:
                pool.ended(engine)
            if response.status_code in UNAVAILABLE_STATUSES:
                self._failed(pool, engine, f"HTTP {response.status_code}")
                continue
            pool.answered(engine)
            if 400 <= response.status_code < 500:
                return None, _relayed(response.status_code, response.content, response.headers)
            if response.status_code != 200:
                log.warning(
                    "producer %s failed a request (HTTP %d); the consumer computes its prompt",
                    engine.url,
                    response.status_code,
                )
                return None, None
            try:
                params = response.json().get("kv_transfer_params")
            except (ValueError, AttributeError):
                params = None
            return (params if isinstance(params, dict) else None), None
        return None, None

    async def decode(self, path: str, body: dict, params: dict | None, headers: dict[str, str]) -> Response:
        decode_body = {key: value for key, value in body.items() if key != HANDOVER_FIELD}
        if params is not None:
            decode_body["kv_transfer_params"] = params
        streamed = body.get("stream") is True
        tried: list[Engine] = []
        pool = self.decode_pool
        while (engine := pool.pick(tried)) is not None:
            tried.append(engine)
            pool.started(engine)
            request = self.client.build_request("POST", engine.url + path, json=decode_body, headers=headers)
            try:
                response = await self.client.send(request, stream=True)
                if response.status_code in UNAVAILABLE_STATUSES:
                    await response.aclose()
                    raise _Unavailable(f"HTTP {response.status_code}")
                if not (streamed and response.status_code == 200):
                    content = await response.aread()
                    await response.aclose()
            except (httpx.TransportError, _Unavailable) as error:
                pool.ended(engine)
                self._failed(pool, engine, f"{type(error).__name__}: {error}")
                continue
            pool.answered(engine)
            if streamed and response.status_code == 200:
                return StreamingResponse(
                    self._events(response, engine),
                    status_code=200,
                    media_type=response.headers.get("content-type", "text/event-stream"),
                )
            pool.ended(engine)
            return _relayed(response.status_code, content, response.headers)
        return JSONResponse(
            error_body("no decode engine answered; try again later", "server_error"), status_code=503
        )

    async def _events(self, response: httpx.Response, engine: Engine) -> AsyncIterator[bytes]:
        """The consumer's events, as they come. A consumer lost mid-stream ends the stream
        with an error event and ``[DONE]`` (its tokens so far cannot be resent elsewhere); a
        client that goes away closes this, which closes the consumer's stream (it aborts)."""
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as error:
            self._failed(self.decode_pool, engine, f"{type(error).__name__}: {error}")
            lost = error_body("the decode engine was lost mid-stream", "server_error")
            yield f"\n\ndata: {json.dumps(lost)}\n\ndata: [DONE]\n\n".encode()
        finally:
            self.decode_pool.ended(engine)
            await response.aclose()


class _Unavailable(Exception):
    """An engine answered 502/503/504."""


def _relayed(status: int, content: bytes, headers: Mapping[str, str]) -> Response:
    return Response(content, status_code=status, media_type=headers.get("content-type", "application/json"))
