"""The clients of ``benchmarks/cache_server.py``'s Put/Get cells, one per thread: the
engine's ``grpc://`` tier over each transport, and redis-py. Both offer the same calls
(``put``, ``put_many``, ``get``, ``get_into``, ``reserve``, ``close``) over the same
serialized chunk bytes.

Made by the benchmark for every cell and round, closed at its end. A ``GrpcClient`` that
the tier served over another transport than the one asked for raises on ``close``: the
cell measured the wrong path.
"""

from __future__ import annotations

import torch

TRANSPORTS = ("unix", "tcp", "grpc")
#: URL query per transport (the tier picks the Unix socket by itself on the same host)
TRANSPORT_QUERY = {"unix": "", "tcp": "&local=off", "grpc": "&bulk=off"}


class GrpcClient:
    """The engine's grpc:// tier (its wire path; it verifies each Get's checksum, redis-py does not)."""

    def __init__(self, address: str, transport: str, bulk_connections: int) -> None:
        from storage_backends import create_backend

        query = f"timeout=60&bulk_connections={bulk_connections}{TRANSPORT_QUERY[transport]}"
        self._backend = create_backend(f"grpc://{address}?{query}")
        self.transport = transport

    def put(self, key: str, data: bytes) -> None:
        self._backend.put_encoded(key, data)

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """Pipelined Puts (the engine's write-through path): sent back to back over the bulk pool."""
        self._backend.put_encoded_many(items)

    def get(self, key: str) -> bytes:
        return self._backend.get_encoded(key)

    def get_into(self, key: str):
        """The engine's read path: the value lands in a buffer kept across calls (a CPU-tier slot)."""
        return self._backend.get_into(key, self._buffer)

    def reserve(self, num_bytes: int) -> None:
        self._buffer = torch.empty(num_bytes, dtype=torch.uint8)

    def close(self) -> None:
        used = self._backend.transport
        self._backend.close()
        if used != self.transport:
            raise RuntimeError(f"asked for transport {self.transport}, the tier used {used}")


class RedisClient:
    def __init__(self, port: int) -> None:
        import redis

        self._client = redis.Redis(port=port, socket_timeout=60)

    def put(self, key: str, data: bytes) -> None:
        self._client.set(key, data)

    def put_many(self, items: list[tuple[str, bytes]]) -> None:
        """The same SETs in one redis-py pipeline (sent back to back, replies read at the end):
        how the Redis tier writes a batch."""
        with self._client.pipeline(transaction=False) as pipe:
            for key, data in items:
                pipe.set(key, data)
            pipe.execute()

    def get(self, key: str) -> bytes:
        return self._client.get(key)

    def get_into(self, key: str) -> bytes:
        """redis-py has no way to read into a buffer: the same GET."""
        return self._client.get(key)

    def reserve(self, num_bytes: int) -> None:
        pass

    def close(self) -> None:
        self._client.close()
