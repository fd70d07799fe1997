"""The disk tier's index lock is never held across a file-system call (issue 23).

The engine's step thread takes that lock (``pin``, ``unpin``, ``contains`` through the
tier manager) while the write-through thread writes. A rename or unlink can wait tens of
milliseconds for the file system's journal while other files are fsynced; these tests
block one for real-time-independent certainty (the call waits on an event, then runs
for real) and check that another thread's calls on other keys complete meanwhile.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from storage_backends.disk_backend import WRITES_IN_FLIGHT, DiskBackend, key_to_filename
from storage_backends.disk_io import write_from
from tests.storage_backends.helpers import aligned_copy, make_chunk

CHUNK = {"num_tokens": 16, "num_kv_heads": 2, "head_dim": 64}
#: bound on waits that only a hang would reach (the calls take microseconds)
HANG_S = 30.0


class BlockedCall:
    """Replaces ``module.name`` (``os.replace`` or ``os.unlink``) so that a call on the file
    of ``key`` waits until :meth:`release`; every other call goes straight through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, key: str) -> None:
        self.started = threading.Event()
        self._release = threading.Event()
        real = getattr(os, name)
        file_name = key_to_filename(key)

        def blocked(path, *args, **kwargs):
            if os.path.basename(os.fspath(args[0] if name == "replace" else path)) == file_name:
                self.started.set()
                self._release.wait(HANG_S)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, blocked)

    def release(self) -> None:
        self._release.set()


def other_key_calls_finish(disk: DiskBackend, key: str) -> bool:
    """Whether pin, contains, unpin and get of ``key`` finish in another thread (as the step's would)."""
    results: dict[str, object] = {}
    done = threading.Event()

    def step() -> None:
        results["pinned"] = disk.pin([key])
        results["present"] = disk.contains([key])
        disk.unpin([key])
        results["chunk"] = disk.get(key)
        done.set()

    threading.Thread(target=step, daemon=True).start()
    finished = done.wait(HANG_S)
    if finished:
        assert results["pinned"] == 1 and results["present"] == 1 and results["chunk"] is not None
    return finished


def run_blocked(
    monkeypatch: pytest.MonkeyPatch,
    disk: DiskBackend,
    name: str,
    blocked_key: str,
    call: Callable[[], object],
) -> bool:
    """Run ``call`` in a thread until its ``os.<name>`` of ``blocked_key``'s file blocks; then
    whether calls on another key finish meanwhile. The blocked call then completes."""
    blocker = BlockedCall(monkeypatch, name, blocked_key)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        assert blocker.started.wait(HANG_S), f"os.{name} of {blocked_key!r} never ran"
        return other_key_calls_finish(disk, "other")
    finally:
        blocker.release()
        worker.join(HANG_S)
        assert not worker.is_alive() and not errors, errors


@pytest.fixture
def disk(tmp_path: Path):
    backend = DiskBackend(str(tmp_path / "disk"), capacity_bytes=64 << 20)
    backend.put("other", aligned_copy(make_chunk(1, **CHUNK)))
    yield backend
    backend.close()


def test_rename_into_place_does_not_hold_the_index_lock(monkeypatch, disk):
    chunk = aligned_copy(make_chunk(2, **CHUNK))
    assert run_blocked(monkeypatch, disk, "replace", "new", lambda: disk.put("new", chunk))
    assert disk.get("new").equal(chunk)


def test_unlink_of_a_deleted_file_does_not_hold_the_index_lock(monkeypatch, disk):
    disk.put("gone", aligned_copy(make_chunk(3, **CHUNK)))
    assert run_blocked(monkeypatch, disk, "unlink", "gone", lambda: disk.delete("gone"))
    assert disk.get("gone") is None
    assert not (Path(disk.root) / key_to_filename("gone")).exists()


def two_files(tmp_path: Path, chunk) -> int:
    """A cap that holds two files of ``chunk`` under the keys these tests use, not three."""
    probe = DiskBackend(str(tmp_path / "probe"), capacity_bytes=64 << 20)
    probe.put("newcomer", chunk)  # the longest key: the largest file
    file_bytes = probe.stats()["bytes_used"]
    probe.close()
    return 2 * file_bytes


def test_unlink_of_an_evicted_file_does_not_hold_the_index_lock(monkeypatch, tmp_path):
    chunk = aligned_copy(make_chunk(4, **CHUNK))
    disk = DiskBackend(str(tmp_path / "disk"), capacity_bytes=two_files(tmp_path, chunk))
    try:
        disk.put("victim", chunk)
        disk.put("other", chunk)  # more recent: "victim" goes first
        assert run_blocked(monkeypatch, disk, "unlink", "victim", lambda: disk.put("newcomer", chunk))
        assert disk.keys() and sorted(disk.keys()) == ["newcomer", "other"]
        assert not (Path(disk.root) / key_to_filename("victim")).exists()
    finally:
        disk.close()


def test_a_key_put_again_while_its_evicted_file_is_unlinked_keeps_its_new_file(monkeypatch, tmp_path):
    """The unlink of an evicted file and a new put of the same key are ordered by the path's
    lock: the new file is never the one unlinked."""
    old, new = aligned_copy(make_chunk(5, **CHUNK)), aligned_copy(make_chunk(6, **CHUNK))
    disk = DiskBackend(str(tmp_path / "disk"), capacity_bytes=two_files(tmp_path, old))
    try:
        disk.put("victim", old)
        disk.put("other", old)
        blocker = BlockedCall(monkeypatch, "unlink", "victim")
        evicting = threading.Thread(target=disk.put, args=("newcomer", old), daemon=True)
        evicting.start()
        assert blocker.started.wait(HANG_S)
        # "victim" is out of the index, its old file not yet unlinked: put it again meanwhile.
        putting = threading.Thread(target=disk.put, args=("victim", new), daemon=True)
        putting.start()
        blocker.release()
        evicting.join(HANG_S)
        putting.join(HANG_S)
        assert not evicting.is_alive() and not putting.is_alive()
        got = disk.get("victim")
        assert got is not None and got.equal(new)
    finally:
        disk.close()


def test_put_many_writes_at_most_writes_in_flight_files_at_once(monkeypatch, tmp_path):
    """The write-through's files go out a few at a time, however many I/O threads the tier
    has for reads: threads finishing writes together queue for the GIL together."""
    disk = DiskBackend(str(tmp_path / "disk"), capacity_bytes=64 << 20, io_threads=16)
    lock = threading.Lock()
    in_flight = [0]
    most_in_flight = [0]
    all_started = threading.Event()
    num_items = 2 * WRITES_IN_FLIGHT + 1

    def counted_write_from(fd, views, offset):
        with lock:
            in_flight[0] += 1
            most_in_flight[0] = max(most_in_flight[0], in_flight[0])
            if most_in_flight[0] > WRITES_IN_FLIGHT:
                all_started.set()
        # Hold the write until more than the allowed number are in flight (never, when the
        # limit holds): then the limit is what stops more from starting, not luck.
        all_started.wait(0.2)
        try:
            return write_from(fd, views, offset)
        finally:
            with lock:
                in_flight[0] -= 1

    monkeypatch.setattr("storage_backends.disk_io.write_from", counted_write_from)
    try:
        items = [(f"k{index}", aligned_copy(make_chunk(index, **CHUNK))) for index in range(num_items)]
        disk.put_many(items)
        assert most_in_flight[0] <= WRITES_IN_FLIGHT
        assert all(disk.get(key).equal(chunk) for key, chunk in items)
    finally:
        disk.close()
