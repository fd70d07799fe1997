"""Local-disk tier: one file per key, atomic durable writes, direct I/O, a start-up index,
a folder lock, a byte cap with LRU.

URL: ``file:///path/to/dir?capacity=BYTES[&codec=none|lz4][&fsync=1|0][&io_threads=N][&direct_io=1|0]``.

File ``<dir>/<blake2b-160 of key>.kvc`` holds one record: its layout, and when a payload
is 4 KiB-aligned for ``O_DIRECT``, are in ``storage_backends/disk_record.py``; the read
paths are in ``storage_backends/disk_reads.py``.

The file name is derived from the key, so a record whose key does not hash to
its own file name is corrupt. Writes go to ``.tmp-*`` files, then
``os.replace``: a reader or a restart never sees half a file. With ``fsync=1``
(the default) the file is fsynced before the rename and the folder after it,
so a power loss leaves only whole chunks; a killed process (SIGKILL) never
could leave a partial one.

Start-up: the folder lock is taken (:mod:`storage_backends.folder_lock`: a
second process on the folder gets :class:`FolderInUseError`); ``.tmp-*``
leftovers are removed; files that the index (:mod:`storage_backends.disk_index`)
lists with their current size and modification time are taken from it, every
other ``.kvc`` file is opened and its head parsed (broken records removed,
records or chunks of another format version ignored: left in place, not
counted against the cap). Recency comes from the index's order, then from
modification times. The index is rewritten on close and every
``INDEX_EVERY_CHANGES`` writes and removals.

Reads: the head (record, key, chunk header) into a small aligned per-thread
buffer, the record's key and the chunk header's key hash checked against the
key asked for, then the payload straight into the destination tensor (the
caller's buffer for :meth:`get_into`, a new block-aligned value buffer for
:meth:`get_encoded`, which is returned as a view, uncopied), the CRC verified once
in the reading thread (counted in ``verified``);
any mismatch is logged, counted in ``corrupt``, the file removed and the read is
a miss. ``get_many``/``get_many_into`` keep up to ``io_threads`` files in flight,
``put_many`` up to ``WRITES_IN_FLIGHT`` (4) of them.

Torch is imported only by the calls that make or fill tensors (``get``, ``get_into``,
``put`` and their ``_many`` forms: the engine's connector). The cache server's calls
(``get_encoded``, ``put_encoded``, listing, stats) move bytes through ``bytearray`` and
``mmap`` buffers and import neither torch nor numpy (issue 35).

Locks: ``_lock`` guards the index and is held only for index work, never across a
file-system call; the engine's step waits on it (``pin``, ``unpin``, ``contains``) while
writes are in flight. Renames into a chunk file's final path and unlinks of it (which can
wait tens of milliseconds for the journal while other files are fsynced) run under a
per-path lock (:meth:`DiskBackend._path_lock`) that orders them with the index decision
before each.

The cap counts whole chunk-file sizes, writes in flight included; victims are
removed before the new file is written, so the chunk files never exceed the cap
(``.tmp-*`` files included; the index and lock files are outside it, about
``key length + 18`` bytes per chunk). When pinned entries leave no room a put
stores nothing and raises :class:`CapacityError` (counted as ``rejected``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from storage_backends import disk_io
from storage_backends.base import BackendError, CapacityError, StorageBackend
from storage_backends.chunk import (
    CODECS,
    FORMAT_VERSION,
    ChunkFormatError,
    ChunkVersionError,
    KVChunk,
    encode_chunk_parts,
    verify_chunk,
)
from storage_backends.counters import Counters
from storage_backends.disk_index import IndexEntry, IndexFormatError, read_index, write_index
from storage_backends.disk_reads import DiskReads
from storage_backends.disk_record import (
    FILE_SUFFIX,
    RECORD,
    RECORD_MAGIC,
    RECORD_VERSION,
    TMP_PREFIX,
    key_to_filename,
    parse_record,
    record_layout,
)
from storage_backends.folder_lock import FolderInUseError, FolderLock
from storage_backends.lru import IndexedTierMixin, LRUEntry, LRUIndex
from storage_backends.thread_pools import started_thread_pool
from storage_backends.urls import parse_bool, parse_size, split_backend_url
from storage_backends.write_gate import WriteGate

logger = logging.getLogger(__name__)

__all__ = ["DiskBackend", "FolderInUseError", "key_to_filename", "parse_record"]

DEFAULT_IO_THREADS = 16
#: most files one put_many writes at once (see put_many)
WRITES_IN_FLIGHT = 4
#: locks that order renames and unlinks of chunk files (see DiskBackend._path_lock)
_NUM_PATH_LOCKS = 64
#: the index file is rewritten after this many writes and removals (and on close)
INDEX_EVERY_CHANGES = 1024


@dataclass
class _FileRecord:
    path: str
    ready: bool  # False while the file is being written
    mtime_ns: int = 0  # of the finished file, for the index


class DiskBackend(DiskReads, IndexedTierMixin, StorageBackend):
    name = "disk"

    def __init__(
        self,
        root: str,
        capacity_bytes: int,
        codec: str = "none",
        fsync: bool = True,
        io_threads: int = DEFAULT_IO_THREADS,
        direct_io: bool = True,
    ) -> None:
        if codec not in CODECS:
            raise ValueError(f"unknown codec {codec!r} for the disk tier; expected one of {CODECS}")
        if not isinstance(io_threads, int) or not 1 <= io_threads <= 256:
            raise ValueError(f"io_threads must be an integer from 1 to 256, got {io_threads!r}")
        self.root = os.path.abspath(root)
        self.codec = codec
        self.fsync = fsync
        self.io_threads = io_threads
        os.makedirs(self.root, exist_ok=True)
        self._folder_lock = FolderLock(self.root)  # before anything in the folder is touched
        self._index = LRUIndex(capacity_bytes, ordered=True)  # ordered: the cache server pages ListKeys
        self._lock = threading.Lock()
        self._index_file_lock = threading.Lock()
        self._path_locks = [threading.Lock() for _ in range(_NUM_PATH_LOCKS)]  # see _path_lock
        #: background writes wait here between system calls while the engine holds it
        #: (set by the connector's tier manager; None: writes never wait)
        self.write_gate: WriteGate | None = None
        #: told ``("stored" | "removed", keys)`` after a chunk file becomes readable or goes
        #: (the engine's KV events); called outside the locks
        self.on_change: Callable[[str, list[str]], None] | None = None
        self._counters = Counters()
        # per-thread aligned buffers: a file's head, a payload's last partial block, an lz4 payload
        self._head_scratch = disk_io.AlignedScratch()
        self._tail_scratch = disk_io.AlignedScratch()
        self._lz4_scratch = disk_io.AlignedScratch()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self.num_ignored_files = 0
        self.num_files_scanned = 0  # opened at start-up because the index did not vouch for them
        self._num_changes = 0  # writes and removals since the index file was last written
        try:
            self.direct_io = False
            if direct_io:
                reason = disk_io.probe_direct_io(self.root, TMP_PREFIX)
                self.direct_io = reason is None
                if reason is not None:
                    logger.info("disk tier %s: O_DIRECT refused (%s); using buffered I/O", self.root, reason)
            self._rebuild_index()
        except BaseException:
            self._folder_lock.release()
            raise

    @classmethod
    def from_url(cls, url: str) -> DiskBackend:
        parts, params = split_backend_url(url, ("capacity", "codec", "fsync", "io_threads", "direct_io"))
        root = parts.path if parts.netloc in ("", "localhost") else parts.netloc + parts.path
        if not root:
            raise ValueError(
                f"file:// URL needs a directory, e.g. file:///var/cache/kvstash?capacity=10GiB: {url!r}"
            )
        if "capacity" not in params:
            raise ValueError(
                f"file:// needs a byte cap, e.g. file:///var/cache/kvstash?capacity=10GiB: {url!r}"
            )
        io_threads_text = params.get("io_threads", str(DEFAULT_IO_THREADS))
        if not io_threads_text.isdigit():
            raise ValueError(f"io_threads: {io_threads_text!r} is not a positive integer in {url!r}")
        return cls(
            root,
            capacity_bytes=parse_size(params["capacity"], "disk capacity"),
            codec=params.get("codec", "none"),
            fsync=parse_bool(params.get("fsync", "1"), "disk fsync"),
            io_threads=int(io_threads_text),
            direct_io=parse_bool(params.get("direct_io", "1"), "disk direct_io"),
        )

    # ---- start-up ------------------------------------------------------------
    def _rebuild_index(self) -> None:
        """Index the folder from the index file and the files it does not vouch for (``__init__`` only)."""
        name_to_indexed = self._load_index_file()
        trusted: list[tuple[int, str, int, int, str]] = []  # (rank in the index, key, size, mtime_ns, path)
        scanned: list[tuple[int, str, int, str]] = []  # (mtime_ns, key, size, path)
        with os.scandir(self.root) as scan:
            for dir_entry in scan:
                if dir_entry.name.startswith(TMP_PREFIX):
                    self._remove_file(dir_entry.path)  # a write that never finished
                elif dir_entry.name.endswith(FILE_SUFFIX) and dir_entry.is_file():
                    status = dir_entry.stat()
                    indexed = name_to_indexed.get(dir_entry.name)
                    if indexed is not None:
                        rank, entry = indexed
                        if entry.size == status.st_size and entry.mtime_ns == status.st_mtime_ns:
                            trusted.append((rank, entry.key, entry.size, entry.mtime_ns, dir_entry.path))
                            continue
                    self.num_files_scanned += 1
                    key = self._scan_file(dir_entry.path, dir_entry.name, status.st_size)
                    if key is not None:
                        scanned.append((status.st_mtime_ns, key, status.st_size, dir_entry.path))
        trusted.sort()
        scanned.sort()
        for _, key, size, mtime_ns, path in trusted:
            self._index.add(key, size, _FileRecord(path, ready=True, mtime_ns=mtime_ns))
        for mtime_ns, key, size, path in scanned:  # written after the index: more recent
            self._index.add(key, size, _FileRecord(path, ready=True, mtime_ns=mtime_ns))
        # The cap may have shrunk since the files were written.
        victim_keys = self._index.victims_for(0) or []
        for key in victim_keys:
            self._remove_file(self._index.remove(key).record.path)
        self._counters.add("evictions", len(victim_keys))
        if scanned or victim_keys or len(trusted) != len(name_to_indexed):
            self._write_index_file()  # the next start-up need not open these files again

    def _load_index_file(self) -> dict[str, tuple[int, IndexEntry]]:
        """File name -> (rank, entry) from the index file; empty when it is missing or unusable."""
        try:
            entries = read_index(self.root, versions=(RECORD_VERSION, FORMAT_VERSION))
        except FileNotFoundError:
            return {}
        except (OSError, IndexFormatError) as exc:
            logger.info("disk tier %s: index file not used (%s); scanning every file", self.root, exc)
            return {}
        return {key_to_filename(entry.key): (rank, entry) for rank, entry in enumerate(entries)}

    def _scan_file(self, path: str, name: str, size: int) -> str | None:
        """The key stored in ``path`` when its head is sound; removes broken files, ignores foreign versions."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                key, head = self._read_head(fd, expected_key=None)
            finally:
                os.close(fd)
            if key_to_filename(key) != name:
                raise ChunkFormatError(f"record key {key!r} does not belong to file name {name}")
            if head.payload_offset + head.header.payload_len != size:
                raise ChunkFormatError(
                    f"file is {size} bytes, header says {head.payload_offset + head.header.payload_len}"
                )
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

    def put(self, key: str, chunk: KVChunk) -> None:
        if not isinstance(chunk, KVChunk):
            raise TypeError(f"put needs a KVChunk, got {type(chunk).__name__}")
        self._write(key, *encode_chunk_parts(chunk, self.codec, key=key))
        self._sync_folder()

    def put_encoded(self, key: str, data: bytes) -> None:
        view = memoryview(data)
        header = verify_chunk(view, key=key)
        self._write(key, bytes(view[: header.header_len]), view[header.header_len :])
        self._sync_folder()

    def put_many(self, items: Sequence[tuple[str, KVChunk]]) -> None:
        """:meth:`put` of every item, up to ``min(io_threads, WRITES_IN_FLIGHT)`` files in
        flight, one folder fsync at the end. Every item is attempted; the first error is
        raised afterwards. Called by the connector's write-through thread."""
        items = list(items)
        for _, chunk in items:
            if not isinstance(chunk, KVChunk):
                raise TypeError(f"put needs a KVChunk, got {type(chunk).__name__}")
        errors: list[BaseException] = []

        def write_one(item: tuple[str, KVChunk]) -> None:
            try:
                self._wait_for_gate()
                self._write(item[0], *encode_chunk_parts(item[1], self.codec, key=item[0]))
            except Exception as exc:  # raised after the other writes have had their turn
                errors.append(exc)

        # Each of a few threads writes its share in turn: threads that finish their writes
        # together queue for the GIL together, and the engine's step thread waits behind
        # each of them (issue 23); a few large writes in flight already keep a device busy.
        num_groups = min(self.io_threads, WRITES_IN_FLIGHT, len(items))
        groups = [items[index::num_groups] for index in range(num_groups)]
        self._map(lambda group: [write_one(item) for item in group], groups)
        self._sync_folder()
        if errors:
            raise errors[0]

    def _write(self, key: str, chunk_header: bytes, payload: memoryview | bytes) -> None:
        key_bytes = key.encode("utf-8")
        if len(key_bytes) > 0xFFFF:
            raise ValueError(f"key of {len(key_bytes)} bytes is too long for the disk tier (at most 65535)")
        payload = memoryview(payload).cast("B")
        chunk_offset, payload_offset = record_layout(len(key_bytes), len(chunk_header), len(payload))
        size = payload_offset + len(payload)
        if size > self._index.capacity:
            raise ValueError(
                f"chunk file of {size} bytes exceeds the disk tier's cap of {self._index.capacity} bytes"
            )
        path = os.path.join(self.root, key_to_filename(key))
        with self._path_lock(path):
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
                victims = [
                    (victim_key, self._index.remove(victim_key).record.path) for victim_key in victim_keys
                ]
                self._counters.add("evictions", len(victim_keys))
                self._num_changes += len(victim_keys)
                # The reservation holds one pin so that no concurrent put evicts it mid-write.
                entry = self._index.add(key, size, _FileRecord(path, ready=False), num_pins + 1)
            if old is not None:
                self._remove_file(path)
        # Victims go before this file is written, so the chunk files stay within the cap.
        for victim_key, victim_path in victims:
            self._remove_unindexed(victim_key, victim_path)
        self._changed("removed", [victim_key for victim_key, _ in victims])
        head = self._head_scratch.get(payload_offset)[:payload_offset]
        head[:] = bytes(payload_offset)
        RECORD.pack_into(head, 0, RECORD_MAGIC, RECORD_VERSION, len(key_bytes), chunk_offset, payload_offset)
        head[RECORD.size : RECORD.size + len(key_bytes)] = key_bytes
        head[chunk_offset:payload_offset] = chunk_header
        tmp_path = os.path.join(self.root, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        try:
            mtime_ns = self._write_file(tmp_path, head, payload)
        except OSError as exc:
            self._remove_file(tmp_path)
            self._counters.add("errors")
            self._drop_entry(key, entry)
            raise BackendError(f"disk tier: cannot write {path}: {exc}") from exc
        self._wait_for_gate()
        with self._path_lock(path):
            with self._lock:
                current = self._index.get(key, touch=False) is entry
            if current:
                # Nothing removes ``entry`` meanwhile: a delete or another put of ``key`` needs
                # this path lock, and eviction skips it (pinned).
                try:
                    os.replace(tmp_path, path)
                except OSError as exc:
                    self._remove_file(tmp_path)
                    self._counters.add("errors")
                    with self._lock:
                        self._index.remove(key)
                    self._changed("removed", [key])
                    raise BackendError(f"disk tier: cannot rename into {path}: {exc}") from exc
                with self._lock:
                    entry.record.ready = True
                    entry.record.mtime_ns = mtime_ns
                    entry.num_pins -= 1
                    self._counters.add("puts")
                    self._num_changes += 1
                    index_due = self._num_changes >= INDEX_EVERY_CHANGES
        if not current:
            self._remove_file(tmp_path)  # deleted or replaced while being written: the newer call wins
            return
        self._changed("stored", [key])
        if index_due:
            self._write_index_file()

    def _wait_for_gate(self) -> None:
        """Between a write's system calls: wait while the engine holds the write gate."""
        gate = self.write_gate
        if gate is not None:
            gate.wait_open()

    def _write_file(self, tmp_path: str, head: memoryview, payload: memoryview) -> int:
        """Write head then payload into a new file (fsynced when ``fsync``); its mtime in ns.

        O_DIRECT when the head is whole blocks and the payload's memory is aligned:
        one vectored write of head, the payload's whole blocks and its last block
        padded in the scratch, then a truncate to the real size."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        direct = (
            self.direct_io
            and len(head) % disk_io.BLOCK == 0
            and disk_io.address_of(payload) % disk_io.BLOCK == 0
            and len(payload) >= disk_io.BLOCK
        )
        fd = os.open(tmp_path, flags | (disk_io.O_DIRECT if direct else 0), 0o644)
        try:
            self._wait_for_gate()
            if direct:
                num_aligned = len(payload) - len(payload) % disk_io.BLOCK
                views = [head, payload[:num_aligned]]
                num_tail = len(payload) - num_aligned
                if num_tail:
                    tail = self._tail_scratch.get(disk_io.BLOCK)  # zero-padded to a whole block
                    tail[:num_tail] = payload[num_aligned:]
                    tail[num_tail:] = bytes(disk_io.BLOCK - num_tail)
                    views.append(tail)
                disk_io.write_from(fd, views, 0)
                if num_tail:
                    os.ftruncate(fd, len(head) + len(payload))
            else:
                disk_io.write_from(fd, [head, payload], 0)
            if self.fsync:
                self._wait_for_gate()
                os.fsync(fd)
            return os.fstat(fd).st_mtime_ns
        finally:
            os.close(fd)

    def _sync_folder(self) -> None:
        """Make the renames of finished writes durable (``fsync`` only)."""
        if self.fsync:
            try:
                disk_io.fsync_folder(self.root)
            except OSError as exc:
                self._counters.add("errors")
                raise BackendError(f"disk tier: cannot fsync folder {self.root}: {exc}") from exc

    def _changed(self, kind: str, keys: list[str]) -> None:
        if keys and self.on_change is not None:
            self.on_change(kind, keys)

    def delete(self, key: str) -> bool:
        path = os.path.join(self.root, key_to_filename(key))
        with self._path_lock(path):
            with self._lock:
                entry = self._index.remove(key)
                if entry is None:
                    return False
                self._num_changes += 1
            self._remove_file(entry.record.path)
        self._changed("removed", [key])
        return True

    def _drop_entry(self, key: str, entry: LRUEntry) -> None:
        """Remove ``key`` and its file if the index still holds this very ``entry``."""
        with self._path_lock(entry.record.path):
            with self._lock:
                if self._index.get(key, touch=False) is not entry:
                    return
                self._index.remove(key)
                self._num_changes += 1
            self._remove_file(entry.record.path)
        self._changed("removed", [key])

    def _remove_unindexed(self, key: str, path: str) -> None:
        """Unlink an evicted ``key``'s file unless a newer put of ``key`` has been indexed since
        (its rename replaces the old file, or its failure removes it)."""
        with self._path_lock(path):
            with self._lock:
                if key in self._index:
                    return
            self._remove_file(path)

    def _path_lock(self, path: str) -> threading.Lock:
        """The lock that orders the file-system calls on one chunk file's final ``path`` (the
        rename into it, its unlink) with the index decision before each. Taken before ``_lock``,
        never while holding ``_lock`` or another path lock. Renames and unlinks run under it and
        not under ``_lock``: with fsyncs in flight they can wait tens of milliseconds for the
        file system's journal, and ``_lock`` is what the engine's step waits on (``pin``,
        ``unpin``, ``contains``). Paths share ``_NUM_PATH_LOCKS`` locks by file name."""
        return self._path_locks[int(os.path.basename(path)[:8], 16) % _NUM_PATH_LOCKS]

    @staticmethod
    def _remove_file(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    # ---- threads and the index file -------------------------------------------
    def _map(self, call: Callable[[Any], Any], items: list) -> list:
        """``[call(item) for item in items]`` with up to ``io_threads`` calls in flight."""
        if len(items) <= 1 or self.io_threads == 1:
            return [call(item) for item in items]
        with self._lock:
            if self._closed:
                raise BackendError(f"disk tier {self.root} is closed")
            if self._pool is None:
                self._pool = started_thread_pool(self.io_threads, "kvstash-disk-io")
            pool = self._pool
        return list(pool.map(call, items))

    def _write_index_file(self) -> None:
        """Rewrite the index file from the in-memory index (ready entries, recency order)."""
        with self._index_file_lock:
            with self._lock:
                entries = [
                    IndexEntry(key, entry.size, entry.record.mtime_ns)
                    for key, entry in self._index.items()
                    if entry.record.ready
                ]
                self._num_changes = 0
            try:
                write_index(
                    self.root, entries, versions=(RECORD_VERSION, FORMAT_VERSION), temp_prefix=TMP_PREFIX
                )
            except OSError as exc:  # a stale index only costs a longer start-up
                logger.warning("disk tier %s: cannot write the index file: %s", self.root, exc)

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
                "num_files_scanned_at_start": self.num_files_scanned,
                "root": self.root,
                "codec": self.codec,
                "io_threads": self.io_threads,
                "direct_io": self.direct_io,
                "fsync": self.fsync,
            }
        return {**gauges, **self._counters.snapshot()}

    def close(self) -> None:
        """Finish in-flight I/O, write the index file, release the folder lock. Idempotent;
        no other call may follow it."""
        if self._closed:
            return
        super().close()  # waits for submit_put_many/submit_get_many, which use the I/O pool
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if os.path.isdir(self.root):
            self._write_index_file()
        self._folder_lock.release()
