"""How long each phase of an engine's start took (docs/serving.md, "Start-up").

The engine core times its phases in order:

* ``config``: read the model's config (mostly importing transformers) while the
  checkpoint's files start into the page cache (engine.model_folder);
* ``weights``: read the files and copy them to the device;
* ``fingerprint``: the weights' identity for the offload namespace;
* ``kv_cache``: size and allocate the paged KV cache, capture the decode and mixed CUDA
  graphs;
* ``tokenizer``: what the tokenizer's own thread had left to load by then;
* ``tiers``: open the offload tiers, the CPU tier's first slab piece, the disk index scan;
* ``warmup``: compile every kernel shape.

``kvstash serve`` adds ``imports`` (process start to the engine's first line) and
``server`` (engine ready to listening), and the CPU tier's slab that grows after ready
reports ``cpu_tier_background``. The engine logs one line when it is ready; ``/metrics``
exports ``kvstash_startup_phase_seconds{phase=...}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: the phases in the order they run
PHASES = ("imports", "config", "weights", "fingerprint", "kv_cache", "tokenizer", "tiers", "warmup", "server")


class StartupPhases:
    """Seconds per phase, written by the thread that starts the engine (and, for
    ``cpu_tier_background``, read from the tier when asked). ``clock`` is injectable."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.phase_to_seconds: dict[str, float] = {}
        #: what the weights phase read (engine.models.weight_reader.WeightReadStats), or None
        self.weight_read_stats: Any = None
        #: the CPU tier whose slab grows after ready (its ``allocation_s``), or None
        self.cpu_tier: Any = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added to what the phase already had)."""
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    def now(self) -> float:
        """A mark for :meth:`add_since`."""
        return self._clock()

    def add_since(self, name: str, mark: float) -> None:
        """Add the time since ``mark`` (from :meth:`now`) to phase ``name``."""
        self.add(name, self._clock() - mark)

    def add(self, name: str, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"phase {name!r} cannot take {seconds!r} seconds")
        self.phase_to_seconds[name] = self.phase_to_seconds.get(name, 0.0) + seconds

    def snapshot(self) -> dict[str, float]:
        """Every phase timed so far, plus ``cpu_tier_background`` once the slab is whole."""
        phases = dict(self.phase_to_seconds)
        background_s = getattr(self.cpu_tier, "allocation_s", None)
        if background_s is not None:
            phases["cpu_tier_background"] = background_s
        return phases

    def total_s(self) -> float:
        """Seconds of the phases before ready (the background slab is not one of them)."""
        return sum(self.phase_to_seconds.values())

    def describe(self) -> str:
        """One line: the total and each phase (the weights with what they read)."""
        parts = []
        for name, seconds in self.phase_to_seconds.items():
            text = f"{name} {seconds:.2f} s"
            stats = self.weight_read_stats
            if name == "weights" and stats is not None:
                text += (
                    f" ({stats.num_bytes / 1e9:.2f} GB from {stats.num_files} file(s) on {stats.num_threads} "
                    f"thread(s), {stats.num_bytes / 1e9 / max(stats.wall_s, 1e-9):.2f} GB/s; thread-seconds: "
                    f"read {stats.read_s:.2f}, copy {stats.copy_s:.2f}, hash {stats.hash_s:.2f})"
                )
            parts.append(text)
        return f"{self.total_s():.2f} s: " + ", ".join(parts)
