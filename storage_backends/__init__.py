"""Storage tiers behind one interface (docs/architecture.md, Storage backends): CPU memory,
local disk, Redis, gRPC.

``create_backend(url)`` picks the tier by URL scheme (see :mod:`storage_backends.registry`).
"""

from storage_backends.base import BackendError, CapacityError, StorageBackend
from storage_backends.chunk import ChunkFormatError, ChunkVersionError, KVChunk, decode_chunk, encode_chunk
from storage_backends.registry import SCHEME_TO_FACTORY, create_backend

__all__ = [
    "SCHEME_TO_FACTORY",
    "BackendError",
    "CapacityError",
    "ChunkFormatError",
    "ChunkVersionError",
    "KVChunk",
    "StorageBackend",
    "create_backend",
    "decode_chunk",
    "encode_chunk",
]
