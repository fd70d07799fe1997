"""How many threads torch's host-side operators use in an engine on a GPU.

On a GPU the engine's host work is bookkeeping on small tensors (slot maps, pinned
staging of a step's inputs, chunk tables): at a few thousand elements torch spreads
an operator over its intra-op thread pool, whose threads wake, spin and contend with
the connector's I/O threads for the cores. On the H100 machine (16 cores) that
stretched the host part of CPU-tier hits of 8k tokens from ~4 ms to 10-30 ms now and
then (`kvstash bench` rounds 2/3: 5.1x / 4.8x with the default threads, 6.6x / 6.7x with
one thread, same run). vLLM's worker processes make the same choice (one thread unless
``OMP_NUM_THREADS`` says otherwise). On CPU the model itself runs on those threads, so
nothing changes there.

Called once by `EngineCore.__init__`; torch's thread count is a process setting.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch

logger = logging.getLogger(__name__)


def host_threads_for(device: torch.device, environ: Mapping[str, str]) -> int | None:
    """The intra-op thread count to set for an engine on ``device``, or None to leave
    torch's default (CPU engines, or ``OMP_NUM_THREADS`` set by the user)."""
    if device.type != "cuda" or "OMP_NUM_THREADS" in environ:
        return None
    return 1


def limit_host_threads(device: torch.device) -> None:
    """Apply `host_threads_for` to this process, logging the change once."""
    num_threads = host_threads_for(device, os.environ)
    if num_threads is None or torch.get_num_threads() == num_threads:
        return
    logger.info(
        "torch host threads %d -> %d: the engine's host work is small tensors on a GPU engine "
        "(set OMP_NUM_THREADS to choose)",
        torch.get_num_threads(),
        num_threads,
    )
    torch.set_num_threads(num_threads)
