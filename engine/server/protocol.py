"""OpenAI request bodies the server accepts (pydantic), and their translation into
`SamplingParams`. Responses are plain dicts built in `engine.server.responses`.

Only what the engine implements is accepted: one prompt and one choice (`n=1`),
no logprobs or echo. Unknown fields are ignored, as the OpenAI API does.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.cache_salt import check_cache_salt
from engine.config import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    #: not in the OpenAI API; vLLM and SGLang accept it too (0 disables it)
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: not in the OpenAI API: keep generating past EOS (benchmarks)
    ignore_eos: bool = False
    logprobs: int | bool | None = None
    #: not in the OpenAI API (vLLM's name): requests share cached KV (GPU prefix cache and
    #: offload tiers) only with requests of the same salt; absent = shared with every unsalted one
    cache_salt: str | None = None
    #: not in the OpenAI API (vLLM's name): disaggregated prefill/decode. A consumer is given
    #: the object a producer's response carried (its prompt's KV is durable in the shared
    #: tier, ``connector.base.KVTransferParams``); checked when the engine admits the request
    kv_transfer_params: dict | None = None

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        return check_cache_salt(value)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a request this server cannot honour, else None."""
        if self.n != 1:
            return "n", f"n must be 1 (one choice per request), got {self.n}"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported by this server"
        return None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def field_param(self, field_name: str) -> str:
        """The request field that a `SamplingParams` field came from (an error's `param`)."""
        return field_name

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """Raises SamplingParamsError naming the bad field (SamplingParams validates)."""
        max_tokens = self.requested_max_tokens()
        if max_tokens is None:
            max_tokens = default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop or None,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`. `prompt` is a string or a list of token ids (a list
    holding exactly one of those is accepted too, as the OpenAI client may send it)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported by this server"
        return super().unsupported()

    def single_prompt(self) -> str | list[int]:
        """The one prompt; raises ValueError for a batch or an empty prompt."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request, got a batch of {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`. `max_completion_tokens` (the newer name) wins over
    `max_tokens` when both are given."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def field_param(self, field_name: str) -> str:
        if field_name == "max_tokens" and self.max_completion_tokens is not None:
            return "max_completion_tokens"
        return field_name

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens
