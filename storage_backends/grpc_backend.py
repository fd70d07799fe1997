"""The ``grpc://host:port`` / ``grpcs://host:port`` tier: a client of the kvstash cache server.

URL parameters: ``token`` (bearer token; default ``$KVSTASH_AUTH_TOKEN``),
``ca`` (PEM file of the CA that signed the server's certificate, for
``grpcs://``; default: the system roots), ``timeout`` (seconds per call,
default 30), ``codec`` (``none`` or ``lz4``, used when this tier encodes a
chunk), ``concurrency`` (parallel calls of ``get_many`` / ``put_many``, default 8),
``bulk`` (``on``, the default, or ``off``: move values over gRPC only, e.g. when
only the gRPC port is forwarded to the client), ``bulk_connections`` (bulk
connections in use at once, default 4: the calls of ``get_many`` spread over
them, and ``put_many`` pipelines its Puts over them), ``local`` (``auto``, the default: use the server's Unix socket
when it runs on this host; ``off``: always TCP).

A synchronous API over one gRPC channel (channels are thread-safe, so is this
class). Values move over the server's bulk data channel when it has one; which
path (Unix socket, TCP, gRPC) and the fallback to gRPC are
:class:`~storage_backends.transport_policy.BulkTransportPolicy`'s job, the gRPC
wire form of Put and Get is ``storage_backends.grpc_codec``'s and the channel's
``storage_backends.grpc_channel``'s. Every call has a deadline; a failed call
raises :class:`~storage_backends.base.BackendError` naming the server and the
reason, except that an unknown key is a miss and a refused value is a
``ValueError``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.base import BackendError, StorageBackend
from storage_backends.bulk_channel import DEFAULT_MAX_CONNECTIONS, BulkClient, PartsSource
from storage_backends.bulk_errors import BulkStatusError, BulkUnavailable
from storage_backends.chunk import (
    CODECS,
    ChunkFormatError,
    KVChunk,
    decode_chunk,
    encode_chunk_parts,
    verify_chunk,
)
from storage_backends.chunk_receiver import Destination, out_view_for, pooled_tensor
from storage_backends.grpc_channel import (
    AUTH_TOKEN_ENV,
    CHANNEL_OPTIONS,
    MAX_MESSAGE_BYTES,
    auth_metadata,
    make_channel,
)
from storage_backends.grpc_codec import PIECE_BYTES, put_messages, value_from_get_messages
from storage_backends.host_identity import host_identity
from storage_backends.thread_pools import started_thread_pool
from storage_backends.transport_policy import TRANSPORT_GRPC, BulkTransportPolicy
from storage_backends.urls import parse_grpc_url

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONCURRENCY = 8
LIST_PAGE_SIZE = 5000
CODE_TO_STATUS = {status.value[0]: status for status in grpc.StatusCode}
TRANSPORTS = ("unix", "tcp", TRANSPORT_GRPC)
#: what a bulk Get answers when the channel failed and the call must go over gRPC
_USE_GRPC = object()

logger = logging.getLogger(__name__)
# make_channel, CHANNEL_OPTIONS, MAX_MESSAGE_BYTES and PIECE_BYTES lived here before the channel
# and the codec had their own modules; they stay importable from here.
__all__ = [
    "CHANNEL_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "PIECE_BYTES",
    "GrpcBackend",
    "auth_metadata",
    "make_channel",
]


class GrpcBackend(StorageBackend):
    """Remote tier backed by a kvstash cache server. Usually built by ``create_backend("grpc://…")``;
    the token falls back to ``$KVSTASH_AUTH_TOKEN``. ``host_id`` is this host's identity for
    choosing the Unix socket (default: :func:`~storage_backends.host_identity.host_identity`)."""

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
        bulk: bool = True,
        bulk_connections: int = DEFAULT_MAX_CONNECTIONS,
        local: bool = True,
        host_id: str | None = None,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
        if ca_path is not None and not secure:
            raise ValueError("a TLS CA only makes sense with TLS (grpcs://)")
        if timeout_s <= 0 or concurrency <= 0 or bulk_connections <= 0:
            raise ValueError(
                f"timeout, concurrency and bulk_connections must be positive, "
                f"got {timeout_s}, {concurrency} and {bulk_connections}"
            )
        self.address = address
        self.codec = codec
        #: reads beyond the bulk connections wait for one (over gRPC alone: no bound of our own)
        self.max_reads_in_flight = bulk_connections if bulk else None
        self.timeout_s = timeout_s
        token = token or os.environ.get(AUTH_TOKEN_ENV)
        self._metadata = auth_metadata(token)
        self._channel = make_channel(address, secure=secure, ca_path=ca_path)
        self._kv = kvstash_pb2_grpc.KVCacheStub(self._channel)
        # Put and Get carry pre-serialized messages (see grpc_codec).
        self._put_wire = self._channel.stream_unary(
            "/kvstash.v1.KVCache/Put",
            request_serializer=None,
            response_deserializer=kvstash_pb2.PutResponse.FromString,
        )
        self._get_wire = self._channel.unary_stream(
            "/kvstash.v1.KVCache/Get",
            request_serializer=kvstash_pb2.GetRequest.SerializeToString,
            response_deserializer=None,
        )
        self._admin = kvstash_pb2_grpc.AdminStub(self._channel)
        self._pool = started_thread_pool(concurrency, "kvstash-grpc")
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "corrupt": 0, "errors": 0}
        # values moved over the bulk channel (and per path), and bulk calls that failed and went
        # over gRPC instead
        self._counts.update(bulk_calls=0, bulk_failures=0, **{f"{name}_calls": 0 for name in TRANSPORTS})
        self._closed = False
        self._transport = BulkTransportPolicy(
            address=address,
            ask_endpoint=lambda: self._kv.GetBulkEndpoint(
                kvstash_pb2.BulkEndpointRequest(), timeout=self.timeout_s, metadata=self._metadata
            ),
            token=token,
            timeout_s=timeout_s,
            secure=secure,
            ca_path=ca_path,
            enabled=bulk,
            local=local,
            max_connections=bulk_connections,
            host_id=host_identity() if host_id is None else host_id,
        )
        #: finds and opens the bulk channel while the caller does other things (an engine loads
        #: its model), so the first Put or Get finds it open; None with ``bulk=off``
        self._discovery_thread: threading.Thread | None = None
        if bulk:
            self._discovery_thread = threading.Thread(
                target=self._transport.prepare, name="kvstash-bulk-discovery", daemon=True
            )
            self._discovery_thread.start()

    @classmethod
    def from_url(cls, url: str) -> GrpcBackend:
        """``grpc://host:port`` or ``grpcs://host:port`` with the parameters in the module docstring."""
        try:
            kwargs = parse_grpc_url(url)
        except ValueError as error:
            raise ValueError(f"grpc URL {url!r}: {error}") from None
        return cls(kwargs.pop("address"), **kwargs)

    @property
    def transport(self) -> str:
        """The path values take now: "unix" (same host), "tcp" (bulk port) or "grpc"."""
        return self._transport.transport

    # ---- helpers -------------------------------------------------------------
    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def _error(self, what: str, error: grpc.RpcError | BulkStatusError) -> BackendError:
        """A BackendError for a failed call (and one more counted error)."""
        self._count("errors")
        if isinstance(error, BulkStatusError):
            code, details = CODE_TO_STATUS.get(error.code, grpc.StatusCode.UNKNOWN), error.message
        else:
            code, details = error.code(), error.details()
        if code == grpc.StatusCode.UNAVAILABLE:
            reason = f"cannot reach {self.address} ({details})"
        elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"no answer from {self.address} within {self.timeout_s:g} s"
        elif code == grpc.StatusCode.UNAUTHENTICATED:
            reason = f"{self.address} refused the auth token (set ?token= or ${AUTH_TOKEN_ENV})"
        else:
            reason = f"{self.address} answered {code.name}: {details}"
        return BackendError(f"grpc tier {what} failed: {reason}")

    def _bulk_client(self) -> BulkClient | None:
        self._check_open()
        return self._transport.client()

    def _bulk_succeeded(self, client: BulkClient) -> None:
        self._transport.succeeded()
        with self._lock:
            self._counts["bulk_calls"] += 1
            self._counts[f"{client.transport}_calls"] += 1

    def _bulk_failed(self, client: BulkClient, error: BulkUnavailable) -> None:
        self._count("bulk_failures")
        self._transport.failed(client, error)

    def _refused_value(self, key: str, details: str) -> ChunkFormatError:
        return ChunkFormatError(f"{self.address} refused the value for {key!r}: {details}")

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

    def _fetch(self, key: str) -> bytes | memoryview | None:
        """Raw value bytes or None when the server does not hold ``key``."""
        bulk = self._bulk_client()
        if bulk is not None:
            try:
                data = bulk.get(key)
                self._bulk_succeeded(bulk)
                return data
            except BulkUnavailable as error:
                self._bulk_failed(bulk, error)
            except BulkStatusError as error:
                raise self._error("get", error) from None
        return self._fetch_over_grpc(key)

    def _fetch_over_grpc(self, key: str) -> bytes | None:
        self._check_open()
        self._count("grpc_calls")
        try:
            return value_from_get_messages(
                self._get_wire(
                    kvstash_pb2.GetRequest(key=key), timeout=self.timeout_s, metadata=self._metadata
                )
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise self._error("get", error) from None
        except ValueError as error:
            self._count("errors")
            raise BackendError(f"grpc tier get from {self.address} failed: {error}") from None

    def get_encoded(self, key: str) -> bytes | memoryview | None:
        data = self._fetch(key)
        if data is None:
            self._count("misses")
            return None
        try:
            verify_chunk(data, key=key)
        except ChunkFormatError as error:
            logger.warning("grpc tier: corrupt value for key %r (treated as a miss): %s", key, error)
            self._count("corrupt")
            return None
        self._count("hits")
        return data

    def get(self, key: str) -> KVChunk | None:
        """Over the bulk channel the payload lands in a new tensor as it arrives, verified on the
        way (no value object, no decode copy); over gRPC the value is fetched and decoded."""
        bulk = self._bulk_client()
        if bulk is not None:
            received = self._bulk_get_chunk(bulk, key, pooled_tensor(bulk.receive_buffers))
            if received is not _USE_GRPC:
                return received
        data = self._fetch_over_grpc(key)
        if data is None:
            self._count("misses")
            return None
        try:
            chunk = decode_chunk(data, key=key)
        except ChunkFormatError as error:
            logger.warning("grpc tier: corrupt value for key %r (treated as a miss): %s", key, error)
            self._count("corrupt")
            return None
        self._count("hits")
        return chunk

    def get_into(self, key: str, out: torch.Tensor) -> KVChunk | None:
        """Read ``key`` into ``out`` (see ``StorageBackend.get_into``). Over the bulk channel the
        payload is received with ``recv_into`` straight into ``out`` and its CRC-32 computed once it
        landed (``storage_backends.chunk_receiver``): no intermediate value object.
        When the bulk channel is off or fails, the value comes over gRPC and is copied in.
        A miss or a corrupt value is None (counted); ValueError when ``out`` cannot hold it."""
        bulk = self._bulk_client()
        if bulk is not None:
            received = self._bulk_get_chunk(bulk, key, lambda header: out_view_for(out, header, key))
            if received is not _USE_GRPC:
                return received
        return super().get_into(key, out)

    def _bulk_get_chunk(
        self, bulk: BulkClient, key: str, destination: Destination
    ) -> KVChunk | None | object:
        """A Get over the bulk channel into ``destination``: the chunk, None (miss or corrupt, counted)
        or ``_USE_GRPC`` when the channel failed (then the caller goes over gRPC)."""
        try:
            chunk = bulk.get_chunk(key, destination)
        except BulkUnavailable as error:
            self._bulk_failed(bulk, error)
            return _USE_GRPC
        except BulkStatusError as error:
            raise self._error("get", error) from None
        except ChunkFormatError as error:
            self._bulk_succeeded(bulk)
            self._count("corrupt")
            logger.warning(
                "grpc tier %s: corrupt value for %r treated as a miss: %s", self.address, key, error
            )
            return None
        except ValueError:
            self._bulk_succeeded(bulk)  # the channel carried the call; the buffer was wrong
            raise
        self._bulk_succeeded(bulk)
        self._count("misses" if chunk is None else "hits")
        return chunk

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        """Concurrent Gets (``concurrency`` at a time, over at most ``bulk_connections`` bulk
        connections), results in key order."""
        return list(self._pool.map(self.get, keys))

    # ---- writes --------------------------------------------------------------
    def put_encoded(self, key: str, data: bytes) -> None:
        self.put_encoded_many([(key, data)])

    def put_encoded_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Store serialized values (each verified by the server); pipelined like :meth:`put_many`.
        ValueError, before anything is sent, for an empty value."""
        if any(not len(data) for _, data in items):
            raise ValueError("cannot store an empty value")
        self._raise_first(self._put_items([(key, (data,)) for key, data in items]))

    def put(self, key: str, chunk: KVChunk) -> None:
        """Over the bulk channel the header and the tensor's own memory are sent as they are
        (no joined copy of the value), or, on the server's host, copied into the connection's
        shared-memory staging area (a staged Put, ``storage_backends.staging_area``); over
        gRPC the value is joined first."""
        self.put_many([(key, chunk)])

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        """Pipelined Puts: over the bulk channel the values are spread over up to
        ``bulk_connections`` connections, and each connection sends its values one after the
        other without waiting for the replies in between (``BulkClient.put_many``; a window of
        unanswered Puts). Each chunk is serialized (its CRC-32) just before it is sent, from the
        tensor's own memory. Raises the first failure after every Put has ended; a refused
        value is a ValueError (ChunkFormatError) and stores nothing."""
        self._raise_first(
            self._put_items([(key, functools.partial(self._encode, key, chunk)) for key, chunk in items])
        )

    def _encode(self, key: str, chunk: KVChunk) -> tuple[bytes | memoryview, ...]:
        return encode_chunk_parts(chunk, self.codec, key=key)

    @staticmethod
    def _raise_first(errors: list[Exception | None]) -> None:
        first_error = next((error for error in errors if error is not None), None)
        if first_error is not None:
            raise first_error

    def _put_items(self, items: list[tuple[str, PartsSource]]) -> list[Exception | None]:
        """Store every item; returns per item None (stored) or the error it got. Over the bulk
        channel first; the items whose connection failed (BulkUnavailable) go over gRPC."""
        self._check_open()
        errors: list[Exception | None] = [None] * len(items)
        over_grpc = list(range(len(items)))
        bulk = self._bulk_client()
        if bulk is not None and items:
            over_grpc = []
            num_groups = min(bulk.max_connections, len(items))
            groups = [list(range(first, len(items), num_groups)) for first in range(num_groups)]
            if num_groups == 1:
                results = [bulk.put_many(items)]
            else:
                results = list(self._pool.map(lambda group: bulk.put_many([items[i] for i in group]), groups))
            unavailable: BulkUnavailable | None = None
            for group, outcomes in zip(groups, results, strict=True):
                for index, outcome in zip(group, outcomes, strict=True):
                    if isinstance(outcome, BulkUnavailable):
                        unavailable = outcome
                        over_grpc.append(index)
                    elif isinstance(outcome, BulkStatusError):  # refused: counted as an error, not a call
                        errors[index] = self._put_refusal(items[index][0], outcome)
                    elif isinstance(outcome, Exception):
                        errors[index] = outcome
                    else:
                        self._bulk_succeeded(bulk)
                        self._count("puts")
            if unavailable is not None:
                self._bulk_failed(bulk, unavailable)
        if not over_grpc:  # all went over the bulk channel
            return errors
        if len(over_grpc) == 1:  # no thread hop for a single Put
            grpc_errors = [self._put_over_grpc(*items[over_grpc[0]])]
        else:
            grpc_errors = self._pool.map(lambda index: self._put_over_grpc(*items[index]), over_grpc)
        for index, error in zip(over_grpc, grpc_errors, strict=True):
            errors[index] = error
        return errors

    def _put_refusal(self, key: str, error: BulkStatusError) -> Exception:
        if error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
            return self._refused_value(key, error.message)
        return self._error("put", error)

    def _put_over_grpc(self, key: str, source: PartsSource) -> Exception | None:
        """One Put over gRPC (the value joined first); returns its error instead of raising it."""
        try:
            parts = tuple(source() if callable(source) else source)
            if not sum(memoryview(part).nbytes for part in parts):
                raise ValueError("cannot store an empty value")
            self._check_open()
        except Exception as error:  # noqa: BLE001 - returned for its key
            return error
        self._count("grpc_calls")
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        try:
            self._put_wire(put_messages(key, data), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                return self._refused_value(key, error.details())
            return self._error("put", error)
        self._count("puts")
        return None

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
        """Client-side counters (``transport``: the path values take now; ``*_calls`` per path)
        plus the server's memory-tier gauges (None when unreachable, or when the token is a
        non-admin tenant's)."""
        with self._lock:
            result: dict[str, Any] = dict(self._counts)
        result["transport"] = self.transport
        result.update(num_keys=None, bytes_used=None, capacity_bytes=None, evictions=None)
        if self._closed:
            return result
        try:
            server = self._admin.Stats(
                kvstash_pb2.StatsRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as error:
            # Server-wide gauges are admin-only on a server with tenants: unknown, not an error.
            if error.code() != grpc.StatusCode.PERMISSION_DENIED:
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
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
        self._transport.close()
        self._channel.close()
        super().close()
