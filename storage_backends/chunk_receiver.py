"""Receive one serialized chunk from a stream straight into the caller's tensor, verifying it once it landed.

The ``grpc://`` tier's ``get_into`` reads a Get's value from the bulk channel with
this: the header into a small buffer, then the payload with ``recv_into``
directly into ``out`` (a CPU-tier slot, usually pinned, that feeds the
host→device copy), then the CRC-32 over the payload. No intermediate ``bytes``
object holds the value.

The payload is one read (on the bulk channel's Unix socket or plain TCP one
``MSG_WAITALL`` system call, ``protos.bulk_wire.recv_exactly``) and one CRC-32 call, both of which
release the GIL. It used to be read and checksummed per 1 MiB piece while the piece was
in cache: 32 pieces and ~45 system calls per 32 MiB chunk, each return needing the GIL
back. In an engine whose step thread runs Python that wait is up to the interpreter's
switch interval each time, and a fetch got half the rate the same reads got alone (on the
2-core VM, 4 connections, a thread holding the GIL half the time: 2.3 GB/s in pieces,
3.6 GB/s whole; docs/benchmarks.md, "Fetches from the cache server").

The header and the key it was written for are checked
(:func:`~storage_backends.chunk.parse_header`, :func:`~storage_backends.chunk.check_key`)
before any payload byte is written, the checksum when the last byte has landed (also when
``out`` does not fit the header, so a corrupt header is a corrupt value, not a
buffer error); whatever
fails, the rest of the announced value is read and dropped so the connection
stays in step, and the caller gets ChunkFormatError (corrupt value: a miss) or
ValueError (``out`` cannot hold it). ``out``'s contents are undefined after a
failure. An lz4 payload is received into a scratch buffer and decompressed into
``out`` (one copy; compressed values are the exception).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from zlib_ng.zlib_ng import crc32

from storage_backends.chunk import (
    HEADER_LENGTH_PREFIX,
    ChunkFormatError,
    ChunkHeader,
    KVChunk,
    check_key,
    header_checksum,
    header_length,
    parse_header,
)
from storage_backends.receive_buffers import OWN_MAPPING_BYTES, ReceiveBufferPool

#: bytes per read of a value that is dropped (a refused or corrupt value is read to its end)
RECV_PIECE_BYTES = 1 << 20

#: fills the whole view from the stream or raises (ConnectionError, TimeoutError, ...)
ReadExactly = Callable[[memoryview], None]
#: the tensor (contiguous, CPU, the header's dtype and shape) the payload lands in; ValueError if none
Destination = Callable[[ChunkHeader], torch.Tensor]


def fresh_tensor(header: ChunkHeader) -> torch.Tensor:
    """A new, uninitialized tensor for the chunk (``get``: the chunk owns its memory)."""
    return torch.empty(header.shape, dtype=header.dtype)


def pooled_tensor(pool: ReceiveBufferPool) -> Destination:
    """A destination like :func:`fresh_tensor` whose chunks of
    :data:`~storage_backends.receive_buffers.OWN_MAPPING_BYTES` or more land in a buffer of
    ``pool`` (reused once the chunk and every view of it are dropped: no page faults per Get)."""

    def destination(header: ChunkHeader) -> torch.Tensor:
        if header.raw_len < OWN_MAPPING_BYTES:
            return fresh_tensor(header)
        return torch.frombuffer(pool.take(header.raw_len), dtype=header.dtype).view(header.shape)

    return destination


def out_view_for(out: torch.Tensor, header: ChunkHeader, key: str) -> torch.Tensor:
    """The leading elements of ``out`` shaped as the chunk, or ValueError when ``out`` cannot hold it."""
    numel = header.raw_len // max(1, torch.empty((), dtype=header.dtype).element_size())
    if (
        out.device.type != "cpu"
        or out.dtype != header.dtype
        or out.numel() < numel
        or not out.is_contiguous()
    ):
        raise ValueError(
            f"get_into: {key!r} holds {numel} elements of {header.dtype}; the buffer has "
            f"{out.numel()} of {out.dtype} on {out.device}{'' if out.is_contiguous() else ' (not contiguous)'}"
        )
    return out.reshape(-1)[:numel].view(header.shape)


def receive_chunk(read_exactly: ReadExactly, value_len: int, destination: Destination, key: str) -> KVChunk:
    """Read the value of ``key``, ``value_len`` bytes, into ``destination(header)`` and return it as a chunk.

    Called by the bulk client on a connection's thread, once per Get, after the reply
    announced ``value_len``. Raises ChunkFormatError or ValueError after consuming all
    ``value_len`` bytes (stream in step), and transport errors as they come (stream broken).
    """
    num_read = 0
    try:
        if value_len < HEADER_LENGTH_PREFIX.size:
            raise ChunkFormatError(f"truncated chunk: {value_len} bytes")
        prefix = bytearray(HEADER_LENGTH_PREFIX.size)
        read_exactly(memoryview(prefix))
        num_read = len(prefix)
        head_len = header_length(prefix)
        if head_len > value_len:
            raise ChunkFormatError(f"truncated chunk header: {value_len} of {head_len} bytes")
        head = prefix + bytearray(head_len - len(prefix))
        read_exactly(memoryview(head)[len(prefix) :])
        num_read = head_len
        header = parse_header(head)
        check_key(header, key)  # a value filed under another key is a miss, before any byte lands
        if header.total_len != value_len:
            raise ChunkFormatError(
                f"value of {key!r} is {value_len} bytes, its header says {header.total_len}"
            )
        checksum = header_checksum(head, header)
        try:
            view = destination(header)
        except ValueError:
            # A buffer that does not fit may mean a corrupt header (a flipped dtype byte): the
            # checksum over the whole value tells a corrupt value (a miss) from a wrong buffer.
            checksum = _discard(read_exactly, header.payload_len, checksum)
            num_read = value_len
            if checksum != header.checksum:
                raise ChunkFormatError(
                    f"chunk checksum mismatch: stored {header.checksum:#010x}, computed {checksum:#010x}"
                ) from None
            raise
        if header.codec == "none":
            payload = memoryview(view.reshape(-1).view(torch.uint8).numpy())
        else:
            scratch = bytearray(header.payload_len)
            payload = memoryview(scratch)
        # One read and one CRC-32 call for the whole payload: the thread gives up and takes
        # back the GIL a few times per chunk, not twice per piece (see the module docstring).
        read_exactly(payload)
        num_read += len(payload)
        checksum = crc32(payload, checksum)
        if checksum != header.checksum:
            raise ChunkFormatError(
                f"chunk checksum mismatch: stored {header.checksum:#010x}, computed {checksum:#010x}"
            )
        if header.codec != "none":
            _decompress_into(scratch, header, view)
        return KVChunk(view, header.layout)
    except (ChunkFormatError, ValueError):
        if num_read < value_len:
            _discard(read_exactly, value_len - num_read)
        raise


def _decompress_into(payload: bytearray, header: ChunkHeader, view: torch.Tensor) -> None:
    import lz4.block

    try:
        raw = lz4.block.decompress(payload, uncompressed_size=header.raw_len, return_bytearray=True)
    except lz4.block.LZ4BlockError as exc:
        raise ChunkFormatError(f"lz4 payload does not decompress: {exc}") from None
    if len(raw) != header.raw_len:
        raise ChunkFormatError(f"lz4 payload decompressed to {len(raw)} bytes, expected {header.raw_len}")
    view.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))


def _discard(read_exactly: ReadExactly, num_bytes: int, checksum: int = 0) -> int:
    """Read and drop ``num_bytes``; returns ``checksum`` continued over them."""
    scratch = memoryview(bytearray(min(num_bytes, RECV_PIECE_BYTES)))
    while num_bytes > 0:
        piece = scratch[: min(num_bytes, len(scratch))]
        read_exactly(piece)
        checksum = crc32(piece, checksum)
        num_bytes -= len(piece)
    return checksum
