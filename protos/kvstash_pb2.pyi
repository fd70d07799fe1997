from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutRequest(_message.Message):
    __slots__ = ("key", "total_size", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    total_size: int
    data: bytes
    def __init__(self, key: _Optional[str] = ..., total_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("total_size", "data")
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    total_size: int
    data: bytes
    def __init__(self, total_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ContainsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ContainsResponse(_message.Message):
    __slots__ = ("num_hits",)
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    num_hits: int
    def __init__(self, num_hits: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BulkEndpointResponse(_message.Message):
    __slots__ = ("port", "tls", "protocol_version", "unix_path", "host_id", "instance_id")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNIX_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    port: int
    tls: bool
    protocol_version: int
    unix_path: str
    host_id: str
    instance_id: str
    def __init__(self, port: _Optional[int] = ..., tls: _Optional[bool] = ..., protocol_version: _Optional[int] = ..., unix_path: _Optional[str] = ..., host_id: _Optional[str] = ..., instance_id: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "num_keys", "bytes_used", "capacity_bytes", "hits", "misses", "puts", "evictions", "corrupt", "errors", "verified")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_keys: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    corrupt: int
    errors: int
    verified: int
    def __init__(self, name: _Optional[str] = ..., num_keys: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., errors: _Optional[int] = ..., verified: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "uptime_s", "num_active_streams", "num_puts", "num_gets", "num_get_hits", "bytes_received", "bytes_sent", "num_rejected", "version", "transports")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GETS_FIELD_NUMBER: _ClassVar[int]
    NUM_GET_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    uptime_s: float
    num_active_streams: int
    num_puts: int
    num_gets: int
    num_get_hits: int
    bytes_received: int
    bytes_sent: int
    num_rejected: int
    version: str
    transports: _containers.RepeatedCompositeFieldContainer[TransportStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., num_active_streams: _Optional[int] = ..., num_puts: _Optional[int] = ..., num_gets: _Optional[int] = ..., num_get_hits: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., num_rejected: _Optional[int] = ..., version: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[TransportStats, _Mapping]]] = ...) -> None: ...

class TransportStats(_message.Message):
    __slots__ = ("name", "num_puts", "num_gets", "bytes_received", "bytes_sent")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_puts: int
    num_gets: int
    bytes_received: int
    bytes_sent: int
    def __init__(self, name: _Optional[str] = ..., num_puts: _Optional[int] = ..., num_gets: _Optional[int] = ..., bytes_received: _Optional[int] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("prefix", "page_size", "page_token")
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    page_size: int
    page_token: str
    def __init__(self, prefix: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class KeyEntry(_message.Message):
    __slots__ = ("key", "tier")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    key: str
    tier: str
    def __init__(self, key: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("entries", "next_page_token")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KeyEntry]
    next_page_token: str
    def __init__(self, entries: _Optional[_Iterable[_Union[KeyEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("entry", "size_bytes", "dtype", "shape", "layout", "num_tokens", "codec")
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    entry: KeyEntry
    size_bytes: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    layout: str
    num_tokens: int
    codec: str
    def __init__(self, entry: _Optional[_Union[KeyEntry, _Mapping]] = ..., size_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., layout: _Optional[str] = ..., num_tokens: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("key", "prefix")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    key: str
    prefix: str
    def __init__(self, key: _Optional[str] = ..., prefix: _Optional[str] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("num_evicted",)
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    def __init__(self, num_evicted: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("num_evicted",)
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_evicted: int
    def __init__(self, num_evicted: _Optional[int] = ...) -> None: ...
