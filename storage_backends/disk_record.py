"""The disk tier's chunk file: its record layout, file names and the parsing of a record header.

File ``<dir>/<blake2b-160 of key>.kvc`` holds a record::

    offset 0   b"KVSD" | record version (u16) | key length (u16)
           8   chunk offset (u32): where the serialized chunk starts
           12  payload offset (u32): where the chunk's payload starts
           16  key (UTF-8) | zero padding | serialized chunk (header, then payload)

A payload of at least ``ALIGN_MIN_PAYLOAD`` bytes starts on a 4 KiB boundary (the
padding before the chunk header makes it so): it is read and written with
``O_DIRECT`` straight between the device and the caller's memory. Smaller chunks

Used by ``storage_backends.disk_backend`` (writes, start-up scan) and
``storage_backends.disk_reads`` (reads); tools and tests parse whole files with
:func:`parse_record`.
"""

from __future__ import annotations

import hashlib
import struct

from storage_backends import disk_io
from storage_backends.chunk import ChunkFormatError, ChunkVersionError

RECORD_MAGIC = b"KVSD"
RECORD_VERSION = 2
RECORD = struct.Struct("<4sHHII")
FILE_SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
#: payloads from this size on start on a block boundary (read and written with O_DIRECT)
ALIGN_MIN_PAYLOAD = 64 << 10
#: a head (record header, key, padding, chunk header) is never larger than this
MAX_HEAD_BYTES = disk_io.round_up(RECORD.size + 0xFFFF + 4096) + disk_io.BLOCK


def key_to_filename(key: str) -> str:
    """The file name that stores ``key`` (fixed length, filesystem-safe, whatever the key holds)."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=20).hexdigest() + FILE_SUFFIX


def record_layout(key_len: int, chunk_header_len: int, payload_len: int) -> tuple[int, int]:
    """(chunk offset, payload offset) of a file holding a key of ``key_len`` bytes."""
    key_end = RECORD.size + key_len
    if payload_len < ALIGN_MIN_PAYLOAD:
        return key_end, key_end + chunk_header_len
    payload_offset = disk_io.round_up(key_end + chunk_header_len)
    return payload_offset - chunk_header_len, payload_offset


def unpack_record(data: bytes | memoryview, num_bytes: int) -> tuple[int, int, int]:
    """-> (key length, chunk offset, payload offset) of a record header among the first
    ``num_bytes`` of ``data``; ChunkFormatError when truncated or foreign, ChunkVersionError
    for another record version."""
    if num_bytes < RECORD.size:
        raise ChunkFormatError(f"truncated disk record: {num_bytes} bytes")
    magic, version, key_len, chunk_offset, payload_offset = RECORD.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise ChunkFormatError(f"not a kvstash disk record: magic {bytes(magic)!r}")
    if version != RECORD_VERSION:
        raise ChunkVersionError(
            f"disk record version {version} is not supported (this build reads {RECORD_VERSION})"
        )
    return key_len, chunk_offset, payload_offset


def parse_record(data: bytes) -> tuple[str, int]:
    """(key, offset of the serialized chunk) of a whole chunk file's bytes; ChunkFormatError when
    foreign. For tools and tests that look inside files."""
    key_len, chunk_offset, _ = unpack_record(data, len(data))
    if not RECORD.size + key_len <= chunk_offset <= len(data):
        raise ChunkFormatError("truncated or inconsistent disk record")
    return bytes(data[RECORD.size : RECORD.size + key_len]).decode("utf-8"), chunk_offset
