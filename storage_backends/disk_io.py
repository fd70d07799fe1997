"""Block-aligned whole-file I/O for the disk tier: ``O_DIRECT`` where the filesystem
accepts it, buffered otherwise.

``O_DIRECT`` moves bytes between the device and the caller's memory without the
page cache (no second copy, no cache pollution), but every buffer address, file
offset and length must be a multiple of the block size. The disk tier's file
layout puts large payloads on a block boundary (see ``disk_backend``); the few
bytes around them (the head with the key and chunk header, the payload's last
partial block) go through a small per-thread aligned scratch buffer.

All functions release the GIL in the system call, so several threads keep
several reads or writes in flight. Called only by :mod:`storage_backends.disk_backend`.
Imports neither torch nor numpy (the cache server's disk tier runs without them).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import uuid

#: alignment of addresses, offsets and lengths for O_DIRECT (the page size; covers 512-byte
#: and 4 KiB logical blocks)
BLOCK = 4096
#: O_DIRECT flag (0 where the platform lacks it: never direct)
O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(value: int, multiple: int = BLOCK) -> int:
    return -(-value // multiple) * multiple


class _PyBuffer(ctypes.Structure):
    """CPython's ``Py_buffer`` (the buffer protocol's view of an object's memory)."""

    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),  # a reference PyBuffer_Release drops
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)
_release_buffer.restype = None
#: PyBUF_SIMPLE: a contiguous buffer, read-only ones accepted
_PYBUF_SIMPLE = 0


def address_of(view: memoryview) -> int:
    """The address of a buffer's first byte (to check its alignment); 0 for an empty one.

    Any C-contiguous buffer, read-only ones (``bytes``) included; BufferError for a
    non-contiguous one. Through CPython's buffer protocol (ctypes), without numpy."""
    if len(view) == 0:
        return 0
    buffer = _PyBuffer()
    _get_buffer(view, ctypes.byref(buffer), _PYBUF_SIMPLE)  # ctypes raises the Python error
    try:
        return buffer.buf or 0
    finally:
        _release_buffer(ctypes.byref(buffer))


def is_aligned(view: memoryview) -> bool:
    return address_of(view) % BLOCK == 0 and len(view) % BLOCK == 0


class AlignedScratch:
    """One block-aligned scratch buffer per thread, grown on demand (anonymous mmap is page-aligned).

    Holds a file's head or a payload's last partial block on the way to or from the
    caller's memory; a thread reuses its buffer from call to call, so reads and
    writes allocate nothing in the steady state.
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, num_bytes: int) -> memoryview:
        """A writable aligned view of at least ``num_bytes`` (rounded up to whole blocks)."""
        size = round_up(max(num_bytes, 1))
        view = getattr(self._local, "view", None)
        if view is None or len(view) < size:
            self._local.view = view = memoryview(mmap.mmap(-1, size))
        return view[:size]


def set_direct(fd: int, direct: bool) -> None:
    """Switch ``O_DIRECT`` on or off for an open file (Linux lets F_SETFL change it)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | O_DIRECT) if direct else (flags & ~O_DIRECT))


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; returns the bytes read."""
    num_read = 0
    while num_read < len(view):
        wanted = len(view) - num_read
        got = os.preadv(fd, [view[num_read:]], offset + num_read)
        num_read += got
        # A short read that ends off a block boundary is the end of the file; another read
        # from there would also be misaligned for O_DIRECT.
        if got == 0 or (got < wanted and got % BLOCK):
            break
    return num_read


def write_from(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back from ``offset`` with vectored writes, resuming after short writes."""
    pending = [view for view in views if len(view)]
    while pending:
        written = os.pwritev(fd, pending, offset)
        if written == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += written
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if pending and written:
            pending[0] = pending[0][written:]


def fsync_folder(path: str) -> None:
    """Make renames and unlinks in ``path`` durable (the entries live in the folder, not the files)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def probe_direct_io(folder: str, temp_prefix: str) -> str | None:
    """None when ``folder``'s filesystem accepts an O_DIRECT write and read of one block,
    else the reason it does not (tmpfs refuses the open, some overlay setups the I/O)."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = os.path.join(folder, f"{temp_prefix}probe-{uuid.uuid4().hex}")
    block = memoryview(mmap.mmap(-1, BLOCK))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o600)
        try:
            write_from(fd, [block], 0)
            if read_into(fd, block, 0) != BLOCK:
                return "a direct read returned a short block"
        finally:
            os.close(fd)
    except OSError as exc:
        return f"{exc.strerror or exc}"
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return None
