"""State the two connector roles share inside one engine process: saves in
flight per request and per-request transfer figures.

The scheduler side records what it promised (prompt, GPU hit, external hit) and
the saves it issued; the worker side records what it loaded and which saves
have read their blocks. Thread-safe (the worker may run on another thread).
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from connector.base import RequestTransferStats

#: finished requests whose figures stay available to ``request_stats``
MAX_FINISHED_STATS = 10_000


@dataclass
class RequestFigures:
    """Figures of one request, filled in by both roles."""

    num_prompt_tokens: int
    num_gpu_hit_tokens: int = 0
    num_external_hit_tokens: int = 0
    num_loaded_tokens: int = 0
    num_loaded_bytes: int = 0
    load_seconds: float = 0.0
    num_saved_tokens: int = 0
    tier_to_loaded_tokens: Counter[str] = field(default_factory=Counter)

    def to_stats(self) -> RequestTransferStats:
        return RequestTransferStats(
            self.num_prompt_tokens,
            self.num_gpu_hit_tokens,
            self.num_external_hit_tokens,
            self.num_loaded_tokens,
            self.num_loaded_bytes,
            self.load_seconds,
            self.num_saved_tokens,
            dict(self.tier_to_loaded_tokens),
        )


class TransferTracker:
    """One per connector pair, made by ``create_kv_connector``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request_id_to_figures: dict[str, RequestFigures] = {}
        self._finished_figures: OrderedDict[str, RequestFigures] = OrderedDict()
        self._request_id_to_num_pending_saves: Counter[str] = Counter()
        self._finished_sending_ids: set[str] = set()

    # ---- scheduler side ------------------------------------------------------
    def admitted(self, request_id: str, num_prompt_tokens: int, num_gpu_hit: int, num_external: int) -> None:
        """A request was admitted (again after a preemption): the GPU hit of its first
        admission is kept, external hits add up like the loads that follow them."""
        with self._lock:
            figures = self._request_id_to_figures.get(request_id)
            if figures is None:
                self._request_id_to_figures[request_id] = RequestFigures(
                    num_prompt_tokens, num_gpu_hit, num_external
                )
            else:
                figures.num_external_hit_tokens += num_external

    def save_issued(self, request_id: str) -> None:
        with self._lock:
            self._request_id_to_num_pending_saves[request_id] += 1

    def finish(self, request_id: str) -> tuple[RequestFigures | None, bool]:
        """A request finished: returns its figures and whether saves still read its blocks
        (then its id is reported by :meth:`take_finished_sending` once they are done)."""
        with self._lock:
            figures = self._request_id_to_figures.pop(request_id, None)
            if figures is not None:
                self._finished_figures[request_id] = figures
                while len(self._finished_figures) > MAX_FINISHED_STATS:
                    self._finished_figures.popitem(last=False)
            sending = self._request_id_to_num_pending_saves[request_id] > 0
            if sending:
                self._finished_sending_ids.add(request_id)
            else:
                self._request_id_to_num_pending_saves.pop(request_id, None)
            return figures, sending

    def stats(self, request_id: str) -> RequestTransferStats | None:
        with self._lock:
            figures = self._finished_figures.get(request_id) or self._request_id_to_figures.get(request_id)
            return None if figures is None else figures.to_stats()

    # ---- worker side ---------------------------------------------------------
    def loaded(
        self,
        request_id: str,
        num_loaded: int,
        num_promised: int,
        num_bytes: int,
        seconds: float,
        tier_to_num_tokens: dict[str, int] | None = None,
    ) -> None:
        """A load finished with ``num_loaded`` of ``num_promised`` tokens in the paged
        cache (``tier_to_num_tokens``: how many came from each tier); the tokens it could
        not load are no external hit."""
        with self._lock:
            figures = self._request_id_to_figures.get(request_id)
            if figures is None:
                return
            figures.num_loaded_tokens += num_loaded
            figures.num_external_hit_tokens -= num_promised - num_loaded
            figures.num_loaded_bytes += num_bytes
            figures.load_seconds += seconds
            figures.tier_to_loaded_tokens.update(tier_to_num_tokens or {})

    def save_done(self, request_id: str, num_saved_tokens: int) -> None:
        """A save issued by the scheduler side has read its blocks (or was skipped)."""
        with self._lock:
            figures = self._request_id_to_figures.get(request_id) or self._finished_figures.get(request_id)
            if figures is not None:
                figures.num_saved_tokens += num_saved_tokens
            self._request_id_to_num_pending_saves[request_id] -= 1
            if self._request_id_to_num_pending_saves[request_id] <= 0:
                del self._request_id_to_num_pending_saves[request_id]

    def take_finished_sending(self) -> set[str]:
        """Finished requests whose saves all completed since the last call."""
        with self._lock:
            done = {
                rid for rid in self._finished_sending_ids if rid not in self._request_id_to_num_pending_saves
            }
            self._finished_sending_ids -= done
            return done
