"""Disk tier start-up from its index file (and the scan it falls back to), and the folder
lock that keeps a second process off a folder in use."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage_backends.disk_backend import DiskBackend, FolderInUseError, key_to_filename
from storage_backends.disk_index import INDEX_NAME
from tests.storage_backends.helpers import make_chunk

REPO_ROOT = Path(__file__).resolve().parents[2]
NUM_FILES = 30


def fill(folder: Path, num_files: int = NUM_FILES) -> None:
    backend = DiskBackend(str(folder), 1 << 24)
    for i in range(num_files):
        backend.put(f"ns:{i}", make_chunk(i, num_tokens=1 + i % 5))
    backend.get("ns:3")  # recency: 3 is now the most recent
    backend.close()  # writes the index


def contents(backend: DiskBackend) -> list[tuple[str, int]]:
    """(key, file size) in recency order, oldest first."""
    with backend._lock:
        return [(key, entry.size) for key, entry in backend._index.items()]


def test_start_up_from_the_index_agrees_with_a_full_scan(tmp_path: Path) -> None:
    fill(tmp_path)
    assert (tmp_path / INDEX_NAME).exists()
    from_index = DiskBackend(str(tmp_path), 1 << 24)
    assert from_index.stats()["num_files_scanned_at_start"] == 0  # no chunk file was opened
    indexed = contents(from_index)
    from_index.close()

    (tmp_path / INDEX_NAME).unlink()
    scanned_backend = DiskBackend(str(tmp_path), 1 << 24)
    assert scanned_backend.stats()["num_files_scanned_at_start"] == NUM_FILES
    assert sorted(contents(scanned_backend)) == sorted(indexed)
    assert len(indexed) == NUM_FILES and indexed[-1][0] == "ns:3"  # the index also kept recency
    for i in range(NUM_FILES):
        assert scanned_backend.get(f"ns:{i}").equal(make_chunk(i, num_tokens=1 + i % 5))
    scanned_backend.close()


def test_stale_index_entries_are_dropped_and_unindexed_files_are_scanned(tmp_path: Path) -> None:
    fill(tmp_path)
    (tmp_path / key_to_filename("ns:1")).unlink()  # gone
    truncated = tmp_path / key_to_filename("ns:2")
    os.truncate(truncated, truncated.stat().st_size - 10)  # truncated: size no longer matches
    replaced = tmp_path / key_to_filename("ns:4")
    replaced.write_bytes(b"not a chunk file at all")  # rewritten since the index
    # A file written after the index (its writer was killed before it could rewrite it).
    writer_without_index = DiskBackend(str(tmp_path / "elsewhere"), 1 << 20)
    writer_without_index.put("ns:late", make_chunk(99))
    writer_without_index.close()
    os.replace(tmp_path / "elsewhere" / key_to_filename("ns:late"), tmp_path / key_to_filename("ns:late"))

    backend = DiskBackend(str(tmp_path), 1 << 24)
    keys = set(backend.keys("ns:"))
    assert keys == {f"ns:{i}" for i in range(NUM_FILES)} - {"ns:1", "ns:2", "ns:4"} | {"ns:late"}
    assert backend.stats()["num_files_scanned_at_start"] == 3  # ns:2, ns:4 and ns:late
    assert backend.stats()["corrupt"] == 2 and not truncated.exists() and not replaced.exists()
    assert backend.get("ns:late").equal(make_chunk(99))
    assert backend.stats()["bytes_used"] == sum(size for _, size in contents(backend))
    backend.close()
    restarted = DiskBackend(str(tmp_path), 1 << 24)  # the index was brought up to date
    assert restarted.stats()["num_files_scanned_at_start"] == 0
    assert set(restarted.keys("ns:")) == keys
    restarted.close()


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "garbage"])
def test_a_corrupt_index_file_means_a_full_scan(tmp_path: Path, damage: str) -> None:
    fill(tmp_path)
    index = tmp_path / INDEX_NAME
    data = bytearray(index.read_bytes())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x04
    elif damage == "truncated":
        del data[-7:]
    else:
        data = bytearray(b"\x00" * 64)
    index.write_bytes(bytes(data))
    backend = DiskBackend(str(tmp_path), 1 << 24)
    assert backend.stats()["num_files_scanned_at_start"] == NUM_FILES
    assert len(backend.keys("ns:")) == NUM_FILES and backend.stats()["corrupt"] == 0
    backend.close()


def test_an_index_entry_never_names_another_key_than_its_file_holds(tmp_path: Path) -> None:
    """Two files swapped by hand keep their sizes only if they are equal; the key check of
    every read still makes a swapped file a miss, never the other key's chunk."""
    backend = DiskBackend(str(tmp_path), 1 << 24)
    backend.put("ns:a", make_chunk(1))
    backend.put("ns:b", make_chunk(2))
    backend.close()
    a, b = tmp_path / key_to_filename("ns:a"), tmp_path / key_to_filename("ns:b")
    a_stat, b_stat = a.stat(), b.stat()
    a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
    a.write_bytes(b_bytes)
    b.write_bytes(a_bytes)
    os.utime(a, ns=(a_stat.st_atime_ns, a_stat.st_mtime_ns))  # even with the index's mtimes restored
    os.utime(b, ns=(b_stat.st_atime_ns, b_stat.st_mtime_ns))
    restarted = DiskBackend(str(tmp_path), 1 << 24)
    assert restarted.get("ns:a") is None and restarted.get("ns:b") is None
    assert restarted.stats()["corrupt"] == 2
    restarted.close()


LOCKER = """
import sys
from storage_backends.disk_backend import DiskBackend, FolderInUseError
try:
    DiskBackend(sys.argv[1], 1 << 20)
except FolderInUseError as exc:
    print("refused:", exc)
    sys.exit(3)
print("opened")
"""


def run_second_process(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOCKER, str(folder)],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_second_process_on_the_same_folder_gets_a_clear_error(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    backend.put("ns:a", make_chunk(1))
    leftover = tmp_path / ".tmp-in-flight"
    leftover.write_bytes(b"a write of the first process")  # what the second one used to delete
    second = run_second_process(tmp_path)
    assert second.returncode == 3, second.stdout + second.stderr
    assert "in use by another kvstash disk tier" in second.stdout and str(tmp_path) in second.stdout
    assert leftover.exists() and backend.get("ns:a").equal(make_chunk(1))
    with pytest.raises(FolderInUseError):  # a second backend in this process too
        DiskBackend(str(tmp_path), 1 << 20)
    backend.close()
    leftover.unlink()
    after_close = run_second_process(tmp_path)
    assert after_close.returncode == 0 and after_close.stdout.strip() == "opened"


def test_a_backend_dropped_without_close_releases_its_folder(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), 1 << 20)
    backend.put("ns:a", make_chunk(1))
    del backend
    gc.collect()
    reopened = DiskBackend(str(tmp_path), 1 << 20)  # no FolderInUseError
    assert reopened.get("ns:a").equal(make_chunk(1))
    reopened.close()
