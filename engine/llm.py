"""The offline API: `LLM(model, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.cache_salt import check_cache_salt
from engine.config import EngineArgs, SamplingParams
from engine.engine_core import EngineCore, EngineStats, EngineStepError
from engine.request import RequestOutput, index_of_token_outside_vocab

#: keys a dict prompt may hold (vLLM's TextPrompt / TokensPrompt)
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})

Prompt = str | Sequence[int] | Mapping[str, Any]


class LLM:
    """Owns one `EngineCore`. `model` is a local Hugging Face folder (or an
    in-memory transformers config with `load_format="dummy"`); keyword arguments
    are `EngineArgs` fields.

    With `nnodes` > 1 and `node_rank` ≥ 1 this host runs its share of node 0's engine's
    processes only: the constructor blocks until node 0's engine shuts down (it raises
    when node 0 never came, stopped on an error or went away; engine.pipeline.node), and
    the object has no engine (`engine` None; `generate` raises)."""

    def __init__(self, model: str | Path | Any, **engine_args: Any) -> None:
        unknown = set(engine_args) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        args = EngineArgs(**engine_args)
        self._request_counter = itertools.count()
        if args.node_rank > 0:
            from engine.pipeline.node import run_node

            args.validate()
            self.engine = None
            run_node(Path(model) if isinstance(model, str | Path) else None, args)
            return
        self.engine = EngineCore(model, args)

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

    def _split_prompt(self, prompt: Prompt, index: int) -> tuple[str | Sequence[int], str | None]:
        """(text or token ids, cache salt) of one prompt. A dict prompt is vLLM's form:
        ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``, with an optional
        ``"cache_salt"``; anything else is a ValueError naming the prompt."""
        if not isinstance(prompt, Mapping):
            return prompt, None
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(f"prompt {index}: unknown key(s) {', '.join(map(repr, unknown))}")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(f"prompt {index}: give exactly one of 'prompt' and 'prompt_token_ids'")
        if "prompt" in prompt and not isinstance(prompt["prompt"], str):
            raise ValueError(f"prompt {index}: 'prompt' must be a string")
        if "prompt_token_ids" in prompt and isinstance(prompt["prompt_token_ids"], str | bytes | Mapping):
            raise ValueError(f"prompt {index}: 'prompt_token_ids' must be a list of token ids")
        try:
            cache_salt = check_cache_salt(prompt.get("cache_salt"))
        except ValueError as error:
            raise ValueError(f"prompt {index}: {error}") from None
        return prompt.get("prompt", prompt.get("prompt_token_ids")), cache_salt

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order. A prompt is a
        string, a list of token ids, or a dict ``{"prompt": str}`` /
        ``{"prompt_token_ids": [...]}`` with an optional ``"cache_salt"`` (requests
        share cached KV only with requests of the same salt). Raises ValueError before
        queuing anything when a prompt or its params are invalid. A request that makes an
        engine step raise (alone: the engine retries the others) ends with finish_reason
        "error"; the other requests complete as usual."""
        if self.engine is None:
            raise RuntimeError("this LLM ran another node's ranks (node_rank > 0): node 0 generates")
        if isinstance(prompts, str | Mapping) or (prompts and isinstance(prompts[0], int)):
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
        split = [self._split_prompt(p, i) for i, p in enumerate(prompts)]
        token_id_lists = [self._to_token_ids(p, i) for i, (p, _) in enumerate(split)]
        cache_salts = [cache_salt for _, cache_salt in split]
        for index, (token_ids, params) in enumerate(zip(token_id_lists, params_list, strict=True)):
            self._check_prompt(index, token_ids, params)
        request_ids = [f"gen-{next(self._request_counter)}" for _ in prompts]
        for request_id, token_ids, params, cache_salt in zip(
            request_ids, token_id_lists, params_list, cache_salts, strict=True
        ):
            self.engine.add_request(request_id, token_ids, params, cache_salt=cache_salt)
        finished: dict[str, RequestOutput] = {}
        # (with async scheduling, also until the steps in flight after the last end are collected)
        while len(finished) < len(request_ids) or self.engine.num_steps_in_flight:
            try:
                outputs = self.engine.step()
            except EngineStepError as error:
                outputs = error.outputs  # the requests it ended (none while it retries)
            for output in outputs:
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
        bad = index_of_token_outside_vocab(token_ids, vocab_size)
        if bad is not None:
            raise ValueError(
                f"prompt {index}: token id {token_ids[bad]!r} is outside the vocabulary [0, {vocab_size})"
            )
