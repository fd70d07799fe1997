"""The engines behind the proxy, one pool per role: a request goes to the live engine with
the fewest requests in flight; an engine that does not answer is taken out for
``retry_after_s`` and then tried again by the next request that needs one."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: seconds before an engine that did not answer is tried again (`kvstash proxy --retry-after-s`)
DEFAULT_RETRY_AFTER_S = 5.0


@dataclass(eq=False)
class Engine:
    """One `kvstash serve` process as the proxy sees it."""

    url: str
    role: str
    num_in_flight: int = 0
    #: monotonic time before which it is out (0.0: in); set when it failed to answer
    out_until: float = 0.0
    num_failures: int = 0
    #: the last failure in words (``/health``)
    last_error: str = ""


class EnginePool:
    """Engines of one role (``prefill`` or ``decode``). Used from the event loop only."""

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        *,
        retry_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_after_s <= 0:
            raise ValueError(f"retry_after_s must be positive, got {retry_after_s}")
        self.role = role
        self.engines = [Engine(url.rstrip("/"), role) for url in urls]
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._turn = 0  # ties go round-robin

    def is_up(self, engine: Engine) -> bool:
        return engine.out_until <= self._clock()

    def pick(self, exclude: Sequence[Engine] = ()) -> Engine | None:
        """The engine to send the next request to: of those in (never failed, or out for
        ``retry_after_s`` already) and not in ``exclude``, the one with the fewest requests in
        flight (ties in turn). None when there is none. The caller counts the request with
        :meth:`started` and :meth:`ended`."""
        candidates = [e for e in self.engines if e not in exclude and self.is_up(e)]
        if not candidates:
            return None
        self._turn += 1
        order = {id(e): (i - self._turn) % len(self.engines) for i, e in enumerate(self.engines)}
        return min(candidates, key=lambda e: (e.num_in_flight, order[id(e)]))

    @staticmethod
    def started(engine: Engine) -> None:
        engine.num_in_flight += 1

    @staticmethod
    def ended(engine: Engine) -> None:
        engine.num_in_flight -= 1

    def failed(self, engine: Engine, error: str) -> None:
        """It did not answer (refused, reset, timed out, or said it cannot serve): out for
        ``retry_after_s``."""
        engine.out_until = self._clock() + self.retry_after_s
        engine.num_failures += 1
        engine.last_error = error

    def answered(self, engine: Engine) -> None:
        engine.out_until = 0.0

    def describe(self) -> list[dict]:
        """Each engine's state (the proxy's ``/health``)."""
        return [
            {
                "url": e.url,
                "up": self.is_up(e),
                "in_flight": e.num_in_flight,
                "failures": e.num_failures,
                "last_error": e.last_error,
            }
            for e in self.engines
        ]
