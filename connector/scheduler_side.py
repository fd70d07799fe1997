"""Scheduler-side connector: decides what each step loads and saves (no tensors
other than slot maps). Called only from the engine's scheduler thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connector.base import (
    ConnectorMetadata,
    ConnectorRequest,
    KVConnectorScheduler,
    LoadSpec,
    RequestTransferStats,
    SaveSpec,
    ScheduledRequest,
)
from connector.cache_engine import CacheEngine
from connector.tracker import TransferTracker


def slot_mapping_for(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """int64 [num_tokens]: slot of token i = block_ids[i // block_size] * block_size + i % block_size."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    positions = torch.arange(num_tokens, dtype=torch.int64)
    blocks = torch.as_tensor(
        list(block_ids[: (num_tokens + block_size - 1) // block_size]), dtype=torch.int64
    )
    return blocks[positions // block_size] * block_size + positions % block_size


@dataclass
class _SaveState:
    prompt: tuple[int, ...]
    #: leading prompt tokens already stored (or being stored)
    num_saved: int
    #: num_computed_tokens the request should show next step (None before its first step)
    num_expected_computed: int | None = None
    #: the request's salt: its chunk keys are those of this salted chain
    cache_salt: str | None = None


class OffloadScheduler(KVConnectorScheduler):
    """Looks up prompts in the tiers, records loads at admission, and emits saves of
    prompt chunks as they are computed (plus the trailing partial chunk at the end
    of the prompt when ``save_partial_chunks``). Output tokens are never saved, so
    uncomputed or rejected speculative tokens cannot reach the store."""

    def __init__(self, cache_engine: CacheEngine, tracker: TransferTracker, *, block_size: int) -> None:
        self.cache_engine = cache_engine
        self.tracker = tracker
        self.block_size = block_size
        self.chunk_size = cache_engine.token_db.chunk_size
        self.save_partial_chunks = cache_engine.token_db.save_partial_chunks
        # request id -> (num_computed_tokens, lookup hit) of its latest get_num_new_matched_tokens
        self._request_id_to_match: dict[str, tuple[int, int]] = {}
        self._request_id_to_save: dict[str, _SaveState] = {}
        self._pending_loads: list[LoadSpec] = []

    @staticmethod
    def _prompt(request: ConnectorRequest) -> tuple[int, ...]:
        return tuple(request.all_token_ids[: request.num_prompt_tokens])

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> int:
        num_hit = self.cache_engine.lookup(self._prompt(request), cache_salt=request.cache_salt)
        self._request_id_to_match[request.request_id] = (num_computed_tokens, num_hit)
        # The last prompt token is always computed: its logits give the first output token.
        return max(0, min(num_hit, request.num_prompt_tokens - 1) - num_computed_tokens)

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        prompt = self._prompt(request)
        num_gpu_hit, num_hit = self._request_id_to_match.pop(request.request_id, (0, 0))
        self.tracker.admitted(request.request_id, len(prompt), num_gpu_hit, num_external_tokens)
        # Chunks wholly present need no save; a present trailing partial chunk counts only
        # when the whole prompt is present.
        num_stored = num_hit if num_hit == len(prompt) else num_hit - num_hit % self.chunk_size
        state = self._request_id_to_save.get(request.request_id)
        if state is None:
            self._request_id_to_save[request.request_id] = _SaveState(
                prompt, num_stored, cache_salt=request.cache_salt
            )
        if num_external_tokens <= 0:
            return
        num_load_end = num_gpu_hit + num_external_tokens
        # Pinned until the load's retrieve or the pin timeout.
        self.cache_engine.lookup(prompt, pin=True, cache_salt=request.cache_salt)
        self._pending_loads.append(
            LoadSpec(
                request.request_id,
                prompt,
                slot_mapping_for(block_ids, self.block_size, num_load_end),
                num_gpu_hit,
                num_load_end,
                request.cache_salt,
            )
        )

    def build_connector_meta(self, scheduled: Sequence[ScheduledRequest]) -> ConnectorMetadata:
        metadata = ConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for entry in scheduled:
            state = self._request_id_to_save.get(entry.request_id)
            if state is None:
                continue
            num_prompt = len(state.prompt)
            num_computed = entry.num_computed_tokens
            expected = state.num_expected_computed
            if expected is not None and num_computed < expected and num_computed < state.num_saved:
                # A load failure or preemption moved the request back: its KV past that point
                # is recomputed, so save again from there (chunks still in the CPU tier are skipped).
                state.num_saved = num_computed - num_computed % self.chunk_size
            num_computed_after = min(entry.num_computed_tokens + entry.num_scheduled_tokens, num_prompt)
            state.num_expected_computed = entry.num_computed_tokens + entry.num_scheduled_tokens
            num_save_end = num_computed_after - num_computed_after % self.chunk_size
            if num_computed_after == num_prompt and self.save_partial_chunks:
                num_save_end = num_prompt
            if num_save_end <= state.num_saved:
                continue
            metadata.saves.append(
                SaveSpec(
                    entry.request_id,
                    state.prompt,
                    slot_mapping_for(entry.block_ids, self.block_size, num_save_end),
                    state.num_saved,
                    num_save_end,
                    state.cache_salt,
                )
            )
            self.tracker.save_issued(entry.request_id)
            state.num_saved = num_save_end
        return metadata

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> bool:
        self._request_id_to_save.pop(request.request_id, None)
        self._request_id_to_match.pop(request.request_id, None)
        # Ended by a step that raised while scheduling: its load must never reach freed blocks.
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != request.request_id]
        # The engine writes the request's one log line with these figures (request_stats).
        _, sending = self.tracker.finish(request.request_id)
        return sending

    def request_rolled_back(self, request: ConnectorRequest) -> None:
        self._request_id_to_match.pop(request.request_id, None)
        self._pending_loads = [spec for spec in self._pending_loads if spec.request_id != request.request_id]

    def flush(self) -> None:
        self.cache_engine.publish_finished_stores(wait=True)
        self.cache_engine.tiers.flush()

    def request_stats(self, request_id: str) -> RequestTransferStats | None:
        return self.tracker.stats(request_id)
