"""The disk tier's read paths: a chunk file's head checked, its payload read (``O_DIRECT``
where aligned) into the caller's tensor or a new buffer, its checksum verified once.

:class:`DiskReads` is a part of :class:`~storage_backends.disk_backend.DiskBackend` (a base
class of it): its methods use the backend's index and lock (``_index``, ``_lock``), counters
(``_counters``), per-thread scratch buffers (``_head_scratch``, ``_tail_scratch``,
``_lz4_scratch``), ``direct_io``, and its ``_drop_entry`` and ``_map``. What they check and
count is in ``storage_backends/disk_backend.py``'s docstring ("Reads").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from zlib_ng.zlib_ng import crc32

from storage_backends import disk_io
from storage_backends.base import BackendError
from storage_backends.chunk import (
    ChunkFormatError,
    ChunkHeader,
    KVChunk,
    check_key,
    header_checksum,
    parse_header,
    tensor_bytes,
)
from storage_backends.disk_record import MAX_HEAD_BYTES, RECORD, unpack_record
from storage_backends.receive_buffers import uninitialized_bytearray

if TYPE_CHECKING:
    import torch

    from storage_backends.lru import LRUEntry

#: the tier's log lines keep the one logger name they always had
logger = logging.getLogger("storage_backends.disk_backend")

_T = TypeVar("_T")


@dataclass
class ChunkFileHead:
    """What a file's first bytes say: the record and the chunk header."""

    chunk_offset: int
    payload_offset: int
    header: ChunkHeader
    header_bytes: bytes  # the serialized chunk header, for the checksum
    prefetched: memoryview  # payload bytes that came with the head (small files)


class DiskReads:
    """The read half of the disk tier (see the module docstring for what it relies on)."""

    def _is_readable(self, entry: LRUEntry) -> bool:
        return entry.record.ready  # its file is written and renamed into place

    def _read_head(self, fd: int, expected_key: str | None) -> tuple[str, ChunkFileHead]:
        """Parse a file's record and chunk header from its first block(s), read into the
        thread's aligned scratch (O_DIRECT-safe). Raises ChunkFormatError when foreign,
        truncated, (with ``expected_key``) filed under another key, or when the chunk's key
        hash is not the record key's (:class:`ChunkKeyError`: a chunk moved between files)."""
        view = self._head_scratch.get(disk_io.BLOCK)
        num_read = disk_io.read_into(fd, view, 0)
        key_len, chunk_offset, payload_offset = unpack_record(view, num_read)
        if not RECORD.size + key_len <= chunk_offset < payload_offset <= MAX_HEAD_BYTES:
            raise ChunkFormatError(
                f"inconsistent disk record: key of {key_len} bytes, chunk at {chunk_offset}, "
                f"payload at {payload_offset}"
            )
        if payload_offset > num_read:
            if num_read < len(view):
                raise ChunkFormatError(f"truncated disk record: {num_read} bytes, head of {payload_offset}")
            view = self._head_scratch.get(payload_offset)
            num_read = disk_io.read_into(fd, view, 0)
            if num_read < payload_offset:
                raise ChunkFormatError(f"truncated disk record: {num_read} bytes, head of {payload_offset}")
        key = bytes(view[RECORD.size : RECORD.size + key_len]).decode("utf-8")
        if expected_key is not None and key != expected_key:
            raise ChunkFormatError(f"file holds key {key!r}")
        header_bytes = bytes(view[chunk_offset:payload_offset])
        header = parse_header(header_bytes)
        if header.header_len != len(header_bytes):
            raise ChunkFormatError(
                f"chunk header of {header.header_len} bytes in a slot of {len(header_bytes)}"
            )
        check_key(header, key)  # the chunk was serialized for this record's (and file name's) key
        return key, ChunkFileHead(
            chunk_offset, payload_offset, header, header_bytes, view[payload_offset:num_read]
        )

    def _open_for_read(self, path: str) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC
        return os.open(path, flags | disk_io.O_DIRECT) if self.direct_io else os.open(path, flags)

    def _read_payload(self, fd: int, head: ChunkFileHead, dest: memoryview) -> None:
        """Fill ``dest`` (the stored payload's length) from the file, O_DIRECT where aligned."""
        num_prefetched = min(len(head.prefetched), len(dest))
        dest[:num_prefetched] = head.prefetched[:num_prefetched]
        offset = head.payload_offset + num_prefetched
        rest = dest[num_prefetched:]
        if not len(rest):
            return
        num_aligned = len(rest) - len(rest) % disk_io.BLOCK
        if self.direct_io and offset % disk_io.BLOCK == 0 and disk_io.address_of(rest) % disk_io.BLOCK == 0:
            num_read = disk_io.read_into(fd, rest[:num_aligned], offset) if num_aligned else 0
            if num_read == num_aligned and num_aligned < len(rest):  # the last partial block
                block = self._tail_scratch.get(disk_io.BLOCK)
                num_tail = disk_io.read_into(fd, block, offset + num_aligned)
                num_copied = min(num_tail, len(rest) - num_aligned)
                rest[num_aligned : num_aligned + num_copied] = block[:num_copied]
                num_read += num_copied
        else:
            if self.direct_io:
                disk_io.set_direct(fd, False)  # the caller's buffer or the offset is not aligned
            num_read = disk_io.read_into(fd, rest, offset)
        if num_read != len(rest):
            raise ChunkFormatError(
                f"truncated chunk payload: {num_prefetched + num_read} of {len(dest)} bytes"
            )

    def _read_verified(self, key: str, read_body: Callable[[int, ChunkFileHead], _T]) -> _T | None:
        """Open ``key``'s file, check its head (record, key, chunk header, file size), then
        ``read_body(fd, head)``, which reads the payload and calls :meth:`_check_checksum`;
        its result, or None on a miss. Every read goes through here, so every value is
        verified exactly once, in the calling thread; a ChunkFormatError from anywhere in
        the read (corrupt, truncated, misfiled) is logged, counted in ``corrupt``, the file
        removed and the read a miss. A ValueError from ``read_body`` (an unfit caller
        buffer) propagates: it is not the file's fault."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or not entry.record.ready:
                self._counters.add("misses")
                return None
        path = entry.record.path
        try:
            fd = self._open_for_read(path)
        except FileNotFoundError:  # evicted or deleted since the index lookup
            self._counters.add("misses")
            return None
        except OSError as exc:
            self._counters.add("errors")
            raise BackendError(f"disk tier: cannot open {path}: {exc}") from exc
        try:
            _, head = self._read_head(fd, expected_key=key)
            file_size = os.fstat(fd).st_size
            expected_size = head.payload_offset + head.header.payload_len
            if file_size != expected_size:
                what = "truncated" if file_size < expected_size else "oversized"
                raise ChunkFormatError(f"{what} file: {file_size} bytes, header says {expected_size}")
            result = read_body(fd, head)
        except (ChunkFormatError, UnicodeDecodeError) as exc:
            logger.warning(
                "disk tier: corrupt chunk for key %r in %s (treated as a miss): %s", key, path, exc
            )
            self._counters.add("corrupt")
            self._counters.add("misses")
            self._drop_entry(key, entry)
            return None
        except OSError as exc:
            self._counters.add("errors")
            raise BackendError(f"disk tier: cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)
        self._counters.add("hits")
        return result

    def _check_checksum(self, head: ChunkFileHead, stored: memoryview) -> None:
        """The chunk's CRC over its header and the ``stored`` payload; ChunkFormatError on a
        mismatch. Counted in ``verified`` (one per value read: tests hold reads to that)."""
        checksum = crc32(stored, header_checksum(head.header_bytes, head.header))
        self._counters.add("verified")
        if checksum != head.header.checksum:
            raise ChunkFormatError(
                f"chunk checksum mismatch: stored {head.header.checksum:#010x}, computed {checksum:#010x}"
            )

    def _read_into(self, key: str, allocate: Callable[[ChunkHeader], torch.Tensor]) -> KVChunk | None:
        """Read and verify ``key``'s chunk into the tensor ``allocate(header)`` returns (the
        chunk's shape and dtype, a view of the caller's memory or a new buffer); None on a
        miss. Runs in the calling thread, checksum included."""

        def read_body(fd: int, head: ChunkFileHead) -> KVChunk:
            header = head.header
            tensor = allocate(header)
            raw = memoryview(tensor_bytes(tensor).numpy())
            if header.codec == "none":
                stored = raw
            else:
                stored = self._lz4_scratch.get(header.payload_len)[: header.payload_len]
            self._read_payload(fd, head, stored)
            self._check_checksum(head, stored)
            if header.codec == "lz4":
                _decompress_lz4_into(stored, raw)
            return KVChunk(tensor, header.layout)

        return self._read_verified(key, read_body)

    def get(self, key: str) -> KVChunk | None:
        return self._read_into(key, _new_aligned_tensor)

    def get_into(self, key: str, out: torch.Tensor) -> KVChunk | None:
        """Read ``key`` straight into ``out`` (see :meth:`StorageBackend.get_into`): the payload
        goes from the file into ``out``'s memory with O_DIRECT when ``out`` is 4 KiB aligned
        (pinned CPU-tier slots are), the checksum is computed over ``out`` in this thread."""
        import torch

        if not isinstance(out, torch.Tensor) or out.device.type != "cpu":
            raise ValueError(f"get_into needs a CPU tensor, got {type(out).__name__}")

        def view_of_out(header: ChunkHeader) -> torch.Tensor:
            numel = _numel(header.shape)
            if out.dtype != header.dtype or out.numel() < numel or not out.is_contiguous():
                raise ValueError(
                    f"get_into: {key!r} holds {numel} elements of {header.dtype}; the buffer has "
                    f"{out.numel()} of {out.dtype}{'' if out.is_contiguous() else ' (not contiguous)'}"
                )
            return out.reshape(-1)[:numel].view(header.shape)

        return self._read_into(key, view_of_out)

    def get_many(self, keys: Sequence[str]) -> list[KVChunk | None]:
        """:meth:`get` of every key, up to ``io_threads`` files in flight; in order."""
        return self._map(self.get, list(keys))

    def get_many_into(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> list[KVChunk | None]:
        """:meth:`get_into` of ``keys[i]`` into ``outs[i]``, up to ``io_threads`` files in flight."""
        if len(keys) != len(outs):
            raise ValueError(f"get_many_into: {len(keys)} keys but {len(outs)} buffers")
        return self._map(lambda pair: self.get_into(*pair), list(zip(keys, outs, strict=True)))

    def get_encoded(self, key: str) -> memoryview | None:
        """The serialized chunk (header, then payload as stored), verified once (header, key
        hash, file size, CRC) by the read that fills it, or None on a miss.

        The chunk header is copied from the head read; the payload goes from the file straight
        into the returned buffer (O_DIRECT when the tier uses it: the buffer is placed so that
        the payload starts on a block boundary). No other copy is made: the result is a
        read-only view of a buffer nobody else holds, so the cache server keeps it as its
        memory-tier entry as it is (``EncodedMemoryTier.put_verified``) and sends from it."""

        def read_body(fd: int, head: ChunkFileHead) -> memoryview:
            header = head.header
            value = _new_value_buffer(header.header_len, header.payload_len)
            value[: header.header_len] = head.header_bytes
            stored = value[header.header_len :]
            self._read_payload(fd, head, stored)
            self._check_checksum(head, stored)
            return value.toreadonly()

        return self._read_verified(key, read_body)

    # ---- writes --------------------------------------------------------------


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _new_aligned_tensor(header: ChunkHeader) -> torch.Tensor:
    """A new tensor of the chunk's shape whose memory starts on a block boundary (for O_DIRECT).
    Imports torch (the engine's :meth:`DiskBackend.get`; the cache server never calls it)."""
    import torch

    storage = torch.empty(header.raw_len + disk_io.BLOCK, dtype=torch.uint8)
    start = -storage.data_ptr() % disk_io.BLOCK
    return storage[start : start + header.raw_len].view(header.dtype).view(header.shape)


def _new_value_buffer(header_len: int, payload_len: int) -> memoryview:
    """A writable view of ``header_len + payload_len`` new bytes whose payload part starts on a
    block boundary (O_DIRECT reads land there). It views one larger ``bytearray`` (one block
    more, which ``memoryview.obj`` exposes, so a cap can count the whole of it) that is not
    zero-filled first (:func:`~storage_backends.receive_buffers.uninitialized_bytearray`, as
    the cache server's Put buffers in cache_server.value_assembly); its address never moves
    (a bytearray with a view over it cannot be resized). No torch or numpy."""
    backing = memoryview(uninitialized_bytearray(header_len + payload_len + disk_io.BLOCK))
    start = -(disk_io.address_of(backing) + header_len) % disk_io.BLOCK
    return backing[start : start + header_len + payload_len]


def _decompress_lz4_into(stored: memoryview, raw: memoryview) -> None:
    import lz4.block

    try:
        decompressed = lz4.block.decompress(stored, uncompressed_size=len(raw), return_bytearray=True)
    except lz4.block.LZ4BlockError as exc:
        raise ChunkFormatError(f"lz4 payload does not decompress: {exc}") from exc
    if len(decompressed) != len(raw):
        raise ChunkFormatError(f"lz4 payload decompressed to {len(decompressed)} bytes, expected {len(raw)}")
    raw[:] = decompressed
