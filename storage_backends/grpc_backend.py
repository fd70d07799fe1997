"""The ``grpc://host:port`` / ``grpcs://host:port`` tier: a client of the kvstash cache server.

URL parameters: ``token`` (bearer token; default ``$KVSTASH_AUTH_TOKEN``),
``ca`` (PEM file of the CA that signed the server's certificate, for
``grpcs://``; default: the system roots), ``timeout`` (seconds per call,
default 30), ``codec`` (``none`` or ``lz4``, used when this tier encodes a
chunk), ``concurrency`` (parallel calls of ``get_many`` / ``put_many``, default 8).

A synchronous API over one gRPC channel (channels are thread-safe, so is this
class). Values travel as streams of ``PIECE_BYTES`` pieces, so no message comes
near the size limits that both sides set in ``CHANNEL_OPTIONS``. Every call has
a deadline; a failed call raises :class:`~storage_backends.base.BackendError`
naming the server and the reason, except that an unknown key is a miss and a
refused value is a ``ValueError``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.base import BackendError, StorageBackend
from storage_backends.chunk import CODECS, ChunkFormatError, KVChunk, decode_chunk, encode_chunk, verify_chunk
from storage_backends.urls import parse_float, split_backend_url

#: bytes of value per Put/Get message
PIECE_BYTES = 1 << 20
#: the largest message either side accepts: a piece plus framing, with room to spare
MAX_MESSAGE_BYTES = 8 * PIECE_BYTES
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
AUTH_TOKEN_ENV = "KVSTASH_AUTH_TOKEN"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONCURRENCY = 8
LIST_PAGE_SIZE = 5000


def make_channel(address: str, *, secure: bool, ca_path: str | None = None) -> grpc.Channel:
    """A channel to ``address`` ("host:port"), TLS when ``secure`` (trusting ``ca_path`` or the system roots)."""
    if not secure:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    root_certificates = None
    if ca_path is not None:
        try:
            with open(ca_path, "rb") as ca_file:
                root_certificates = ca_file.read()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS CA file {ca_path}: {exc.strerror}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def put_requests(key: str, data: bytes) -> Iterator[kvstash_pb2.PutRequest]:
    """The Put stream for one value: key and size in the first message, then the pieces."""
    view = memoryview(data)
    yield kvstash_pb2.PutRequest(key=key, total_size=len(data), data=bytes(view[:PIECE_BYTES]))
    for start in range(PIECE_BYTES, len(data), PIECE_BYTES):
        yield kvstash_pb2.PutRequest(data=bytes(view[start : start + PIECE_BYTES]))


def join_pieces(responses: Iterator[kvstash_pb2.GetResponse]) -> bytes:
    """The value carried by a Get stream; ValueError when its length differs from the announced size."""
    total_size = None
    pieces = []
    for response in responses:
        if total_size is None:
            total_size = response.total_size
        pieces.append(response.data)
    data = b"".join(pieces)
    if total_size is None or len(data) != total_size:
        raise ValueError(f"incomplete Get stream: {len(data)} bytes, announced {total_size}")
    return data


class GrpcBackend(StorageBackend):
    """Remote tier backed by a kvstash cache server. Usually built by ``create_backend("grpc://…")``;
    the token falls back to ``$KVSTASH_AUTH_TOKEN``."""

    name = "grpc"

    def __init__(
        self,
        address: str,
        *,
        secure: bool = False,
        token: str | None = None,
        ca_path: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        codec: str = "none",
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        if ca_path is not None and not secure:
            raise ValueError("a TLS CA only makes sense with TLS (grpcs://)")
        if timeout_s <= 0 or concurrency <= 0:
            raise ValueError(f"timeout and concurrency must be positive, got {timeout_s} and {concurrency}")
        self.address = address
        self.codec = codec
        self.timeout_s = timeout_s
        self._metadata = auth_metadata(token or os.environ.get(AUTH_TOKEN_ENV))
        self._channel = make_channel(address, secure=secure, ca_path=ca_path)
        self._kv = kvstash_pb2_grpc.KVCacheStub(self._channel)
        self._admin = kvstash_pb2_grpc.AdminStub(self._channel)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvstash-grpc")
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "corrupt": 0, "errors": 0}
        self._closed = False

    @classmethod
    def from_url(cls, url: str) -> GrpcBackend:
        """``grpc://host:port`` or ``grpcs://host:port`` with the parameters in the module docstring."""
        parts, params = split_backend_url(url, ("token", "ca", "timeout", "codec", "concurrency"))
        if parts.scheme not in ("grpc", "grpcs"):
            raise ValueError(f"not a grpc:// or grpcs:// URL: {url!r}")
        if not parts.hostname or parts.port is None:
            raise ValueError(f"grpc URL needs host and port, e.g. grpc://127.0.0.1:50051; got {url!r}")
        if parts.path not in ("", "/"):
            raise ValueError(f"grpc URL takes no path, got {parts.path!r} in {url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        concurrency = params.get("concurrency", str(DEFAULT_CONCURRENCY))
        if not concurrency.isdigit():
            raise ValueError(f"grpc concurrency must be a positive integer, got {concurrency!r}")
        return cls(
            f"{host}:{parts.port}",
            secure=parts.scheme == "grpcs",
            token=params.get("token"),
            ca_path=params.get("ca"),
            timeout_s=parse_float(params["timeout"], "grpc timeout")
            if "timeout" in params
            else DEFAULT_TIMEOUT_S,
            codec=params.get("codec", "none"),
            concurrency=int(concurrency),
        )

    # ---- helpers -------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _error(self, what: str, error: grpc.RpcError) -> BackendError:
        """A BackendError for a failed call (and one more counted error)."""
        self._count("errors")
        code = error.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = f"cannot reach {self.address} ({error.details()})"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"no answer from {self.address} within {self.timeout_s:g} s"
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            reason = f"{self.address} refused the auth token (set ?token= or ${AUTH_TOKEN_ENV})"
        else:
            reason = f"{self.address} answered {code.name}: {error.details()}"
        return BackendError(f"grpc tier {what} failed: {reason}")

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"grpc tier {self.address} is closed")

    # ---- reads ---------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> int:
        self._check_open()
        if not keys:
            return 0
        try:
            reply = self._kv.Contains(
                kvstash_pb2.ContainsRequest(keys=list(keys)), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            raise self._error("contains", error) from None
        return reply.num_hits

    def _fetch(self, key: str) -> bytes | None:
        """Raw value bytes or None when the server does not hold ``key``."""
        self._check_open()
        try:
            return join_pieces(
                self._kv.Get(kvstash_pb2.GetRequest(key=key), timeout=self.timeout_s, metadata=self._metadata)
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._error("get", error) from None
        except ValueError as error:
            self._count("errors")
            raise BackendError(f"grpc tier get from {self.address} failed: {error}") from None

    def get_encoded(self, key: str) -> bytes | None:
        data = self._fetch(key)
        if data is None:
            self._count("misses")
            return None
        try:
            verify_chunk(data)
        except ChunkFormatError:
            self._count("corrupt")
            return None
        self._count("hits")
        return data

    def get(self, key: str) -> KVChunk | None:
        data = self._fetch(key)
        if data is None:
            self._count("misses")
            return None
        try:
            chunk = decode_chunk(data)
        except ChunkFormatError:
            self._count("corrupt")
            return None
        self._count("hits")
        return chunk

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        """Concurrent Gets (``concurrency`` at a time), results in key order."""
        return list(self._pool.map(self.get, keys))

    # ---- writes --------------------------------------------------------------
    def put_encoded(self, key: str, data: bytes) -> None:
        self._check_open()
        if not data:
            raise ValueError("cannot store an empty value")
        try:
            self._kv.Put(put_requests(key, data), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ChunkFormatError(
                    f"{self.address} refused the value for {key!r}: {error.details()}"
                ) from None
            raise self._error("put", error) from None
        self._count("puts")

    def put(self, key: str, chunk: KVChunk) -> None:
        self.put_encoded(key, encode_chunk(chunk, self.codec))

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        """Concurrent Puts; raises the first failure after every Put has ended."""
        futures = [self._pool.submit(self.put, key, chunk) for key, chunk in items]
        errors = [future.exception() for future in futures]
        first_error = next((error for error in errors if error is not None), None)
        if first_error is not None:
            raise first_error

    def delete(self, key: str) -> bool:
        self._check_open()
        try:
            self._kv.Delete(
                kvstash_pb2.DeleteRequest(key=key), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise self._error("delete", error) from None
        return True

    # ---- listing, stats, lifecycle ------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        self._check_open()
        found: list[str] = []
        page_token = ""
        try:
            while True:
                page = self._admin.ListKeys(
                    kvstash_pb2.ListKeysRequest(
                        prefix=prefix, page_size=LIST_PAGE_SIZE, page_token=page_token
                    ),
                    timeout=self.timeout_s,
                    metadata=self._metadata,
                )
                found.extend(entry.key for entry in page.entries)
                page_token = page.next_page_token
                if not page_token:
                    return found
        except grpc.RpcError as error:
            raise self._error("keys", error) from None

    def stats(self) -> dict[str, Any]:
        """Client-side counters plus the server's memory-tier gauges (None when unreachable)."""
        with self._lock:
            result: dict[str, Any] = dict(self._counts)
        result.update(num_keys=None, bytes_used=None, capacity_bytes=None, evictions=None)
        if self._closed:
            return result
        try:
            server = self._admin.Stats(
                kvstash_pb2.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError:
            self._count("errors")
            result["errors"] += 1
            return result
        if server.tiers:
            memory = server.tiers[0]
            result.update(
                num_keys=memory.num_keys,
                bytes_used=memory.bytes_used,
                capacity_bytes=memory.capacity_bytes or None,
                evictions=memory.evictions,
            )
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._channel.close()
