"""What the scheduler-side connector reads of an engine's tiers (docs/architecture.md,
The connector contract): the chunk keys (``TokenDatabase``), the chunks' shapes, the CPU
tier's slot grants, and the tiers' membership and pins. No bytes, movers or tensors: those
are the worker side's (``connector.cache_engine.CacheEngine``).

One :class:`SchedulerIndex` per engine, made by ``connector/factory.py`` from the first
stage's cache engine (:meth:`CacheEngine.scheduler_index`) and handed to the scheduler
side at start-up; it never changes afterwards (its parts change under their own locks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from connector.slot_grants import SlotGrants
from connector.slot_index import SlotIndex
from connector.token_db import ChunkSpan, TokenDatabase


@dataclass(frozen=True)
class ChunkGeometry:
    """The KV of one chunk: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` elements
    of ``element_size`` bytes (a pipeline stage's layers, a tensor-parallel rank's heads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_size: int

    def shape_of(self, span: ChunkSpan) -> tuple[int, ...]:
        """The shape of the chunk ``span`` keys."""
        return (self.num_layers, 2, span.end - span.start, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token (keys and values of every layer)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.element_size


class TierIndex(Protocol):
    """The tiers as the scheduler side asks them (``connector.tiers.TierManager`` is one):
    which leading keys some tier holds, and pins against eviction. Any thread."""

    @property
    def names(self) -> list[str]:
        """The tiers' names, the CPU tier's first."""

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` some tier holds."""

    def pin(self, keys: Sequence[str]) -> None:
        """Protect ``keys`` from eviction in the tiers that evict on their own."""

    def unpin(self, keys: Sequence[str]) -> None:
        """Release the oldest pin of each of ``keys``."""


@dataclass(frozen=True)
class SchedulerIndex:
    """Everything the scheduler side reads or pins of the tiers; ``grants``: the CPU tier's
    slots as granted (None: no CPU tier)."""

    token_db: TokenDatabase
    geometry: ChunkGeometry
    tiers: TierIndex
    grants: SlotGrants | None = None

    @property
    def cpu_index(self) -> SlotIndex | None:
        """The CPU tier's index (which chunk each slot holds, pins; no memory)."""
        return None if self.grants is None else self.grants.index

    @property
    def cpu_staging(self) -> bool:
        """The CPU tier is a staging area: it holds fetched chunks only (stores skip it)."""
        return self.grants is not None and not self.grants.stores_in_cpu
