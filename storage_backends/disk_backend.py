"""Local-disk tier: one file per key, atomic writes, an index rebuilt on start, a byte cap with LRU.

URL: ``file:///path/to/dir?capacity=BYTES[&codec=none|lz4][&fsync=0|1]``.

File ``<dir>/<blake2b-160 of key>.kvc`` holds a record::

    b"KVSD" | record version (u16) | key length (u16) | key (UTF-8) | serialized chunk

The file name is derived from the key, so a record whose key does not hash to
its own file name is corrupt. Writes go to ``.tmp-*`` files, then
``os.replace``: a reader or a restart never sees half a file. Without
``fsync=1`` a power loss may leave a torn file, which the chunk checksum turns
into a miss; a killed process (SIGKILL) cannot, since the page cache survives it.

On start the directory is scanned: ``.tmp-*`` leftovers and broken records are
removed; records or chunks of another format version are ignored (left in
place, not counted against the cap); recency is rebuilt from modification times.
Every read verifies the chunk checksum; a mismatch is logged, counted in
``corrupt``, the file removed and the read is a miss.

The cap counts whole file sizes, writes in flight included; victims are removed
before the new file is written, so the directory never holds more than the cap
(``.tmp-*`` files included). When pinned entries leave no room a put stores
nothing and raises :class:`CapacityError` (counted as ``rejected``).
``submit_put_many`` runs writes off the caller's thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from storage_backends.base import BackendError, CapacityError, StorageBackend
from storage_backends.chunk import (
    CODECS,
    ChunkFormatError,
    ChunkHeader,
    ChunkVersionError,
    KVChunk,
    check_key,
    decode_verified_chunk,
    encode_chunk,
    parse_header,
    verify_chunk,
)
from storage_backends.counters import Counters
from storage_backends.lru import IndexedTierMixin, LRUEntry, LRUIndex
from storage_backends.urls import parse_bool, parse_size, split_backend_url

logger = logging.getLogger(__name__)

RECORD_MAGIC = b"KVSD"
RECORD_VERSION = 1
_RECORD = struct.Struct("<4sHH")
FILE_SUFFIX = ".kvc"
TMP_PREFIX = ".tmp-"
_SCAN_PREFIX_BYTES = 1 << 16  # enough for the record header, any key and any chunk header


def key_to_filename(key: str) -> str:
    """The file name that stores ``key`` (fixed length, filesystem-safe, whatever the key holds)."""
    return hashlib.blake2b(key.encode("utf-8"), digest_size=20).hexdigest() + FILE_SUFFIX


@dataclass
class _FileRecord:
    path: str
    ready: bool  # False while the file is being written


class DiskBackend(IndexedTierMixin, StorageBackend):
    name = "disk"

    def __init__(self, root: str, capacity_bytes: int, codec: str = "none", fsync: bool = False) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r} for the disk tier; expected one of {CODECS}")
        self.root = os.path.abspath(root)
        self.codec = codec
        self.fsync = fsync
        os.makedirs(self.root, exist_ok=True)
        self._index = LRUIndex(capacity_bytes)
        self._lock = threading.Lock()
        self._counters = Counters()
        self.num_ignored_files = 0
        self._rebuild_index()

    @classmethod
    def from_url(cls, url: str) -> DiskBackend:
        parts, params = split_backend_url(url, ("capacity", "codec", "fsync"))
        root = parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path
        if not root:
            raise ValueError(
                f"file:// URL needs a directory, e.g. file:///var/cache/kvstash?capacity=10GiB: {url!r}"
            )
        if "capacity" not in params:
            raise ValueError(
                f"file:// needs a byte cap, e.g. file:///var/cache/kvstash?capacity=10GiB: {url!r}"
            )
        return cls(
            root,
            capacity_bytes=parse_size(params["capacity"], "disk capacity"),
            codec=params.get("codec", "none"),
            fsync=parse_bool(params.get("fsync", "0"), "disk fsync"),
        )

    # ---- start-up ------------------------------------------------------------
    def _rebuild_index(self) -> None:
        """Scan the directory once (called by ``__init__`` only)."""
        found: list[tuple[float, str, int, str]] = []  # (mtime, key, size, path)
        with os.scandir(self.root) as scan:
            for dir_entry in scan:
                if dir_entry.name.startswith(TMP_PREFIX):
                    self._remove_file(dir_entry.path)  # a write that never finished
                elif dir_entry.name.endswith(FILE_SUFFIX) and dir_entry.is_file():
                    status = dir_entry.stat()
                    key = self._scan_file(dir_entry.path, dir_entry.name, status.st_size)
                    if key is not None:
                        found.append((status.st_mtime, key, status.st_size, dir_entry.path))
        found.sort()
        for _, key, size, path in found:
            self._index.add(key, size, _FileRecord(path, ready=True))
        # The cap may have shrunk since the files were written.
        victim_keys = self._index.victims_for(0) or []
        for key in victim_keys:
            self._remove_file(self._index.remove(key).record.path)
        self._counters.add("evictions", len(victim_keys))

    def _scan_file(self, path: str, name: str, size: int) -> str | None:
        """The key stored in ``path`` when its header is sound; removes broken files, ignores foreign versions."""
        try:
            with open(path, "rb") as file:
                prefix = file.read(_SCAN_PREFIX_BYTES)
            key, chunk_offset = _parse_record(prefix)
            if key_to_filename(key) != name:
                raise ChunkFormatError(f"record key {key!r} does not belong to file name {name}")
            header = parse_header(memoryview(prefix)[chunk_offset:])
            check_key(header, key)
            if chunk_offset + header.total_len != size:
                raise ChunkFormatError(f"file is {size} bytes, header says {chunk_offset + header.total_len}")
        except ChunkVersionError as exc:
            self.num_ignored_files += 1
            logger.info("disk tier: ignoring %s: %s", path, exc)
            return None
        except (ChunkFormatError, UnicodeDecodeError, OSError) as exc:
            logger.warning("disk tier: removing broken file %s: %s", path, exc)
            self._counters.add("corrupt")
            self._remove_file(path)
            return None
        return key

    # ---- reads ---------------------------------------------------------------
    def _is_readable(self, entry: LRUEntry) -> bool:
        return entry.record.ready  # its file is written and renamed into place

    def _read_verified(self, key: str) -> tuple[memoryview, ChunkHeader] | None:
        """The verified serialized chunk of ``key`` (a view into the file's bytes) and its header,
        or None; counts hits and misses."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or not entry.record.ready:
                self._counters.add("misses")
                return None
        try:
            with open(entry.record.path, "rb") as file:
                data = file.read()
        except FileNotFoundError:  # evicted or deleted since the index lookup
            self._counters.add("misses")
            return None
        except OSError as exc:
            self._counters.add("errors")
            raise BackendError(f"disk tier: cannot read {entry.record.path}: {exc}") from exc
        try:
            stored_key, chunk_offset = _parse_record(data)
            if stored_key != key:
                raise ChunkFormatError(f"file holds key {stored_key!r}")
            chunk_bytes = memoryview(data)[chunk_offset:]
            header = verify_chunk(chunk_bytes, key=key)
        except (ChunkFormatError, UnicodeDecodeError) as exc:
            logger.warning(
                "disk tier: corrupt chunk for key %r in %s (treated as a miss): %s",
                key,
                entry.record.path,
                exc,
            )
            self._counters.add("corrupt")
            self._counters.add("misses")
            self._drop_entry(key, entry)
            return None
        self._counters.add("hits")
        return chunk_bytes, header

    def get(self, key: str) -> KVChunk | None:
        found = self._read_verified(key)
        return None if found is None else decode_verified_chunk(*found)

    def get_encoded(self, key: str) -> bytes | None:
        found = self._read_verified(key)
        return None if found is None else bytes(found[0])

    # ---- writes --------------------------------------------------------------
    def put(self, key: str, chunk: KVChunk) -> None:
        if not isinstance(chunk, KVChunk):
            raise TypeError(f"put needs a KVChunk, got {type(chunk).__name__}")
        self._write(key, encode_chunk(chunk, self.codec, key=key))

    def put_encoded(self, key: str, data: bytes) -> None:
        verify_chunk(data, key=key)
        self._write(key, data)

    def _write(self, key: str, chunk_bytes: bytes | memoryview) -> None:
        key_bytes = key.encode("utf-8")
        if len(key_bytes) > 0xFFFF:
            raise ValueError(f"key of {len(key_bytes)} bytes is too long for the disk tier (at most 65535)")
        record_header = _RECORD.pack(RECORD_MAGIC, RECORD_VERSION, len(key_bytes)) + key_bytes
        size = len(record_header) + len(chunk_bytes)
        if size > self._index.capacity:
            raise ValueError(
                f"chunk file of {size} bytes exceeds the disk tier's cap of {self._index.capacity} bytes"
            )
        path = os.path.join(self.root, key_to_filename(key))
        with self._lock:
            old = self._index.remove(key)  # its bytes count as free room for the new value
            victim_keys = self._index.victims_for(size)
            if victim_keys is None:
                if old is not None:  # keep the old value: a refused put changes nothing
                    self._index.add(key, old.size, old.record, old.num_pins)
                self._counters.add("rejected")
                raise CapacityError(
                    f"disk tier: no room for {key!r} ({size} bytes): pinned or in-flight files fill "
                    f"{self._index.used} of {self._index.capacity} bytes"
                )
            num_pins = 0 if old is None else old.num_pins
            if old is not None:
                self._remove_file(path)
            for victim_key in victim_keys:
                self._remove_file(self._index.remove(victim_key).record.path)
            self._counters.add("evictions", len(victim_keys))
            # The reservation holds one pin so that no concurrent put evicts it mid-write.
            entry = self._index.add(key, size, _FileRecord(path, ready=False), num_pins + 1)
        tmp_path = os.path.join(self.root, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with open(tmp_path, "wb") as file:
                file.write(record_header)
                file.write(chunk_bytes)
                if self.fsync:
                    file.flush()
                    os.fsync(file.fileno())
        except OSError as exc:
            self._remove_file(tmp_path)
            self._counters.add("errors")
            self._drop_entry(key, entry)
            raise BackendError(f"disk tier: cannot write {path}: {exc}") from exc
        with self._lock:
            if self._index.get(key, touch=False) is entry:
                try:
                    os.replace(tmp_path, path)
                except OSError as exc:
                    self._index.remove(key)
                    self._remove_file(tmp_path)
                    self._counters.add("errors")
                    raise BackendError(f"disk tier: cannot rename into {path}: {exc}") from exc
                entry.record.ready = True
                entry.num_pins -= 1
                self._counters.add("puts")
                return
        self._remove_file(tmp_path)  # deleted or replaced while being written: the newer call wins

    def delete(self, key: str) -> bool:
        with self._lock:
            entry = self._index.remove(key)
            if entry is None:
                return False
            self._remove_file(entry.record.path)
            return True

    def _drop_entry(self, key: str, entry: LRUEntry) -> None:
        """Remove ``key`` and its file if the index still holds this very ``entry``."""
        with self._lock:
            if self._index.get(key, touch=False) is entry:
                self._index.remove(key)
                self._remove_file(entry.record.path)

    @staticmethod
    def _remove_file(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # pin, unpin (and keys) come from IndexedTierMixin
    # ---- listing, stats, lifecycle ------------------------------------------
    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [
                key for key, entry in self._index.items() if entry.record.ready and key.startswith(prefix)
            ]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            gauges = {
                "num_keys": sum(1 for _, entry in self._index.items() if entry.record.ready),
                "bytes_used": self._index.used,
                "capacity_bytes": self._index.capacity,
                "num_pinned": self._index.num_pinned(),
                "num_ignored_files": self.num_ignored_files,
                "root": self.root,
                "codec": self.codec,
            }
        return {**gauges, **self._counters.snapshot()}


def _parse_record(data: bytes) -> tuple[str, int]:
    """(key, offset of the serialized chunk) from a record's first bytes; ChunkFormatError when foreign."""
    if len(data) < _RECORD.size:
        raise ChunkFormatError(f"truncated disk record: {len(data)} bytes")
    magic, version, key_len = _RECORD.unpack_from(data)
    if magic != RECORD_MAGIC:
        raise ChunkFormatError(f"not a kvstash disk record: magic {magic!r}")
    if version != RECORD_VERSION:
        raise ChunkVersionError(
            f"disk record version {version} is not supported (this build reads {RECORD_VERSION})"
        )
    chunk_offset = _RECORD.size + key_len
    if len(data) < chunk_offset:
        raise ChunkFormatError("truncated disk record key")
    return bytes(data[_RECORD.size : chunk_offset]).decode("utf-8"), chunk_offset
