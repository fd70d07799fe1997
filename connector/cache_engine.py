"""``CacheEngine``: masked, chunk-aligned lookup, store and retrieve (docs/architecture.md, Connector).

Masks have the form ``F…FT…T`` (Falses only at the front). True means "store /
retrieve this token"; False means the engine's GPU cache already holds it.
Retrieve reads every chunk overlapping the True region and writes only the
True tokens into the paged cache, so a False prefix need not be chunk-aligned
and no token already on the GPU is rewritten. Its result is a CPU bool mask,
True exactly for the tokens now in the paged cache from the store: a
contiguous run from the first True that ends before the first missing, corrupt
or failed chunk; nothing after that chunk is written.

The worker-side connector uses the two-phase forms (``plan_load`` /
``move_loads`` / ``finish_load`` and ``begin_store`` / ``finish_store``) to
overlap transfers with the forward pass; ``retrieve`` and ``store`` are the
same phases run back to back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from connector.base import LOAD_NOT_IN_CPU, SAVE_NO_CPU
from connector.scheduler_index import ChunkGeometry, SchedulerIndex
from connector.slot_grants import SlotGrants
from connector.tiers import PendingPut, TierManager
from connector.token_db import KV_LAYOUT, ChunkSpan, TokenDatabase
from connector.transfer import KVMover
from storage_backends.chunk import KVChunk

log = logging.getLogger(__name__)

Tokens = Sequence[int] | torch.Tensor


class LoadPlan(NamedTuple):
    """Chunks read from the tiers for one load, ready to move into the paged cache."""

    chunks: list[torch.Tensor]  # host [num_layers, 2, chunk_tokens_i, num_kv_heads, head_dim]
    slot_mappings: list[torch.Tensor]  # int64 [chunk_tokens_i] on the KV device, -1 = leave untouched
    held_keys: list[str]  # CPU-tier read pins to release after the move
    num_loaded_end: int  # tokens [start, num_loaded_end) are in the paged cache once moved
    #: tokens of [start, num_loaded_end) per tier they are read from ("cpu", "disk", ...)
    tier_to_num_tokens: dict[str, int]
    #: (key, slot id, ok) of the promotion slots granted to it (its report carries them)
    fills: list[tuple[str, int, bool]] = []


class PendingStore(NamedTuple):
    """Host buffers being filled from the paged cache; ``finish_store`` queues their
    write-through and says which granted slots they filled."""

    puts: list[PendingPut]
    num_stored_tokens: int
    #: the cache engine reserved the slots itself (it stands alone, or is a worker side
    #: alone): it also publishes them; else the worker reports the fills
    granted_here: bool = False

    @property
    def fills(self) -> list[tuple[str, int, bool]]:
        """``(key, slot id, True)`` of each granted slot filled (once the copies are done)."""
        return [(put.key, put.slot_id, True) for put in self.puts if put.slot_id is not None]


class CacheEngine:
    """One per connector; used from the engine's step loop (not re-entrant). Standing
    alone (``lookup``/``store``/``retrieve``: tests, benchmarks) it plays both roles: it
    grants the CPU tier's slots through its own :class:`SlotGrants` (``grants``, which the
    connector's scheduler side takes over) and fills them."""

    def __init__(
        self,
        token_db: TokenDatabase,
        tiers: TierManager,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        self.token_db = token_db
        self.tiers = tiers
        self.dtype = dtype
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.geometry = ChunkGeometry(
            num_layers, num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size()
        )
        self.chunk_shape = (num_layers, 2, token_db.chunk_size, num_kv_heads, head_dim)
        cpu = tiers.cpu
        #: the CPU tier's slots as granted (None: no CPU tier); the scheduler side's, in a connector
        self.grants: SlotGrants | None = None
        if cpu is not None:
            self.grants = SlotGrants(
                cpu.index, stores_in_cpu=not cpu.staging, write_through=bool(tiers.lower)
            )
        self._mover: KVMover | None = None
        #: CPU moves on a worker thread (``OffloadConfig.cpu_async_moves``: CI runs the async paths)
        self.cpu_async_moves = False
        #: CUDA loads from pinned slots read the host memory in the kernel (``OffloadConfig.direct_host_loads``)
        self.direct_host_loads = False
        self.num_corrupt_chunks = 0
        # Stores whose device→host copies are queued but maybe not done, oldest first:
        # (event after their copies or None on CPU, the store, called with its token count).
        self._stores_in_flight: list[tuple[torch.cuda.Event | None, PendingStore, Callable[[int], None]]] = []

    # ---- public API ----------------------------------------------------------
    def lookup(self, tokens: Tokens, pin: bool = False, *, cache_salt: str | None = None) -> int:
        """Number of leading tokens whose KV some tier holds (stops at the first missing
        chunk). ``pin=True`` keeps those chunks from eviction until the next retrieve of
        these tokens or the pin timeout. Otherwise side-effect free. ``cache_salt`` (the
        request's; every method here takes it) selects the salted chain of keys."""
        spans = self.token_db.chunk_spans(tokens, cache_salt)
        self.publish_finished_stores()
        self.settle_write_throughs()
        self.tiers.expire_pins()
        keys = [span.key for span in spans]
        num_chunks = self.tiers.contains_prefix(keys)
        if pin and num_chunks:
            self.tiers.pin(keys[:num_chunks])
        return spans[num_chunks - 1].end if num_chunks else 0

    def store(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None = None,
        *,
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [len(tokens)]
        cache_salt: str | None = None,
    ) -> int:
        """Store every chunk that overlaps the mask's True region (whole chunks, read
        from the paged cache at ``slot_mapping``). Returns the tokens newly stored."""
        start = self._check(tokens, mask, kv_caches, slot_mapping)
        self.settle_write_throughs()
        pending = self.begin_store(
            tokens, start, kv_caches=kv_caches, slot_mapping=slot_mapping, cache_salt=cache_salt
        )
        self.mover(kv_caches).synchronize()
        return self.finish_store(pending)

    def retrieve(
        self,
        tokens: Tokens,
        mask: torch.Tensor | None = None,
        *,
        kv_caches: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [len(tokens)]
        cache_salt: str | None = None,
    ) -> torch.Tensor:
        """Write the True tokens' KV from the tiers into the paged cache; returns the
        CPU bool mask [len(tokens)] of the tokens now there from the store."""
        start = self._check(tokens, mask, kv_caches, slot_mapping)
        self.settle_write_throughs()
        num_tokens = len(tokens)
        ret_mask = torch.zeros(num_tokens, dtype=torch.bool)
        if start == num_tokens:
            return ret_mask
        plan = self.plan_load(
            tokens, start, num_tokens, kv_caches=kv_caches, slot_mapping=slot_mapping, cache_salt=cache_salt
        )
        self.mover(kv_caches).wait_for_compute()
        self.move_loads([plan], kv_caches, [(0, self.num_layers)])
        self.finish_load(plan)
        ret_mask[start : plan.num_loaded_end] = True
        return ret_mask

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token (keys and values of every layer)."""
        return self.geometry.bytes_per_token

    def shape_of(self, span: ChunkSpan) -> tuple[int, ...]:
        """[num_layers, 2, num_tokens, num_kv_heads, head_dim] of the chunk ``span`` keys."""
        return self.geometry.shape_of(span)

    def scheduler_index(self) -> SchedulerIndex:
        """What a scheduler side over these tiers reads and pins (no bytes): the keys, the
        chunks' geometry, the tiers' membership and pins, and the CPU tier's slot grants,
        which it then takes over from this cache engine. Called once, by the factory."""
        return SchedulerIndex(self.token_db, self.geometry, self.tiers, self.grants)

    def settle_write_throughs(self) -> None:
        """Drop the write-through pins of the slots whose writes to the lower tiers ended
        (standing alone, or a worker side alone: no report carries them)."""
        if self.grants is not None:
            self.grants.write_through_done(self.tiers.take_written_through())

    # ---- phases --------------------------------------------------------------
    def mover(self, kv_caches: torch.Tensor) -> KVMover:
        """The mover for the KV tensor's device (made on first use)."""
        if self._mover is None or self._mover.device != kv_caches.device:
            self._mover = KVMover(
                kv_caches.device,
                self.dtype,
                self.chunk_shape,
                cpu_worker_thread=self.cpu_async_moves,
                direct_host_loads=self.direct_host_loads,
            )
        return self._mover

    def plan_load(
        self,
        tokens: Tokens,
        start: int,
        end: int,
        *,
        kv_caches: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [end]
        cache_salt: str | None = None,
        cpu_only: bool = False,
        slot_ids: Sequence[int] | None = None,
        promotion_slot_ids: Sequence[int] | None = None,
    ) -> LoadPlan:
        """Read the chunks that overlap tokens ``[start, end)`` of ``tokens`` (chunk keys
        come from all of ``tokens``, which may run past ``end``); with ``cpu_only`` only
        from the CPU tier (a step never waits on a lower tier). Stops at the first
        missing or corrupt chunk. ``slot_ids`` (``LoadSpec.slot_ids``): the CPU-tier slots the
        scheduler side READ-pinned for it, whose pins and the lookup's it drops when the load
        ends; None: this engine pins what it reads (released by :meth:`finish_load`) and
        releases the lookup pins of the chunks up to ``end``. ``promotion_slot_ids``
        (``LoadSpec.promotion_slot_ids``): slots granted to promote its lower-tier hits into
        (the plan's ``fills``); without them, its hits are promoted as the CPU tier finds room."""
        covering = [span for span in self.token_db.chunk_spans(tokens, cache_salt) if span.start < end]
        spans = [span for span in covering if span.end > start]
        keys = [span.key for span in spans]
        if slot_ids is not None:
            if len(slot_ids) != len(spans):
                raise ValueError(f"a load of {len(spans)} chunks names {len(slot_ids)} slot ids")
            cpu_chunks = {
                span.key: KVChunk(self.tiers.cpu.view(slot_id, self.shape_of(span)), KV_LAYOUT)
                for span, slot_id in zip(spans, slot_ids, strict=True)
                if slot_id != LOAD_NOT_IN_CPU
            }
            promotion_slots = {
                key: slot_id
                for key, slot_id in zip(keys, promotion_slot_ids or (), strict=False)
                if slot_id != LOAD_NOT_IN_CPU
            }
            chunks, held_keys, tier_names, fills = self.tiers.get_prefix(
                keys, cpu_only=cpu_only, cpu_chunks=cpu_chunks, promotion_slots=promotion_slots
            )
        else:
            chunks, held_keys, tier_names, fills = self.tiers.get_prefix(keys, cpu_only=cpu_only)
            # The lookup pinned every chunk up to its hit, also those before ``start``; they go
            # once the read pins hold what this load reads (a fetch's pins may be gone already).
            self.tiers.unpin([span.key for span in covering])
        tensors = []
        for span, chunk in zip(spans, chunks, strict=False):
            if not self._chunk_fits(span, chunk):
                break
            tensors.append(chunk.tensor)
        if not tensors:
            return LoadPlan([], [], held_keys, start, {}, fills)
        loaded = spans[: len(tensors)]
        num_loaded_end = min(end, loaded[-1].end)
        tier_to_num_tokens: dict[str, int] = {}
        for span, tier_name in zip(loaded, tier_names, strict=False):
            num_tokens = min(span.end, num_loaded_end) - max(span.start, start)
            tier_to_num_tokens[tier_name] = tier_to_num_tokens.get(tier_name, 0) + num_tokens
        # One host tensor of slots for every loaded chunk, -1 outside [start, num_loaded_end).
        slots = torch.full((loaded[-1].end - loaded[0].start,), -1, dtype=torch.int64)
        offset = loaded[0].start
        slots[start - offset : num_loaded_end - offset] = slot_mapping[start:num_loaded_end].cpu()
        slots = self.mover(kv_caches).to_device(slots)
        slot_mappings = [slots[span.start - offset : span.end - offset] for span in loaded]
        return LoadPlan(tensors, slot_mappings, held_keys, num_loaded_end, tier_to_num_tokens, fills)

    def move_loads(
        self, plans: Sequence[LoadPlan], kv_caches: torch.Tensor, layer_ranges: Sequence[tuple[int, int]]
    ) -> list:
        """Queue every plan's moves, range of layers by range, on the mover; -> one event
        per range, done once that range of every plan is in place (None on CPU, where the
        moves are done, or queued in order on the mover's thread)."""
        chunks = [chunk for plan in plans for chunk in plan.chunks]
        slot_mappings = [slots for plan in plans for slots in plan.slot_mappings]
        return self.mover(kv_caches).load_chunks(chunks, slot_mappings, kv_caches, layer_ranges)

    def finish_load(self, plan: LoadPlan) -> None:
        """Wait for the plan's moves and drop its CPU-tier read pins."""
        if self._mover is not None:
            self._mover.synchronize_loads()
        self.tiers.release(plan.held_keys)

    def begin_store(
        self,
        tokens: Tokens,
        start: int,
        *,
        kv_caches: torch.Tensor,
        slot_mapping: torch.Tensor,  # int64 [len(tokens)], valid for every token of the stored chunks
        cache_salt: str | None = None,
        slot_ids: Sequence[int] | None = None,
    ) -> PendingStore:
        """Queue copies of every chunk of ``tokens`` overlapping ``[start, len(tokens))``
        into host buffers: the CPU-tier slots ``slot_ids`` names (one per such chunk,
        ``SaveSpec.slot_ids``: the scheduler side's grants), or, with None, slots this
        engine grants itself. Chunks the CPU tier holds or fills already are skipped."""
        spans = [span for span in self.token_db.chunk_spans(tokens, cache_salt) if span.end > start]
        if not spans:
            return PendingStore([], 0)
        granted_here = slot_ids is None
        shapes = [self.shape_of(span) for span in spans]
        if slot_ids is None:
            self.tiers.expire_pins()  # stale pins must not keep slots from this store
            keys = [span.key for span in spans]
            slot_ids = (
                self.grants.grant_save(keys, shapes)
                if self.grants is not None
                else (SAVE_NO_CPU,) * len(keys)
            )
        elif len(slot_ids) != len(spans):
            raise ValueError(f"a save of {len(spans)} chunks names {len(slot_ids)} slot ids")
        host_slots = slot_mapping[spans[0].start : spans[-1].end].cpu()
        num_slots = kv_caches.shape[2] * kv_caches.shape[3]
        check_slot_range(
            host_slots, num_slots, f"every token of the chunks to store ({spans[0].start}..{spans[-1].end})"
        )
        mover = self.mover(kv_caches)
        mover.wait_for_compute()
        device_slots = mover.to_device(host_slots, for_store=True)
        offset = spans[0].start
        puts = []
        num_stored_tokens = 0
        for span, shape, slot_id in zip(spans, shapes, slot_ids, strict=True):
            pending = self.tiers.begin_put(span.key, shape, slot_id=slot_id, pin_memory=mover.on_cuda)
            if pending is None:
                continue
            try:
                mover.store(kv_caches, device_slots[span.start - offset : span.end - offset], pending.buffer)
            except Exception:
                if granted_here and pending.slot_id is not None:
                    self.grants.apply_fills([(span.key, pending.slot_id, False)])
                raise
            puts.append(pending)
            num_stored_tokens += span.end - span.start
        return PendingStore(puts, num_stored_tokens, granted_here)

    def finish_store(self, pending: PendingStore) -> int:
        """Queue the filled buffers' write-through (call after the mover synchronized) and,
        for slots granted here, publish them; returns tokens stored."""
        for put in pending.puts:
            self.tiers.end_put(put)
        if pending.granted_here and self.grants is not None:
            self.grants.apply_fills(pending.fills)
        return pending.num_stored_tokens

    def finish_store_later(self, pending: PendingStore, on_published: Callable[[int], None]) -> None:
        """Finish ``pending`` once its queued copies are done, without blocking now: call
        ``on_published(num_stored_tokens)``, then :meth:`finish_store`. Stores finish in the
        order given, from :meth:`publish_finished_stores` (each lookup and step polls it)."""
        mover = self._mover
        event = mover.record_stores() if mover is not None and (mover.on_cuda or mover.threaded) else None
        self._stores_in_flight.append((event, pending, on_published))
        self.publish_finished_stores()

    def publish_finished_stores(self, wait: bool = False) -> None:
        """Publish the stores whose copies finished (all of them with ``wait``, blocking
        until their copies are done). Called once per step, by ``lookup`` and by a flush."""
        while self._stores_in_flight:
            event, pending, on_published = self._stores_in_flight[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._stores_in_flight.pop(0)
            # told first: a report carries its fills before any write-through of them ends
            on_published(pending.num_stored_tokens)
            self.finish_store(pending)

    # ---- checks --------------------------------------------------------------
    def _chunk_fits(self, span: ChunkSpan, chunk) -> bool:
        expected = self.geometry.shape_of(span)
        tensor = chunk.tensor
        if tuple(tensor.shape) == expected and tensor.dtype == self.dtype and chunk.layout == KV_LAYOUT:
            return True
        self.num_corrupt_chunks += 1
        log.warning(
            "chunk %s has shape %s %s layout %s, expected %s %s %s: treated as a miss",
            span.key,
            tuple(tensor.shape),
            tensor.dtype,
            chunk.layout,
            expected,
            self.dtype,
            KV_LAYOUT,
        )
        return False

    def _check(
        self, tokens: Tokens, mask: torch.Tensor | None, kv_caches: torch.Tensor, slot_mapping: torch.Tensor
    ) -> int:
        """Validate a store/retrieve call; returns the index of the mask's first True
        (``len(tokens)`` when there is none)."""
        num_tokens = len(tokens)
        expected = f"[{self.num_layers}, 2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}]"
        if not isinstance(kv_caches, torch.Tensor) or kv_caches.dim() != 6:
            raise ValueError(f"kv_caches must be one tensor {expected}, got {_describe(kv_caches)}")
        shape = tuple(kv_caches.shape)
        if shape[0] != self.num_layers or shape[1] != 2 or shape[4:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"kv_caches has shape {list(shape)}, expected {expected}")
        if kv_caches.dtype != self.dtype:
            raise ValueError(f"kv_caches has dtype {kv_caches.dtype}, expected {self.dtype}")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
            raise ValueError(f"slot_mapping must be a 1-D int64 tensor, got {_describe(slot_mapping)}")
        if slot_mapping.dtype != torch.int64:
            raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
        if slot_mapping.numel() != num_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} entries but tokens has {num_tokens}")
        if slot_mapping.device.type != "cpu" and slot_mapping.device != kv_caches.device:
            raise ValueError(f"slot_mapping is on {slot_mapping.device}, kv_caches on {kv_caches.device}")
        start = mask_start(mask, num_tokens)
        if start < num_tokens:
            check_slot_range(slot_mapping[start:].cpu(), shape[2] * shape[3], "the masked-in tokens")
        return start


def check_slot_range(slots: torch.Tensor, num_slots: int, what: str) -> None:
    """ValueError unless every slot (a CPU int64 tensor) lies in [0, num_slots)."""
    if slots.numel() == 0:
        return
    low, high = (int(value) for value in torch.aminmax(slots))
    if low < 0 or high >= num_slots:
        raise ValueError(f"slot_mapping of {what} must lie in [0, {num_slots}), got min {low} max {high}")


def mask_start(mask: torch.Tensor | None, num_tokens: int) -> int:
    """Index of the first True of a ``F…FT…T`` mask of length ``num_tokens`` (0 for None,
    ``num_tokens`` for all-False). Any other form is a ``ValueError``."""
    if mask is None:
        return 0
    if not isinstance(mask, torch.Tensor) or mask.dim() != 1 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a 1-D bool tensor, got {_describe(mask)}")
    if mask.numel() != num_tokens:
        raise ValueError(f"mask has {mask.numel()} entries but tokens has {num_tokens}")
    host_mask = mask.cpu()
    num_false = num_tokens - int(host_mask.sum())
    if bool(host_mask[:num_false].any()):
        raise ValueError("mask must have the form F...FT...T (Falses only at the front)")
    return num_false


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return type(value).__name__
