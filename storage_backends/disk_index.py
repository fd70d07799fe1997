"""The disk tier's index file: which key each chunk file holds, so a start-up need not
open every file.

``<folder>/index.kvi``, rewritten whole (temp file, fsync, rename) on close and
every so many changes::

    b"KVSI" | index version (u16) | disk record version (u16) | chunk format version (u16)
    | reserved (u16) | number of entries (u32) | CRC-32 of the body (u32) | body length (u64)
    body, one entry per chunk file, least recently used first:
    key length (u16) | file size (u64) | modification time in ns (i64) | key (UTF-8)

It is a hint, never the truth: the start-up scan still lists the folder, and an
entry is used only when its file exists with the same size and modification
time (otherwise that one file is read, as without an index). A missing, corrupt
or foreign index means a full scan. Every read verifies the chunk anyway.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
from typing import NamedTuple

from zlib_ng.zlib_ng import crc32

INDEX_NAME = "index.kvi"
INDEX_MAGIC = b"KVSI"
INDEX_VERSION = 1
_HEADER = struct.Struct("<4sHHHHIIQ")
_ENTRY = struct.Struct("<HQq")


class IndexEntry(NamedTuple):
    key: str
    size: int  # bytes of the chunk file
    mtime_ns: int  # the file's modification time when it was indexed


class IndexFormatError(ValueError):
    """The index file is truncated, corrupt or written by another build: scan instead."""


def write_index(
    folder: str, entries: list[IndexEntry], *, versions: tuple[int, int], temp_prefix: str
) -> None:
    """Replace ``<folder>/index.kvi`` atomically with ``entries`` (in recency order).

    ``versions`` = (disk record version, chunk format version) of the files indexed.
    Called by the disk backend from one thread at a time (its own index lock).
    """
    body = bytearray()
    for entry in entries:
        key_bytes = entry.key.encode("utf-8")
        body += _ENTRY.pack(len(key_bytes), entry.size, entry.mtime_ns)
        body += key_bytes
    header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, *versions, 0, len(entries), crc32(body), len(body))
    temp_path = os.path.join(folder, f"{temp_prefix}index-{uuid.uuid4().hex}")
    try:
        with open(temp_path, "wb") as file:
            file.write(header)
            file.write(body)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_path, os.path.join(folder, INDEX_NAME))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise


def read_index(folder: str, *, versions: tuple[int, int]) -> list[IndexEntry]:
    """The entries of ``<folder>/index.kvi``, least recent first.

    Raises FileNotFoundError when there is none and :class:`IndexFormatError` when
    it is corrupt or indexes files of other ``versions``.
    """
    with open(os.path.join(folder, INDEX_NAME), "rb") as file:
        data = file.read()
    if len(data) < _HEADER.size:
        raise IndexFormatError(f"index of {len(data)} bytes is truncated")
    magic, version, record_version, chunk_version, _, num_entries, body_crc, body_len = _HEADER.unpack_from(
        data
    )
    if magic != INDEX_MAGIC or version != INDEX_VERSION:
        raise IndexFormatError(
            f"not a version-{INDEX_VERSION} kvstash disk index (magic {magic!r}, version {version})"
        )
    if (record_version, chunk_version) != versions:
        raise IndexFormatError(
            f"index of record/chunk versions {(record_version, chunk_version)}, not {versions}"
        )
    body = memoryview(data)[_HEADER.size :]
    if len(body) != body_len or crc32(body) != body_crc:
        raise IndexFormatError("index body is truncated or its checksum does not match")
    entries: list[IndexEntry] = []
    offset = 0
    try:
        for _ in range(num_entries):
            key_len, size, mtime_ns = _ENTRY.unpack_from(body, offset)
            offset += _ENTRY.size
            key = bytes(body[offset : offset + key_len]).decode("utf-8")
            offset += key_len
            entries.append(IndexEntry(key, size, mtime_ns))
    except (struct.error, UnicodeDecodeError) as exc:
        raise IndexFormatError(f"index entry {len(entries)} is malformed: {exc}") from exc
    if offset != len(body):
        raise IndexFormatError(f"index body has {len(body) - offset} bytes after its {num_entries} entries")
    return entries
