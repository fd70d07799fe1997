"""The router's FastAPI app: `POST /v1/completions` and `/v1/chat/completions` to the
replica `choice` ranks first (the next one when it does not answer), `GET /v1/models` from
a replica, `GET /health` and `GET /metrics`. The API key and the body size limit are those
of `kvstash serve` (`engine.server.guards`).

Per request: the prompt is tokenized on the tokenizer threads (never on the event loop),
hashed as the engines hash it, matched against every live replica's index (`matching`),
ranked (`choice`) and forwarded unchanged (`engine.server.upstream.forward`); one log
line says where it went, why, and what the replica held of it per tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES
from engine.server.responses import error_body
from engine.server.router.choice import Candidate, Decision, choose
from engine.server.router.costs import DEFAULT_INTERVAL_S, DEFAULT_TIER_COST, CostPoller
from engine.server.router.index import ReplicaIndex
from engine.server.router.matching import PrefixMatch, PromptHashes, SharedTiers, match_prefix
from engine.server.router.metrics import RouterMetrics
from engine.server.router.prompt import request_prompt
from engine.server.upstream.forward import Forwarder
from engine.server.upstream.http import add_generation_routes, engine_client, front_app
from engine.server.upstream.pool import DEFAULT_RETRY_AFTER_S, Engine, EnginePool
from kv_events.follower import EngineKV
from storage_backends.thread_pools import started_thread_pool

log = logging.getLogger("kvstash.router")

#: threads that tokenize prompts and apply chat templates (fast tokenizers release the GIL)
NUM_TOKENIZER_THREADS = 2


def create_router_app(
    replica_urls: Sequence[str],
    replica_events: Sequence[tuple[str, str]],
    tokenizer: Any,
    *,
    api_key: str | None = None,
    engine_api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    retry_after_s: float = DEFAULT_RETRY_AFTER_S,
    costs_interval_s: float = DEFAULT_INTERVAL_S,
) -> FastAPI:
    """The router over the replicas at ``replica_urls`` (at least one), the i-th followed
    through ``replica_events[i]`` ((PUB endpoint, replay endpoint); none at all: routing by
    load alone). ``tokenizer`` is the served model's. Clients need ``api_key`` when one is
    set; ``engine_api_key`` is sent to the replicas. Each replica's ``/metrics`` is read
    every ``costs_interval_s`` for its measured tier costs (`costs`)."""
    if not replica_urls:
        raise ValueError("the router needs at least one replica (--replica URL)")
    if replica_events and len(replica_events) != len(replica_urls):
        raise ValueError(
            f"{len(replica_events)} --replica-events for {len(replica_urls)} --replica: give one per replica, "
            "in the same order, or none"
        )
    pool = EnginePool("replica", replica_urls, retry_after_s=retry_after_s)
    indexes = {
        id(engine): ReplicaIndex(engine.url, *endpoints)
        for engine, endpoints in zip(pool.engines, replica_events, strict=False)
    }
    request_numbers = itertools.count(1)
    forwarder: Forwarder | None = None
    poller: CostPoller | None = None
    metrics = RouterMetrics(pool, list(indexes.values()), lambda: poller)
    tokenizer_pool = started_thread_pool(NUM_TOKENIZER_THREADS, "kvstash-router-tokenizer")

    def drop_index(engine: Engine) -> None:
        index = indexes.get(id(engine))
        if index is not None:
            index.drop()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal forwarder, poller
        for index in indexes.values():
            index.start()
        try:
            async with engine_client() as client:
                forwarder = Forwarder(client, metrics.engine_failures, engine_api_key, on_failed=drop_index)
                poller = CostPoller(pool.engines, client, forwarder.headers({}), interval_s=costs_interval_s)
                polling = asyncio.create_task(poller.run())
                try:
                    yield
                finally:
                    polling.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await polling
        finally:
            for index in indexes.values():
                index.close()
            tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    app = front_app(
        "kvstash router",
        lifespan,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        render_metrics=metrics.render,
    )

    def tier_cost(engine: Engine, num_prompt_tokens: int) -> Mapping[str, float]:
        costs = None if poller is None else poller.costs(engine)
        return DEFAULT_TIER_COST if costs is None else costs.tier_cost(num_prompt_tokens)

    def views(live: list[Engine]) -> list[tuple[EngineKV | None, dict[str, str]]]:
        """What each live replica's index says now: (its state or None, its key heads)."""
        return [
            (indexes[id(e)].state, indexes[id(e)].key_heads) if id(e) in indexes else (None, {}) for e in live
        ]

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while some replica is in (a request can be answered), else 503."""
        state = pool.describe()
        for entry, engine in zip(state, pool.engines, strict=True):
            index = indexes.get(id(engine))
            entry["index"] = (
                "none" if index is None else ("synced" if index.state is not None else "out of date")
            )
        if not any(pool.is_up(engine) for engine in pool.engines):
            return JSONResponse({"status": "no replica is in", "replicas": state}, status_code=503)
        return JSONResponse({"status": "ok", "replicas": state})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        answer = await forwarder.get_first(pool, "/v1/models", forwarder.headers(request.headers))
        if answer is not None:
            return answer
        return JSONResponse(error_body("no replica answered", "server_error"), status_code=503)

    async def forward(route: str, body: dict, incoming: Mapping[str, str]) -> Response:
        live = pool.live()
        if not live:
            return JSONResponse(
                error_body("no replica is in; try again later", "server_error"), status_code=503
            )
        # tokenizing and hashing on the tokenizer threads, never on the event loop
        tokens, matches = await asyncio.get_running_loop().run_in_executor(
            tokenizer_pool, functools.partial(prompt_matches, tokenizer, route, body, views(live))
        )
        num_prompt_tokens = len(tokens or ())
        decision = choose(
            [Candidate(e, m, tier_cost(e, num_prompt_tokens)) for e, m in zip(live, matches, strict=True)],
            num_prompt_tokens,
        )
        if tokens is None:
            decision = Decision(decision.order, "untokenized", decision.matches, decision.prompt_tokens)
        name = incoming.get("x-request-id") or f"router-{next(request_numbers)}"
        num_tokens = "?" if tokens is None else len(tokens)

        def next_replica(tried: Sequence[Engine]) -> Engine | None:
            engine = next((e for e in decision.order if e not in tried and pool.is_up(e)), None)
            if engine is not None:
                reason = decision.reason if not tried else "retry"
                note(engine, reason)
            return engine

        def note(engine: Engine, reason: str) -> None:
            match = decision.match(engine)
            metrics.routed.labels(url=engine.url, reason=reason).inc()
            metrics.prompt_tokens.labels(url=engine.url).inc(0 if tokens is None else len(tokens))
            for tier, count in match.by_tier().items():
                metrics.matched_tokens.labels(url=engine.url, tier=tier).inc(count)
            tiers = " ".join(f"{tier}={count}" for tier, count in match.by_tier().items())
            log.info(
                "route %s -> %s (%s): prompt %s tokens, matched %s; in flight %d",
                name,
                engine.url,
                reason,
                num_tokens,
                tiers,
                engine.num_in_flight,
            )

        headers = forwarder.headers(incoming)
        sent = await forwarder.send(pool, next_replica, route, body, headers, tokens_at=decision.tokens_at)
        if sent is None:
            return JSONResponse(
                error_body("no replica answered; try again later", "server_error"), status_code=503
            )
        return sent[0]

    add_generation_routes(app, forward, metrics.requests)
    return app


def prompt_matches(
    tokenizer: Any, route: str, body: dict, views: list[tuple[EngineKV | None, dict[str, str]]]
) -> tuple[list[int] | None, list[PrefixMatch]]:
    """(the request's prompt tokens or None, each replica's cached prefix of it) for the
    replicas' ``views`` ((index state or None, key heads) each)."""
    tokens, cache_salt = request_prompt(tokenizer, route, body)
    if tokens is None:
        return None, [PrefixMatch() for _ in views]
    states = [state for state, _ in views]
    shared = SharedTiers(states, [heads for _, heads in views])
    chunk_size = next((state.chunk_size for state in states if state is not None and state.chunk_size), 0)
    prompt = PromptHashes(tokens, cache_salt)
    return tokens, [match_prefix(prompt, state, heads, shared, chunk_size) for state, heads in views]
