"""Host-to-device copies that never make the host wait for the device.

A copy from pageable host memory may synchronize with its stream before it starts
(CUDA's API synchronization rules), so the host would wait until the device reached
the copy: under async scheduling that is the end of the step in flight, and the
overlap is gone. Staging the data in pinned memory first (PyTorch's caching host
allocator, which keeps a block until the copies reading it are done) makes the copy
truly asynchronous. Called by the model runner, the decode graphs and the sampler for
every per-step input; on CPU it is a plain conversion.
"""

from __future__ import annotations

import numpy as np
import torch


def staged(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` as a CPU tensor to copy to `device` with `non_blocking=True`: in pinned
    memory when `device` is CUDA, else as it is (a numpy array's memory shared)."""
    tensor = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    return tensor.pin_memory() if device.type == "cuda" else tensor


def host_to_device(data: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """`data` (a numpy array or a CPU tensor) on `device`, queued without waiting on CUDA.
    On CPU a numpy array's memory is shared, not copied (as `torch.from_numpy`)."""
    return staged(data, device).to(device, non_blocking=True)
