"""The soak's load: concurrent users holding conversations with ``kvstash serve`` over
``/v1/completions`` (token ids), streamed or not, some streams dropped mid-way; and the
greedy requests whose outputs the soak compares with an engine without offload.

``benchmarks/soak.py`` runs one `Load` (``asyncio.run(load.run())``) for the soak's
duration, then `greedy_outputs` against the soaked server and a fresh reference server.
Every request's outcome is a record in ``Load.records``; a failed request is counted, it
never stops the load. Sends requests only; changes nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time


class Load:
    """The users: asyncio tasks over one httpx client, at most ``concurrency`` requests in
    flight, until the deadline (or ``max_requests``)."""

    def __init__(self, args: argparse.Namespace, url: str, vocab_size: int, t0: float) -> None:
        self.args, self.url, self.vocab_size, self.t0 = args, url, vocab_size, t0
        self.records: list[dict] = []
        self.num_done = 0
        #: conversations sent, newest last: (user, prompt token ids) of each one's last turn
        self.conversations: dict[tuple[int, int], list[int]] = {}
        self.deadline = t0 + args.duration

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        # ids 5.. (the tiny tokenizer's special tokens are 0-4)
        return [rng.randrange(5, self.vocab_size) for _ in range(n)]

    async def run(self) -> None:
        import httpx

        limits = httpx.Limits(
            max_connections=self.args.concurrency * 2, max_keepalive_connections=self.args.concurrency
        )
        semaphore = asyncio.Semaphore(self.args.concurrency)
        async with httpx.AsyncClient(timeout=self.args.request_timeout_s, limits=limits) as client:
            await asyncio.gather(*(self.user(client, semaphore, u) for u in range(self.args.users)))

    def stopped(self) -> bool:
        return time.monotonic() >= self.deadline or len(self.records) >= self.args.max_requests

    async def user(self, client, semaphore: asyncio.Semaphore, user: int) -> None:
        args = self.args
        rng = random.Random(args.seed * 1000 + user)
        conversation_index = 0
        while not self.stopped():
            long = rng.random() < args.long_share
            context = self.tokens(rng, args.long_tokens if long else args.short_tokens)
            key = (user, conversation_index)
            conversation_index += 1
            for turn in range(args.turns):
                if self.stopped():
                    return
                prompt = context + self.tokens(rng, args.question_tokens)
                stream = rng.random() < args.stream_share
                abort_after = rng.randint(1, 3) if stream and rng.random() < args.abort_share else None
                async with semaphore:
                    if self.stopped():
                        return
                    record = await self.request(client, prompt, stream, abort_after)
                record.update(user=user, conversation=key[1], turn=turn, long=long)
                self.records.append(record)
                self.num_done += 1
                if record["ok"] and not record["aborted"]:
                    self.conversations[key] = prompt
                # the conversation goes on with a fixed-length answer of its own
                context = prompt + self.tokens(rng, args.answer_tokens)

    async def request(self, client, prompt: list[int], stream: bool, abort_after: int | None) -> dict:
        body = {
            "model": "soak",
            "prompt": prompt,
            "max_tokens": self.args.answer_tokens,
            "temperature": 0.8,
            "seed": len(prompt),
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        started = time.monotonic()
        record = {
            "t_s": round(started - self.t0, 3),
            "prompt_tokens": len(prompt),
            "stream": stream,
            "aborted": False,
            "ok": False,
            "error": None,
            "external_hit_tokens": 0,
            "cached_tokens": 0,
        }
        try:
            if stream:
                await self._stream(client, body, record, abort_after)
            else:
                response = await client.post(f"{self.url}/v1/completions", json=body)
                if response.status_code != 200:
                    record["error"] = f"HTTP {response.status_code}: {response.text[:300]}"
                else:
                    self._usage(record, response.json().get("usage"))
                    record["ok"] = True
        except Exception as error:  # noqa: BLE001 - every failure is counted, none stops the soak
            record["error"] = f"{type(error).__name__}: {error}"
        record["latency_s"] = round(time.monotonic() - started, 4)
        return record

    async def _stream(self, client, body: dict, record: dict, abort_after: int | None) -> None:
        events = 0
        async with client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    if events == 0:
                        record["error"] = "stream ended without a token"
                    else:
                        record["ok"] = True
                    return
                event = json.loads(payload)
                if "error" in event:
                    record["error"] = f"error event: {event['error']}"
                    return
                self._usage(record, event.get("usage"))
                if event.get("choices"):
                    events += 1
                if abort_after is not None and events >= abort_after:
                    # leaving the block closes the response and its connection mid-stream
                    record["aborted"] = record["ok"] = True
                    return
        record["error"] = f"stream ended after {events} events without [DONE]"

    @staticmethod
    def _usage(record: dict, usage: dict | None) -> None:
        if not usage:
            return
        record["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        record["external_hit_tokens"] = (usage.get("kvstash") or {}).get("external_hit_tokens") or 0


def greedy_outputs(url: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Each prompt alone, greedily -> its text, token count, finish reason and hits."""
    import httpx

    outputs = []
    with httpx.Client(timeout=600) as client:
        for prompt in prompts:
            body = {"model": "soak", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            response = client.post(f"{url}/v1/completions", json={**body, "ignore_eos": True})
            response.raise_for_status()
            reply = response.json()
            usage = reply["usage"]
            outputs.append(
                {
                    "text": reply["choices"][0]["text"],
                    "completion_tokens": usage["completion_tokens"],
                    "finish_reason": reply["choices"][0]["finish_reason"],
                    "external_hit_tokens": (usage.get("kvstash") or {}).get("external_hit_tokens", 0),
                }
            )
    return outputs
