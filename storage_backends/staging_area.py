"""Shared-memory staging areas: how a Put's value reaches a cache server on the same host.

Over a Unix socket a value still costs the kernel two copies (into socket buffers, out of
them), an allocation per buffer and a wake-up per buffer's worth. A staging area skips all
of it: the server creates an anonymous shared file (``memfd``) for one bulk connection,
maps it read-only and hands its descriptor to the client over the Unix socket
(``SCM_RIGHTS``); the client maps it writable, copies each value into it and sends only a
small request. The server copies the value out into the buffer it keeps, checksumming it as
it goes (``cache_server.value_assembly``), so what it stores is what it verified, whatever
the client writes into the area afterwards.

The server seals the file against shrinking and growing before handing it out
(``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): a client cannot truncate it under the
server's mapping, which would make the server's reads fault (SIGBUS) instead of failing.

Used by ``storage_backends.bulk_channel`` (client side: :meth:`StagingArea.from_fd`,
:meth:`StagingArea.write`) and ``cache_server.bulk_server`` (server side:
:func:`create_sealed_area`, :meth:`StagingArea.view`). Linux only; where ``memfd_create``
is missing the server refuses areas and clients stream values over the socket.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
from collections.abc import Callable, Sequence

#: seals the server puts on an area before handing it out (the size is fixed from then on)
AREA_SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
)
#: the shared file's name (``/proc/PID/fd`` shows ``/memfd:kvstash-staging (deleted)``)
AREA_NAME = "kvstash-staging"
#: areas are whole multiples of this (a client asking for 2 MiB + a header gets 3 MiB)
AREA_GRANULE_BYTES = 1 << 20
#: both sides map an area with its pages in place: one call instead of a page fault per 4 KiB
#: written or read (on the 2-core VM 1.6 us a fault: 3.5 ms for 9 MiB, against 0.6-1.3 ms)
MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def staging_supported() -> bool:
    """True where this Python can create sealed shared files (Linux with ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and AREA_SEALS != 0


def area_size_for(num_bytes: int) -> int:
    """The area a client asks for to hold a value of ``num_bytes``: rounded up to a granule."""
    return -(-num_bytes // AREA_GRANULE_BYTES) * AREA_GRANULE_BYTES


class StagingArea:
    """One mapping of a staging area: ``size`` bytes, read-only (server) or writable (client).
    Owned by one connection, used by one thread at a time."""

    def __init__(self, mapping: mmap.mmap, size: int) -> None:
        self._mapping = mapping
        self.size = size

    @classmethod
    def from_fd(cls, fd: int, size: int) -> StagingArea:
        """Map a descriptor the server handed over, writable (client side); closes ``fd``.
        ValueError when the file is not a sealed area of ``size`` bytes (a garbled reply)."""
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"staging area is {os.fstat(fd).st_size} bytes, the reply said {size}")
            if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & AREA_SEALS != AREA_SEALS:
                raise ValueError("staging area is not sealed against resizing")
            return cls(mmap.mmap(fd, size, flags=MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE), size)
        finally:
            os.close(fd)

    def write(
        self,
        parts: Sequence[bytes | bytearray | memoryview],
        segment_bytes: int,
        written: Callable[[int], None],
        wait_for_room: Callable[[int], None] | None = None,
    ) -> int:
        """Copy ``parts`` back to back from the start of the area (client side), ``segment_bytes``
        at a time, calling ``written(num_bytes_so_far)`` after each segment (the reader may copy
        those bytes out meanwhile) and after the last; returns the number of bytes written.

        Without ``wait_for_room`` the value must fit the area (ValueError, before anything is
        written, when it does not). With it, the area is a ring: byte ``i`` of the value goes to
        ``i % size``, and before a segment overwrites bytes of the value the reader may not
        have copied yet, ``wait_for_room(num_bytes)`` blocks until the reader has copied at
        least ``num_bytes`` of them; ``segment_bytes`` must then divide the area's size."""
        sources = [memoryview(part).cast("B") for part in parts]
        num_bytes = sum(len(source) for source in sources)
        if wait_for_room is None and num_bytes > self.size:
            raise ValueError(f"a value of {num_bytes} bytes does not fit a staging area of {self.size}")
        if wait_for_room is not None and (segment_bytes <= 0 or self.size % segment_bytes):
            raise ValueError(f"ring segments of {segment_bytes} bytes do not divide an area of {self.size}")
        offset = 0
        with memoryview(self._mapping) as area:
            for source in sources:
                start = 0
                while start < len(source):
                    room = segment_bytes - offset % segment_bytes
                    segment_end = offset + min(segment_bytes, num_bytes - offset)
                    if wait_for_room is not None and offset % segment_bytes == 0 and segment_end > self.size:
                        wait_for_room(segment_end - self.size)
                    piece = source[start : start + room]
                    position = offset % self.size
                    area[position : position + len(piece)] = piece
                    offset += len(piece)
                    start += len(piece)
                    if offset % segment_bytes == 0 and offset < num_bytes:
                        written(offset)
        written(num_bytes)
        return num_bytes

    def view(self) -> memoryview:
        """The whole area as a memoryview (release it before :meth:`close`)."""
        return memoryview(self._mapping)

    def close(self) -> None:
        """Unmap (a view still held keeps the mapping until it is released)."""
        with contextlib.suppress(BufferError):
            self._mapping.close()


def create_sealed_area(size: int) -> tuple[int, StagingArea]:
    """A new shared file of ``size`` bytes (> 0), sealed against resizing, and the server's
    read-only mapping of it. The caller sends the descriptor to its client and then closes it.
    OSError when the system cannot create it (no memfd, no memory)."""
    fd = os.memfd_create(AREA_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, AREA_SEALS)
        return fd, StagingArea(mmap.mmap(fd, size, flags=MAP_FLAGS, prot=mmap.PROT_READ), size)
    except BaseException:
        os.close(fd)
        raise
