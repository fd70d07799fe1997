"""Redis tier (standalone or Redis Cluster) through redis-py: one Redis key per chunk.

URLs::

    redis://[user:password@]host:port[/db][?ttl=SECONDS&timeout=SECONDS&codec=lz4&key_prefix=kvstash:]
    rediss://...                 (TLS; other redis-py query options such as ssl_ca_certs pass through)
    redis+cluster://host:port    (any one node of the cluster; the others are discovered)
    rediss+cluster://host:port

Each value is one serialized chunk (header + checksum + payload), so a write can
never half-land. Batch calls (``contains``, ``get_many``, ``put_many``) are one
pipelined round trip; in Cluster mode redis-py's cluster pipeline groups the
commands by node. Every socket operation is bounded by ``timeout`` (default 5 s):
a standalone call fails within one timeout, a Cluster call within three (it retries
twice to follow failovers). A failure raises :class:`BackendError` naming host:port. The connection pool
reconnects by itself, so the backend works again once Redis is back.

Redis evicts by its own ``maxmemory`` policy, so this tier has no pins and
reports ``capacity_bytes`` from Redis' ``maxmemory`` (None when unlimited).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from storage_backends.base import BackendError, StorageBackend
from storage_backends.chunk import (
    CODECS,
    ChunkFormatError,
    ChunkHeader,
    KVChunk,
    decode_verified_chunk,
    encode_chunk,
    verify_chunk,
)
from storage_backends.counters import Counters
from storage_backends.urls import parse_redis_url

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_KEY_PREFIX = "kvstash:"
NUM_CLUSTER_RETRIES = 2
_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


class RedisBackend(StorageBackend):
    name = "redis"

    def __init__(
        self,
        url: str,
        ttl_s: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        codec: str = "none",
        key_prefix: str = DEFAULT_KEY_PREFIX,
    ) -> None:
        """``url``: a redis-py URL (``redis://`` or ``rediss://``, or the ``+cluster`` forms) without our own parameters."""
        import redis  # optional: only the Redis tier needs redis-py
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        parts = urlsplit(url)
        if parts.scheme not in SCHEMES:
            raise ValueError(
                f"not a Redis URL: {url!r}; expected one of {', '.join(s + '://' for s in SCHEMES)}"
            )
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r} for the Redis tier; expected one of {CODECS}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"Redis ttl must be a positive number of seconds, got {ttl_s}")
        self.is_cluster = parts.scheme.endswith("+cluster")
        self.address = f"{parts.hostname or 'localhost'}:{parts.port or 6379}"
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.codec = codec
        self.key_prefix = key_prefix
        self._redis_errors = (redis.RedisError, OSError)
        self._counters = Counters()
        client_url = urlunsplit(parts._replace(scheme=parts.scheme.removesuffix("+cluster")))
        # Standalone: no retries, so a call never outlasts one timeout; a pooled socket that
        # a Redis restart closed is noticed and replaced by the pool when it is handed out.
        # Cluster: two retries let redis-py follow a topology change (a failover, moved slots).
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), NUM_CLUSTER_RETRIES if self.is_cluster else 0),
        }
        with self._guard("connect"):
            if self.is_cluster:
                self._client = RedisCluster.from_url(client_url, **options)
            else:
                self._client = redis.Redis.from_url(client_url, **options)

    @classmethod
    def from_url(cls, url: str) -> RedisBackend:
        """Split kvstash's own parameters (ttl, timeout, codec, key_prefix) from those redis-py reads."""
        try:
            client_url, kwargs = parse_redis_url(url)
        except ValueError as error:
            raise ValueError(f"redis URL {url!r}: {error}") from None
        return cls(client_url, **kwargs)

    @contextlib.contextmanager
    def _guard(self, operation: str) -> Iterator[None]:
        """Turn any redis-py or socket failure into a BackendError that names the server."""
        try:
            yield
        except self._redis_errors as exc:
            self._counters.add("errors")
            kind = "cluster" if self.is_cluster else "server"
            raise BackendError(
                f"redis {kind} {self.address}: {operation} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _redis_key(self, key: str) -> str:
        return self.key_prefix + key

    # ---- reads ---------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> int:
        num_present = 0
        for present in self.present(keys):
            if not present:
                break
            num_present += 1
        return num_present

    def present(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined EXISTS per key, one round trip."""
        if not keys:
            return []
        with self._guard("contains"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._redis_key(key))
            return [bool(exists) for exists in pipe.execute()]

    def _fetch_many(self, keys: Sequence[str]) -> list[tuple[bytes, ChunkHeader] | None]:
        """Values and their headers in one pipelined round trip, checksums verified (corrupt ones become None)."""
        if not keys:
            return []
        with self._guard("get"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._redis_key(key))
            values = pipe.execute()
        verified: list[tuple[bytes, ChunkHeader] | None] = []
        for key, value in zip(keys, values, strict=True):
            result = None
            if value is not None:
                try:
                    result = (value, verify_chunk(value, key=key))
                except ChunkFormatError as exc:
                    logger.warning("redis tier: corrupt value for key %r (treated as a miss): %s", key, exc)
                    self._counters.add("corrupt")
                    with contextlib.suppress(
                        BackendError
                    ):  # the read already succeeded; cleanup is best effort
                        self.delete(key)
            self._counters.add("hits" if result is not None else "misses")
            verified.append(result)
        return verified

    def get(self, key: str) -> KVChunk | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        return [None if found is None else decode_verified_chunk(*found) for found in self._fetch_many(keys)]

    def get_encoded(self, key: str) -> bytes | None:
        found = self._fetch_many([key])[0]
        return None if found is None else found[0]

    # ---- writes --------------------------------------------------------------
    def put(self, key: str, chunk: KVChunk) -> None:
        self.put_many([(key, chunk)])

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        for _, chunk in items:
            if not isinstance(chunk, KVChunk):
                raise TypeError(f"put needs a KVChunk, got {type(chunk).__name__}")
        self._store_many([(key, encode_chunk(chunk, self.codec, key=key)) for key, chunk in items])

    def put_encoded(self, key: str, data: bytes) -> None:
        verify_chunk(data, key=key)
        self._store_many([(key, data)])

    def _store_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        with self._guard("put"):
            pipe = self._client.pipeline(transaction=False)
            for key, data in items:
                pipe.set(self._redis_key(key), data, ex=self.ttl_s)
            pipe.execute()
        self._counters.add("puts", len(items))

    def delete(self, key: str) -> bool:
        with self._guard("delete"):
            return bool(self._client.delete(self._redis_key(key)))

    # ---- listing, stats, lifecycle ------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        """SCAN (on every primary in Cluster mode) for keys under ``key_prefix + prefix``."""
        pattern = _GLOB_SPECIAL.sub(r"\\\1", self._redis_key(prefix)) + "*"
        with self._guard("scan"):
            found = self._client.scan_iter(match=pattern, count=1000)
            start = len(self.key_prefix.encode("utf-8"))
            return [redis_key[start:].decode("utf-8") for redis_key in found]

    def stats(self) -> dict[str, Any]:
        """Counters, plus gauges from INFO (summed over primaries in Cluster mode); gauges are
        None while Redis is unreachable. ``num_keys`` counts kvstash's keys with a SCAN."""
        gauges: dict[str, Any] = {
            "num_keys": None,
            "bytes_used": None,
            "capacity_bytes": None,
            "reachable": False,
        }
        with contextlib.suppress(BackendError), self._guard("stats"):
            memory_infos = self._memory_infos()
            gauges["num_keys"] = len(self.keys())
            gauges["bytes_used"] = sum(int(info["used_memory"]) for info in memory_infos)
            max_memory = sum(int(info.get("maxmemory", 0)) for info in memory_infos)
            gauges["capacity_bytes"] = max_memory or None
            gauges["reachable"] = True
        return {**gauges, "address": self.address, "cluster": self.is_cluster, **self._counters.snapshot()}

    def _memory_infos(self) -> list[dict[str, Any]]:
        if not self.is_cluster:
            return [self._client.info("memory")]
        from redis.cluster import RedisCluster

        node_to_info = self._client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return list(node_to_info.values())

    def close(self) -> None:
        super().close()
        with contextlib.suppress(*self._redis_errors):
            self._client.close()
