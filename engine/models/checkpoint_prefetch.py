"""Warm the page cache with a checkpoint's files while the engine does what comes first.

Between the start of ``EngineCore`` and the first byte ``engine.models.weight_reader``
reads, the engine imports transformers for the model config, builds the model on the meta
device and initialises CUDA: seconds in which the disk sits idle (issue 33: an 8B start
took 24 s where reading its 16 GB took 7.2 s). ``CheckpointPrefetch`` reads the files'
heads ahead (one thread per file, in ``STEP_BYTES`` pieces from the start, the order the
reader reads them, into one scratch buffer that is thrown away), so that the reader finds
those pages in the page cache.

It only warms the cache: a failure is logged and ignored, it stops as soon as the weights
are read (``stop``), and it reads no more than ``SHARE_OF_AVAILABLE`` of the host's
available memory (a checkpoint larger than that is prefetched in part: the head of every
file), so that prefetched pages are not evicted before the reader gets to them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: bytes read per call (small enough that ``stop`` takes effect soon)
STEP_BYTES = 64 << 20
#: the share of the host's available memory a prefetch may fill
SHARE_OF_AVAILABLE = 0.5


def available_host_bytes() -> int:
    """MemAvailable of this host (psutil), or 0 where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # advice only: no figure means no prefetch
        return 0


class CheckpointPrefetch:
    """Created once per engine start (``start``); ``stop`` once the weights are read.

    Each file gets a daemon thread that reads its first ``per_file_bytes`` bytes in
    steps, stopping early on ``stop``. ``num_prefetched_bytes`` is what was
    (read so far; a figure for logs and tests)."""

    def __init__(self, files: Sequence[Path], budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes!r}")
        self.files = list(files)
        self.per_file_bytes = budget_bytes // len(self.files) if self.files else 0
        self.num_prefetched_bytes = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._threads = [
            threading.Thread(target=self._read_ahead, args=(path,), name="weights-prefetch", daemon=True)
            for path in self.files
        ]

    @classmethod
    def start(cls, model_dir: Path, available_bytes: int | None = None) -> CheckpointPrefetch | None:
        """Start prefetching ``model_dir``'s ``*.safetensors`` (the files the loader reads);
        None where there is nothing to do (no files, no memory
        figure). ``available_bytes`` defaults to the host's MemAvailable."""
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if available_bytes is None:
            available_bytes = available_host_bytes()
        budget = int(available_bytes * SHARE_OF_AVAILABLE)
        if not files or budget <= 0:
            return None
        prefetch = cls(files, budget)
        for thread in prefetch._threads:
            thread.start()
        return prefetch

    def stop(self) -> None:
        """Read no more (a read under way ends first). Idempotent; any thread."""
        self._stopped.set()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for every thread (tests); True when all have ended."""
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)

    def _read_ahead(self, path: Path) -> None:
        # Reads, not posix_fadvise(WILLNEED): on the kernels tried, the advice brought in
        # the first 128 MiB of a file and ignored the rest. A read lands in the page cache
        # for certain; its copy into the one scratch buffer costs little beside the disk.
        scratch = bytearray(min(STEP_BYTES, self.per_file_bytes) or 1)
        try:
            with open(path, "rb", buffering=0) as file:
                end = min(os.fstat(file.fileno()).st_size, self.per_file_bytes)
                offset = 0
                while offset < end and not self._stopped.is_set():
                    view = memoryview(scratch)[: min(len(scratch), end - offset)]
                    num_read = file.readinto(view)
                    if not num_read:
                        return
                    offset += num_read
                    with self._lock:
                        self.num_prefetched_bytes += num_read
        except OSError as error:
            logger.debug("prefetch of %s stopped: %s", path, error)
