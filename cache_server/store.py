"""The server's storage: a byte-capped memory tier, then optional disk, then optional Redis.

Values stay serialized end to end (``put_encoded`` / ``get_encoded``): the server
never turns them into tensors. The Put handler verifies a value's header and
checksum as it arrives (``value_assembly``), so a corrupt upload is refused with
``ValueError`` and stores nothing; lower tiers verify again on their own.

Writes go to every tier (write-through), so a restart with a disk tier keeps its
data; reads take the highest tier that holds the key and keep a lower-tier hit
in memory too (the very buffer that tier verified as it read it: no copy, no
second checksum). A lower tier that fails (Redis down) is logged and skipped by every
call (Get, Put, Contains, Delete, listing, Evict, Clear): the memory tier still
serves, and a value it lacks is a miss. Called from the server's worker threads; every method is
thread-safe because every backend is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from cache_server.config import ServerConfig
from cache_server.memory_tier import EncodedMemoryTier, Reservation
from storage_backends.base import BackendError, CapacityError, StorageBackend

logger = logging.getLogger(__name__)


class StoredValue(NamedTuple):
    data: bytes | memoryview
    #: name of the tier it was read from ("memory", "disk", "redis")
    tier: str


def _lower_tier_urls(config: ServerConfig) -> list[str]:
    """Backend URLs of the configured tiers below memory, highest first."""
    urls = []
    if config.disk_path is not None:
        params = [] if config.disk_direct_io else ["direct_io=0"]
        if config.disk_bytes is not None:
            params.insert(0, f"capacity={config.disk_bytes}")
        disk_url = f"file://{Path(config.disk_path).resolve()}"
        urls.append(disk_url + ("?" + "&".join(params) if params else ""))
    if config.redis_url is not None:
        urls.append(config.redis_url)
    return urls


class TieredStore:
    """Memory → disk → Redis, built from a :class:`ServerConfig`. Owns its backends."""

    def __init__(self, config: ServerConfig) -> None:
        tiers: list[StorageBackend] = [EncodedMemoryTier(config.memory_bytes)]
        try:
            lower_urls = _lower_tier_urls(config)
            if lower_urls:
                # The registry imports the backend modules; a memory-only server needs none of them.
                from storage_backends import create_backend

                tiers.extend(create_backend(url) for url in lower_urls)
        except Exception:
            for tier in tiers:
                tier.close()
            raise
        self.tiers: tuple[StorageBackend, ...] = tuple(tiers)
        self.memory: EncodedMemoryTier = tiers[0]
        self.memory_capacity_bytes = config.memory_bytes
        #: the disk tier's cap (None: no disk tier or no cap); the Put handlers refuse a larger
        #: value before it is uploaded, so a refused Put stores nothing
        self.disk_capacity_bytes = config.disk_bytes if config.disk_path is not None else None

    def put_verified(
        self, key: str, data: bytes | memoryview, reservation: Reservation | None = None
    ) -> None:
        """Store ``data`` in every tier. The caller (the Put handler, which checks header and
        checksum while the pieces arrive) has verified it and never changes it again, so the
        memory tier keeps it without a copy. ``reservation`` (the memory tier's room held for
        this upload) becomes the entry's room. ``ValueError`` (a value some tier can never hold)
        leaves the key stored nowhere, so the refusal the client sees is the whole truth; a lower
        tier that is down (``BackendError``) is logged and skipped."""
        self.memory.put_verified(key, data, reservation)
        for tier in self.tiers[1:]:
            try:
                tier.put_encoded(key, data)
            except BackendError as error:
                logger.warning("write-through of %r to %s failed: %s", key, tier.name, error)
            except ValueError:
                self.delete(key)
                raise

    def _find(self, key: str) -> StoredValue | None:
        for tier in self.tiers:
            try:
                data = tier.get_encoded(key)
            except BackendError as error:
                logger.warning("read of %r from %s failed (treated as a miss): %s", key, tier.name, error)
                continue
            if data is not None:
                return StoredValue(data, tier.name)
        return None

    def get(self, key: str) -> StoredValue | None:
        """Highest-tier copy of ``key``; a lower-tier hit is kept in memory too when there is room.

        Every tier's ``get_encoded`` returns a value it verified (header, key hash, checksum)
        in that very read, as a buffer nobody else changes, so the memory tier keeps that same
        object (``put_verified``): no second checksum pass, no copy."""
        found = self._find(key)
        if found is not None and found.tier != self.memory.name:
            try:
                self.memory.put_verified(key, found.data)
            except (CapacityError, ValueError) as error:
                # pins or uploads in flight hold the room, or the value is larger than the whole
                # memory tier (written under a larger --memory-gb): serve it anyway
                logger.debug("not promoting %r into memory: %s", key, error)
        return found

    def peek(self, key: str) -> StoredValue | None:
        """Like :meth:`get` but copies nothing into memory (for admin calls)."""
        return self._find(key)

    def contains(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` held by some tier; stops at the first key no tier holds.

        One ``present`` call per tier over the keys no higher tier holds, so the work is at
        most (number of tiers) x len(keys) lookups however the keys are spread over the tiers.
        A tier that fails is skipped (its keys count as absent)."""
        missing_positions = list(range(len(keys)))
        for tier in self.tiers:
            if not missing_positions:
                break
            try:
                flags = tier.present([keys[position] for position in missing_positions])
            except BackendError as error:
                logger.warning("contains on %s failed (treated as misses): %s", tier.name, error)
                continue
            missing_positions = [
                position for position, found in zip(missing_positions, flags, strict=True) if not found
            ]
        return missing_positions[0] if missing_positions else len(keys)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier that answers; True when one of them held it. A tier
        that fails is logged and skipped (its copy stays until it is back and the key is deleted again)."""
        removed = False
        for tier in self.tiers:
            try:
                removed = tier.delete(key) or removed
            except BackendError as error:
                logger.warning("delete of %r from %s failed (skipped): %s", key, tier.name, error)
        return removed

    def _answering_tiers(self, operation: str, call) -> list[tuple[StorageBackend, Any]]:
        """``(tier, call(tier))`` for every tier, highest first, skipping (and logging) tiers that fail."""
        results = []
        for tier in self.tiers:
            try:
                results.append((tier, call(tier)))
            except BackendError as error:
                logger.warning("%s on %s failed (skipped): %s", operation, tier.name, error)
        return results

    def key_to_tier(self, prefix: str = "") -> dict[str, str]:
        """Every key starting with ``prefix``, mapped to the highest answering tier holding it."""
        key_to_tier: dict[str, str] = {}
        for tier, keys in reversed(self._answering_tiers("listing", lambda tier: tier.keys(prefix))):
            for key in keys:
                key_to_tier[key] = tier.name
        return key_to_tier

    def keys_page(self, prefix: str, after: str | None, limit: int) -> tuple[list[tuple[str, str]], bool]:
        """The first ``limit`` keys (in key order) starting with ``prefix`` and greater than
        ``after``, each with the highest tier holding it, and whether more follow.

        Each tier lists at most ``limit + 1`` keys from its own ordered index, so a page costs
        time proportional to the page on the memory and disk tiers (Redis has no order: SCAN)."""
        key_to_tier: dict[str, str] = {}
        pages = self._answering_tiers("listing", lambda tier: tier.keys_page(prefix, after, limit + 1))
        for tier, keys in reversed(pages):
            for key in keys:
                key_to_tier[key] = tier.name
        # Any key among the first `limit` of the union is among the first `limit` of each tier holding it.
        ordered = sorted(key_to_tier)
        return [(key, key_to_tier[key]) for key in ordered[:limit]], len(ordered) > limit

    def evict_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` (all keys for "") from the tiers that answer;
        returns how many."""
        return sum(1 for key in self.key_to_tier(prefix) if self.delete(key))

    def stats(self) -> list[dict[str, Any]]:
        """One ``stats()`` dict per tier, highest first, each with its ``name``."""
        return [{"name": tier.name, **tier.stats()} for tier in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
