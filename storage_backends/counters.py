"""Thread-safe event counters behind every backend's ``stats()``."""

from __future__ import annotations

import threading

#: ``verified``: checksum passes the backend itself ran over a value (counted by the disk tier's
#: reads and the cache server's memory tier's ``put_encoded``; the cache server's tests hold a
#: Get served from disk to one)
COUNTER_NAMES = ("hits", "misses", "puts", "evictions", "corrupt", "errors", "rejected", "verified")


class Counters:
    """Monotonic counts of backend events; one instance per backend (never shared)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._name_to_count = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: str, amount: int = 1) -> None:
        if name not in self._name_to_count:
            raise KeyError(f"unknown counter {name!r}; known: {COUNTER_NAMES}")
        with self._lock:
            self._name_to_count[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._name_to_count)
