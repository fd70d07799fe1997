"""The local-disk tier fails while the engine serves: its folder is replaced by a
plain file (every open fails with ENOTDIR, even for root, unlike a chmod), and its
byte cap is far smaller than the stream's chunks (full: every write evicts).

One engine throughout, disk as the only tier (``cpu_bytes=0``). Every request
completes with the reference's token ids; failures are counted and logged once per
incident; hits resume once the folder is back.
"""

from __future__ import annotations

import logging
import shutil

from connector import OffloadConfig
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    PARAMS,
    StreamTally,
    cache_engine_of,
    full_hits,
    incident_logs,
    make_prompts,
    new_llm,
    run_until_full_hits,
    tier_errors,
    tiers_of,
    warnings_other_than_incidents,
)

NUM_PROMPTS = 4


def disk_stats(llm) -> dict:
    (disk,) = (tier for tier in tiers_of(llm).lower if tier.name == "disk")
    return disk.stats()


def test_disk_folder_replaced_by_a_file(model_dir, reference, reliability_report, caplog, tmp_path):
    folder = tmp_path / "kv"
    llm = new_llm(
        model_dir,
        OffloadConfig(
            chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, disk_path=str(folder), disk_bytes=64 << 20
        ),
    )
    prompts = make_prompts(NUM_PROMPTS, seed=21)
    tally = StreamTally()
    with caplog.at_level(logging.INFO):
        tally.run(llm, prompts, reference)
        tiers_of(llm).flush()
        assert tally.run(llm, prompts, reference) == full_hits(prompts)
        caplog.clear()
        shutil.rmtree(folder)
        folder.write_text("not a folder any more\n")
        num_requests_before = tally.num_requests
        for _ in range(2):
            tally.run(llm, prompts, reference)
        tiers_of(llm).flush()
        num_fault_requests = tally.num_requests - num_requests_before
        num_errors = tier_errors(llm, "disk")
        assert num_errors >= num_fault_requests
        assert incident_logs(caplog, "disk") == (1, 0)
        assert warnings_other_than_incidents(caplog) == []
        folder.unlink()
        folder.mkdir()
        num_rounds = run_until_full_hits(tally, llm, prompts, reference)
        assert incident_logs(caplog, "disk") == (1, 1)
    tally.assert_clean()
    reliability_report.record(
        "disk folder unwritable",
        "disk tier folder replaced by a regular file (ENOTDIR on every open), then restored empty",
        num_requests=tally.num_requests,
        num_requests_during_fault=num_fault_requests,
        num_failed=tally.num_failed,
        num_tokens_compared=tally.num_tokens_compared,
        num_tokens_differing=tally.num_tokens_differing,
        tier_errors_counted=num_errors,
        incident_warnings=1,
        recovery_lines=1,
        rounds_until_hits_resumed=num_rounds,
    )


def test_disk_byte_cap_full(model_dir, reference, reliability_report, caplog, tmp_path):
    """A cap of four chunk files under a stream that stores many more: LRU eviction keeps
    the folder under the cap, the latest prompt still hits, evicted ones are recomputed."""
    folder = tmp_path / "kv"
    # One-chunk prompts plus a partial chunk: two files each. Learn a file's size first.
    prompts = make_prompts(8, seed=22, min_tokens=CHUNK_SIZE + 4, max_tokens=CHUNK_SIZE + 12)
    probe = new_llm(
        model_dir,
        OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, disk_path=str(tmp_path / "probe")),
    )
    probe.generate(prompts[:1], PARAMS)
    tiers_of(probe).flush()
    file_bytes = max(path.stat().st_size for path in (tmp_path / "probe").iterdir())
    cap = 4 * file_bytes

    llm = new_llm(
        model_dir,
        OffloadConfig(
            chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, disk_path=str(folder), disk_bytes=cap
        ),
    )
    tally = StreamTally()
    with caplog.at_level(logging.INFO):
        for prompt in prompts:
            tally.run(llm, [prompt], reference)
            tiers_of(llm).flush()
            assert sum(path.stat().st_size for path in folder.iterdir()) <= cap
        stats = disk_stats(llm)
        assert stats["puts"] == 2 * len(prompts)
        assert stats["evictions"] == stats["puts"] - stats["num_keys"] >= len(prompts)
        # The latest prompt is still on disk; the first was evicted and is recomputed.
        assert tally.run(llm, prompts[-1:], reference) == full_hits(prompts[-1:])
        assert tally.run(llm, prompts[:1], reference) == [0]
    assert warnings_other_than_incidents(caplog) == []
    assert tier_errors(llm, "disk") == 0 and cache_engine_of(llm).num_corrupt_chunks == 0
    tally.assert_clean()
    reliability_report.record(
        "disk cap full",
        f"disk tier capped at {cap} bytes (4 chunk files) under a stream of {2 * len(prompts)} chunk files",
        num_requests=tally.num_requests,
        num_failed=tally.num_failed,
        num_tokens_compared=tally.num_tokens_compared,
        num_tokens_differing=tally.num_tokens_differing,
        evictions_counted=stats["evictions"],
        tier_errors_counted=0,
    )
