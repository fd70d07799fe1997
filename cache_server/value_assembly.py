"""One Put's value, copied into place and checksummed piece by piece as the pieces arrive.

The gRPC Put handler makes one :class:`ValueAssembler` per call, calls :meth:`~ValueAssembler.add`
once per received piece (on the event loop) and :meth:`~ValueAssembler.finish` once at the
end; the bulk channel receives straight into :meth:`~ValueAssembler.next_space` and calls
:meth:`~ValueAssembler.advance` (on its connection's thread), or, for a value a client on
this host left in its shared-memory staging area, copies it in with
:meth:`~ValueAssembler.fill_from`. Each piece is copied once, into a buffer of the announced size, and its share of the
chunk's CRC-32 is computed while it is in cache, so the checks that ``verify_chunk`` makes
(header, key hash, length, checksum) are done when the last piece lands: no join and no second pass
over tens of MiB.

Measured on the Put path (docs/benchmarks.md), filling fresh memory that is kept: the
buffer is allocated without being filled, as ``torch.empty`` allocates (0.5 ms/MiB; through
:func:`~storage_backends.receive_buffers.uninitialized_bytearray`, so the server needs no
torch), not ``bytearray(n)`` (zero-filled first, one more pass) nor ``numpy.empty`` (it asks
for transparent huge pages from 4 MiB up, and faulting those in cost 2 to 3.5 ms/MiB of kernel
compaction here). The CRC-32 is zlib-ng's:
the same CRC as ``zlib.crc32``, about 6x faster with its SIMD code. Memory is committed
only as pieces arrive, so one Put holds at most its announced size (a list of pieces
joined at the end held twice that).
"""

from __future__ import annotations

from collections.abc import Callable

from zlib_ng import zlib_ng

from storage_backends.chunk import ChunkFormatError, ChunkHeader, check_key, header_checksum, parse_header
from storage_backends.receive_buffers import uninitialized_bytearray

#: a chunk header is never longer (its length field is a u16), so once this many bytes
#: (or the whole value) have arrived the header can be parsed
MAX_HEADER_BYTES = 1 << 16
#: most bytes copied out of a staging area per step of :meth:`ValueAssembler.fill_from` (what the
#: client has announced, up to this): the checksum then reads back a piece that is still in the
#: core's cache with its source (2 MiB of L2 on the 2-core VM); 256 KiB pieces took 10% less of
#: the server's CPU per 2 MiB Put than 1 MiB ones, whose checksum ran at half speed (docs/benchmarks.md)
FILL_PIECE_BYTES = 256 << 10


class ValueAssembler:
    """Buffer and running checksum of one value of ``total_size`` bytes (> 0) to be stored
    under ``key``: a header written for another key is refused like a bad checksum."""

    def __init__(self, total_size: int, key: str) -> None:
        self.key = key
        self._buffer = uninitialized_bytearray(total_size)  # not zeroed: filled whole before it is read
        self._view = memoryview(self._buffer)
        self.total_size = total_size
        self.num_received = 0
        self._header: ChunkHeader | None = None
        # CRC-32 of the header and of buffer[header_len:num_checked]; valid once _header is set
        self._checksum = 0
        self._num_checked = 0

    def add(self, piece: bytes | memoryview) -> None:
        """Append the next piece (gRPC Put). ChunkFormatError (a ValueError) for too many bytes or a bad header."""
        if self.num_received + len(piece) > len(self._buffer):
            raise ChunkFormatError(f"received more than the announced {len(self._buffer)} bytes")
        self.next_space(len(piece))[:] = piece
        self.advance(len(piece))

    def fill_from(
        self,
        source: memoryview,
        wait_for_more: Callable[[int], int] | None = None,
        copied: Callable[[int], None] | None = None,
    ) -> memoryview:
        """Copy the whole value from ``source`` piece by piece, checksumming each copied piece
        while it is in cache; returns :meth:`finish`'s verified value. ``source`` holds exactly
        ``total_size`` bytes, or, as a ring, fewer: byte ``i`` of the value is then read at
        ``i % len(source)`` (the writer reuses the ring as ``copied`` reports progress).
        ``wait_for_more(num_copied)`` blocks until the writer of ``source`` has written more
        than ``num_copied`` bytes and returns how many it has (None: all are there), so copying
        overlaps the writing; ``copied(num_copied)`` is called after each piece. The checksum
        reads this buffer, not ``source``, so a ``source`` that changes meanwhile (a client's
        shared memory) yields a refused value or the value that was verified, never a mix.
        ChunkFormatError for a bad header or checksum."""
        ring = len(source) != self.total_size
        if (
            self.num_received
            or not source
            or (ring and (wait_for_more is None or len(source) > self.total_size))
        ):
            raise ChunkFormatError(f"expected {self.total_size} bytes to copy, got {len(source)}")
        # The loop runs once per piece (9 times for a 2 MiB Put): locals, and no next_space/advance
        # with their slicing and bounds checks per piece (docs/benchmarks.md).
        total_size, source_len, view = self.total_size, len(source), self._view
        num_written = total_size if wait_for_more is None else 0
        start = 0
        while start < total_size:
            if start == num_written:
                num_written = wait_for_more(start)
            position = start % source_len
            # the rest of what is announced (and before the ring wraps) in one piece when it
            # is at most a piece and a half: no sliver of a piece left for another round
            end = min(num_written, start + source_len - position)
            if end - start > FILL_PIECE_BYTES + FILL_PIECE_BYTES // 2:
                end = start + FILL_PIECE_BYTES
            view[start:end] = source[position : position + end - start]
            self._received_through(end)
            start = end
            if copied is not None:
                copied(end)
        return self.finish()

    def next_space(self, max_bytes: int) -> memoryview:
        """The next up to ``max_bytes`` unfilled bytes of the buffer, for ``recv_into`` (bulk Put);
        :meth:`advance` then says how many were filled."""
        return self._view[self.num_received : min(len(self._buffer), self.num_received + max_bytes)]

    def advance(self, num_bytes: int) -> None:
        """Count ``num_bytes`` more bytes as received (written at the end by the caller) and
        checksum them. ChunkFormatError for a bad header."""
        end = self.num_received + num_bytes
        if end > len(self._buffer):
            raise ChunkFormatError(f"received more than the announced {len(self._buffer)} bytes")
        self._received_through(end)

    def _received_through(self, end: int) -> None:
        """Count the buffer's first ``end`` bytes as received and checksum the new ones (from
        the header on, once enough has arrived to parse it). ChunkFormatError for a bad header."""
        self.num_received = end
        if self._header is None and end >= min(self.total_size, MAX_HEADER_BYTES):
            self._start_checksum()
        if self._header is not None:
            self._checksum = zlib_ng.crc32(self._view[self._num_checked : end], self._checksum)
            self._num_checked = end

    def _start_checksum(self) -> None:
        header = parse_header(self._view[: self.num_received])
        if header.total_len != len(self._buffer):
            raise ChunkFormatError(
                f"announced {len(self._buffer)} bytes, but the chunk header says {header.total_len}"
            )
        check_key(header, self.key)
        self._header = header
        self._checksum = header_checksum(self._view, header)
        self._num_checked = header.header_len

    def finish(self) -> memoryview:
        """The verified value (read-only, owns the buffer); ChunkFormatError when it is incomplete or corrupt."""
        if self.num_received != len(self._buffer):
            raise ChunkFormatError(f"value truncated: got {self.num_received} of {len(self._buffer)} bytes")
        if self._header is None:
            self._start_checksum()
            self._checksum = zlib_ng.crc32(self._view[self._num_checked :], self._checksum)
        if self._checksum != self._header.checksum:
            raise ChunkFormatError(
                f"chunk checksum mismatch: stored {self._header.checksum:#010x}, computed {self._checksum:#010x}"
            )
        return self._view.toreadonly()
