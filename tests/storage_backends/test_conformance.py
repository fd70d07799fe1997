"""One conformance suite that every storage tier passes: CPU memory, disk (plain and lz4),
Redis standalone and Redis Cluster, each a real instance built from its URL."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from storage_backends import CapacityError, ChunkFormatError, encode_chunk
from tests.storage_backends.helpers import (
    ALL_KINDS,
    CAPPED_KINDS,
    BackendFactory,
    directory_bytes,
    make_chunk,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@pytest.fixture(params=ALL_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=CAPPED_KINDS)
def capped_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_byte_exact(kind: str, backend_factory: BackendFactory, dtype: torch.dtype) -> None:
    backend = backend_factory(kind)
    chunks = [
        make_chunk(seed, num_tokens=num_tokens, dtype=dtype) for seed, num_tokens in ((1, 16), (2, 5), (3, 0))
    ]
    backend.put("ns:a", chunks[0])
    backend.put_many([("ns:b", chunks[1]), ("ns:c", chunks[2])])
    got = [backend.get("ns:a"), *backend.get_many(["ns:b", "ns:c"])]
    for expected, actual in zip(chunks, got, strict=True):
        assert actual is not None
        assert actual.dtype == dtype and actual.layout == "LKTHD"
        assert actual.tensor.shape == expected.tensor.shape
        assert actual.equal(expected), "stored and loaded bytes differ"
    assert got[1].num_tokens == 5


def test_stored_chunk_is_independent_of_the_callers_tensor(
    kind: str, backend_factory: BackendFactory
) -> None:
    backend = backend_factory(kind)
    chunk = make_chunk(7)
    snapshot = chunk.tensor.clone()
    backend.put("ns:k", chunk)
    chunk.tensor.zero_()  # the caller reuses its buffer
    loaded = backend.get("ns:k")
    assert torch.equal(loaded.tensor.view(torch.int16), snapshot.view(torch.int16))
    loaded.tensor.zero_()  # and the loaded tensor is the caller's to modify
    assert torch.equal(backend.get("ns:k").tensor.view(torch.int16), snapshot.view(torch.int16))


def test_contains_counts_the_leading_present_keys(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    for key in ("ns:0", "ns:1", "ns:3"):
        backend.put(key, make_chunk(len(key)))
    assert backend.contains(["ns:0", "ns:1", "ns:2", "ns:3"]) == 2
    assert backend.contains(["ns:0", "ns:1"]) == 2
    assert backend.contains(["ns:2", "ns:0"]) == 0
    assert backend.contains([]) == 0


def test_get_many_keeps_order_and_reports_misses(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    first, second = make_chunk(1), make_chunk(2)
    backend.put_many([("ns:1", first), ("ns:2", second)])
    got = backend.get_many(["ns:2", "ns:missing", "ns:1"])
    assert got[0].equal(second) and got[1] is None and got[2].equal(first)
    assert backend.get("ns:missing") is None
    assert backend.get_many([]) == []


def test_put_replaces_the_value(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    backend.put("ns:k", make_chunk(1))
    replacement = make_chunk(2, num_tokens=4, dtype=torch.float32)
    backend.put("ns:k", replacement)
    assert backend.get("ns:k").equal(replacement)
    assert backend.keys("ns:") == ["ns:k"]


def test_delete(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    backend.put_many([("ns:a", make_chunk(1)), ("ns:b", make_chunk(2))])
    assert backend.delete("ns:a") is True
    assert backend.delete("ns:a") is False
    assert backend.get("ns:a") is None
    assert backend.contains(["ns:a"]) == 0
    assert backend.get("ns:b") is not None


def test_keys_by_prefix(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    names = ["model-a:1", "model-a:2", "model-b:1", "glob*[?]:1"]
    backend.put_many([(name, make_chunk(i, num_tokens=1)) for i, name in enumerate(names)])
    assert sorted(backend.keys("model-a:")) == ["model-a:1", "model-a:2"]
    assert sorted(backend.keys("")) == sorted(names)
    assert backend.keys("glob*[?]") == ["glob*[?]:1"]  # glob characters are literal
    assert backend.keys("model-c") == []


def test_encoded_values_round_trip_and_bad_bytes_are_refused(
    kind: str, backend_factory: BackendFactory
) -> None:
    backend = backend_factory(kind)
    chunk = make_chunk(3)
    backend.put_encoded("ns:enc", encode_chunk(chunk, "lz4", key="ns:enc"))
    assert backend.get("ns:enc").equal(chunk)
    stored = backend.get_encoded("ns:enc")
    assert stored is not None
    with pytest.raises(ChunkFormatError, match="another key"):
        backend.put_encoded("ns:copy", stored)  # serialized for "ns:enc"
    assert backend.contains(["ns:copy"]) == 0
    damaged = bytearray(encode_chunk(chunk, key="ns:bad"))
    damaged[-1] ^= 0x40
    with pytest.raises(ChunkFormatError, match="checksum"):
        backend.put_encoded("ns:bad", bytes(damaged))
    assert backend.contains(["ns:bad"]) == 0
    assert backend.get_encoded("ns:bad") is None


def test_stats_count_events(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    before = backend.stats()
    for name in (
        "num_keys",
        "bytes_used",
        "capacity_bytes",
        "hits",
        "misses",
        "puts",
        "evictions",
        "corrupt",
        "errors",
    ):
        assert name in before, name
    backend.put_many([("ns:1", make_chunk(1)), ("ns:2", make_chunk(2))])
    backend.get("ns:1")
    backend.get_many(["ns:2", "ns:3", "ns:4"])
    after = backend.stats()
    assert after["puts"] - before["puts"] == 2
    assert after["hits"] - before["hits"] == 2
    assert after["misses"] - before["misses"] == 2
    assert after["num_keys"] == 2
    assert after["bytes_used"] > 0
    assert after["errors"] == 0 and after["corrupt"] == 0


def test_concurrent_use_from_several_threads(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    num_threads, num_rounds = 4, 12
    failures: list[BaseException] = []

    def worker(thread_id: int) -> None:
        try:
            kept_keys: list[str] = []
            for round_id in range(num_rounds):
                key = f"t{thread_id}:{round_id}"
                chunk = make_chunk(thread_id * 1000 + round_id, num_tokens=1 + round_id % 4)
                backend.put(key, chunk)
                assert backend.get(key).equal(chunk)
                if round_id % 3 == 0:
                    assert backend.delete(key)
                else:
                    kept_keys.append(key)
                assert backend.contains(kept_keys) == len(kept_keys)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(thread_id,)) for thread_id in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    expected_keys = {f"t{t}:{r}" for t in range(num_threads) for r in range(num_rounds) if r % 3 != 0}
    assert set(backend.keys("t")) == expected_keys


def test_submit_put_many_writes_off_the_callers_thread(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    items = [(f"ns:{i}", make_chunk(i)) for i in range(4)]
    future = backend.submit_put_many(items)
    future.result(timeout=30)
    loaded = backend.submit_get_many([key for key, _ in items]).result(timeout=30)
    assert all(got.equal(chunk) for got, (_, chunk) in zip(loaded, items, strict=True))


# ---- tiers with a kvstash-enforced byte cap ---------------------------------------------
CHUNK_TOKENS = 16  # 2 layers * 2 * 16 tokens * 2 heads * 8 dim * 2 bytes = 2 KiB of bf16


def _capacity_for(backend_kind: str, num_chunks: int) -> int:
    """A cap that holds exactly ``num_chunks`` chunks of CHUNK_TOKENS tokens in this tier."""
    if backend_kind == "cpu":
        return num_chunks * 4096  # one 4 KiB slot per chunk
    return num_chunks * (2048 + 512)  # file: record header + chunk header + payload (< 512 B overhead)


def test_eviction_is_least_recently_used(capped_kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(capped_kind, capacity=_capacity_for(capped_kind, 3))
    for name in "abc":
        backend.put(f"ns:{name}", make_chunk(ord(name), num_tokens=CHUNK_TOKENS))
    assert backend.get("ns:a") is not None  # a becomes the most recent; b is now the oldest
    backend.put("ns:d", make_chunk(4, num_tokens=CHUNK_TOKENS))
    assert sorted(backend.keys("ns:")) == ["ns:a", "ns:c", "ns:d"]
    assert backend.contains(["ns:c"]) == 1  # contains also refreshes recency: a is now the oldest
    backend.put("ns:e", make_chunk(5, num_tokens=CHUNK_TOKENS))
    assert sorted(backend.keys("ns:")) == ["ns:c", "ns:d", "ns:e"]
    assert backend.stats()["evictions"] == 2


def test_byte_cap_is_never_exceeded(capped_kind: str, backend_factory: BackendFactory, tmp_path) -> None:
    capacity = 40_000
    backend = backend_factory(capped_kind, capacity=capacity)
    generator = torch.Generator().manual_seed(0)
    for i in range(40):
        num_tokens = int(torch.randint(1, 40, (), generator=generator))
        backend.put(f"ns:{i}", make_chunk(i, num_tokens=num_tokens))
        stats = backend.stats()
        assert stats["bytes_used"] <= capacity
        if capped_kind.startswith("disk"):
            assert directory_bytes(stats["root"]) <= capacity  # measured on the filesystem
            assert directory_bytes(stats["root"]) == stats["bytes_used"]
        assert backend.get(f"ns:{i}") is not None  # the newest chunk always fits
    assert backend.stats()["evictions"] > 0


def test_a_value_larger_than_the_cap_is_refused(capped_kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(capped_kind, capacity=8192)
    with pytest.raises(ValueError, match="exceeds|needs"):
        backend.put("ns:huge", make_chunk(1, num_tokens=80))  # 10 KiB of payload
    assert backend.contains(["ns:huge"]) == 0


def test_pinned_chunks_are_never_evicted(capped_kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(capped_kind, capacity=_capacity_for(capped_kind, 2))
    backend.put("ns:a", make_chunk(1, num_tokens=CHUNK_TOKENS))
    backend.put("ns:b", make_chunk(2, num_tokens=CHUNK_TOKENS))
    assert backend.pin(["ns:a", "ns:missing", "ns:b"]) == 1  # stops at the first miss, like contains
    assert backend.pin(["ns:a"]) == 1  # pins are counted
    backend.put("ns:c", make_chunk(3, num_tokens=CHUNK_TOKENS))  # evicts b, never the older pinned a
    assert sorted(backend.keys("ns:")) == ["ns:a", "ns:c"]
    assert backend.pin(["ns:c"]) == 1
    with pytest.raises(CapacityError, match="no room"):
        backend.put("ns:d", make_chunk(4, num_tokens=CHUNK_TOKENS))
    assert backend.contains(["ns:d"]) == 0 and backend.stats()["rejected"] == 1
    backend.unpin(["ns:a"])
    with pytest.raises(CapacityError):  # a still holds one of its two pins
        backend.put("ns:d", make_chunk(4, num_tokens=CHUNK_TOKENS))
    backend.unpin(["ns:a"])
    backend.put("ns:d", make_chunk(4, num_tokens=CHUNK_TOKENS))
    assert sorted(backend.keys("ns:")) == ["ns:c", "ns:d"]


def test_a_refused_replacement_keeps_the_old_value_and_its_pins(
    capped_kind: str, backend_factory: BackendFactory
) -> None:
    backend = backend_factory(capped_kind, capacity=_capacity_for(capped_kind, 3))
    original = make_chunk(1, num_tokens=CHUNK_TOKENS)
    backend.put("ns:a", original)
    backend.put("ns:b", make_chunk(2, num_tokens=CHUNK_TOKENS))
    assert backend.pin(["ns:a", "ns:b"]) == 2
    # A value within the cap but larger than the room that the pinned b leaves.
    num_big_tokens = 96 if capped_kind == "cpu" else 48  # 3 of 3 slots; 6 KiB of a 7.5 KiB cap
    with pytest.raises(CapacityError):
        backend.put("ns:a", make_chunk(3, num_tokens=num_big_tokens))
    assert backend.get("ns:a").equal(original)
    backend.unpin(["ns:b"])
    backend.put("ns:a", make_chunk(3, num_tokens=num_big_tokens))  # now b can be evicted
    assert backend.keys("ns:") == ["ns:a"] and backend.pin(["ns:a"]) == 1


def test_get_into_fills_the_callers_buffer(kind: str, backend_factory: BackendFactory) -> None:
    backend = backend_factory(kind)
    chunk = make_chunk(7, num_tokens=5, dtype=torch.float16)
    backend.put("ns:into", chunk)
    buffer = torch.full((chunk.tensor.numel() + 11,), -1.0, dtype=torch.float16)
    got = backend.get_into("ns:into", buffer)
    assert got is not None and got.equal(chunk)
    assert got.tensor.data_ptr() == buffer.data_ptr(), "the chunk must view the caller's buffer"
    assert bool((buffer[chunk.tensor.numel() :] == -1.0).all()), "bytes past the chunk were written"
    assert backend.get_into("ns:absent", buffer) is None
    with pytest.raises(ValueError, match="get_into"):
        backend.get_into("ns:into", torch.empty(chunk.tensor.numel() - 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="get_into"):
        backend.get_into("ns:into", torch.empty(chunk.tensor.numel(), dtype=torch.float32))


def misfile_behind_the_backend(kind: str, backend, source_key: str, target_key: str) -> None:
    """Put the bytes stored under ``source_key`` in ``target_key``'s place, in the tier's own
    storage (disk files, Redis values), as a bug or an attacker with write access could."""
    if kind.startswith("disk"):
        from storage_backends.disk_backend import key_to_filename

        def split(path: str) -> tuple[bytes, bytes]:
            with open(path, "rb") as file:
                record = file.read()
            key_len = int.from_bytes(record[6:8], "little")  # disk record: magic, version, key length, key
            return record[: 8 + key_len], record[8 + key_len :]

        source_path = os.path.join(backend.root, key_to_filename(source_key))
        target_path = os.path.join(backend.root, key_to_filename(target_key))
        target_head, _ = split(target_path)
        with open(target_path, "wb") as file:
            file.write(target_head + split(source_path)[1])  # the target's record header, the source's chunk
    elif kind.startswith("redis"):
        client = backend._client  # the backend's own redis-py client: the same server or cluster
        client.set(backend.key_prefix + target_key, client.get(backend.key_prefix + source_key))
    else:
        raise ValueError(f"{kind} has no storage to tamper with from outside")


def test_a_value_filed_under_another_key_is_a_miss(kind: str, backend_factory: BackendFactory) -> None:
    """Issue #17 item 2: every read checks the key hash in the chunk header."""
    backend = backend_factory(kind)
    first, second = make_chunk(1), make_chunk(2)
    backend.put("ns:first", first)
    backend.put("ns:second", second)
    first_bytes = backend.get_encoded("ns:first")
    # The front door: no tier stores bytes serialized for another key.
    with pytest.raises(ChunkFormatError, match="another key"):
        backend.put_encoded("ns:second", first_bytes)
    with pytest.raises(ChunkFormatError, match="another key"):
        backend.put_encoded("ns:third", first_bytes)
    assert backend.get("ns:second").equal(second)
    assert backend.contains(["ns:third"]) == 0
    if kind in ("cpu", "grpc"):
        return  # holds tensors / behind a server that checks: no bytes to misfile from outside
    # The back door: the value is misfiled in the tier's own storage.
    corrupt_before = backend.stats()["corrupt"]
    reads = (
        lambda: backend.get("ns:second"),
        lambda: backend.get_encoded("ns:second"),
        lambda: backend.get_many(["ns:first", "ns:second"])[1],
    )
    for num_done, read in enumerate(reads, start=1):
        backend.put("ns:second", second)  # a tier may drop a corrupt value once it has seen it
        misfile_behind_the_backend(kind, backend, "ns:first", "ns:second")
        assert read() is None
        assert backend.stats()["corrupt"] == corrupt_before + num_done
    assert backend.get("ns:first").equal(first)
