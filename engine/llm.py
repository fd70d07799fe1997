"""The offline API: `LLM(model, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineArgs, SamplingParams
from engine.engine_core import EngineCore, EngineStats
from engine.request import RequestOutput


class LLM:
    """Owns one `EngineCore`. `model` is a local Hugging Face folder (or an
    in-memory transformers config with `load_format="dummy"`); keyword arguments
    are `EngineArgs` fields."""

    def __init__(self, model: str | Path | Any, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine = EngineCore(model, EngineArgs(**engine_args))
        self._request_counter = itertools.count()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    def reset_prefix_cache(self) -> bool:
        """Forget the engine's GPU prefix cache (see `EngineCore.reset_prefix_cache`)."""
        return self.engine.reset_prefix_cache()

    def flush_kv_offload(self) -> None:
        """Wait for queued lower-tier offload writes (see `EngineCore.flush_kv_offload`)."""
        self.engine.flush_kv_offload()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _to_token_ids(self, prompt: str | Sequence[int], index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.engine.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model has none (pass token ids)")
            if not prompt:
                raise ValueError(f"prompt {index} is empty")
            return list(self.engine.tokenizer.encode(prompt))
        return list(prompt)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. Prompts are
        strings or lists of token ids. Raises ValueError before queuing anything
        when a prompt or its params are invalid."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        token_id_lists = [self._to_token_ids(p, i) for i, p in enumerate(prompts)]
        for index, (token_ids, params) in enumerate(zip(token_id_lists, params_list, strict=True)):
            self._check_prompt(index, token_ids, params)
        request_ids = [f"gen-{next(self._request_counter)}" for _ in prompts]
        for request_id, token_ids, params in zip(request_ids, token_id_lists, params_list, strict=True):
            self.engine.add_request(request_id, token_ids, params)
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(request_ids):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]

    def _check_prompt(self, index: int, token_ids: list[int], params: SamplingParams) -> None:
        """The engine's checks, run for every prompt before any is queued."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params {index} must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if not token_ids:
            raise ValueError(f"prompt {index} is empty")
        if len(token_ids) >= self.engine.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(token_ids)} tokens; the model's context is {self.engine.max_model_len}"
            )
        vocab_size = self.engine.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {index}: token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})"
            )
