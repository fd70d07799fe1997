"""NIXL, the transfer library of the direct path (``pip install kvstash[nixl]``): importing
it, and one agent per engine with its memory registered (docs/architecture.md,
"Disaggregated prefill and decode"). Used by :mod:`connector.direct_export` and
:mod:`connector.direct_peer`; nothing else imports NIXL.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch

from connector.nixl_import import import_nixl

log = logging.getLogger(__name__)


def mem_type_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL's memory kind and device id of a tensor's memory."""
    if tensor.device.type == "cuda":
        return "VRAM", tensor.device.index or 0
    return "DRAM", 0


class NixlAgent:
    """One NIXL agent (UCX backend) with the connector's CPU tier's slab registered, piece
    by piece as it grows: the producer's chunks are read from it and the consumer's reads land in it. Its
    name is unique per process (``role-pid-random``). Thread-safe: the agent is made with
    NIXL's strict thread synchronization (the fetcher's threads read through it at once)."""

    def __init__(self, role: str, memory_pieces: Callable[[], list[torch.Tensor]]) -> None:
        nixl = import_nixl()
        config = nixl.nixl_agent_config(
            backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.name = f"kvstash-{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent: Any = nixl.nixl_agent(self.name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend here: the direct KV path cannot run")
        self._memory_pieces = memory_pieces
        first = memory_pieces()[0]
        self.mem_type, self.device_id = mem_type_of(first)
        self._lock = threading.Lock()
        self._registered: list[Any] = []
        #: what a peer loads to reach this agent (its address and registered memory)
        self.metadata: bytes = b""
        self.ensure_registered()

    def ensure_registered(self) -> bytes:
        """Register the pieces of memory that appeared since the last call (the CPU tier's
        slab grows in pieces after start-up) and return the agent's metadata, which names
        them all. Called before every offer (producer) and read (consumer); any thread."""
        with self._lock:
            pieces = self._memory_pieces()
            for piece in pieces[len(self._registered) :]:
                self._registered.append(self.agent.register_memory(piece))
                log.info(
                    "NIXL agent %s: %.1f MiB of %s registered",
                    self.name,
                    piece.numel() * piece.element_size() / 2**20,
                    self.mem_type,
                )
                self.metadata = b""
            if not self.metadata:
                self.metadata = self.agent.get_agent_metadata()
            return self.metadata

    def descs(self, spans: list[tuple[int, int]], mem_type: str | None = None, device_id: int | None = None):
        """NIXL transfer descriptors of ``(address, num_bytes)`` spans."""
        mem_type = mem_type or self.mem_type
        device = self.device_id if device_id is None else device_id
        return self.agent.get_xfer_descs([(address, size, device) for address, size in spans], mem_type)

    def close(self) -> None:
        """Deregister the memory (the agent goes with the object). Idempotent."""
        with self._lock:
            registered, self._registered = self._registered, []
        for handle in registered:
            try:
                self.agent.deregister_memory(handle)
            except Exception as error:  # noqa: BLE001 - shutting down: nothing left to do about it
                log.debug("NIXL agent %s: deregistering failed: %s", self.name, error)
