"""An exclusive lock on a disk-tier folder, held for the backend's life.

Two processes on one folder would each enforce their own byte cap and each
delete the other's in-flight temporary files at start-up; the lock turns that
into a clear error for the second one. ``fcntl.flock`` on ``<folder>/.lock``:
the kernel releases it when the holder exits or is killed, so a crash never
leaves a stale lock behind. The file stays empty (it takes no room under the cap).
"""

from __future__ import annotations

import fcntl
import os
import weakref

from storage_backends.base import BackendError

LOCK_NAME = ".lock"


class FolderInUseError(BackendError):
    """Another backend (in this or another process) holds the folder's lock."""


class FolderLock:
    """Take the lock on ``folder`` now (non-blocking) or raise :class:`FolderInUseError`."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, LOCK_NAME)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderInUseError(
                f"disk tier folder {folder} is in use by another kvstash disk tier (it holds the lock on "
                f"{self.path}); give each engine or cache server its own folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # Closing the descriptor drops the lock: at release(), or when a backend that was
        # never closed is garbage-collected.
        self._close_fd = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        """Drop the lock (idempotent). The file stays: unlinking it would let two
        processes lock two different inodes under one name."""
        self._close_fd()
