"""The server's storage: a byte-capped memory tier, then optional disk, then optional Redis.

Values stay serialized end to end (``put_encoded`` / ``get_encoded``): the server
never turns them into tensors. The Put handler verifies a value's header and
checksum as it arrives (``value_assembly``), so a corrupt upload is refused with
``ValueError`` and stores nothing; lower tiers verify again on their own.

Writes go to every tier (write-through), so a restart with a disk tier keeps its
data; reads take the highest tier that holds the key and copy a lower-tier hit
into memory. A lower tier that fails (Redis down) is logged and skipped: the
memory tier still serves, and a value it lacks is a miss. Called from the server's worker threads; every method is
thread-safe because every backend is.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from cache_server.config import ServerConfig
from cache_server.memory_tier import EncodedMemoryTier
from storage_backends.base import BackendError, StorageBackend

logger = logging.getLogger(__name__)


class StoredValue(NamedTuple):
    data: bytes | memoryview
    #: name of the tier it was read from ("memory", "disk", "redis")
    tier: str


def _lower_tier_urls(config: ServerConfig) -> list[str]:
    """Backend URLs of the configured tiers below memory, highest first."""
    urls = []
    if config.disk_path is not None:
        disk_url = f"file://{Path(config.disk_path).resolve()}"
        if config.disk_bytes is not None:
            disk_url += f"?capacity={config.disk_bytes}"
        urls.append(disk_url)
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
        self.memory = tiers[0]
        self.memory_capacity_bytes = config.memory_bytes

    def put_verified(self, key: str, data: bytes | memoryview) -> None:
        """Store ``data`` in every tier. The caller (the Put handler, which checks header and
        checksum while the pieces arrive) has verified it and never changes it again, so the
        memory tier keeps it without a copy. ``ValueError`` (oversized value) stores nothing."""
        self.memory.put_verified(key, data)
        for tier in self.tiers[1:]:
            try:
                tier.put_encoded(key, data)
            except BackendError as error:
                logger.warning("write-through of %r to %s failed: %s", key, tier.name, error)

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
        """Highest-tier copy of ``key``; a lower-tier hit is copied into memory."""
        found = self._find(key)
        if found is not None and found.tier != self.memory.name:
            self.memory.put_encoded(key, found.data)
        return found

    def peek(self, key: str) -> StoredValue | None:
        """Like :meth:`get` but copies nothing into memory (for admin calls)."""
        return self._find(key)

    def contains(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` held by some tier; stops at the first key no tier holds."""
        num_hits = 0
        while num_hits < len(keys):
            # Each tier answers how far its own run reaches; any run extends the prefix.
            for tier in self.tiers:
                run = tier.contains(keys[num_hits:])
                if run > 0:
                    num_hits += run
                    break
            else:
                break
        return num_hits

    def delete(self, key: str) -> bool:
        """Remove ``key`` from every tier; True when some tier held it."""
        removed = [tier.delete(key) for tier in self.tiers]
        return any(removed)

    def key_to_tier(self, prefix: str = "") -> dict[str, str]:
        """Every key starting with ``prefix``, mapped to the highest tier holding it."""
        key_to_tier: dict[str, str] = {}
        for tier in reversed(self.tiers):
            for key in tier.keys(prefix):
                key_to_tier[key] = tier.name
        return key_to_tier

    def evict_prefix(self, prefix: str) -> int:
        """Remove every key starting with ``prefix`` (all keys for ""); returns how many."""
        return sum(1 for key in self.key_to_tier(prefix) if self.delete(key))

    def stats(self) -> list[dict[str, Any]]:
        """One ``stats()`` dict per tier, highest first, each with its ``name``."""
        return [{"name": tier.name, **tier.stats()} for tier in self.tiers]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
