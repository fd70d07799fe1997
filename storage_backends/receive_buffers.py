"""Host buffers for values received from a socket: large ones mapped on their own and reused.

A Get that hands the caller a new buffer (the ``grpc://`` tier's ``get_encoded`` and ``get``)
pays for that memory's first touch when the memory is new. glibc's malloc serves blocks under
32 MiB from memory freed earlier (its mmap threshold rises to the largest block freed, up to
32 MiB on 64-bit), but maps every block of 32 MiB or more fresh from the kernel and unmaps it
when it is freed: a 32 MiB chunk of an 8B model (plus its header) then cost a fault per 4 KiB
page on every Get, 8,193 faults and 16-17 ms on the 2-core development VM, where receiving it
into memory already touched takes 6-7 ms (docs/benchmarks.md, "Gets of 32 MiB"). So values of
:data:`OWN_MAPPING_BYTES` or more land in a private anonymous mapping advised
``MADV_HUGEPAGE`` (faulted in 2 MiB at a time where transparent huge pages are enabled, or
``madvise``; a no-op under ``never``), and a :class:`ReceiveBufferPool` keeps a few such
mappings for later values once nothing refers to them any more.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading

#: a transparent huge page on x86-64 and most arm64 kernels
HUGE_PAGE_BYTES = 2 << 20
#: buffers this large or larger get a mapping of their own; smaller ones come from malloc, which
#: reuses memory freed earlier (faulted in already) for them
OWN_MAPPING_BYTES = 32 << 20
#: idle mappings a pool keeps by default: three 32 MiB chunks of an 8B model with their headers
DEFAULT_MAX_KEPT_BYTES = 3 * (34 << 20)


_new_bytearray = ctypes.pythonapi.PyByteArray_FromStringAndSize
_new_bytearray.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_new_bytearray.restype = ctypes.py_object


def uninitialized_bytearray(num_bytes: int) -> bytearray:
    """A new ``bytearray`` of ``num_bytes`` whose contents are NOT zero-filled (whatever the
    memory held), for a buffer that is overwritten whole before it is read.

    ``bytearray(n)`` zero-fills its n bytes first: one more pass over memory. CPython's
    ``PyByteArray_FromStringAndSize(NULL, n)`` allocates without filling (from malloc, hence
    from the heap that the cache server's :mod:`cache_server.allocator` settings keep faulted in),
    as ``torch.empty`` does, without importing torch. ValueError for a negative size.
    """
    if num_bytes < 0:
        raise ValueError(f"a bytearray of {num_bytes} bytes")
    return _new_bytearray(None, num_bytes)


def new_receive_buffer(num_bytes: int) -> memoryview:
    """A writable, zero-filled buffer of ``num_bytes`` (unsigned bytes) that the caller owns.

    Called once per value, on the thread that receives it, just before ``recv_into``. At least
    :data:`OWN_MAPPING_BYTES`: a view of a mapping of its own (rounded up to whole huge pages),
    advised ``MADV_HUGEPAGE`` where the platform has it, unmapped when the last view of it is
    released; smaller: a ``bytearray``. ValueError for a negative size.
    """
    if num_bytes < 0:
        raise ValueError(f"a receive buffer of {num_bytes} bytes")
    if num_bytes < OWN_MAPPING_BYTES:
        return memoryview(bytearray(num_bytes))
    # A whole number of huge pages: Linux places only such anonymous mappings on a huge page
    # boundary (a 32 MiB value plus its header otherwise took 528 faults, not 17). Private: an
    # anonymous shared mapping is shmem, whose huge pages follow another setting.
    mapped_bytes = -(-num_bytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mapping = mmap.mmap(-1, mapped_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without THP refuses the advice: small pages then
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return memoryview(mapping)[:num_bytes]


def _references_to(objects: list[object], index: int) -> int:
    """References to ``objects[index]``, counted the same way for the probe and the real check."""
    return sys.getrefcount(objects[index])


# What the count says for an object only the list refers to. Measured, not assumed: what the
# interpreter counts (argument, stack, borrowed references) differs between Python versions.
_IDLE_REFERENCES = _references_to([bytearray()], 0)


class ReceiveBufferPool:
    """Mappings of :func:`new_receive_buffer` kept for later values once their callers dropped them.

    A mapping unmapped and mapped again per value costs its faults again, and on a VM that
    reports free memory to its host (virtio-balloon free page reporting) memory freed and
    touched again sometimes costs 40-100 ms. So mappings stay mapped, up to ``max_kept_bytes``
    of them, and one is handed out again when nothing refers to it but the pool: every
    ``memoryview``, numpy array, tensor or ``ctypes`` object over it holds a reference to the
    mapping (directly or through the view it was made from), so its reference count tells.
    A caller that keeps only a raw address (``data_ptr()``) without the object is on its own,
    as with any allocator.

    Owned by one :class:`~storage_backends.bulk_channel.BulkClient`; ``take`` is called on its
    connection threads (thread-safe); ``clear`` when the client closes. Values under
    :data:`OWN_MAPPING_BYTES` are never pooled (malloc reuses their memory already).
    """

    def __init__(self, max_kept_bytes: int = DEFAULT_MAX_KEPT_BYTES) -> None:
        if max_kept_bytes < 0:
            raise ValueError(f"a receive buffer pool cannot keep {max_kept_bytes} bytes")
        self.max_kept_bytes = max_kept_bytes
        self._kept: list[mmap.mmap] = []
        self._lock = threading.Lock()
        #: values served from a kept mapping / from a new one (counted for stats and tests)
        self.num_reused = 0
        self.num_new = 0

    @property
    def num_kept_bytes(self) -> int:
        with self._lock:
            return sum(len(mapping) for mapping in self._kept)

    def take(self, num_bytes: int) -> memoryview:
        """A writable buffer of ``num_bytes`` that the caller owns until it drops every reference
        to it; its contents are undefined (the caller fills all of it)."""
        if num_bytes < OWN_MAPPING_BYTES:
            return new_receive_buffer(num_bytes)
        with self._lock:
            # by index, with no local name for a mapping: the count must see only the list's reference
            for index in range(len(self._kept)):
                if (
                    len(self._kept[index]) >= num_bytes
                    and _references_to(self._kept, index) <= _IDLE_REFERENCES
                ):
                    self.num_reused += 1
                    return memoryview(self._kept[index])[:num_bytes]
            self.num_new += 1
        view = new_receive_buffer(num_bytes)
        mapping = view.obj
        with self._lock:
            kept_bytes = sum(len(kept) for kept in self._kept)
            if isinstance(mapping, mmap.mmap) and kept_bytes + len(mapping) <= self.max_kept_bytes:
                self._kept.append(mapping)
        return view

    def clear(self) -> None:
        """Stop keeping every mapping (each is unmapped once its last user drops it)."""
        with self._lock:
            self._kept = []
