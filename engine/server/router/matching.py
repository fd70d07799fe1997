"""A prompt's cached prefix on each replica, per tier, from the replicas' KV indexes.

The names are the engines' own: GPU blocks by the chained block hash of
`engine.block_manager` (``root_hash(cache_salt)``, ``hash_block``), offload chunks by the
keys of `connector.token_db.TokenDatabase` (``key_prefix + namespace + ":" + hash``),
both seeded by the request's ``cache_salt``: a tenant's prompt can only match that
tenant's KV. A replica's block and chunk sizes come from its events, its key prefix and
namespace from its keys (`index.ReplicaIndex.key_heads`).

The prefix is attributed to the best tier that holds each part, as the engine loads it:
leading full blocks in the GPU prefix cache first, then chunk by chunk (until a chunk no
tier holds) the replica's CPU tier, its disk tier, or a shared tier (``redis``, ``grpc``),
which any replica can read: what one replica wrote through counts for every replica of
the same namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from connector.config import REMOTE_TIER_NAMES
from connector.token_db import TokenDatabase
from engine.block_manager import hash_block, root_hash
from kv_events.follower import EngineKV
from kv_events.messages import CPU, DISK, GPU

#: the shared tiers' media (kv_events: a write-through to them), in a fixed order
SHARED_MEDIA = tuple(sorted(REMOTE_TIER_NAMES))
#: tiers in the order a hit there is cheaper, as counted in `PrefixMatch`
TIERS = ("gpu", "cpu", "disk", "shared")


@dataclass(frozen=True)
class PrefixMatch:
    """Prompt tokens a replica would not recompute, by the tier they come from."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0
    shared: int = 0

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.disk + self.shared

    def by_tier(self) -> dict[str, int]:
        return {tier: getattr(self, tier) for tier in TIERS}


class PromptHashes:
    """One prompt's block hashes and chunk keys, made once per block size and key head and
    chunk size however many replicas ask."""

    def __init__(self, tokens: Sequence[int], cache_salt: str | None) -> None:
        self.tokens = list(tokens)
        self.cache_salt = cache_salt
        self._blocks: dict[int, list[str]] = {}
        self._chunks: dict[tuple[str, int], list[tuple[int, int, str]]] = {}

    def block_hashes(self, block_size: int) -> list[str]:
        """Hex hashes of the prompt's full blocks, as the engine's prefix cache names them."""
        if block_size not in self._blocks:
            parent, hashes = root_hash(self.cache_salt), []
            for start in range(0, len(self.tokens) - block_size + 1, block_size):
                parent = hash_block(parent, self.tokens[start : start + block_size])
                hashes.append(parent.hex())
            self._blocks[block_size] = hashes
        return self._blocks[block_size]

    def chunk_spans(self, key_head: str, chunk_size: int) -> list[tuple[int, int, str]]:
        """``(start, end, key)`` of each chunk (the trailing partial one too) under
        ``key_head`` (``key_prefix + namespace + ":"``)."""
        if (key_head, chunk_size) not in self._chunks:
            database = TokenDatabase(key_head[:-1], chunk_size, save_partial_chunks=True)
            spans = database.chunk_spans(self.tokens, self.cache_salt)
            self._chunks[key_head, chunk_size] = [(s.start, s.end, s.key) for s in spans]
        return self._chunks[key_head, chunk_size]


class SharedTiers:
    """The chunk keys replicas wrote through to the shared tiers (their sets, not copied),
    and the key head they were written under."""

    def __init__(self, states: Sequence[EngineKV | None], key_heads: Sequence[dict[str, str]]) -> None:
        self.sets = [
            keys
            for state in states
            if state is not None
            for medium in SHARED_MEDIA
            if (keys := state.medium_to_keys.get(medium))
        ]
        self.head = next((heads[m] for heads in key_heads for m in SHARED_MEDIA if m in heads), None)

    def __contains__(self, key: str) -> bool:
        return any(key in keys for keys in self.sets)


def match_prefix(
    prompt: PromptHashes,
    state: EngineKV | None,
    key_heads: dict[str, str],
    shared: SharedTiers,
    chunk_size: int,
) -> PrefixMatch:
    """The prompt's cached prefix on one replica (``state`` None: nothing known), with
    ``shared`` what the shared tiers hold and ``chunk_size`` the replicas' chunk size where
    this one has not said its own."""
    if state is None:
        return PrefixMatch()
    gpu = 0
    if state.block_size > 0:
        gpu = state.num_leading(GPU, prompt.block_hashes(state.block_size)) * state.block_size
    head = next(iter(key_heads.values()), None) or shared.head
    chunk_size = state.chunk_size or chunk_size
    if head is None or chunk_size <= 0:
        return PrefixMatch(gpu=gpu)
    own = {tier: state.medium_to_keys.get(tier, set()) for tier in (CPU, DISK)}
    found = {"cpu": 0, "disk": 0, "shared": 0}
    use_shared = shared.head == head
    for start, end, key in prompt.chunk_spans(head, chunk_size):
        if end <= gpu:
            continue
        if key in own[CPU]:
            tier = "cpu"
        elif key in own[DISK]:
            tier = "disk"
        elif use_shared and key in shared:
            tier = "shared"
        else:
            break
        found[tier] += end - max(start, gpu)
    return PrefixMatch(gpu=gpu, **found)
