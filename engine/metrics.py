"""Prometheus metrics of one serving engine, in a registry of its own.

Each `EngineMetrics` owns a `CollectorRegistry` (never the global default one),
so two servers in one process keep separate figures. Two kinds of figures:

- per-request events, recorded by the async front end's engine thread as outputs
  arrive (`observe_output`, `observe_finished`): requests by finish reason,
  prompt/generated tokens, GPU prefix hits, external hits, tokens and bytes
  loaded and saved, TTFT, inter-token latency and load throughput;
- engine state, read at scrape time by a collector (`_EngineStateCollector`):
  KV block usage, speculative decoding counters, connector hits and errors per tier.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from connector.base import RequestTransferStats
    from engine.engine_core import EngineCore
    from engine.request import RequestOutput

#: Prometheus text format content type (what `/metrics` answers with)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_GBPS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)


class EngineMetrics:
    """The figures of one engine. Created once per server; the engine thread calls the
    `observe_*` methods (prometheus_client metrics are thread-safe) and `/metrics`
    calls `render` from the event loop."""

    def __init__(self, engine: EngineCore) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "kvstash_requests", "Finished requests by finish reason.", ["finish_reason"], registry=registry
        )
        self.prompt_tokens = Counter(
            "kvstash_prompt_tokens", "Prompt tokens of finished requests.", registry=registry
        )
        self.generation_tokens = Counter(
            "kvstash_generation_tokens", "Tokens generated (counted as they stream).", registry=registry
        )
        self.gpu_prefix_hit_tokens = Counter(
            "kvstash_gpu_prefix_hit_tokens",
            "Prompt tokens found in the engine's GPU prefix cache.",
            registry=registry,
        )
        self.external_hit_tokens = Counter(
            "kvstash_external_hit_tokens", "Prompt tokens loaded from the offload tiers.", registry=registry
        )
        self.loaded_tokens = Counter(
            "kvstash_kv_loaded_tokens",
            "Tokens whose KV was loaded from the offload tiers.",
            registry=registry,
        )
        self.loaded_bytes = Counter(
            "kvstash_kv_loaded_bytes", "Bytes of KV loaded from the offload tiers.", registry=registry
        )
        self.saved_tokens = Counter(
            "kvstash_kv_saved_tokens",
            "Prompt tokens whose KV was saved to the offload tiers.",
            registry=registry,
        )
        self.load_seconds = Counter(
            "kvstash_kv_load_seconds", "Seconds spent loading KV from the offload tiers.", registry=registry
        )
        self.load_throughput = Histogram(
            "kvstash_kv_load_throughput_gb_per_second",
            "Load throughput per request that loaded KV (GB/s).",
            buckets=_GBPS_BUCKETS,
            registry=registry,
        )
        self.pd_fallbacks = Counter(
            "kvstash_pd_fallbacks",
            "Consumer requests that recomputed part of the prompt a producer handed over, by reason.",
            ["reason"],
            registry=registry,
        )
        from connector.base import FALLBACK_REASONS  # torch: only where a server runs

        for reason in FALLBACK_REASONS:
            self.pd_fallbacks.labels(reason=reason)
        self.pd_handed_over_tokens = Counter(
            "kvstash_pd_handed_over_tokens",
            "Producer: prompt tokens whose KV was handed over (durable in the shared tier, or "
            "offered by the direct path) when the response returned.",
            registry=registry,
        )
        self.pd_handoffs = Counter(
            "kvstash_pd_handoffs",
            "Hand-overs by path (direct: NIXL, shared: the shared tier): a producer's answers, "
            "a consumer's requests.",
            ["path"],
            registry=registry,
        )
        for path in ("direct", "shared"):
            self.pd_handoffs.labels(path=path)
        self.ttft = Histogram(
            "kvstash_time_to_first_token_seconds",
            "Seconds from arrival to the first output token.",
            buckets=_TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "kvstash_inter_token_latency_seconds",
            "Seconds between consecutive output tokens of a request.",
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        registry.register(_EngineStateCollector(engine))

    def observe_output(self, num_new_tokens: int, ttft_s: float | None, inter_token_s: float | None) -> None:
        """One request got `num_new_tokens` tokens in one engine step. `ttft_s` is given
        for its first token, `inter_token_s` (seconds since its previous tokens, spread
        over the new ones) for later ones."""
        if num_new_tokens <= 0:
            return
        self.generation_tokens.inc(num_new_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if inter_token_s is not None:
            for _ in range(num_new_tokens):
                self.inter_token_latency.observe(inter_token_s)

    def observe_finished(self, output: RequestOutput, transfer: RequestTransferStats | None) -> None:
        """A request finished (any reason). `transfer` is the connector's figures for it
        (None when offload is off)."""
        self.requests.labels(finish_reason=output.finish_reason or "unknown").inc()
        metrics = output.metrics
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.gpu_prefix_hit_tokens.inc(metrics.num_local_cached_tokens)
        self.external_hit_tokens.inc(metrics.num_external_cached_tokens)
        if transfer is None:
            return
        self.loaded_tokens.inc(transfer.num_loaded_tokens)
        self.loaded_bytes.inc(transfer.num_loaded_bytes)
        self.saved_tokens.inc(transfer.num_saved_tokens)
        self.load_seconds.inc(transfer.load_seconds)
        if transfer.pd_fallback:
            self.pd_fallbacks.labels(reason=transfer.pd_fallback).inc()
        if transfer.pd_path:
            self.pd_handoffs.labels(path=transfer.pd_path).inc()
        if transfer.num_loaded_bytes > 0 and transfer.load_seconds > 0:
            self.load_throughput.observe(transfer.num_loaded_bytes / transfer.load_seconds / 1e9)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _EngineStateCollector(Collector):
    """Reads the engine's own counters at scrape time. Plain int reads from another
    thread: a scrape may see a step half-recorded, never a torn value."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        engine = self.engine
        block_manager = engine.block_manager
        num_used = block_manager.num_blocks - block_manager.num_free_blocks
        yield GaugeMetricFamily(
            "kvstash_kv_blocks_total", "KV blocks in the engine's pool.", block_manager.num_blocks
        )
        yield GaugeMetricFamily("kvstash_kv_blocks_used", "KV blocks held by running requests.", num_used)
        yield GaugeMetricFamily(
            "kvstash_kv_cache_usage_ratio",
            "Fraction of KV blocks in use (0..1).",
            num_used / block_manager.num_blocks,
        )
        spec = engine.stats.spec_decode
        yield CounterMetricFamily(
            "kvstash_spec_decode_draft_tokens", "Speculative draft tokens proposed.", spec.num_draft_tokens
        )
        yield CounterMetricFamily(
            "kvstash_spec_decode_accepted_tokens",
            "Speculative draft tokens accepted.",
            spec.num_accepted_tokens,
        )
        yield GaugeMetricFamily(
            "kvstash_spec_decode_acceptance_ratio",
            "Accepted / proposed draft tokens over the engine's life.",
            spec.acceptance_rate,
        )
        yield GaugeMetricFamily(
            "kvstash_spec_decode_mean_accepted_length",
            "Accepted draft tokens per request-step that carried drafts.",
            spec.mean_accepted_length,
        )
        yield CounterMetricFamily(
            "kvstash_engine_computed_tokens",
            "Tokens the model ran a forward pass on.",
            engine.stats.num_computed_tokens_total,
        )
        yield CounterMetricFamily(
            "kvstash_engine_step_errors",
            "Engine steps that raised (their requests were retried in smaller groups, or the one "
            "request that failed alone was ended with an error; serving went on).",
            engine.stats.num_step_errors,
        )
        yield CounterMetricFamily(
            "kvstash_engine_retried_requests",
            "Requests a failed engine step sent back to be retried in smaller groups.",
            engine.stats.num_requests_retried,
        )
        yield CounterMetricFamily(
            "kvstash_engine_probe_failures",
            "Probe steps (run after a request failed a step alone) that failed too: failures of the engine.",
            engine.stats.num_probe_failures,
        )
        exporter = getattr(engine.scheduler.connector, "exporter", None)
        if exporter is not None:  # a producer with the direct path
            yield GaugeMetricFamily(
                "kvstash_pd_direct_held_offers",
                "Producer, direct path: hand-overs whose chunks are pinned for a consumer now.",
                exporter.num_holds(),
            )
            released = CounterMetricFamily(
                "kvstash_pd_direct_released_offers",
                "Producer, direct path: hand-overs unpinned, by why (done: the consumer said so; "
                "expired: after --kv-direct-hold-s).",
                labels=["by"],
            )
            released.add_metric(["done"], exporter.num_released_done)
            released.add_metric(["expired"], exporter.num_released_expired)
            yield released
        tier_hits = CounterMetricFamily(
            "kvstash_tier_hit_chunks", "Chunks read from each offload tier.", labels=["tier"]
        )
        for tier, count in _tier_hits(engine).items():
            tier_hits.add_metric([tier], count)
        yield tier_hits
        tier_errors = CounterMetricFamily(
            "kvstash_tier_errors",
            "Failed calls to each offload tier (a read that failed is a miss, a write is dropped).",
            labels=["tier"],
        )
        for tier, count in _tier_errors(engine).items():
            tier_errors.add_metric([tier], count)
        yield tier_errors
        yield from _planner_and_breaker_metrics(engine)
        startup = GaugeMetricFamily(
            "kvstash_startup_phase_seconds",
            "Seconds each phase of the engine's start took (engine.startup_phases; "
            "cpu_tier_background: the CPU tier's slab, grown after ready).",
            labels=["phase"],
        )
        for phase, seconds in engine.startup.snapshot().items():
            startup.add_metric([phase], seconds)
        yield startup


def _planner_and_breaker_metrics(engine: EngineCore):
    """``kvstash_planner_*`` (decisions and the rates they used) and the lower tiers'
    circuit breakers (nothing without asynchronous loads)."""
    connector = engine.scheduler.connector
    step_time = GaugeMetricFamily(
        "kvstash_step_time_seconds",
        "The engine's step-time model (the planner and the prefill cap plan with it): "
        "step (every step), eager_step (a step with prompt tokens outside a CUDA graph, on top), "
        "token (per prompt token), pair (per query-key pair of attention).",
        labels=["term"],
    )
    for term, value in engine.step_times.parameters().items():
        step_time.add_metric([term.removesuffix("_s")], value)
    yield step_time
    yield GaugeMetricFamily(
        "kvstash_requests_waiting_for_remote_kv",
        "Requests waiting unadmitted while their KV is fetched into the CPU tier.",
        len(engine.scheduler.request_id_to_remote_wait),
    )
    planner = getattr(connector, "planner", None)
    if planner is not None:
        counts = dict(planner.counts)
        for name, text in (
            ("requests", "Requests the load-or-recompute planner decided."),
            ("cpu_tokens", "Prompt tokens the planner loaded from the CPU tier."),
            ("fetched_tokens", "Prompt tokens the planner fetched from lower tiers to load."),
            ("recomputed_tokens", "Prompt tokens the planner chose to recompute."),
            (
                "probes",
                "Background measurements of a lower tier the plans skip or measured slow (after the one at start).",
            ),
        ):
            yield CounterMetricFamily(f"kvstash_planner_{name}", text, counts[name])
        tier_rate = GaugeMetricFamily(
            "kvstash_planner_tier_read_bytes_per_second",
            "Read rate per tier the planner uses with `connections` reads in flight (measured moving "
            "average, or its prior; connections 0: the CPU tier's loads, whatever the reads in flight).",
            labels=["tier", "connections"],
        )
        prefill_rate = GaugeMetricFamily(
            "kvstash_planner_prefill_tokens_per_second",
            "Prefill rate of a whole prompt of prompt_tokens recomputed alone, predicted by the step-time model.",
            labels=["prompt_tokens"],
        )
        for (tier, connections), value in sorted(planner.rates.snapshot().items()):
            tier_rate.add_metric([tier, str(connections)], value)
        for name, value in planner.snapshot().items():
            kind, label = name.split(":", 1)
            if kind == "prefill":
                prefill_rate.add_metric([label], value)
        yield tier_rate
        yield prefill_rate
        yield GaugeMetricFamily(
            "kvstash_kv_bytes_per_token",
            "Bytes of one token's KV in a chunk (all layers, keys and values): a tier's bytes per second "
            "over this is its tokens per second (a router's tier costs).",
            planner.bytes_per_token,
        )
    cache_engine = engine.offload_cache_engine
    breakers = cache_engine.tiers.breakers if cache_engine is not None else {}
    if breakers:
        trips = CounterMetricFamily(
            "kvstash_tier_breaker_trips", "Times a tier's circuit breaker opened.", labels=["tier"]
        )
        skipped = CounterMetricFamily(
            "kvstash_tier_breaker_skipped",
            "Lookups and reads skipped because the tier's breaker was open.",
            labels=["tier"],
        )
        is_open = GaugeMetricFamily(
            "kvstash_tier_breaker_open", "1 while the tier is skipped by its breaker.", labels=["tier"]
        )
        for name, breaker in breakers.items():
            trips.add_metric([name], breaker.num_trips)
            skipped.add_metric([name], breaker.num_skipped)
            is_open.add_metric([name], int(breaker.is_open))
        yield trips
        yield skipped
        yield is_open


def _tier_hits(engine: EngineCore) -> dict[str, int]:
    """Chunk hits per tier name from the connector's tier manager ({} without offload)."""
    cache_engine = engine.offload_cache_engine
    if cache_engine is None:
        return {}
    tiers = cache_engine.tiers
    counters = tiers.counters()
    return {tier.name: counters.get(f"hits_{tier.name}", 0) for tier in tiers.tiers}


def _tier_errors(engine: EngineCore) -> dict[str, int]:
    """Failed calls per tier name, as the connector's tier manager counted them ({} without offload)."""
    cache_engine = engine.offload_cache_engine
    if cache_engine is None:
        return {}
    return {health.name: health.counts["errors"] for health in cache_engine.tiers.health.values()}
