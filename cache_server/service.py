"""gRPC handlers of ``kvstash.v1.KVCache`` and ``kvstash.v1.Admin``.

The handlers run on the server's asyncio loop; every storage call goes to a
worker thread so one slow tier never stalls other calls. A request outside the
limits, a corrupt value or an unknown key ends the call with a status code and a
one-line message; an unexpected error is logged with its traceback on the server
and reported as INTERNAL without details. No handler can stop the server.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import grpc

from cache_server.config import Limits
from cache_server.store import TieredStore
from cache_server.tenants import OPEN_ACCESS, Tenant, TenantRegistry
from cache_server.value_assembly import ValueAssembler
from protos import kvstash_pb2, kvstash_pb2_grpc
from storage_backends.base import BackendError, CapacityError
from storage_backends.chunk import verify_chunk
from storage_backends.grpc_channel import MAX_MESSAGE_BYTES
from storage_backends.grpc_codec import GET_DATA_FIELD, PUT_DATA_FIELD, parse_fields, piece_messages

logger = logging.getLogger(__name__)

DEFAULT_PAGE_SIZE = 1000
#: most bytes in one ListKeys page: the message limit less room for the page token (a base64
#: key), so the largest page always fits the server's own message limit
MAX_PAGE_BYTES = MAX_MESSAGE_BYTES - 4096
#: protobuf framing per listed entry (tags and lengths of the entry, its key and its tier), rounded up
ENTRY_FRAMING_BYTES = 16
VERSION = "kvstash.v1"
PUT_KEY_FIELD = kvstash_pb2.PutRequest.DESCRIPTOR.fields_by_name["key"].number
PUT_TOTAL_SIZE_FIELD = kvstash_pb2.PutRequest.DESCRIPTOR.fields_by_name["total_size"].number


class RequestError(Exception):
    """A refused request: ends the call with ``code`` and ``message``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status_for(error: Exception) -> tuple[grpc.StatusCode, str]:
    """The status code and client-facing message for an exception raised by a handler."""
    if isinstance(error, RequestError):
        return error.code, error.message
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"invalid value: {error}"
    if isinstance(error, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room: {error}"
    if isinstance(error, BackendError):
        return grpc.StatusCode.UNAVAILABLE, f"storage tier unavailable: {error}"
    logger.exception("unexpected error in a cache server handler")
    return grpc.StatusCode.INTERNAL, "internal server error (details are in the server log)"


def unary_handler(method: Callable) -> Callable:
    """Turn exceptions of a unary-response handler into statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            return await method(self, request, context)
        except Exception as error:  # noqa: BLE001 - every error becomes a status, never a crash
            code, message = status_for(error)
            self.counters.count_failure(code)
            await context.abort(code, message)

    return wrapper


def streaming_handler(method: Callable) -> Callable:
    """Turn exceptions of a response-streaming handler (one that sends with ``context.write``,
    so that it can bound each write by a deadline) into statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context: grpc.aio.ServicerContext):
        try:
            await method(self, request, context)
            return
        except Exception as error:  # noqa: BLE001 - every error becomes a status, never a crash
            code, message = status_for(error)
        # Outside the except block: the traceback (and the value it references) is dropped
        # before abort, which may wait while a client that stopped reading holds the stream.
        self.counters.count_failure(code)
        await context.abort(code, message)

    return wrapper


@dataclass
class Counters:
    """Server-wide counters. The gRPC handlers (event loop) and the bulk channel's connection
    threads both change them, so every change goes through a method that holds the lock."""

    started_at: float = field(default_factory=time.monotonic)
    num_active_streams: int = 0
    num_puts: int = 0
    num_gets: int = 0
    num_get_hits: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    num_rejected: int = 0
    #: per path ("unix", "tcp", "grpc"): {"num_puts", "num_gets", "bytes_received", "bytes_sent"}
    transports: dict[str, dict[str, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Add to counters by name, e.g. ``add(num_puts=1, bytes_received=n)``."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def count_put(self, transport: str, num_bytes: int) -> None:
        """One value of ``num_bytes`` stored, received over ``transport``."""
        self._count_transfer(transport, "num_puts", "num_puts", "bytes_received", num_bytes)

    def count_get_hit(self, transport: str, num_bytes: int) -> None:
        """One value of ``num_bytes`` sent over ``transport`` (num_get_hits and bytes_sent)."""
        self._count_transfer(transport, "num_get_hits", "num_gets", "bytes_sent", num_bytes)

    def _count_transfer(
        self, transport: str, total_name: str, count_name: str, bytes_name: str, num_bytes: int
    ) -> None:
        with self._lock:
            setattr(self, total_name, getattr(self, total_name) + 1)
            setattr(self, bytes_name, getattr(self, bytes_name) + num_bytes)
            per_path = self.transports.setdefault(
                transport, {"num_puts": 0, "num_gets": 0, "bytes_received": 0, "bytes_sent": 0}
            )
            per_path[count_name] += 1
            per_path[bytes_name] += num_bytes

    def transport_snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(values) for name, values in self.transports.items()}

    def try_open_stream(self, limit: int) -> bool:
        """Take one of ``limit`` stream slots; False when all are taken."""
        with self._lock:
            if self.num_active_streams >= limit:
                return False
            self.num_active_streams += 1
            return True

    def count_failure(self, code: grpc.StatusCode) -> None:
        """A miss (NOT_FOUND) is an answer, not a rejected request."""
        if code != grpc.StatusCode.NOT_FOUND:
            self.add(num_rejected=1)


def short_key(key: str) -> str:
    return key if len(key) <= 80 else key[:77] + "..."


class _Checks:
    """Limit and tenant checks shared by both services."""

    def __init__(self, limits: Limits, counters: Counters, tenants: TenantRegistry | None = None) -> None:
        self.limits = limits
        self.counters = counters
        #: None: an open server, every caller may do everything
        self.tenants = tenants

    def tenant_of(self, context: grpc.aio.ServicerContext) -> Tenant:
        """The calling tenant (the auth interceptor already refused unknown tokens)."""
        if self.tenants is None:
            return OPEN_ACCESS
        tenant = self.tenants.tenant_for_metadata(context.invocation_metadata())
        if tenant is None:
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        return tenant

    def check_access(self, tenant: Tenant, key: str, what: str) -> str:
        """``key`` when ``tenant`` may touch it; PERMISSION_DENIED otherwise."""
        if not tenant.may_access_key(key):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, tenant.denied(f"{what} key {short_key(key)!r}")
            )
        return key

    def check_admin(self, tenant: Tenant, what: str) -> None:
        if not tenant.admin:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, tenant.denied(f"{what} (admin only)"))

    def check_key(self, key: str) -> str:
        if not key:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty key")
        num_bytes = len(key.encode())
        if num_bytes > self.limits.max_key_bytes:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"key of {num_bytes} bytes exceeds the limit of {self.limits.max_key_bytes} bytes",
            )
        return key

    @contextlib.contextmanager
    def stream_slot(self) -> Iterator[None]:
        """Hold one of the ``max_concurrent_streams`` slots for a Put or Get (gRPC or bulk)."""
        if not self.counters.try_open_stream(self.limits.max_concurrent_streams):
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"too many concurrent streams (limit {self.limits.max_concurrent_streams}); retry later",
            )
        try:
            yield
        finally:
            self.counters.add(num_active_streams=-1)


class KVCacheService(kvstash_pb2_grpc.KVCacheServicer, _Checks):
    """Data plane. One instance per server; handlers may run concurrently. The bulk channel
    (``cache_server.bulk_server``) uses the same checks, so both paths enforce the same limits."""

    def __init__(
        self, store: TieredStore, limits: Limits, counters: Counters, tenants: TenantRegistry | None = None
    ) -> None:
        _Checks.__init__(self, limits, counters, tenants)
        self.store = store
        #: what GetBulkEndpoint answers; the server sets it once its bulk channel listens
        self.bulk_endpoint = kvstash_pb2.BulkEndpointResponse()

    @unary_handler
    async def Put(self, request_iterator, context) -> kvstash_pb2.PutResponse:
        """Messages arrive serialized (see ``kvcache_handler``); each piece is copied into place and
        checksummed as it arrives, so the value is verified when the stream ends.

        The first message must come within ``request_timeout_s``; the whole stream must end
        within ``Limits.transfer_deadline_s(total_size)`` of the call's start (DEADLINE_EXCEEDED
        otherwise). Memory for the value is reserved against the memory cap before its buffer
        is allocated and released however the call ends."""
        tenant = self.tenant_of(context)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.request_timeout_s
        messages = aiter(request_iterator)
        with self.stream_slot(), contextlib.ExitStack() as cleanup:
            key, value = None, None
            while (message := await _next_before(messages, deadline, loop)) is not None:
                fields = _parse(message)
                message_key = _text_field(fields, PUT_KEY_FIELD)
                if key is None:
                    key = self.check_access(tenant, self.check_key(message_key), "put")
                    total_size = self.check_size(_int_field(fields, PUT_TOTAL_SIZE_FIELD))
                    reservation = self.store.memory.reserve(key, total_size)
                    cleanup.callback(reservation.release)
                    deadline += self.limits.transfer_deadline_s(total_size) - self.limits.request_timeout_s
                    value = ValueAssembler(total_size, key)
                elif message_key and message_key != key:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "key changed within one Put stream")
                value.add(_bytes_field(fields, PUT_DATA_FIELD))
            if key is None:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty Put stream (no key)")
            data = value.finish()
            await asyncio.to_thread(self.store.put_verified, key, data, reservation)
            self.counters.count_put("grpc", len(data))
            return kvstash_pb2.PutResponse(num_bytes=len(data))

    def check_size(self, total_size: int) -> int:
        """``total_size`` when a value of that many bytes may be stored; RequestError otherwise."""
        if total_size == 0:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT, "total_size must be set on the first message"
            )
        if total_size > self.limits.max_value_bytes:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"value of {total_size} bytes exceeds the limit of {self.limits.max_value_bytes} bytes",
            )
        if total_size > self.store.memory_capacity_bytes:
            raise RequestError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"value of {total_size} bytes is larger than the memory tier "
                f"({self.store.memory_capacity_bytes} bytes)",
            )
        disk_capacity = self.store.disk_capacity_bytes
        if disk_capacity is not None and total_size > disk_capacity:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"value of {total_size} bytes is larger than the disk tier ({disk_capacity} bytes)",
            )
        return total_size

    @streaming_handler
    async def Get(self, request, context) -> None:
        """Writes serialized GetResponse messages (see ``kvcache_handler``) straight from the stored bytes.

        The whole stream must be sent within ``Limits.transfer_deadline_s(value size)`` of the
        call's start: a client that stops reading stalls the writes (flow control), and at the
        deadline the call ends with DEADLINE_EXCEEDED and its stream slot is freed."""
        key = self.check_access(self.tenant_of(context), self.check_key(request.key), "get")
        loop = asyncio.get_running_loop()
        started = loop.time()
        with self.stream_slot():
            self.counters.add(num_gets=1)
            stored = await asyncio.to_thread(self.store.get, key)
            if stored is None:
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"key not found: {short_key(key)}")
            total_size = len(stored.data)
            deadline = started + self.limits.transfer_deadline_s(total_size)
            head = kvstash_pb2.GetResponse(total_size=total_size).SerializeToString()
            for message in piece_messages(head, GET_DATA_FIELD, stored.data):
                await _before(context.write(message), deadline, loop)
            self.counters.count_get_hit("grpc", total_size)

    @unary_handler
    async def Contains(self, request, context) -> kvstash_pb2.ContainsResponse:
        keys = list(request.keys)
        if len(keys) > self.limits.max_contains_keys:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(keys)} keys in one Contains exceeds the limit of {self.limits.max_contains_keys}",
            )
        tenant = self.tenant_of(context)
        for key in keys:
            self.check_access(tenant, self.check_key(key), "check")
        num_hits = await asyncio.to_thread(self.store.contains, keys) if keys else 0
        return kvstash_pb2.ContainsResponse(num_hits=num_hits)

    @unary_handler
    async def Delete(self, request, context) -> kvstash_pb2.DeleteResponse:
        key = self.check_access(self.tenant_of(context), self.check_key(request.key), "delete")
        if not await asyncio.to_thread(self.store.delete, key):
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"key not found: {short_key(key)}")
        return kvstash_pb2.DeleteResponse()

    @unary_handler
    async def GetBulkEndpoint(self, request, context) -> kvstash_pb2.BulkEndpointResponse:
        return self.bulk_endpoint


class AdminService(kvstash_pb2_grpc.AdminServicer, _Checks):
    """Control plane for ``kvstash admin``."""

    def __init__(
        self, store: TieredStore, limits: Limits, counters: Counters, tenants: TenantRegistry | None = None
    ) -> None:
        _Checks.__init__(self, limits, counters, tenants)
        self.store = store

    @unary_handler
    async def Stats(self, request, context) -> kvstash_pb2.StatsResponse:
        self.check_admin(self.tenant_of(context), "read the server-wide stats")
        tier_stats = await asyncio.to_thread(self.store.stats)
        counters = self.counters
        return kvstash_pb2.StatsResponse(
            tiers=[_tier_stats_message(stats) for stats in tier_stats],
            uptime_s=time.monotonic() - counters.started_at,
            num_active_streams=counters.num_active_streams,
            num_puts=counters.num_puts,
            num_gets=counters.num_gets,
            num_get_hits=counters.num_get_hits,
            bytes_received=counters.bytes_received,
            bytes_sent=counters.bytes_sent,
            num_rejected=counters.num_rejected,
            version=VERSION,
            transports=[
                kvstash_pb2.TransportStats(name=name, **values)
                for name, values in sorted(counters.transport_snapshot().items())
            ],
        )

    @unary_handler
    async def ListKeys(self, request, context) -> kvstash_pb2.ListKeysResponse:
        """One page in key order, at most ``page_size`` keys and :data:`MAX_PAGE_BYTES` of them;
        ``next_page_token`` names the last key returned (so paging survives concurrent writes)
        and is empty on the last page. Costs time proportional to the page on ordered tiers."""
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        if page_size > self.limits.max_page_size:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"page_size {page_size} exceeds the limit of {self.limits.max_page_size}",
            )
        after = _decode_page_token(request.page_token)
        key_tiers, more = await asyncio.to_thread(
            self._visible_page, self.tenant_of(context), request.prefix, after, page_size
        )
        entries = []
        num_page_bytes = 0
        for key, tier in key_tiers:
            num_page_bytes += len(key.encode()) + len(tier) + ENTRY_FRAMING_BYTES
            if entries and num_page_bytes > MAX_PAGE_BYTES:
                more = True  # the rest goes on the next page
                break
            entries.append(kvstash_pb2.KeyEntry(key=key, tier=tier))
        next_token = _encode_page_token(entries[-1].key) if more and entries else ""
        return kvstash_pb2.ListKeysResponse(entries=entries, next_page_token=next_token)

    @unary_handler
    async def Info(self, request, context) -> kvstash_pb2.InfoResponse:
        key = self.check_access(self.tenant_of(context), self.check_key(request.key), "read")
        stored = await asyncio.to_thread(self.store.peek, key)
        if stored is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"key not found: {short_key(key)}")
        header = await asyncio.to_thread(verify_chunk, stored.data, key=key)
        return kvstash_pb2.InfoResponse(
            entry=kvstash_pb2.KeyEntry(key=key, tier=stored.tier),
            size_bytes=len(stored.data),
            dtype=header.dtype_name,
            shape=list(header.shape),
            layout=header.layout,
            num_tokens=header.shape[header.layout.index("T")],
            codec=header.codec,
        )

    @unary_handler
    async def Evict(self, request, context) -> kvstash_pb2.EvictResponse:
        if bool(request.key) == bool(request.prefix):
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "set exactly one of key or prefix")
        tenant = self.tenant_of(context)
        if request.key:
            key = self.check_access(tenant, self.check_key(request.key), "evict")
            if not await asyncio.to_thread(self.store.delete, key):
                raise RequestError(grpc.StatusCode.NOT_FOUND, f"key not found: {short_key(key)}")
            return kvstash_pb2.EvictResponse(num_evicted=1)
        if not tenant.may_list_prefix(request.prefix):
            raise RequestError(
                grpc.StatusCode.PERMISSION_DENIED, tenant.denied(f"evict keys under {request.prefix!r}")
            )
        num_evicted = await asyncio.to_thread(self.store.evict_prefix, request.prefix)
        return kvstash_pb2.EvictResponse(num_evicted=num_evicted)

    def _visible_page(
        self, tenant: Tenant, prefix: str, after: str | None, limit: int
    ) -> tuple[list[tuple[str, str]], bool]:
        """Like ``TieredStore.keys_page`` over the keys ``tenant`` may see (see
        :meth:`_visible_key_to_tier`): with no prefix, a non-admin's page merges one page per
        own prefix. Runs on a worker thread."""
        if tenant.admin or prefix:
            if not tenant.may_list_prefix(prefix):
                raise RequestError(
                    grpc.StatusCode.PERMISSION_DENIED, tenant.denied(f"list keys under {prefix!r}")
                )
            return self.store.keys_page(prefix, after, limit)
        key_to_tier: dict[str, str] = {}
        more = False
        for own_prefix in tenant.prefixes:
            page, own_more = self.store.keys_page(own_prefix, after, limit)
            key_to_tier.update(page)  # overlapping prefixes list a key twice, with the same tier
            more = more or own_more
        # Any key among the first `limit` of the union is among the first `limit` of its prefix's page.
        ordered = sorted(key_to_tier)
        return [(key, key_to_tier[key]) for key in ordered[:limit]], more or len(ordered) > limit

    def _visible_key_to_tier(self, tenant: Tenant, prefix: str, what: str) -> dict[str, str]:
        """Key -> tier of the keys under ``prefix`` that ``tenant`` may see: with no
        prefix, a non-admin's keys under each of its prefixes; a prefix that reaches
        outside the tenant's keys is PERMISSION_DENIED. Runs on a worker thread."""
        if tenant.admin or prefix:
            if not tenant.may_list_prefix(prefix):
                raise RequestError(grpc.StatusCode.PERMISSION_DENIED, tenant.denied(f"{what} {prefix!r}"))
            return self.store.key_to_tier(prefix)
        key_to_tier: dict[str, str] = {}
        for own_prefix in tenant.prefixes:
            key_to_tier.update(self.store.key_to_tier(own_prefix))
        return key_to_tier

    @unary_handler
    async def Clear(self, request, context) -> kvstash_pb2.ClearResponse:
        self.check_admin(self.tenant_of(context), "clear every key")
        num_evicted = await asyncio.to_thread(self.store.evict_prefix, "")
        return kvstash_pb2.ClearResponse(num_evicted=num_evicted)


TIER_STAT_FIELDS = (
    "num_keys",
    "bytes_used",
    "capacity_bytes",
    "hits",
    "misses",
    "puts",
    "evictions",
    "corrupt",
    "errors",
    "verified",
)


def _tier_stats_message(stats: dict) -> kvstash_pb2.TierStats:
    # A tier without a cap reports capacity None; the message says 0.
    values = {name: int(stats.get(name) or 0) for name in TIER_STAT_FIELDS}
    return kvstash_pb2.TierStats(name=stats["name"], **values)


def _encode_page_token(last_key: str) -> str:
    return base64.urlsafe_b64encode(last_key.encode()).decode()


def _decode_page_token(token: str) -> str | None:
    if not token:
        return None
    try:
        return base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "malformed page_token") from None


async def _next_before(messages: AsyncIterator, deadline: float, loop: asyncio.AbstractEventLoop):
    """The next message of a request stream, None at its end; DEADLINE_EXCEEDED when the
    stream has not delivered it by ``deadline`` (``loop.time()``), which ends the call."""
    try:
        return await _before(anext(messages), deadline, loop)
    except StopAsyncIteration:
        return None


async def _before(step: Awaitable, deadline: float, loop: asyncio.AbstractEventLoop):
    """``await step`` (a read from or a write to a stream); DEADLINE_EXCEEDED when it has not
    finished by ``deadline`` (``loop.time()``), which ends the call."""
    try:
        return await asyncio.wait_for(step, timeout=max(0.0, deadline - loop.time()))
    except asyncio.TimeoutError:
        raise RequestError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "request too slow: not complete within its deadline (--request-timeout-s plus its size "
            "at --min-rate-mib-s); its stream slot and memory were freed",
        ) from None


def _parse(message: bytes) -> dict:
    try:
        return parse_fields(message)
    except ValueError as error:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(error)) from None


def _bytes_field(fields: dict, number: int) -> memoryview | bytes:
    value = fields.get(number, b"")
    if isinstance(value, int):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"field {number} must be length-delimited")
    return value


def _text_field(fields: dict, number: int) -> str:
    try:
        return bytes(_bytes_field(fields, number)).decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "key is not valid UTF-8") from None


def _int_field(fields: dict, number: int) -> int:
    value = fields.get(number, 0)
    if not isinstance(value, int):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"field {number} must be an integer")
    return value


def kvcache_handler(service: KVCacheService) -> grpc.GenericRpcHandler:
    """The KVCache service for ``server.add_generic_rpc_handlers``.

    Like the generated ``add_KVCacheServicer_to_server``, except that Put
    receives and Get sends serialized messages (no protobuf copy of the pieces).
    """
    return grpc.method_handlers_generic_handler(
        "kvstash.v1.KVCache",
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                service.Put,
                request_deserializer=None,
                response_serializer=kvstash_pb2.PutResponse.SerializeToString,
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                service.Get, request_deserializer=kvstash_pb2.GetRequest.FromString, response_serializer=None
            ),
            "Contains": grpc.unary_unary_rpc_method_handler(
                service.Contains,
                request_deserializer=kvstash_pb2.ContainsRequest.FromString,
                response_serializer=kvstash_pb2.ContainsResponse.SerializeToString,
            ),
            "Delete": grpc.unary_unary_rpc_method_handler(
                service.Delete,
                request_deserializer=kvstash_pb2.DeleteRequest.FromString,
                response_serializer=kvstash_pb2.DeleteResponse.SerializeToString,
            ),
            "GetBulkEndpoint": grpc.unary_unary_rpc_method_handler(
                service.GetBulkEndpoint,
                request_deserializer=kvstash_pb2.BulkEndpointRequest.FromString,
                response_serializer=kvstash_pb2.BulkEndpointResponse.SerializeToString,
            ),
        },
    )
