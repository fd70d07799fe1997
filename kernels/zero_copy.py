"""Write a small device tensor into pinned host memory with a kernel, not a copy engine.

`Tensor.copy_` from the device to pinned memory is a DMA on a copy engine, and copies
of one direction queue behind each other there whatever their streams: a step's
sampled token ids (a few hundred bytes) waited ~20 ms on the H100 behind the
connector's saves of the same step (1 GiB of KV to the CPU tier) before the host could
read them, and the GPU sat idle meanwhile. `copy_to_host` instead launches one small
kernel on the current stream that stores the values through unified virtual
addressing (pinned host memory is mapped into the device's address space): ordered
after the work that produced them, and never behind a copy engine's queue.

For small tensors only (token ids, flags): every element crosses PCIe as a store of
its own. The caller keeps ``host`` alive and unread until the kernel has run (an
event recorded after the call, synchronized before reading).

Under TRITON_INTERPRET=1 the same kernel writes ordinary CPU tensors (tests on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import check_kernel_device

#: elements per program, fixed: one compiled kernel serves every batch size (a block
#: sized by the count would compile anew, ~0.1 s, for each power of two met at run time)
_BLOCK = 1024


@triton.jit(do_not_specialize=["host_address", "num_elements"])
def _copy_to_host_kernel(source_ptr, host_address, num_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < num_elements
    values = tl.load(source_ptr + offsets, mask=mask)
    host_ptr = host_address.to(tl.pointer_type(source_ptr.dtype.element_ty))
    tl.store(host_ptr + offsets, values, mask=mask)


def copy_to_host(source: torch.Tensor, host: torch.Tensor) -> None:
    """Queue on the current stream the write of ``source`` (contiguous, on the kernels'
    device) into ``host`` (contiguous, same dtype and number of elements; pinned host
    memory on CUDA). Raises ValueError on a mismatch."""
    check_kernel_device("source", source, _copy_to_host_kernel)
    if host.device.type != "cpu":
        raise ValueError(f"host must be a host tensor, got one on {host.device}")
    if source.dtype != host.dtype:
        raise ValueError(f"source is {source.dtype} but host is {host.dtype}")
    if source.numel() != host.numel():
        raise ValueError(f"source has {source.numel()} elements but host {host.numel()}")
    if not (source.is_contiguous() and host.is_contiguous()):
        raise ValueError("source and host must be contiguous")
    if source.device.type == "cuda" and not host.is_pinned():
        raise ValueError("host must be pinned memory: the device writes it through its mapping")
    num_elements = source.numel()
    if num_elements == 0:
        return
    _copy_to_host_kernel[(triton.cdiv(num_elements, _BLOCK),)](
        source, host.data_ptr(), num_elements, BLOCK=_BLOCK, num_warps=4
    )
