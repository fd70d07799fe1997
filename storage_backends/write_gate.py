"""A gate that background writes wait at while the engine's step thread needs the host.

The connector's write-through copies chunks from the CPU tier to the disk tier on
threads of its own. Their file-system calls give up the GIL, and each return takes it
back: while a step that loads KV is being planned and queued, every one of those returns
may make the step thread wait (on the H100, an 8k-token CPU-tier hit took ~2 ms longer
while round 1's chunks were still being written, issue 23). So the connector holds the
gate from a request's lookup hit until its loads are done, and the disk tier's writers
wait at the gate between their system calls: at most one more return per writer, then
nothing until the step has what it needs.

A hold always ends: at :meth:`release` or after its ``seconds``, whichever comes first, so
a hold that is never released pauses writes for a bounded time, never forever.
Thread-safe; no state shared beyond the object.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class WriteGate:
    """Open unless held; :meth:`wait_open` blocks writers while it is held."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._condition = threading.Condition()
        self._held_until = 0.0
        self._num_waiting = 0

    def hold(self, seconds: float) -> None:
        """Close the gate for at most ``seconds`` from now (a longer hold already in place
        stays). Called by the connector on the step thread; never blocks on writers."""
        if seconds <= 0:
            raise ValueError(f"a hold needs a positive duration, got {seconds!r}")
        with self._condition:
            self._held_until = max(self._held_until, self._clock() + seconds)

    def release(self) -> None:
        """Open the gate now (every hold ends) and wake the writers waiting at it."""
        with self._condition:
            self._held_until = 0.0
            self._condition.notify_all()

    @property
    def is_held(self) -> bool:
        with self._condition:
            return self._clock() < self._held_until

    @property
    def num_waiting(self) -> int:
        """Writers blocked in :meth:`wait_open` now (tests and stats)."""
        with self._condition:
            return self._num_waiting

    def wait_open(self) -> None:
        """Return once the gate is open: at once when it is, else at the release or the
        end of the hold. Called by background writers between their system calls."""
        with self._condition:
            while True:
                remaining = self._held_until - self._clock()
                if remaining <= 0:
                    return
                self._num_waiting += 1
                try:
                    self._condition.wait(remaining)
                finally:
                    self._num_waiting -= 1
