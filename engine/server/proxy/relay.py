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

import logging
from collections.abc import Mapping

import httpx
from fastapi.responses import JSONResponse, Response

from engine.server.proxy.metrics import ProxyMetrics
from engine.server.responses import error_body
from engine.server.upstream.forward import UNAVAILABLE_STATUSES, Forwarder, relayed
from engine.server.upstream.pool import Engine, EnginePool

log = logging.getLogger("kvstash.proxy")

#: the hand-over is the proxy's: a client's own ``kv_transfer_params`` goes to no engine
HANDOVER_FIELD = "kv_transfer_params"


class Relay:
    """Sends requests to the engines of two pools through one `Forwarder` (one HTTP client,
    its connections kept across requests)."""

    def __init__(
        self, forwarder: Forwarder, prefill: EnginePool, decode: EnginePool, metrics: ProxyMetrics
    ) -> None:
        self.forwarder = forwarder
        self.client = forwarder.client
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.metrics = metrics

    async def run(self, path: str, body: dict, incoming: Mapping[str, str]) -> Response:
        """The client's request ``body`` to ``path`` (``/v1/completions`` or
        ``/v1/chat/completions``): prefill, then decode."""
        headers = self.forwarder.headers(incoming)
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
                self.forwarder.failed(pool, engine, f"{type(error).__name__}: {error}")
                continue
            finally:
                pool.ended(engine)
            if response.status_code in UNAVAILABLE_STATUSES:
                self.forwarder.failed(pool, engine, f"HTTP {response.status_code}")
                continue
            pool.answered(engine)
            if 400 <= response.status_code < 500:
                return None, relayed(response.status_code, response.content, response.headers)
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
        """The consumer's answer (the first consumer that answers), or 503 when none does."""
        decode_body = {key: value for key, value in body.items() if key != HANDOVER_FIELD}
        if params is not None:
            decode_body["kv_transfer_params"] = params
        pool = self.decode_pool
        sent = await self.forwarder.send(pool, pool.pick, path, decode_body, headers)
        if sent is None:
            return JSONResponse(
                error_body("no decode engine answered; try again later", "server_error"), status_code=503
            )
        return sent[0]
