"""The connector's CPU-memory tier: one chunk-shaped slot per chunk in a pinned slab.

Why not ``storage_backends``' ``cpu://`` backend: that one copies on every get
and put (its contract, right for a server holding bytes). The connector's
CPU tier sits on the transfer path, so here a slot *is* the staging buffer:
a store copies the paged cache straight into a slot (device → pinned host,
one DMA), a retrieve copies straight out of it (pinned host → device, one DMA).
Every slot holds ``[num_layers, 2, chunk_size, num_kv_heads, head_dim]`` of the
model's dtype, so slots never fragment and the byte cap is the slab's size.

Zero-copy reads: :meth:`get` returns a view into the slab. A view stays valid
only while its key holds a pin (:meth:`pin`) — the tier manager takes one for
every read and releases it after the transfer. Writes go through
:meth:`reserve` (a :class:`Reservation`: a slot that nobody can see yet) and
:meth:`publish` of that same reservation. Which slot holds which chunk, the pins and
the reservations are the tier's :class:`~connector.slot_index.SlotIndex` (``index``),
which holds no memory; this class adds the slab. Thread-safe.

The slab is made of pieces of about ``PIECE_BYTES``. Pinning host memory is slow (a 60 GB
tier took an engine from 39 s to 72 s to ready on an H100, issue 33), so with
``grow_in_background`` only the first piece is allocated by the constructor, and
:meth:`start_growing` (the engine calls it once it is ready) allocates the others on a
thread of its own, each piece's slots joining the index as it arrives. Until then the
tier is smaller: a store that finds no free slot is not kept in the CPU tier (it still
goes to the lower tiers through the save buffers), as when pinned chunks fill it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from connector.slot_index import PinKind, SlotIndex, SlotReservation
from storage_backends.base import StorageBackend
from storage_backends.chunk import KVChunk, decode_chunk, encode_chunk

#: alignment of the slab (the disk tier's O_DIRECT needs block-aligned memory)
_PAGE_BYTES = 4096
#: bytes per piece of the slab (whole slots; at least one slot)
PIECE_BYTES = 1 << 30

logger = logging.getLogger(__name__)

#: allocates one piece: (num_slots, slot_numel, dtype, pin_memory) -> [num_slots, slot_numel]
PieceAllocator = Callable[[int, int, torch.dtype, bool], torch.Tensor]


@dataclass(eq=False)
class Reservation:
    """One slot reserved for ``key`` by :meth:`PinnedChunkPool.reserve`: fill ``buffer``,
    then :meth:`~PinnedChunkPool.publish` or :meth:`~PinnedChunkPool.cancel` this object.
    Compared by identity: two reservations of one key are never the same."""

    slot: SlotReservation
    buffer: torch.Tensor  # the slot's view [num_layers, 2, num_tokens, num_kv_heads, head_dim]

    @property
    def key(self) -> str:
        return self.slot.key


class PinnedChunkPool(StorageBackend):
    """Byte-capped LRU pool of chunk slots; pinned host memory when ``pin_memory``."""

    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        chunk_shape: tuple[int, ...],  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]
        dtype: torch.dtype,
        *,
        pin_memory: bool,
        layout: str,
        staging: bool = False,
        grow_in_background: bool = False,
        allocate_piece: PieceAllocator | None = None,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        """``grow_in_background``: allocate the first piece now and the rest after
        :meth:`start_growing`; ``allocate_piece`` (default: pinned or page-aligned plain
        memory) is how a piece is made (tests pass a slow one)."""
        if len(chunk_shape) != 5 or chunk_shape[1] != 2:
            raise ValueError(
                f"chunk_shape must be [num_layers, 2, chunk_size, heads, head_dim], got {chunk_shape}"
            )
        self.slot_numel = math.prod(chunk_shape)
        self.slot_bytes = self.slot_numel * torch.empty((), dtype=dtype).element_size()
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots == 0:
            what = "staging area" if staging else "cpu tier"
            raise ValueError(
                f"{what} of {capacity_bytes} bytes cannot hold one chunk of {self.slot_bytes} bytes; "
                f"raise {'staging_bytes' if staging else 'cpu_bytes'} or lower chunk_size"
            )
        #: a staging area (no CPU tier configured): fetched chunks only, stores skip it
        self.staging = staging
        self.chunk_shape = tuple(chunk_shape)
        self.layout = layout
        self.pinned = pin_memory
        self.dtype = dtype
        self.slots_per_piece = max(1, min(self.num_slots, piece_bytes // self.slot_bytes))
        self._allocate_piece = allocate_piece or _page_aligned_slab
        start = time.perf_counter()
        #: the slab's pieces, in slot order; piece i holds slots [i * slots_per_piece, ...)
        self._pieces = [self._new_piece(0)]
        #: which slot holds which chunk, pins and reservations (no memory of its own)
        self.index = SlotIndex(self.num_slots, self._pieces[0].shape[0])
        while not grow_in_background and self.index.num_ready_slots < self.num_slots:
            self._add_piece()
        #: seconds the whole slab took to allocate (None while it grows)
        self.allocation_s: float | None = (time.perf_counter() - start) if not grow_in_background else None
        self._allocation_start = start
        self._grower: threading.Thread | None = None
        self._stop_growing = threading.Event()
        self._grown = threading.Event()
        if self.index.num_ready_slots == self.num_slots:
            self.allocation_s = time.perf_counter() - start
            self._grown.set()
        # slot id -> its full-chunk view, made on the slot's first use and kept: a read of
        # whole chunks then makes no tensor (each torch call gives up the GIL and waits to
        # take it back, per chunk, on the step's path while the disk tier's I/O threads run)
        self._slot_id_to_view: dict[int, torch.Tensor] = {}

    # ---- the slab's pieces ------------------------------------------------------
    def _new_piece(self, first_slot: int) -> torch.Tensor:
        num_slots = min(self.slots_per_piece, self.num_slots - first_slot)
        piece = self._allocate_piece(num_slots, self.slot_numel, self.dtype, self.pinned)
        if tuple(piece.shape) != (num_slots, self.slot_numel) or piece.dtype != self.dtype:
            raise ValueError(f"a slab piece must be [{num_slots}, {self.slot_numel}] of {self.dtype}")
        return piece

    def _add_piece(self) -> None:
        piece = self._new_piece(self.index.num_ready_slots)
        self._pieces.append(piece)  # before its slots are free: a reader finds its memory
        self.index.add_ready_slots(piece.shape[0])

    def start_growing(self) -> None:
        """Allocate the slab's other pieces on a thread of its own (idempotent). Called once
        by the engine when it is ready (not while it captures CUDA graphs: pinning is a
        driver call that a capture may forbid on other threads)."""
        if self._grown.is_set() or self._grower is not None:
            return
        self._grower = threading.Thread(target=self._grow, name="cpu-tier-slab", daemon=True)
        self._grower.start()

    def _grow(self) -> None:
        try:
            while self.index.num_ready_slots < self.num_slots and not self._stop_growing.is_set():
                self._add_piece()
        except (RuntimeError, MemoryError) as error:  # the host ran out: keep what there is
            logger.warning(
                "cpu tier: stopped growing at %.1f of %.1f GiB: %s",
                self.index.num_ready_slots * self.slot_bytes / (1 << 30),
                self.num_slots * self.slot_bytes / (1 << 30),
                error,
            )
        self.allocation_s = time.perf_counter() - self._allocation_start
        logger.info(
            "cpu tier: %.1f GiB in %d pieces%s ready %.1f s after it was created",
            self.index.num_ready_slots * self.slot_bytes / (1 << 30),
            len(self._pieces),
            " (pinned)" if self.pinned else "",
            self.allocation_s,
        )
        self._grown.set()

    def wait_grown(self, timeout_s: float | None = None) -> bool:
        """Wait until the slab stopped growing (all of it, or what the host gave); True if so."""
        return self._grown.wait(timeout_s)

    def close(self) -> None:
        """Stop growing the slab (a piece being allocated finishes first)."""
        self._stop_growing.set()
        if self._grower is not None:
            self._grower.join()
        super().close()

    def pieces(self) -> list[torch.Tensor]:
        """The slab's pieces allocated so far, in slot order (a snapshot: the list only grows;
        the direct path registers each with NIXL: connector.nixl_agents). Any thread."""
        return list(self._pieces)

    def view(self, slot_id: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The slab's memory of slot ``slot_id`` as a chunk of ``shape`` (no copy)."""
        if shape != self.chunk_shape:
            piece_index, row = divmod(slot_id, self.slots_per_piece)
            return self._pieces[piece_index][row, : math.prod(shape)].view(shape)
        view = self._slot_id_to_view.get(slot_id)
        if view is None:  # two threads may both make it: equal views, either one kept
            piece_index, row = divmod(slot_id, self.slots_per_piece)
            view = self._slot_id_to_view[slot_id] = self._pieces[piece_index][row].view(shape)
        return view

    def _check_shape(self, shape: tuple[int, ...]) -> None:
        expected = self.chunk_shape
        if (
            len(shape) != 5
            or shape[:2] != expected[:2]
            or shape[3:] != expected[3:]
            or not 0 < shape[2] <= expected[2]
        ):
            raise ValueError(f"chunk shape {tuple(shape)} does not fit a cpu-tier slot of shape {expected}")

    def fill(self, slot_id: int, chunk: KVChunk) -> bool:
        """Copy ``chunk`` into the granted slot ``slot_id`` (a promotion); False, copying
        nothing, when it is no chunk of this tier (dtype, layout or shape). No index change."""
        tensor = chunk.tensor
        if tensor.dtype != self.dtype or chunk.layout != self.layout:
            return False
        try:
            self._check_shape(tuple(tensor.shape))
        except ValueError:
            return False
        self.view(slot_id, tuple(tensor.shape)).copy_(tensor)
        return True

    # ---- the index's questions and pins ------------------------------------------
    def contains(self, keys: Sequence[str]) -> int:
        return self.index.contains(keys)

    def present(self, keys: Sequence[str]) -> list[bool]:
        return self.index.present(keys)

    def keys(self, prefix: str = "") -> list[str]:
        return self.index.keys(prefix)

    def pin(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> int:
        """Pin the leading present ``keys`` (stops at the first absent one); returns how many."""
        return self.index.pin(keys, kind)

    def pin_each(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> list[bool]:
        """Pin each present key (absent ones are skipped, not a stop); one lock for all."""
        return self.index.pin_each(keys, kind)

    def unpin(self, keys: Sequence[str], kind: PinKind = PinKind.LOOKUP) -> None:
        """Drop one pin of ``kind`` from each key (keys without such a pin are ignored)."""
        self.index.unpin(keys, kind)

    def pin_counts(self) -> dict[str, int]:
        """Pins held now, per kind (``lookup``, ``read``, ``write_through``, ``fetch``, ``deferred``)."""
        return self.index.pin_counts()

    def stats(self) -> dict[str, Any]:
        gauges = self.index.gauges()
        return {
            "num_keys": gauges["num_keys"],
            "bytes_used": gauges["num_used_slots"] * self.slot_bytes,
            "capacity_bytes": self.num_slots * self.slot_bytes,
            "num_slots": self.num_slots,
            "ready_bytes": self.index.num_ready_slots * self.slot_bytes,
            "slot_bytes": self.slot_bytes,
            "num_pinned": gauges["num_pinned"],
            "pinned_memory": self.pinned,
            **self.index.counters.snapshot(),
            "pins_by_kind": self.pin_counts(),
        }

    # ---- reads ---------------------------------------------------------------
    def get(self, key: str) -> KVChunk | None:
        """A zero-copy view of the chunk; hold a pin on ``key`` while reading it."""
        record = self.index.find(key)
        return None if record is None else KVChunk(self.view(*record), self.layout)

    def pin_and_get(self, keys: Sequence[str]) -> dict[str, KVChunk]:
        """Pin every present key and return its zero-copy view (the read path of a
        retrieve). Each returned key holds one READ pin to release with :meth:`unpin`."""
        # The views are made outside the index's lock: the READ pins keep the slots.
        return {
            key: KVChunk(self.view(slot_id, shape), self.layout)
            for key, (slot_id, shape) in self.index.pin_and_find(keys, PinKind.READ).items()
        }

    def get_encoded(self, key: str) -> bytes | None:
        if self.pin([key], PinKind.READ) == 0:
            return None
        try:
            chunk = self.get(key)
            return None if chunk is None else encode_chunk(chunk, key=key)
        finally:
            self.unpin([key], PinKind.READ)

    # ---- writes --------------------------------------------------------------
    def reserve(self, key: str, shape: tuple[int, ...]) -> Reservation | None:
        """A slot to fill with the chunk stored under ``key``, invisible until :meth:`publish`
        (see :meth:`SlotIndex.reserve`: None when ``key`` is stored or reserved already,
        ``CapacityError`` when pinned chunks leave no room)."""
        self._check_shape(tuple(shape))
        slot = self.index.reserve(key, tuple(shape))
        return None if slot is None else Reservation(slot, self.view(slot.slot_id, slot.shape))

    def publish(
        self, reservation: Reservation, *, num_pins: int = 0, kind: PinKind = PinKind.WRITE_THROUGH
    ) -> None:
        """Make a filled reservation readable, holding ``num_pins`` pins of ``kind`` (each
        released with :meth:`unpin`); ``ValueError`` for one that is not outstanding."""
        self.index.publish(reservation.slot, num_pins=num_pins, kind=kind)

    def cancel(self, reservation: Reservation) -> None:
        """Give back a reservation that will not be filled (the transfer failed); a
        reservation that is no longer outstanding is ignored."""
        self.index.cancel(reservation.slot)

    def put(self, key: str, chunk: KVChunk) -> None:
        if chunk.layout != self.layout:
            raise ValueError(f"cpu tier stores layout {self.layout!r}, got {chunk.layout!r}")
        reservation = self.reserve(key, tuple(chunk.tensor.shape))
        if reservation is None:
            return
        try:
            reservation.buffer.copy_(chunk.tensor)
        except Exception:
            self.cancel(reservation)
            raise
        self.publish(reservation)

    def put_encoded(self, key: str, data: bytes) -> None:
        self.put(key, decode_chunk(data, key=key))

    def delete(self, key: str) -> bool:
        """Remove ``key`` unless a reader holds a pin on it (its view must stay valid)."""
        return self.index.delete(key)


def _page_aligned_slab(num_slots: int, slot_numel: int, dtype: torch.dtype, pin_memory: bool) -> torch.Tensor:
    """``[num_slots, slot_numel]`` of ``dtype`` starting on a page boundary. Pinned memory is
    page-aligned already; plain memory is allocated one page larger and offset, so that the
    disk tier writes and reads slots with O_DIRECT (it falls back to buffered I/O, a
    kernel copy through the page cache, for memory that is not block-aligned)."""
    if pin_memory:
        return torch.empty((num_slots, slot_numel), dtype=dtype, pin_memory=True)
    element_size = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(num_slots * slot_numel * element_size + _PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % _PAGE_BYTES
    return raw[start : start + num_slots * slot_numel * element_size].view(dtype).view(num_slots, slot_numel)
