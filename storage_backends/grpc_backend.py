"""The ``grpc://host:port`` / ``grpcs://host:port`` tier: a client of the kvstash cache server.

URL parameters: ``token`` (bearer token; default ``$KVSTASH_AUTH_TOKEN``),
``ca`` (PEM file of the CA that signed the server's certificate, for
``grpcs://``; default: the system roots), ``timeout`` (seconds per call,
default 30), ``codec`` (``none`` or ``lz4``, used when this tier encodes a
chunk), ``concurrency`` (parallel calls of ``get_many`` / ``put_many``, default 8),
``bulk`` (``on``, the default, or ``off``: move values over gRPC only, e.g. when
only the gRPC port is forwarded to the client).

A synchronous API over one gRPC channel (channels are thread-safe, so is this
class). Values move over the server's bulk data channel when it has one
(``storage_backends.bulk_channel``: raw bytes on a TCP port that the first Put
or Get asks for with ``GetBulkEndpoint``; TLS and the token as for gRPC); when
it is off, unreachable or fails mid-call, the call goes over gRPC instead and
the bulk channel is tried again ``BULK_RETRY_S`` seconds later (doubling after
each failure in a row, up to ``BULK_MAX_RETRY_S``). Over gRPC,
values travel as streams of ``PIECE_BYTES`` pieces, so no message comes
near the size limits that both sides set in ``CHANNEL_OPTIONS``; the pieces are
written and read in protobuf's wire format directly (one copy each, see below). Every call has
a deadline; a failed call raises :class:`~storage_backends.base.BackendError`
naming the server and the reason, except that an unknown key is a miss and a
refused value is a ``ValueError``.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.base import BackendError, StorageBackend
from storage_backends.bulk_channel import PROTOCOL_VERSION, BulkClient, BulkStatusError, BulkUnavailable
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
#: client channels retry a lost server at least once a second (gRPC's default backoff grows
#: to 120 s, so hits would come back minutes after a restarted server is up again)
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
AUTH_TOKEN_ENV = "KVSTASH_AUTH_TOKEN"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_CONCURRENCY = 8
LIST_PAGE_SIZE = 5000
#: seconds values go over gRPC after the bulk channel failed (or was off) before it is asked for again
BULK_RETRY_S = 5.0
#: the longest such wait, reached after failures in a row (an unreachable port costs a connect each time)
BULK_MAX_RETRY_S = 300.0
#: seconds a bulk connection may take to open (a filtered port must not stall a call for the whole timeout)
BULK_CONNECT_TIMEOUT_S = 3.0
CODE_TO_STATUS = {status.value[0]: status for status in grpc.StatusCode}

logger = logging.getLogger(__name__)


def make_channel(address: str, *, secure: bool, ca_path: str | None = None) -> grpc.Channel:
    """A channel to ``address`` ("host:port"), TLS when ``secure`` (trusting ``ca_path`` or the system roots)."""
    if not secure:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)
    root_certificates = None
    if ca_path is not None:
        try:
            with open(ca_path, "rb") as ca_file:
                root_certificates = ca_file.read()
        except OSError as exc:
            raise ValueError(f"cannot read the TLS CA file {ca_path}: {exc.strerror}") from None
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS + RECONNECT_OPTIONS)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying a bearer token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


# ---- the wire form of Put and Get -----------------------------------------------
# Building each piece as a protobuf message and serializing it copies the bytes
# three times, and parsing does the same on the other side; on the hit path that
# is most of the cost. So both sides write and read the pieces in protobuf's
# documented wire format themselves (field tag, length, bytes) through
# memoryviews: one copy per piece. The bytes on the wire are exactly the
# PutRequest / GetResponse messages of kvstash.proto, so generated and
# reflection-based clients interoperate unchanged.
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
PUT_DATA_FIELD = kvstash_pb2.PutRequest.DESCRIPTOR.fields_by_name["data"].number
GET_DATA_FIELD = kvstash_pb2.GetResponse.DESCRIPTOR.fields_by_name["data"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(view: memoryview, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError("malformed message: bad varint")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, position


def parse_fields(message: bytes) -> dict[int, int | memoryview]:
    """Top-level fields of one serialized message: number → int (varint) or memoryview (bytes).

    Length-delimited fields come back as views into ``message`` (no copy). A
    repeated field keeps its last value, as protobuf does for scalars.
    Raises ValueError for a malformed message.
    """
    view = memoryview(message)
    fields: dict[int, int | memoryview] = {}
    position = 0
    while position < len(view):
        key, position = _read_varint(view, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _WIRE_VARINT:
            fields[number], position = _read_varint(view, position)
        elif wire_type == _WIRE_LEN:
            length, position = _read_varint(view, position)
            if position + length > len(view):
                raise ValueError("malformed message: field runs past the end")
            fields[number] = view[position : position + length]
            position += length
        elif wire_type in (_WIRE_I64, _WIRE_I32):
            position += 8 if wire_type == _WIRE_I64 else 4
        else:
            raise ValueError(f"malformed message: wire type {wire_type}")
    if position != len(view):
        raise ValueError("malformed message: truncated field")
    return fields


def piece_messages(head: bytes, data_field: int, data: bytes) -> Iterator[bytes]:
    """Serialized messages carrying ``data`` in pieces of PIECE_BYTES: the first starts with
    ``head`` (the other fields, already serialized), each has one ``data_field``."""
    view = memoryview(data)
    tag = _varint((data_field << 3) | _WIRE_LEN)
    for start in range(0, max(len(data), 1), PIECE_BYTES):
        piece = view[start : start + PIECE_BYTES]
        yield b"".join((head if start == 0 else b"", tag, _varint(len(piece)), piece))


def put_messages(key: str, data: bytes) -> Iterator[bytes]:
    """The Put stream for one value, serialized (key and total_size ride on the first message)."""
    head = kvstash_pb2.PutRequest(key=key, total_size=len(data)).SerializeToString()
    return piece_messages(head, PUT_DATA_FIELD, data)


def value_from_get_messages(messages: Iterator[bytes]) -> bytes:
    """The value carried by a serialized Get stream; ValueError when it is inconsistent."""
    total_size_field = kvstash_pb2.GetResponse.DESCRIPTOR.fields_by_name["total_size"].number
    total_size = None
    pieces = []
    for message in messages:
        fields = parse_fields(message)
        if total_size is None:
            total_size = fields.get(total_size_field, 0)
        pieces.append(fields.get(GET_DATA_FIELD, b""))
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
        bulk: bool = True,
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
        token = token or os.environ.get(AUTH_TOKEN_ENV)
        self._token = token
        self._metadata = auth_metadata(token)
        self._secure = secure
        self._ca_path = ca_path
        self._channel = make_channel(address, secure=secure, ca_path=ca_path)
        self._kv = kvstash_pb2_grpc.KVCacheStub(self._channel)
        # Put and Get carry pre-serialized messages (see put_messages / value_from_get_messages).
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
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="kvstash-grpc")
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "puts": 0, "corrupt": 0, "errors": 0}
        # values moved over the bulk channel, and bulk calls that failed and went over gRPC instead
        self._counts.update(bulk_calls=0, bulk_failures=0)
        self._closed = False
        self._bulk: BulkClient | None = None
        self._use_bulk = bulk
        self._bulk_asked_at = -BULK_MAX_RETRY_S  # monotonic time of the last GetBulkEndpoint
        self._bulk_retry_s = BULK_RETRY_S  # wait after the last failure
        self._num_bulk_failures_in_row = 0

    @classmethod
    def from_url(cls, url: str) -> GrpcBackend:
        """``grpc://host:port`` or ``grpcs://host:port`` with the parameters in the module docstring."""
        parts, params = split_backend_url(url, ("token", "ca", "timeout", "codec", "concurrency", "bulk"))
        if parts.scheme not in ("grpc", "grpcs"):
            raise ValueError(f"not a grpc:// or grpcs:// URL: {url!r}")
        if not parts.hostname or parts.port is None:
            raise ValueError(f"grpc URL needs host and port, e.g. grpc://127.0.0.1:50051; got {url!r}")
        if parts.path not in ("", "/"):
            raise ValueError(f"grpc URL takes no path, got {parts.path!r} in {url!r}")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        concurrency = params.get("concurrency", str(DEFAULT_CONCURRENCY))
        bulk = params.get("bulk", "on")
        if bulk not in ("on", "off"):
            raise ValueError(f"grpc bulk must be 'on' or 'off', got {bulk!r}")
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
            bulk=bulk == "on",
        )

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
        """The bulk channel, asking the server for it at most once per retry period; None: use gRPC."""
        with self._lock:
            if self._bulk is not None or self._closed or not self._use_bulk:
                return self._bulk
            now = time.monotonic()
            if now - self._bulk_asked_at < self._bulk_retry_s:
                return None
            self._bulk_asked_at = now
        try:
            endpoint = self._kv.GetBulkEndpoint(
                kvstash_pb2.BulkEndpointRequest(), timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError:
            return None  # an older server (UNIMPLEMENTED) or none at all: the gRPC call reports it
        # A server with TLS on gRPC has it on the bulk port too; anything else is not used.
        if not endpoint.port or endpoint.protocol_version != PROTOCOL_VERSION or endpoint.tls != self._secure:
            return None
        tls_context = ssl.create_default_context(cafile=self._ca_path) if self._secure else None
        client = BulkClient(
            self.address.rsplit(":", 1)[0].strip("[]"),
            endpoint.port,
            token=self._token,
            timeout_s=self.timeout_s,
            connect_timeout_s=min(self.timeout_s, BULK_CONNECT_TIMEOUT_S),
            tls_context=tls_context,
        )
        with self._lock:
            if self._bulk is None and not self._closed:
                self._bulk = client
                return client
        client.close()
        return self._bulk

    def _bulk_succeeded(self) -> None:
        with self._lock:
            self._counts["bulk_calls"] += 1
            self._num_bulk_failures_in_row = 0

    def _bulk_failed(self, client: BulkClient, error: BulkUnavailable) -> None:
        """Stop using a bulk channel that failed; this call and those of the next retry period
        (doubled after each failure in a row) go over gRPC instead."""
        with self._lock:
            self._counts["bulk_failures"] += 1
            if self._bulk is client:
                self._bulk = None
                self._bulk_asked_at = time.monotonic()
                self._bulk_retry_s = min(BULK_RETRY_S * 2**self._num_bulk_failures_in_row, BULK_MAX_RETRY_S)
                self._num_bulk_failures_in_row += 1
            retry_s = self._bulk_retry_s
        # INFO, not WARNING: the call goes on over gRPC, and a server that is really down is
        # reported once by the caller (the connector's tier incident), not once per channel.
        logger.info("bulk channel of %s failed, using gRPC for %g s: %s", self.address, retry_s, error)
        client.close()

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

    def _fetch(self, key: str) -> bytes | bytearray | None:
        """Raw value bytes or None when the server does not hold ``key``."""
        self._check_open()
        bulk = self._bulk_client()
        if bulk is not None:
            try:
                data = bulk.get(key)
                self._bulk_succeeded()
                return data
            except BulkUnavailable as error:
                self._bulk_failed(bulk, error)
            except BulkStatusError as error:
                raise self._error("get", error) from None
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

    def get_encoded(self, key: str) -> bytes | bytearray | None:
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
        data = self._fetch(key)
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

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        """Concurrent Gets (``concurrency`` at a time), results in key order."""
        return list(self._pool.map(self.get, keys))

    # ---- writes --------------------------------------------------------------
    def put_encoded(self, key: str, data: bytes) -> None:
        self._check_open()
        if not data:
            raise ValueError("cannot store an empty value")
        bulk = self._bulk_client()
        if bulk is not None:
            try:
                bulk.put(key, data)
                self._count("puts")
                self._bulk_succeeded()
                return
            except BulkUnavailable as error:
                self._bulk_failed(bulk, error)
            except BulkStatusError as error:
                if error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]:
                    raise self._refused_value(key, error.message) from None
                raise self._error("put", error) from None
        try:
            self._put_wire(put_messages(key, data), timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise self._refused_value(key, error.details()) from None
            raise self._error("put", error) from None
        self._count("puts")

    def put(self, key: str, chunk: KVChunk) -> None:
        self.put_encoded(key, encode_chunk(chunk, self.codec, key=key))

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
        """Client-side counters plus the server's memory-tier gauges (None when unreachable, or
        when the token is a non-admin tenant's)."""
        with self._lock:
            result: dict[str, Any] = dict(self._counts)
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
        with self._lock:
            bulk, self._bulk = self._bulk, None
        if bulk is not None:
            bulk.close()
        self._channel.close()
