"""OpenAI response bodies (plain dicts) and incremental text for streaming."""

from __future__ import annotations

import json
import time
from typing import Any

from engine.request import RequestOutput


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage(output: RequestOutput) -> dict[str, Any]:
    """OpenAI usage, with cached prompt tokens (GPU prefix + offload tiers) and the split
    between them under `kvstash` (an extension clients ignore)."""
    metrics = output.metrics
    num_prompt = metrics.num_prompt_tokens
    num_completion = len(output.token_ids)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {
            "cached_tokens": metrics.num_local_cached_tokens + metrics.num_external_cached_tokens
        },
        "kvstash": {
            "gpu_hit_tokens": metrics.num_local_cached_tokens,
            "external_hit_tokens": metrics.num_external_cached_tokens,
            "ttft_s": metrics.ttft_s,
        },
    }


def sse(data: dict | str) -> str:
    """One server-sent event line pair."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class ResponseBuilder:
    """Builds the bodies of one completion or chat completion (`chat` picks which)."""

    def __init__(self, response_id: str, model: str, chat: bool) -> None:
        self.response_id = response_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, output: RequestOutput, text: str) -> dict:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": output.finish_reason,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": output.finish_reason}
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage(output)
        return body

    def chunk(self, delta_text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        """One streamed chunk. For chat, the first chunk carries the role."""
        if self.chat:
            delta: dict[str, str] = {}
            if first:
                delta["role"] = "assistant"
            if delta_text is not None:
                delta["content"] = delta_text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, output: RequestOutput) -> dict:
        """The final chunk of `stream_options.include_usage`: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage(output)
        return body


class IncrementalText:
    """Turns cumulative outputs into text deltas for streaming.

    The engine keeps `output.text` current only when stop strings are set (and
    always at the end); otherwise the text so far is decoded here. A delta never
    ends in a partial UTF-8 character, and while running the last
    `len(longest stop) - 1` characters are held back, so text that a stop string
    later cuts off is never sent."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.num_held_back = max((len(s) for s in stop_strings), default=1) - 1
        self.num_sent_chars = 0

    def delta(self, output: RequestOutput) -> str:
        if output.finished:
            text = output.text
        else:
            if self.stop_strings:
                text = output.text
            else:
                text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.num_held_back)]
        if len(text) <= self.num_sent_chars:
            return ""
        delta = text[self.num_sent_chars :]
        self.num_sent_chars = len(text)
        return delta
