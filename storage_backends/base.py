"""The one storage interface every tier implements (docs/architecture.md, Storage backends).

Keys are ``str`` (a namespace fingerprint followed by a chunk hash); values are
:class:`~storage_backends.chunk.KVChunk`. Backends are used from several threads
at once (the engine's step loop, the connector's save worker, server handlers),
so every public method is thread-safe.

Byte-level methods (``get_encoded`` / ``put_encoded``) exist so that a server
can move already-serialized chunks without decoding and re-encoding tensors.
Backends that hold bytes (disk, Redis, gRPC) implement the tensor methods on
top of them; the CPU tier holds tensors and encodes on demand.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from storage_backends.thread_pools import started_thread_pool

if TYPE_CHECKING:
    import torch

    from storage_backends.chunk import KVChunk


class BackendError(RuntimeError):
    """A tier could not serve a call (unreachable, timed out, refused).

    Callers in the connector treat it as a miss for reads and a dropped write
    for stores; the message names the tier and the reason.
    """


class CapacityError(BackendError):
    """A put found no room: every entry that could be evicted is pinned (or being written).

    Nothing was stored; the caller treats it like any dropped write (the chunk is
    recomputed if it is needed later). Counted in ``stats()['rejected']``.
    """


class StorageBackend(abc.ABC):
    """Abstract chunk store. Subclasses: CPU memory, local disk, Redis, gRPC."""

    #: short tier name used in stats, metrics and log lines ("cpu", "disk", "redis", "grpc")
    name: str = "backend"
    #: most reads of this tier that run at once however many threads call it (a pool of
    #: connections of its own: the gRPC tier's bulk connections); None: no bound of its own.
    #: The connector reads at most this many at a time and plans with that count.
    max_reads_in_flight: int | None = None

    # ---- reads ---------------------------------------------------------------
    @abc.abstractmethod
    def contains(self, keys: Sequence[str]) -> int:
        """Return how many leading ``keys`` are present (stops at the first miss).

        Side-effect free apart from LRU recency; one round trip for remote tiers.
        """

    @abc.abstractmethod
    def get(self, key: str) -> KVChunk | None:
        """Return the chunk, or None when absent or when its checksum fails
        (a corrupt value is logged, counted in ``stats()['corrupt']`` and treated as a miss)."""

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        """Batch form of :meth:`get`; remote tiers pipeline it in one round trip."""
        return [self.get(k) for k in keys]

    def get_into(self, key: str, out: torch.Tensor) -> KVChunk | None:
        """Read ``key`` straight into ``out`` and return a chunk viewing it, or None on a miss.

        ``out`` is a writable, contiguous CPU tensor of the chunk's dtype with at
        least as many elements as the chunk (a CPU-tier slot, often pinned); the
        returned chunk's tensor is a view of its leading elements. The value is
        verified before it is returned, in the calling thread; a corrupt value is
        a miss. Called from background fetch threads, several at once. This
        default reads with :meth:`get` and copies; byte tiers override it to read
        into ``out`` without the intermediate copy.
        """
        from storage_backends.chunk import KVChunk

        chunk = self.get(key)
        if chunk is None:
            return None
        numel = chunk.tensor.numel()
        if out.dtype != chunk.dtype or out.numel() < numel or not out.is_contiguous():
            raise ValueError(
                f"get_into: {key!r} holds {numel} elements of {chunk.dtype}; the buffer has "
                f"{out.numel()} of {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}"
            )
        view = out.reshape(-1)[:numel].view(chunk.tensor.shape)
        view.copy_(chunk.tensor)
        return KVChunk(view, chunk.layout)

    @abc.abstractmethod
    def get_encoded(self, key: str) -> bytes | None:
        """Return the serialized chunk (header + payload) after verifying it, or None."""

    # ---- writes --------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: str, chunk: KVChunk) -> None:
        """Store one chunk under ``key`` (one value per key, replacing any old one).

        May evict least-recently-used unpinned entries to respect the byte cap.
        Raises ``ValueError`` for a value that can never fit.
        """

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        """Batch form of :meth:`put`; remote tiers pipeline it."""
        for key, chunk in items:
            self.put(key, chunk)

    @abc.abstractmethod
    def put_encoded(self, key: str, data: bytes) -> None:
        """Store an already-serialized chunk. The header and checksum are
        verified first; a bad value raises ``ValueError`` and stores nothing."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True when something was removed."""

    # ---- pins (protection from eviction between lookup and retrieve) --------
    def pin(self, keys: Sequence[str]) -> int:
        """Protect the leading present ``keys`` from eviction until :meth:`unpin`.

        Returns how many leading keys are present (and pinned); pins are reference
        counted. Tiers that evict on their own (CPU, disk) override this; tiers
        whose eviction kvstash does not control (Redis, gRPC) only report presence.
        """
        return self.contains(keys)

    def unpin(self, keys: Sequence[str]) -> None:  # noqa: B027 - default: nothing was pinned
        """Drop one pin per key taken by :meth:`pin`; absent or unpinned keys are ignored."""

    # ---- listing, stats, lifecycle ------------------------------------------
    @abc.abstractmethod
    def keys(self, prefix: str = "") -> list[str]:
        """Keys that start with ``prefix`` (unordered)."""

    def keys_page(self, prefix: str, after: str | None, limit: int) -> list[str]:
        """Up to ``limit`` keys starting with ``prefix`` and greater than ``after`` (None: from the
        first), in key order. The cache server's ``ListKeys`` calls it once per page. This default
        lists and sorts every key; tiers with an ordered index answer in time proportional to the page."""
        return sorted(key for key in self.keys(prefix) if after is None or key > after)[:limit]

    def present(self, keys: Sequence[str]) -> list[bool]:
        """Whether each of ``keys`` is present (unlike :meth:`contains`, it does not stop at a miss).

        The cache server's ``Contains`` calls it once per tier over the keys no higher tier
        holds. This default asks :meth:`contains` key by key; remote tiers answer in one round trip.
        """
        return [self.contains([key]) == 1 for key in keys]

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and gauges: at least ``num_keys``, ``bytes_used``,
        ``capacity_bytes`` (None when unbounded), ``hits``, ``misses``, ``puts``,
        ``evictions``, ``corrupt``, ``errors``."""

    def close(self) -> None:
        """Release connections, threads and files. Idempotent; subclasses call ``super().close()``."""
        executor = self.__dict__.pop("_io_executor", None)
        if executor is not None:
            executor.shutdown(wait=True)

    # ---- asynchronous helpers (I/O off the caller's thread) -----------------
    def _executor(self) -> ThreadPoolExecutor:
        """This backend's two I/O threads, made on first use (no base ``__init__`` to require)."""
        executor = self.__dict__.get("_io_executor")
        if executor is None:
            created = started_thread_pool(2, f"kvstash-{self.name}")
            # dict.setdefault is atomic: two threads racing here end up sharing one executor.
            executor = self.__dict__.setdefault("_io_executor", created)
            if executor is not created:
                created.shutdown(wait=False)
        return executor

    def submit_put_many(self, items: Iterable[tuple[str, KVChunk]]) -> Future:
        """Run :meth:`put_many` on a background thread; the future carries its exception."""
        return self._executor().submit(self.put_many, list(items))

    def submit_get_many(self, keys: Sequence[str]) -> Future:
        """Run :meth:`get_many` on a background thread."""
        return self._executor().submit(self.get_many, list(keys))

    def __enter__(self) -> StorageBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
