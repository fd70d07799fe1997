"""The disk tier against the raw device, cold: read and write rates of whole chunks and the
start-up time of a folder of many chunk files. Run by ``benchmarks/storage.py --disk``.

Read rates are "cold": before every timed read the page cache is dropped
(``echo 3 > /proc/sys/vm/drop_caches`` as root, else ``posix_fadvise(DONTNEED)`` on
each file, which works unprivileged but keeps directory and inode caches). The
bounds, measured in the same run on the same files:

- raw, same pattern: the same bytes of the same files (head block, then payload
  straight into the same destination slots) with O_DIRECT and the same number of
  threads, with no parsing and no checksum: what the disk tier's I/O pattern
  allows;
- dd: ``dd if=FILE of=/dev/null bs=16M iflag=direct`` file after file (one stream,
  as the issue's 1.26 GB/s on the H100 machine was measured).

The destination is one slab of slots like the connector's CPU tier: pinned
(page-locked) memory when CUDA is available, else page-aligned plain memory.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from storage_backends.chunk import KVChunk
from storage_backends.disk_backend import FILE_SUFFIX, DiskBackend
from storage_backends.disk_index import INDEX_NAME
from storage_backends.disk_io import BLOCK, O_DIRECT, AlignedScratch, read_into

GB = 1e9
#: Llama-3-8B: 32 layers x 2 x 256 tokens x 8 KV heads x 128 dims of bf16 = 32 MiB per chunk
CHUNK_SHAPE_8B = (32, 2, 256, 8, 128)


def drop_page_cache(paths: list[str]) -> str:
    """Drop the cached pages of ``paths``; returns the method that worked."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        for path in paths:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "posix_fadvise(DONTNEED)"


def slot_slab(num_slots: int, slot_bytes: int, pinned: bool) -> list[torch.Tensor]:
    """``num_slots`` page-aligned uint8 slots of one slab (pinned memory is page-aligned)."""
    slab = torch.empty(num_slots * slot_bytes + BLOCK, dtype=torch.uint8, pin_memory=pinned)
    start = -slab.data_ptr() % BLOCK
    return [slab[start + i * slot_bytes : start + (i + 1) * slot_bytes] for i in range(num_slots)]


def raw_read_files(
    paths: list[str], payload_offset: int, slots: list[torch.Tensor], num_threads: int, direct: bool
) -> float:
    """Seconds to read each whole file like the disk tier does (head block, then the payload
    into its slot), O_DIRECT when ``direct``, ``num_threads`` in flight, no parsing or checksum."""
    scratch = AlignedScratch()

    def read_one(index: int) -> None:
        fd = os.open(paths[index], os.O_RDONLY | (O_DIRECT if direct else 0))
        try:
            read_into(fd, scratch.get(payload_offset), 0)
            view = memoryview(slots[index].numpy())
            if read_into(fd, view, payload_offset) != len(view):
                raise RuntimeError(f"{paths[index]} is shorter than expected")
        finally:
            os.close(fd)

    started = time.perf_counter()
    with ThreadPoolExecutor(num_threads) as pool:
        list(pool.map(read_one, range(len(paths))))
    return time.perf_counter() - started


def dd_read_files(paths: list[str], direct: bool) -> float | None:
    """Seconds for ``dd ... bs=16M [iflag=direct]`` over the files one after another (None without dd)."""
    if shutil.which("dd") is None:
        return None
    flags = ["iflag=direct"] if direct else []
    started = time.perf_counter()
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", *flags, "status=none"], check=True)
    return time.perf_counter() - started


def run_disk_rates(folder: Path, total_bytes: int, num_threads: int, repeats: int) -> tuple[list[dict], dict]:
    """Write then cold-read ``total_bytes`` of 8B-shaped chunks; rows for the table and run facts."""
    chunk_numel = 1
    for size in CHUNK_SHAPE_8B:
        chunk_numel *= size
    chunk_bytes = chunk_numel * 2
    num_chunks = max(2, total_bytes // chunk_bytes)
    moved = num_chunks * chunk_bytes
    pinned = torch.cuda.is_available()
    sources = slot_slab(num_chunks, chunk_bytes, pinned)
    destinations = slot_slab(num_chunks, chunk_bytes, pinned)
    for slot in destinations:
        slot.zero_()  # first-touch page faults stay out of the first timed read
    generator = torch.Generator().manual_seed(0)
    first = torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=generator)
    for index, slot in enumerate(sources):  # distinct, incompressible chunks
        torch.bitwise_xor(first, index % 251, out=slot)
    items = [
        (f"bench:disk:{i}", KVChunk(slot.view(torch.bfloat16).view(CHUNK_SHAPE_8B)))
        for i, slot in enumerate(sources)
    ]
    keys = [key for key, _ in items]
    outs = [slot.view(torch.bfloat16) for slot in destinations]

    if folder.exists():
        shutil.rmtree(folder)
    backend = DiskBackend(str(folder), 2 * moved + (64 << 20), io_threads=num_threads)
    write_s, get_cold_s, raw_s, dd_s, buffered_s, no_fsync_s = [], [], [], [], [], []
    drop_method = ""
    for repeat in range(repeats):
        started = time.perf_counter()
        backend.put_many(items)  # replaces the previous repeat's files: a full write each time
        write_s.append(time.perf_counter() - started)
        paths = sorted(str(path) for path in folder.glob(f"*{FILE_SUFFIX}"))

        drop_method = drop_page_cache(paths)
        started = time.perf_counter()
        results = backend.get_many_into(keys, outs)
        get_cold_s.append(time.perf_counter() - started)
        if repeat == 0 and not all(
            result is not None and result.equal(chunk)
            for result, (_, chunk) in zip(results, items, strict=True)
        ):
            raise RuntimeError("disk tier: a chunk read back differs from the one written")
        payload_offset = os.path.getsize(paths[0]) - chunk_bytes
        drop_page_cache(paths)
        raw_s.append(raw_read_files(paths, payload_offset, destinations, num_threads, backend.direct_io))
        drop_page_cache(paths)
        dd_seconds = dd_read_files(paths, backend.direct_io)
        if dd_seconds is not None:
            dd_s.append(dd_seconds)
    stats = backend.stats()
    backend.close()
    buffered = DiskBackend(str(folder), 2 * moved + (64 << 20), io_threads=num_threads, direct_io=False)
    for _ in range(repeats):
        drop_page_cache(paths)
        started = time.perf_counter()
        buffered.get_many_into(keys, outs)
        buffered_s.append(time.perf_counter() - started)
    buffered.close()
    no_fsync = DiskBackend(str(folder), 2 * moved + (64 << 20), io_threads=num_threads, fsync=False)
    for _ in range(repeats):
        started = time.perf_counter()
        no_fsync.put_many(items)
        no_fsync_s.append(time.perf_counter() - started)
    no_fsync.close()
    shutil.rmtree(folder)

    def row(name: str, seconds: list[float], note: str = "") -> dict:
        return {
            "what": name,
            "GBps": round(moved / min(seconds) / GB, 3),
            "GBps_median": round(moved / statistics.median(seconds) / GB, 3),
            "note": note,
        }

    # where the filesystem refuses O_DIRECT (some overlay setups) the bounds read buffered too
    direct_text = "O_DIRECT" if stats["direct_io"] else "buffered (O_DIRECT refused)"
    rows = [
        row("kvstash disk tier get_many_into, cold", get_cold_s, f"{num_threads} threads, checksum verified"),
        row(
            f"raw {direct_text} reads, same files and pattern, cold",
            raw_s,
            f"{num_threads} threads, no checksum",
        ),
    ]
    if dd_s:
        rows.append(
            row(
                f"dd bs=16M{' iflag=direct' if stats['direct_io'] else ''}, file after file, cold",
                dd_s,
                "one stream",
            )
        )
    rows += [
        row(
            "kvstash disk tier get_many_into, cold, direct_io=0",
            buffered_s,
            "buffered reads through the page cache",
        ),
        row("kvstash disk tier put_many (fsync=1)", write_s, f"{num_threads} threads, file + folder fsync"),
        row("kvstash disk tier put_many (fsync=0)", no_fsync_s, "returns before the device has the bytes"),
    ]
    ratio_raw = rows[0]["GBps"] / rows[1]["GBps"]
    facts = {
        "bytes_per_run": moved,
        "num_chunks": num_chunks,
        "chunk_shape": list(CHUNK_SHAPE_8B),
        "io_threads": num_threads,
        "direct_io": stats["direct_io"],
        "pinned_destination": pinned,
        "page_cache_drop": drop_method,
        "repeats": repeats,
        "cold_read_ratio_to_raw_same_pattern": round(ratio_raw, 3),
        "cold_read_ratio_to_dd": round(rows[0]["GBps"] / rows[2]["GBps"], 3) if dd_s else None,
    }
    return rows, facts


def run_index_startup(folder: Path, num_files: int, repeats: int) -> dict:
    """Start-up seconds of a folder of ``num_files`` chunk files, cold, from the index file and by a full scan."""
    if folder.exists():
        shutil.rmtree(folder)
    backend = DiskBackend(str(folder), 1 << 40, fsync=False)
    chunk = KVChunk(torch.zeros((1, 2, 16, 8, 128), dtype=torch.bfloat16))  # 64 KiB
    batch = 256
    for first in range(0, num_files, batch):
        backend.put_many(
            [(f"bench:index:{i:06d}", chunk) for i in range(first, min(first + batch, num_files))]
        )
    backend.close()  # writes the index file
    paths = [str(path) for path in folder.iterdir()]
    from_index_s, scan_s = [], []
    for _ in range(repeats):
        drop_method = drop_page_cache(paths)
        started = time.perf_counter()
        restarted = DiskBackend(str(folder), 1 << 40, fsync=False)
        from_index_s.append(time.perf_counter() - started)
        if (
            len(restarted.keys("bench:index:")) != num_files
            or restarted.stats()["num_files_scanned_at_start"]
        ):
            raise RuntimeError("start-up from the index did not find every file")
        restarted.close()

        os.unlink(folder / INDEX_NAME)
        drop_page_cache(paths)
        started = time.perf_counter()
        restarted = DiskBackend(str(folder), 1 << 40, fsync=False)
        scan_s.append(time.perf_counter() - started)
        if restarted.stats()["num_files_scanned_at_start"] != num_files:
            raise RuntimeError("the scan did not open every file")
        restarted.close()  # writes the index again
    shutil.rmtree(folder)
    return {
        "num_files": num_files,
        "from_index_s": round(min(from_index_s), 3),
        "from_index_s_median": round(statistics.median(from_index_s), 3),
        "full_scan_s": round(min(scan_s), 3),
        "full_scan_s_median": round(statistics.median(scan_s), 3),
        "page_cache_drop": drop_method,
    }


def print_disk(rows: list[dict], facts: dict, startup: dict | None) -> None:
    print(
        f"\nDisk tier, cold reads of {facts['bytes_per_run'] / GB:.2f} GB ({facts['num_chunks']} chunks of "
        f"{CHUNK_SHAPE_8B}, bf16), direct_io={facts['direct_io']}, pinned={facts['pinned_destination']}, "
        f"page cache dropped by {facts['page_cache_drop']}"
    )
    print(f"{'what':<52} {'GB/s best':>10} {'median':>8}  note")
    for row in rows:
        print(f"{row['what']:<52} {row['GBps']:>10.3f} {row['GBps_median']:>8.3f}  {row['note']}")
    print(f"cold read / raw same pattern: {facts['cold_read_ratio_to_raw_same_pattern']:.3f} (target >= 0.8)")
    if facts["cold_read_ratio_to_dd"] is not None:
        print(f"cold read / dd:               {facts['cold_read_ratio_to_dd']:.3f}")
    if startup:
        print(
            f"start-up with {startup['num_files']} chunk files, cold: {startup['from_index_s']:.3f} s from the index "
            f"file (target < 1 s), {startup['full_scan_s']:.3f} s by a full scan"
        )
