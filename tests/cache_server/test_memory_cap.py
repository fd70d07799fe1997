"""The memory tier's byte cap holds under 1,000 puts of random sizes: server stats and process RSS."""

from __future__ import annotations

import random

import psutil
import torch

from benchmarks.support.cache_server_process import CacheServerProcess
from protos import kvstash_pb2
from storage_backends.chunk import KVChunk, encode_chunk
from tests.cache_server.helpers import Stubs

CAP_BYTES = 48 << 20  # --memory-gb 0.046875
NUM_PUTS = 1000
MAX_VALUE_BYTES = 1 << 20


def test_cap_holds_under_many_random_sized_puts() -> None:
    server = CacheServerProcess("--memory-gb", str(CAP_BYTES / (1 << 30))).start()
    try:
        process = psutil.Process(server.process.pid)
        rng = random.Random(0)
        pool = torch.randint(
            0, 256, (MAX_VALUE_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
        )
        with Stubs(server.address) as stubs:
            baseline_rss = process.memory_info().rss
            peak_rss = baseline_rss
            total_bytes = 0
            for i in range(NUM_PUTS):
                num_tokens = rng.randint(512, MAX_VALUE_BYTES // 2)  # 1 KiB .. 1 MiB of uint8 KV
                value = encode_chunk(
                    KVChunk(pool[: 2 * num_tokens].view(1, 2, num_tokens, 1, 1)), key=f"ns/{i}"
                )
                stubs.put(f"ns/{i}", value)
                total_bytes += len(value)
                if i % 50 == 49:
                    (memory,) = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10).tiers
                    assert memory.bytes_used <= CAP_BYTES, (
                        f"after {i + 1} puts: {memory.bytes_used} > {CAP_BYTES}"
                    )
                    peak_rss = max(peak_rss, process.memory_info().rss)
            (memory,) = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10).tiers
            listed = stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(page_size=NUM_PUTS), timeout=10)
            # Everything that remains is the most recent puts, and it still reads back intact.
            newest = max(int(entry.key.split("/")[1]) for entry in listed.entries)
            assert newest == NUM_PUTS - 1 and stubs.get(f"ns/{newest}") == value
        assert total_bytes > 5 * CAP_BYTES, "the test must overflow the cap several times"
        assert memory.evictions >= NUM_PUTS - memory.num_keys
        assert memory.num_keys == len(listed.entries) < NUM_PUTS
        assert CAP_BYTES // 2 < memory.bytes_used <= CAP_BYTES
        # RSS grows by the cap plus transient buffers (a value in flight, allocator slack), never by the total.
        growth = peak_rss - baseline_rss
        assert growth < CAP_BYTES + (64 << 20), (
            f"server RSS grew by {growth >> 20} MiB for a {CAP_BYTES >> 20} MiB cap"
        )
    finally:
        assert server.stop() == 0
        server.close()
