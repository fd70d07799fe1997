"""Polling for a condition that another thread or process makes true (tests only)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], timeout_s: float, poll_s: float = 0.01) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (checked every ``poll_s``,
    and once more at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return bool(condition())
