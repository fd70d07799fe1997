"""The in-memory chunk (:class:`KVChunk`) and its one serialized form.

Serialized chunk = fixed header + shape + layout + payload::

    offset size  field
    0      4     magic b"KVSC"
    4      2     format version (u16, little-endian)
    6      2     header length in bytes, shape and layout included (u16)
    8      1     dtype code (see _DTYPE_TO_CODE)
    9      1     codec code (0 none, 1 lz4)
    10     1     number of dimensions
    11     1     layout name length
    12     8     payload length: stored (possibly compressed) bytes (u64)
    20     8     raw length: uncompressed tensor bytes (u64)
    28     16    key hash: BLAKE2b-128 of the UTF-8 key the chunk is stored under
    44     4     CRC-32 of the header bytes before this field plus the shape,
                 layout and payload (CRC-32 as zlib.crc32 computes it, through zlib-ng's
                 SIMD code: about 14 GB/s on one core against zlib's 2.4)
    48     8*n   shape (u64 each)
    ..     k     layout name (ASCII, e.g. "LKTHD")
    ..           payload

The checksum covers the header too, so a flipped dtype or shape byte is caught
like a flipped payload byte. CRC-32 detects every error burst of up to 32 bits,
hence every single changed byte.

The key hash binds a value to its key: every read names the key it asked for
(``verify_chunk(data, key=...)``) and a value filed under another key (swapped,
copied or misfiled by a bug or an attacker with write access to the store) is a
:class:`ChunkFormatError`, i.e. a miss, never another prompt's KV. Version 1
(no key hash) is a :class:`ChunkVersionError` for this build.

The header is checked before any allocation: the element count is computed
exactly (no wrap-around), the layout must name every dimension, and an lz4 raw
length must be reachable from the payload (LZ4 expands at most 255x), so a
hostile header is a :class:`ChunkFormatError`, never an ``OverflowError`` or a
huge allocation.

This module imports torch (and numpy) only where a tensor is made or read: parsing and
verifying serialized chunks (what the cache server does) needs neither, so ``kvstash
cache-server`` runs without torch (issue 35).
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from zlib_ng.zlib_ng import crc32

if TYPE_CHECKING:
    import torch

MAGIC = b"KVSC"
FORMAT_VERSION = 2
DEFAULT_LAYOUT = "LKTHD"  # [num_layers, 2 (K, V), num_tokens, num_kv_heads, head_dim]
CODECS = ("none", "lz4")

KEY_HASH_BYTES = 16
_FIXED = struct.Struct(f"<4sHHBBBBQQ{KEY_HASH_BYTES}s")  # everything before the checksum
_CHECKSUM = struct.Struct("<I")
_PREFIX_BYTES = _FIXED.size + _CHECKSUM.size  # 48
#: LZ4's best case: one match byte per 255 output bytes (a block of zeros), so a larger
#: announced raw length cannot be real and must not be allocated
_LZ4_MAX_EXPANSION = 255
#: lz4.block takes the raw length as a C int
_LZ4_MAX_RAW_BYTES = (1 << 31) - 1
_DIM = struct.Struct("<Q")


class _DType(NamedTuple):
    name: str  # the torch dtype's name: getattr(torch, name)
    itemsize: int


#: dtype code -> the dtype's torch name and element size (torch-free: the header is parsed
#: without torch; :func:`_torch_dtype_codes` maps torch's dtypes to these codes)
_CODE_TO_DTYPE = MappingProxyType(
    {
        1: _DType("float32", 4),
        2: _DType("float16", 2),
        3: _DType("bfloat16", 2),
        4: _DType("float64", 8),
        5: _DType("int8", 1),
        6: _DType("uint8", 1),
        7: _DType("float8_e4m3fn", 1),
        8: _DType("float8_e5m2", 1),
    }
)
_CODEC_TO_CODE = {"none": 0, "lz4": 1}
_CODE_TO_CODEC = {code: name for name, code in _CODEC_TO_CODE.items()}


@functools.cache
def _torch_dtype_codes() -> Mapping[torch.dtype, int]:
    """torch dtype -> dtype code, for the dtypes this torch build has (float8 types exist
    only in newer builds). Imports torch on first call."""
    import torch

    return MappingProxyType(
        {
            getattr(torch, dtype.name): code
            for code, dtype in _CODE_TO_DTYPE.items()
            if hasattr(torch, dtype.name)
        }
    )


class ChunkFormatError(ValueError):
    """Serialized bytes are not a valid chunk: foreign magic, other format
    version, truncation, inconsistent header or a checksum mismatch."""


class ChunkVersionError(ChunkFormatError):
    """A kvstash chunk of another format version: valid for some build, not readable by this one."""


class ChunkKeyError(ChunkFormatError):
    """An intact chunk that was serialized for another key (a misfiled value): a miss."""


def key_hash(key: str) -> bytes:
    """The 16-byte hash of ``key`` that a serialized chunk carries (BLAKE2b-128 of its UTF-8)."""
    if not isinstance(key, str):
        raise TypeError(f"chunk key must be a str, got {type(key).__name__}")
    return hashlib.blake2b(key.encode("utf-8"), digest_size=KEY_HASH_BYTES).digest()


def check_key(header: ChunkHeader, key: str) -> None:
    """Raise :class:`ChunkKeyError` unless ``header`` was written for ``key``.

    Every reader calls it (through :func:`verify_chunk`, or directly when it
    verifies piece by piece) with the key it asked for.
    """
    if header.key_hash != key_hash(key):
        raise ChunkKeyError(f"chunk was stored for another key (key hash {header.key_hash.hex()})")


@dataclass(frozen=True)
class KVChunk:
    """KV of a run of tokens for every layer, as one CPU tensor.

    ``tensor``: ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` for the
    default layout ``"LKTHD"``; one letter of ``layout`` per dimension, ``T``
    marking the token dimension.
    """

    tensor: torch.Tensor
    layout: str = DEFAULT_LAYOUT

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"KVChunk.tensor must be a torch.Tensor, got {type(self.tensor).__name__}")
        if len(self.layout) != self.tensor.dim() or "T" not in self.layout:
            raise ValueError(
                f"layout {self.layout!r} must name each of the tensor's {self.tensor.dim()} "
                f"dimensions (shape {tuple(self.tensor.shape)}) and contain 'T' for tokens"
            )
        if len(set(self.layout)) != len(self.layout) or not self.layout.isascii():
            raise ValueError(f"layout {self.layout!r} must be distinct ASCII letters")
        if self.tensor.dtype not in _torch_dtype_codes():
            raise ValueError(f"unsupported chunk dtype {self.tensor.dtype}")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def num_tokens(self) -> int:
        return int(self.tensor.shape[self.layout.index("T")])

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def equal(self, other: KVChunk) -> bool:
        """Byte-exact comparison (NaN payloads included), same dtype, shape and layout."""
        import torch

        return (
            self.layout == other.layout
            and self.dtype == other.dtype
            and self.tensor.shape == other.tensor.shape
            and torch.equal(tensor_bytes(self.tensor), tensor_bytes(other.tensor))
        )


class ChunkHeader(NamedTuple):
    """What the header of a serialized chunk says; produced by :func:`parse_header`."""

    version: int
    header_len: int
    #: the dtype's torch name, e.g. "bfloat16" (:attr:`dtype` is the torch dtype)
    dtype_name: str
    codec: str
    shape: tuple[int, ...]
    layout: str
    payload_len: int
    raw_len: int
    key_hash: bytes
    checksum: int

    @property
    def total_len(self) -> int:
        """Length of the whole serialized chunk, header and payload."""
        return self.header_len + self.payload_len

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the chunk's tensor (imports torch); ChunkFormatError when this
        torch build lacks it (a float8 type in an old build)."""
        import torch

        dtype = getattr(torch, self.dtype_name, None)
        if dtype is None:
            raise ChunkFormatError(f"dtype {self.dtype_name} of the chunk is not in this torch build")
        return dtype


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bytes as a flat uint8 tensor (a view when contiguous; never a float conversion)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8)


def encode_chunk(chunk: KVChunk, codec: str = "none", *, key: str) -> bytes:
    """Serialize ``chunk`` (a CPU tensor) with ``codec`` ("none" or "lz4") for storage under ``key``.

    Called on every store to a byte tier; ``key`` is the key the value is filed
    under (its hash goes into the header, and every read checks it). The tensor's bytes are read through a
    memoryview; with codec "none" the only copy is the final join.
    """
    header, payload = encode_chunk_parts(chunk, codec, key=key)
    return b"".join((header, payload))


def encode_chunk_parts(chunk: KVChunk, codec: str = "none", *, key: str) -> tuple[bytes, memoryview | bytes]:
    """The serialized chunk for ``key`` as (header, payload) without joining them: with codec
    "none" the payload is a memoryview of the tensor's own memory (no copy).

    For writers that send the two pieces with vectored I/O (the disk tier's
    ``os.pwritev``); ``header + payload`` equals :func:`encode_chunk`'s bytes. The
    payload view is valid while ``chunk.tensor`` is alive and unchanged.
    """
    if codec not in _CODEC_TO_CODE:
        raise ValueError(f"unknown codec {codec!r}; expected one of {CODECS}")
    tensor = chunk.tensor
    if tensor.device.type != "cpu":
        raise ValueError(f"encode_chunk needs a CPU tensor, got one on {tensor.device}")
    raw = memoryview(tensor_bytes(tensor).numpy())
    if codec == "lz4":
        import lz4.block  # optional dependency, only needed for this codec

        payload = lz4.block.compress(raw, store_size=False)
    else:
        payload = raw
    layout = chunk.layout.encode("ascii")
    shape = tensor.shape
    header_len = _PREFIX_BYTES + _DIM.size * len(shape) + len(layout)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        header_len,
        _torch_dtype_codes()[tensor.dtype],
        _CODEC_TO_CODE[codec],
        len(shape),
        len(layout),
        len(payload),
        len(raw),
        key_hash(key),
    )
    tail = b"".join(_DIM.pack(size) for size in shape) + layout
    checksum = crc32(payload, crc32(tail, crc32(fixed)))
    return b"".join((fixed, _CHECKSUM.pack(checksum), tail)), payload


def parse_header(data: bytes | bytearray | memoryview) -> ChunkHeader:
    """Parse and sanity-check the header only (no checksum, no payload needed).

    Used by the disk tier to rebuild its index from file prefixes. Raises
    :class:`ChunkFormatError` for a foreign magic, another format version or an
    inconsistent header.
    """
    view = memoryview(data)
    if len(view) < _PREFIX_BYTES:
        raise ChunkFormatError(
            f"truncated chunk: {len(view)} bytes is shorter than the {_PREFIX_BYTES}-byte header"
        )
    (
        magic,
        version,
        header_len,
        dtype_code,
        codec_code,
        ndim,
        layout_len,
        payload_len,
        raw_len,
        stored_key_hash,
    ) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a kvstash chunk: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise ChunkVersionError(
            f"chunk format version {version} is not supported (this build reads {FORMAT_VERSION})"
        )
    if header_len != _PREFIX_BYTES + _DIM.size * ndim + layout_len:
        raise ChunkFormatError(f"inconsistent chunk header: length {header_len} for {ndim} dims")
    if len(view) < header_len:
        raise ChunkFormatError(f"truncated chunk header: {len(view)} of {header_len} bytes")
    if dtype_code not in _CODE_TO_DTYPE:
        raise ChunkFormatError(f"unknown dtype code {dtype_code} in chunk header")
    if codec_code not in _CODE_TO_CODEC:
        raise ChunkFormatError(f"unknown codec code {codec_code} in chunk header")
    (checksum,) = _CHECKSUM.unpack_from(view, _FIXED.size)
    shape = tuple(_DIM.unpack_from(view, _PREFIX_BYTES + _DIM.size * i)[0] for i in range(ndim))
    layout_start = _PREFIX_BYTES + _DIM.size * ndim
    layout_bytes = bytes(view[layout_start : layout_start + layout_len])
    layout = _parse_layout(layout_bytes, ndim)
    dtype = _CODE_TO_DTYPE[dtype_code]
    itemsize = dtype.itemsize
    # Python ints: the element count cannot wrap (numpy's uint64 product did, for (2^32, 2^32, 1)).
    if raw_len != math.prod(shape) * itemsize:
        raise ChunkFormatError(
            f"chunk raw length {raw_len} does not match shape {shape} of torch.{dtype.name}"
        )
    codec = _CODE_TO_CODEC[codec_code]
    if codec == "none" and payload_len != raw_len:
        raise ChunkFormatError(f"uncompressed chunk payload {payload_len} bytes, expected {raw_len}")
    if codec == "lz4" and (raw_len > _LZ4_MAX_RAW_BYTES or raw_len > _LZ4_MAX_EXPANSION * payload_len + 16):
        raise ChunkFormatError(f"lz4 payload of {payload_len} bytes cannot decompress to {raw_len} bytes")
    return ChunkHeader(
        version, header_len, dtype.name, codec, shape, layout, payload_len, raw_len, stored_key_hash, checksum
    )


def _parse_layout(layout_bytes: bytes, ndim: int) -> str:
    """The layout name when it is what :class:`KVChunk` accepts for ``ndim`` dimensions."""
    if not layout_bytes.isascii() or not layout_bytes.isalpha():
        raise ChunkFormatError(f"chunk layout name {layout_bytes!r} is not ASCII letters")
    layout = layout_bytes.decode("ascii")
    if len(layout) != ndim or "T" not in layout or len(set(layout)) != len(layout):
        raise ChunkFormatError(
            f"chunk layout {layout!r} must name each of the {ndim} dimensions once and contain 'T'"
        )
    return layout


def header_checksum(data: bytes | bytearray | memoryview, header: ChunkHeader) -> int:
    """The running CRC-32 over the header bytes the checksum covers (all but the checksum field).

    Continuing it over the payload (``crc32(payload, start)``, piece by piece if need be)
    gives ``header.checksum`` for an intact chunk: receivers that get a value in pieces (the
    cache server's Put) verify it as it arrives instead of in a second pass.
    """
    view = memoryview(data)
    return crc32(view[_PREFIX_BYTES : header.header_len], crc32(view[: _FIXED.size]))


def verify_chunk(data: bytes | bytearray | memoryview, *, key: str) -> ChunkHeader:
    """Check header, key, length and checksum of a whole serialized chunk without decoding tensors.

    ``key``: the key the caller reads or stores the value under; a value serialized for
    another key is a :class:`ChunkKeyError`. Used before storing already-encoded bytes
    (``put_encoded``), on every read of a byte tier, and by :func:`decode_chunk`.
    """
    view = memoryview(data)
    header = parse_header(view)
    check_key(header, key)
    if len(view) != header.total_len:
        what = "truncated" if len(view) < header.total_len else "oversized"
        raise ChunkFormatError(f"{what} chunk: {len(view)} bytes, header says {header.total_len}")
    checksum = crc32(view[header.header_len :], header_checksum(view, header))
    if checksum != header.checksum:
        raise ChunkFormatError(
            f"chunk checksum mismatch: stored {header.checksum:#010x}, computed {checksum:#010x}"
        )
    return header


def decode_chunk(data: bytes | bytearray | memoryview, *, key: str) -> KVChunk:
    """Verify and deserialize a chunk read under ``key``; the result owns its (writable) tensor.

    Raises :class:`ChunkFormatError` for anything but an intact chunk of this format
    version serialized for ``key``.
    """
    view = memoryview(data)
    return decode_verified_chunk(view, verify_chunk(view, key=key))


def decode_verified_chunk(data: bytes | bytearray | memoryview, header: ChunkHeader) -> KVChunk:
    """Deserialize bytes that :func:`verify_chunk` has already checked (it returned ``header``).

    For tiers that verify once on read and decode later, so the checksum is not computed twice.
    """
    import numpy as np
    import torch

    payload = memoryview(data)[header.header_len :]
    if header.codec == "lz4":
        import lz4.block

        try:
            raw = lz4.block.decompress(payload, uncompressed_size=header.raw_len, return_bytearray=True)
        except (lz4.block.LZ4BlockError, OverflowError, MemoryError) as exc:
            raise ChunkFormatError(f"lz4 payload does not decompress: {exc}") from exc
        if len(raw) != header.raw_len:
            raise ChunkFormatError(f"lz4 payload decompressed to {len(raw)} bytes, expected {header.raw_len}")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.empty(header.raw_len, dtype=torch.uint8)
        flat.numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
    tensor = flat.view(header.dtype).reshape(header.shape)
    return KVChunk(tensor, header.layout)


#: leading bytes of every serialized chunk that say how long its header is (magic, version, length)
HEADER_LENGTH_PREFIX = struct.Struct("<4sHH")


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """The header length a chunk's first ``HEADER_LENGTH_PREFIX.size`` bytes announce.

    For receivers that read a chunk from a stream: they read this many bytes, then the rest of
    the header, then hand the header to :func:`parse_header` (which checks everything).
    ChunkFormatError for a foreign magic or a length shorter than the prefix itself.
    """
    magic, _version, length = HEADER_LENGTH_PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise ChunkFormatError(f"not a kvstash chunk: magic {bytes(magic)!r}, expected {MAGIC!r}")
    if length < HEADER_LENGTH_PREFIX.size:
        raise ChunkFormatError(f"inconsistent chunk header: length {length}")
    return length
