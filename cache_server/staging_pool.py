"""Staging areas of ended bulk connections, kept for the next connection of the same tenant.

A new staging area (``storage_backends.staging_area``) costs its first Put a page fault and a
fresh page per 4 KiB written: about 3 us a page on the 2-core VM (its freed memory goes back
to the host), 2 ms for a 2 MiB value and 7 ms for 8 MiB, once per connection. A client that
reconnects (a new process, a pool that closed an idle connection) would pay it again, so the
bulk server keeps the area of a connection that ended, pages and all, and hands it to the
next connection of the same tenant that asks for one at most that large.

Only the same tenant: the client that held an area may keep its mapping after it
disconnects, so whoever gets the area next shares it with that client, who may read the
values written there and scribble on them. A tenant may read and write its own keys anyway
(and scribbling makes the server refuse a value, never store another one: it verifies its
own copy), but another tenant's values must never pass through memory it can see.

An area in use is reserved in the memory tier like an upload in flight; a kept one is not
(it must not shrink the cache while nobody uses it), so the process may hold up to
``max_spare_bytes`` (the largest area the server grants) beyond the memory cap in kept
areas. An area that does not fit is freed. Called from the bulk server's connection
threads; thread-safe.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from cache_server.memory_tier import Reservation
from storage_backends.staging_area import StagingArea


@dataclass(eq=False)
class HeldArea:
    """A staging area with what the server holds for it: the descriptor it hands to clients
    (kept open so that it can be handed again), its read-only mapping and, while a connection
    uses it, its reserved room in the memory tier."""

    fd: int
    area: StagingArea
    reservation: Reservation | None

    def free(self) -> None:
        """Unmap, close and release the room (the area is gone for good)."""
        self.area.close()
        os.close(self.fd)
        self.release_room()

    def release_room(self) -> None:
        if self.reservation is not None:
            self.reservation.release()
            self.reservation = None


class StagingAreaPool:
    """Areas of ended connections, by tenant name, at most ``max_spare_bytes`` in all."""

    def __init__(self, max_spare_bytes: int) -> None:
        self.max_spare_bytes = max_spare_bytes
        self._spares: list[tuple[str, HeldArea]] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def num_spare_bytes(self) -> int:
        with self._lock:
            return sum(held.area.size for _, held in self._spares)

    def take(self, tenant_name: str, min_bytes: int) -> HeldArea | None:
        """The smallest kept area of ``tenant_name`` that holds ``min_bytes`` (no longer kept;
        the caller reserves its room again), or None."""
        with self._lock:
            fitting = [
                (held.area.size, index)
                for index, (name, held) in enumerate(self._spares)
                if name == tenant_name and held.area.size >= min_bytes
            ]
            if not fitting:
                return None
            return self._spares.pop(min(fitting)[1])[1]

    def keep(self, tenant_name: str, held: HeldArea) -> None:
        """Keep ``held`` for ``tenant_name``'s next connection, its room released, or free it
        when the pool is full (or closed)."""
        held.release_room()
        with self._lock:
            spare_bytes = sum(spare.area.size for _, spare in self._spares)
            if not self._closed and spare_bytes + held.area.size <= self.max_spare_bytes:
                self._spares.append((tenant_name, held))
                return
        held.free()

    def close(self) -> None:
        """Free every kept area; later ones are freed as they come (the server is stopping)."""
        with self._lock:
            self._closed = True
            spares, self._spares = self._spares, []
        for _, held in spares:
            held.free()
