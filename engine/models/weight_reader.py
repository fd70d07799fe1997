"""Read a sharded safetensors checkpoint into a model's parameters, one pass per file.

Called once per engine start by ``engine.models.loader`` (and a pipeline stage's
builder). Why not ``safe_open(...).get_tensor`` per weight: that maps the file, copies
each tensor into a new CPU tensor, converts it, then copies it again to the device, one
file after another; the fingerprint (``engine.models.fingerprint``) then read every byte
a second time. On an 8B checkpoint (16.1 GB) that made ``LLM()`` take 33-41 s where
reading the files took 10.7 s (issue 33).

Here each file is read by a thread of its own (``max_threads`` at once), sequentially in
pieces of ``PIECE_BYTES``:

* a CPU parameter of the file's dtype is read straight into its memory (no copy at all);
* a CUDA parameter of the file's dtype gets each piece through two pinned buffers per
  thread, copied asynchronously on the thread's own stream while the next piece is read;
* a parameter of another dtype is read whole into host memory and converted by
  ``copy_`` (the only case with an extra copy).

With ``hash_file_ids`` the same pieces go through XXH3-128 as they are read (the header,
every tensor's bytes and anything between, in file order), so the digest equals
``fingerprint.file_digest`` of the file: the model's identity in the offload namespace
costs no second pass. xxhash, file reads and torch copies release the GIL, so threads
overlap.

The file layout is safetensors' documented format: an 8-byte little-endian header size,
a JSON header mapping each tensor to its dtype, shape and ``data_offsets`` (begin, end)
relative to the data that follows; every offset is checked before a byte is written.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

#: bytes read (and hashed, and copied) per piece
PIECE_BYTES = 32 << 20
#: files read at once at most (each thread holds two pinned pieces on CUDA)
MAX_READ_THREADS = 8
#: the largest safetensors header accepted (the format's own limit is 100 MB)
_MAX_HEADER_BYTES = 100_000_000
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class WeightReadStats:
    """What reading the checkpoint took. ``read_s``, ``copy_s`` and ``hash_s`` are summed
    over the reading threads (they overlap one another and the wall time)."""

    wall_s: float = 0.0
    read_s: float = 0.0
    copy_s: float = 0.0
    hash_s: float = 0.0
    num_bytes: int = 0
    num_files: int = 0
    num_threads: int = 0
    #: path -> XXH3-128 hex digest of every byte, for the files asked to be hashed
    path_to_digest: dict[Path, str] = field(default_factory=dict)

    def add(self, other: WeightReadStats) -> None:
        self.read_s += other.read_s
        self.copy_s += other.copy_s
        self.hash_s += other.hash_s
        self.num_bytes += other.num_bytes
        self.path_to_digest.update(other.path_to_digest)


@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int


def read_header(path: Path, head: bytes, file_size: int) -> list[_Entry]:
    """The tensors of safetensors file ``path`` (``head``: its first 8 + N bytes), sorted by
    offset; ValueError naming the file for anything the format does not allow."""
    header_size = struct.unpack("<Q", head[:8])[0]
    try:
        document = json.loads(head[8 : 8 + header_size])
    except ValueError as error:
        raise ValueError(f"{path.name}: the safetensors header is not JSON ({error})") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path.name}: the safetensors header is not a mapping")
    data_start = 8 + header_size
    entries = []
    for name, spec in document.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _SAFETENSORS_DTYPES[spec["dtype"]]
            shape = tuple(int(size) for size in spec["shape"])
            begin, end = (int(offset) for offset in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path.name}: tensor {name!r} has a bad header entry {spec!r}") from None
        num_bytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or not 0 <= begin <= end or end - begin != num_bytes:
            raise ValueError(f"{path.name}: tensor {name!r} has offsets {begin}..{end} for {num_bytes} bytes")
        if data_start + end > file_size:
            raise ValueError(f"{path.name}: tensor {name!r} ends past the end of the file (truncated?)")
        entries.append(_Entry(name, dtype, shape, data_start + begin, data_start + end))
    return sorted(entries, key=lambda entry: entry.begin)


class _FileReader:
    """Reads one file front to back (one thread), hashing when asked."""

    def __init__(
        self,
        path: Path,
        *,
        hashed: bool,
        staging: list[torch.Tensor] | None,
        device: torch.device | None = None,
    ) -> None:
        self.path = path
        self.stats = WeightReadStats(num_files=1)
        self._digest = xxhash.xxh3_128() if hashed else None
        self._file = path.open("rb", buffering=0)
        self._position = 0
        self._staging = staging  # two pinned pieces (CUDA targets), else None
        self._scratch: torch.Tensor | None = None
        self._stream = None
        if staging is not None and device is not None:
            # the target device's own stream (a new thread's current device is cuda:0, a
            # pipeline stage's parameters may live elsewhere), ordered after whatever the
            # device's current stream still has queued (e.g. the parameters' allocation)
            self._stream = torch.cuda.Stream(device)
            self._stream.wait_stream(torch.cuda.current_stream(device))
        self._events = [None, None]
        self._next_buffer = 0

    def close(self) -> None:
        self._file.close()

    def _read_into(self, view: memoryview) -> None:
        """Fill ``view`` from the file (and the digest); ValueError if the file ends first."""
        start = time.perf_counter()
        filled = 0
        while filled < len(view):
            num_read = self._file.readinto(view[filled:])
            if not num_read:
                raise ValueError(
                    f"{self.path.name}: the file ended at byte {self._position + filled} (truncated?)"
                )
            filled += num_read
        self._position += filled
        self.stats.read_s += time.perf_counter() - start
        self.stats.num_bytes += filled
        if self._digest is not None:
            start = time.perf_counter()
            self._digest.update(view)
            self.stats.hash_s += time.perf_counter() - start

    def _scratch_view(self, num_bytes: int) -> memoryview:
        if self._scratch is None or self._scratch.numel() < num_bytes:
            self._scratch = torch.empty(max(num_bytes, 1), dtype=torch.uint8)
        return memoryview(self._scratch.numpy())[:num_bytes]

    def skip_to(self, offset: int) -> None:
        """Move to ``offset``: bytes between are read when hashing, else seeked over."""
        if self._digest is None:
            self._file.seek(offset)
            self._position = offset
            return
        while self._position < offset:
            self._read_into(self._scratch_view(min(PIECE_BYTES, offset - self._position)))

    def read_header(self, file_size: int) -> list[_Entry]:
        if file_size < 8:
            raise ValueError(f"{self.path.name}: {file_size} bytes is too short for a safetensors file")
        size_bytes = bytearray(8)
        self._read_into(memoryview(size_bytes))
        header_size = struct.unpack("<Q", size_bytes)[0]
        if header_size > min(_MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{self.path.name}: a safetensors header of {header_size} bytes does not fit")
        header = bytearray(header_size)
        self._read_into(memoryview(header))
        return read_header(self.path, bytes(size_bytes) + bytes(header), file_size)

    def read_tensor(self, entry: _Entry, param: torch.Tensor) -> None:
        """Read ``entry``'s bytes (the file is at its offset) into ``param``."""
        num_bytes = entry.end - entry.begin
        same_layout = param.dtype == entry.dtype and param.is_contiguous()
        if same_layout and param.device.type == "cpu":
            target = memoryview(param.detach().view(-1).view(torch.uint8).numpy())
            for start in range(0, num_bytes, PIECE_BYTES):
                self._read_into(target[start : start + PIECE_BYTES])
            return
        if same_layout and self._stream is not None and param.device == self._stream.device:
            target_bytes = param.detach().view(-1).view(torch.uint8)
            for start in range(0, num_bytes, PIECE_BYTES):
                length = min(PIECE_BYTES, num_bytes - start)
                index, self._next_buffer = self._next_buffer, 1 - self._next_buffer
                if self._events[index] is not None:
                    self._events[index].synchronize()  # its last copy has read the buffer
                buffer = self._staging[index]
                self._read_into(memoryview(buffer.numpy())[:length])
                copy_start = time.perf_counter()
                with torch.cuda.stream(self._stream):
                    target_bytes[start : start + length].copy_(buffer[:length], non_blocking=True)
                    self._events[index] = torch.cuda.Event()
                    self._events[index].record(self._stream)
                self.stats.copy_s += time.perf_counter() - copy_start
            return
        # another dtype (or layout): whole tensor through host memory, converted by copy_
        scratch = self._scratch_view(num_bytes)
        for start in range(0, num_bytes, PIECE_BYTES):
            self._read_into(scratch[start : start + PIECE_BYTES])
        host = self._scratch[:num_bytes].view(entry.dtype).view(entry.shape)
        copy_start = time.perf_counter()
        param.detach().copy_(host)
        self.stats.copy_s += time.perf_counter() - copy_start

    def finish(self, file_size: int) -> None:
        """Read (hash) what follows the last tensor, wait for this file's copies."""
        if self._digest is not None:
            self.skip_to(file_size)
            if self._file.read(1):
                raise ValueError(f"{self.path.name}: the file grew while it was read")
            self.stats.path_to_digest[self.path] = self._digest.hexdigest()
        if self._stream is not None:
            copy_start = time.perf_counter()
            self._stream.synchronize()
            self.stats.copy_s += time.perf_counter() - copy_start


def _read_file(
    path: Path,
    name_to_param: Mapping[str, torch.Tensor],
    *,
    hashed: bool,
    staging: list[torch.Tensor] | None,
    device: torch.device | None,
) -> tuple[WeightReadStats, set[str]]:
    reader = _FileReader(path, hashed=hashed, staging=staging, device=device)
    try:
        file_size = os.fstat(reader._file.fileno()).st_size
        loaded_names = set()
        for entry in reader.read_header(file_size):
            param = name_to_param.get(entry.name)
            if param is None:  # e.g. rotary inv_freq buffers of old checkpoints, or lm_head when tied
                continue
            if tuple(entry.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {entry.name} in {path.name} has shape {entry.shape}, expected {tuple(param.shape)}"
                )
            reader.skip_to(entry.begin)
            reader.read_tensor(entry, param)
            loaded_names.add(entry.name)
        reader.finish(file_size)
        return reader.stats, loaded_names
    finally:
        reader.close()


def read_checkpoint(
    files: Sequence[Path],
    name_to_param: Mapping[str, torch.Tensor],
    *,
    hash_paths: frozenset[Path] = frozenset(),
    max_threads: int = MAX_READ_THREADS,
) -> tuple[WeightReadStats, set[str]]:
    """Fill ``name_to_param``'s tensors from ``files`` (one thread per file, at most
    ``max_threads`` at once); returns the stats (digests of ``hash_paths``) and the names
    loaded. A name in no file is left for the caller to report; a shape that differs, a
    bad header or a truncated file is a ValueError naming the file. Tensors not in
    ``name_to_param`` are skipped."""
    if isinstance(max_threads, bool) or not isinstance(max_threads, int) or max_threads < 1:
        raise ValueError(f"max_threads must be an integer >= 1, got {max_threads!r}")
    start = time.perf_counter()
    num_threads = min(max_threads, len(files)) or 1
    cuda_devices = {param.device for param in name_to_param.values() if param.device.type == "cuda"}
    # one CUDA device takes the pinned, asynchronous path (several: each tensor by copy_)
    cuda_device = next(iter(cuda_devices)) if len(cuda_devices) == 1 else None
    cuda_targets = cuda_device is not None
    staging_lock = threading.Lock()
    free_staging: list[list[torch.Tensor]] = []

    def take_staging() -> list[torch.Tensor] | None:
        if not cuda_targets:
            return None
        with staging_lock:
            if free_staging:
                return free_staging.pop()
        return [torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def read_one(path: Path) -> tuple[WeightReadStats, set[str]]:
        staging = take_staging()
        try:
            return _read_file(
                path, name_to_param, hashed=path in hash_paths, staging=staging, device=cuda_device
            )
        finally:
            if staging is not None:
                with staging_lock:
                    free_staging.append(staging)

    stats = WeightReadStats(num_files=len(files), num_threads=num_threads)
    loaded_names: set[str] = set()
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="weights") as pool:
        for file_stats, names in pool.map(read_one, files):
            stats.add(file_stats)
            loaded_names |= names
    stats.wall_s = time.perf_counter() - start
    return stats, loaded_names
