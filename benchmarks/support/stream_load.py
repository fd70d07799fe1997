"""A concurrent streaming OpenAI client for serving benchmarks: each request is a streamed
``/v1/completions`` of token ids (greedy, ``ignore_eos``) whose TTFT, times between tokens,
token count, end time, answer text and usage (cached prompt tokens, kvstash's GPU and
external hit split) are recorded; and the figures taken over such records.

Used by ``benchmarks/disaggregated.py`` and ``benchmarks/router.py``: they build the
arrivals (fixed-rate schedules, closed-loop users) with `wait_until` and `stream_completion`
over one ``httpx.AsyncClient`` (`client`). A failed request is recorded (``ok`` False,
``error``), never raised. Times are seconds from the caller's ``t0`` (``time.perf_counter``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from benchmarks.support.serving_stack import SERVED_MODEL_NAME


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds from the load's start."""

    request_id: str
    kind: str  # what the workload calls it: "decode", "long", "turn", ...
    target: str  # the base URL it was sent to
    num_prompt_tokens: int
    sent_s: float = 0.0
    first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one per streamed event with tokens
    end_s: float | None = None
    num_tokens: int = 0  # completion tokens (the usage's, else the events')
    cached_tokens: int = 0
    gpu_hit_tokens: int = 0
    external_hit_tokens: int = 0
    text: str = ""
    ok: bool = False
    error: str | None = None
    user: int | None = None
    turn: int | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.sent_s

    @property
    def itl_s(self) -> list[float]:
        """Times between consecutive token events."""
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def as_json(self, with_times: bool = False) -> dict:
        record = asdict(self)
        if not with_times:
            del record["token_times_s"]
        record["ttft_s"] = self.ttft_s
        return record


def client(max_connections: int, timeout_s: float):
    """One ``httpx.AsyncClient`` for a load of at most ``max_connections`` requests in flight."""
    import httpx

    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=timeout_s, limits=limits)


async def wait_until(t0: float, at_s: float) -> None:
    delay = t0 + at_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)


async def stream_completion(
    http, record: RequestRecord, prompt: list[int], max_tokens: int, t0: float, extra: dict | None = None
) -> RequestRecord:
    """Send ``prompt`` to ``record.target`` as a streamed greedy completion and fill ``record``."""
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    record.sent_s = time.perf_counter() - t0
    try:
        async with http.stream("POST", f"{record.target}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                now = time.perf_counter() - t0
                if payload == "[DONE]":
                    record.end_s = now
                    record.ok = bool(record.token_times_s)
                    if not record.ok:
                        record.error = "stream ended without a token"
                    break
                event = json.loads(payload)
                if "error" in event:
                    record.error = f"error event: {event['error']}"
                    break
                for choice in event.get("choices") or ():
                    # the server sends an event per step with new text, and the last one
                    if choice.get("text") or choice.get("finish_reason"):
                        record.text += choice.get("text") or ""
                        record.token_times_s.append(now)
                        if record.first_token_s is None:
                            record.first_token_s = now
                usage = event.get("usage")
                if usage:
                    record.num_tokens = usage.get("completion_tokens", 0)
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
                    hits = usage.get("kvstash") or {}
                    record.gpu_hit_tokens = hits.get("gpu_hit_tokens") or 0
                    record.external_hit_tokens = hits.get("external_hit_tokens") or 0
            else:
                record.error = "stream ended without [DONE]"
    except Exception as error:  # noqa: BLE001 - every failure is recorded, none stops the load
        record.error = f"{type(error).__name__}: {error}"
    if record.ok and not record.num_tokens:
        record.num_tokens = len(record.token_times_s)
    return record


# ---- figures -------------------------------------------------------------------------------------


def percentile_ms(values_s: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100, linear) of seconds, in ms; None for no values."""
    return float(np.percentile(values_s, q) * 1e3) if values_s else None


def mean_ms(values_s: list[float]) -> float | None:
    return float(np.mean(values_s) * 1e3) if values_s else None


def request_meets_slo(record: RequestRecord, ttft_ms: float, itl_ms: float) -> bool:
    """Finished, its TTFT ≤ ``ttft_ms`` and its own p99 time between tokens ≤ ``itl_ms``."""
    if not record.ok or record.ttft_s is None or record.ttft_s * 1e3 > ttft_ms:
        return False
    gaps = record.itl_s
    return not gaps or float(np.percentile(gaps, 99)) * 1e3 <= itl_ms


def makespan_s(records: list[RequestRecord]) -> float:
    """From the first request sent to the last one ended (0.0 when none ended)."""
    ended = [r.end_s for r in records if r.end_s is not None]
    return max(ended) - min(r.sent_s for r in records) if ended else 0.0
