"""Decoder layers whose weights live in CPU memory (`EngineArgs.cpu_offload_gb`) and are
streamed to the device one layer ahead of the compute, so a model larger than the
GPU's free memory runs at the speed the host→device link allows.

Which layers: the last ones. The copies of the first two offloaded layers then start
at the top of the forward pass and overlap the resident layers' compute; offloading
the first layers would put the first copy on every pass's critical path (or need a
prefetch issued outside the pass, i.e. state across steps). And every pass is
self-contained: the copy stream forks from the compute stream when the pass begins
and is joined by the last offloaded layer, so a pass can be captured into a CUDA
graph as it is (the decode graphs replay the copies; nothing runs on the host).

How: each offloaded layer's parameters are packed into one flat pinned host buffer
(one host→device copy per layer). A ring of `NUM_RING_SLOTS` flat device buffers
holds the layers being computed: offloaded layer j reads its parameters from slot
j % NUM_RING_SLOTS (its `nn.Parameter`s are views into that slot, fixed once, so the
model code is unchanged). Forward hooks on the layers drive the copies: the first
layer's pre-hook starts the copies of the first offloaded layers, an offloaded
layer's pre-hook makes the compute stream wait for its copy, and its post-hook lets
the copy of layer j + NUM_RING_SLOTS into the same slot start once layer j's kernels
are done. Device memory for offloaded layers is thus bounded by two layers.

On CPU (`device="cpu"`) the same code runs: the "device" slots are other CPU tensors
and each copy is synchronous, so CI exercises the bookkeeping.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig, check_cpu_offload_gb
from engine.models.llama import LlamaFamilyForCausalLM

logger = logging.getLogger(__name__)

GIB = 1 << 30
#: device buffers for offloaded layers: the one being computed and the one being copied
NUM_RING_SLOTS = 2
#: byte alignment of each parameter inside a packed layer (GEMM kernels want aligned rows)
_PARAM_ALIGN = 256


@dataclass(frozen=True)
class WeightOffloadPlan:
    """Which decoder layers live in CPU memory."""

    #: the offloaded layers, ascending (always the last layers of the model)
    offloaded_layer_ids: tuple[int, ...]
    #: parameter bytes of one decoder layer in the engine's dtype
    bytes_per_layer: int
    #: parameter bytes of the whole model (embeddings, layers, norm, LM head)
    model_bytes: int

    @property
    def num_offloaded_bytes(self) -> int:
        return len(self.offloaded_layer_ids) * self.bytes_per_layer


def plan_weight_offload(config: ModelConfig, dtype: torch.dtype, cpu_offload_gb: float) -> WeightOffloadPlan:
    """The most whole layers whose parameters fit in `cpu_offload_gb` GiB, taken from the
    last layer backwards. Called once at engine start, before any weight is allocated.

    Raises ValueError when `cpu_offload_gb` is not a number >= 0, is more than the model's
    weights, or is above 0 but smaller than one decoder layer (nothing would be offloaded)."""
    check_cpu_offload_gb(cpu_offload_gb)
    with torch.device("meta"):
        meta_model = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    model_bytes = _param_bytes(meta_model)
    bytes_per_layer = _param_bytes(meta_model.model.layers[0])
    requested_bytes = round(cpu_offload_gb * GIB)
    if requested_bytes > model_bytes:
        raise ValueError(
            f"cpu_offload_gb={cpu_offload_gb} is more than the model's weights "
            f"({model_bytes / GIB:.4g} GiB in {dtype})"
        )
    num_layers = min(requested_bytes // bytes_per_layer, config.num_layers)
    if requested_bytes > 0 and num_layers == 0:
        raise ValueError(
            f"cpu_offload_gb={cpu_offload_gb} is less than one decoder layer "
            f"({bytes_per_layer / GIB:.4g} GiB in {dtype}); whole layers are offloaded"
        )
    first = config.num_layers - num_layers
    return WeightOffloadPlan(tuple(range(first, config.num_layers)), bytes_per_layer, model_bytes)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def materialize(model: nn.Module, device: torch.device, cpu_layer_ids: Sequence[int]) -> None:
    """Allocate (uninitialised) the meta `model`'s parameters and buffers: the decoder
    layers in `cpu_layer_ids` in CPU memory, everything else on `device`. Called once by
    the loader, so offloaded layers never take device memory."""
    cpu_prefixes = tuple(f"model.layers.{i}" for i in cpu_layer_ids)
    cpu = torch.device("cpu")
    for name, module in model.named_modules():
        on_cpu = any(name == p or name.startswith(p + ".") for p in cpu_prefixes)
        module.to_empty(device=cpu if on_cpu else device, recurse=False)


@dataclass(frozen=True)
class _ParamSlot:
    module_name: str
    param_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    num_bytes: int


def _layer_layout(layer: nn.Module) -> tuple[list[_ParamSlot], int]:
    """Where each parameter of `layer` goes in its packed buffer -> (slots, total bytes)."""
    slots, offset = [], 0
    for module_name, module in layer.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            num_bytes = param.numel() * param.element_size()
            slots.append(
                _ParamSlot(module_name, param_name, tuple(param.shape), param.dtype, offset, num_bytes)
            )
            offset += -(-num_bytes // _PARAM_ALIGN) * _PARAM_ALIGN
    return slots, offset


def _view(buffer: torch.Tensor, slot: _ParamSlot) -> torch.Tensor:
    """The parameter `slot` inside the flat uint8 `buffer`."""
    return buffer[slot.offset : slot.offset + slot.num_bytes].view(slot.dtype).view(slot.shape)


def _allocate_host_buffers(num_buffers: int, num_bytes: int, *, pin: bool) -> list[torch.Tensor]:
    """`num_buffers` flat uint8 host buffers of `num_bytes` each. Pinned, they come from
    torch's caching host allocator, which rounds every allocation up to a power of two:
    one allocation sliced into all of them is taken when it wastes less than one each
    (8 GiB instead of 9.5 GiB for 19 bf16 Llama-3.1-8B layers of 416 MiB)."""
    if not pin:
        return [torch.empty(num_bytes, dtype=torch.uint8) for _ in range(num_buffers)]
    if pin_as_one_allocation(num_buffers, num_bytes):
        whole = torch.empty(num_buffers * num_bytes, dtype=torch.uint8, pin_memory=True)
        return [whole[i * num_bytes : (i + 1) * num_bytes] for i in range(num_buffers)]
    return [torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)]


def pin_as_one_allocation(num_buffers: int, num_bytes: int) -> bool:
    """Whether one pinned allocation for all buffers wastes less than one per buffer."""
    return _next_power_of_two(num_buffers * num_bytes) <= num_buffers * _next_power_of_two(num_bytes)


def _next_power_of_two(n: int) -> int:
    return 1 << (n - 1).bit_length()


class WeightOffloader:
    """Owns the packed host copies of the offloaded layers, the device ring and the
    forward hooks that stream one into the other. Built once by the loader after the
    weights are final (projections fused); lives as long as the model.

    `layers` are the decoder layers in execution order (a forward pass runs them all,
    first to last); `offloaded_layer_ids` index into it and must be a run of layers
    of one parameter layout. The parameters of those layers must be in CPU memory; they
    are moved into the packed buffers and replaced by views into the ring."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        offloaded_layer_ids: Sequence[int],
        device: torch.device,
        *,
        num_ring_slots: int = NUM_RING_SLOTS,
    ) -> None:
        if not offloaded_layer_ids:
            raise ValueError("no layer to offload")
        if num_ring_slots < 1:
            raise ValueError(f"num_ring_slots must be >= 1, got {num_ring_slots}")
        self.device = device
        self.offloaded_layer_ids = tuple(offloaded_layer_ids)
        offloaded = [layers[i] for i in self.offloaded_layer_ids]
        self._layout, self.bytes_per_slot = _layer_layout(offloaded[0])
        for layer_id, layer in zip(self.offloaded_layer_ids, offloaded, strict=True):
            layout, _ = _layer_layout(layer)
            if layout != self._layout:
                raise ValueError(
                    f"layer {layer_id} has another parameter layout than layer {self.offloaded_layer_ids[0]}"
                )
            if any(p.device.type != "cpu" for p in layer.parameters()):
                raise ValueError(f"layer {layer_id}'s parameters must be in CPU memory to be offloaded")
        self._on_cuda = device.type == "cuda"
        num_slots = min(num_ring_slots, len(offloaded))
        #: the device ring: offloaded layer j computes from slot j % num_slots
        self.ring = [
            torch.empty(self.bytes_per_slot, dtype=torch.uint8, device=device) for _ in range(num_slots)
        ]
        #: one packed (pinned on CUDA) host buffer per offloaded layer
        self.host_buffers = _allocate_host_buffers(len(offloaded), self.bytes_per_slot, pin=self._on_cuda)
        for j, layer in enumerate(offloaded):
            host = self.host_buffers[j]
            slot_buffer = self.ring[j % num_slots]
            modules = dict(layer.named_modules())
            with torch.no_grad():
                for slot in self._layout:
                    module = modules[slot.module_name]
                    _view(host, slot).copy_(getattr(module, slot.param_name))
                    # the CPU original is dropped: the layer now reads its ring slot
                    module._parameters[slot.param_name] = nn.Parameter(
                        _view(slot_buffer, slot), requires_grad=False
                    )
        self._copy_stream = torch.cuda.Stream(device) if self._on_cuda else None
        #: per pass: the event each offloaded layer's copy records (CUDA)
        self._copy_done: list[torch.cuda.Event | None] = [None] * len(offloaded)
        #: layer copies issued so far (one per offloaded layer per eager pass; a CUDA
        #: graph replay copies without calling back)
        self.num_layer_copies = 0
        self._hooks = [layers[0].register_forward_pre_hook(lambda _module, _args: self._begin_pass())]
        for j, layer in enumerate(offloaded):
            self._hooks.append(layer.register_forward_pre_hook(self._pre_hook(j)))
            self._hooks.append(layer.register_forward_hook(self._post_hook(j)))
        logger.info(
            "weight offload: layers %d-%d (%.3f GiB) in %s CPU memory, a ring of %d device buffers (%.3f GiB)",
            self.offloaded_layer_ids[0],
            self.offloaded_layer_ids[-1],
            self.num_offloaded_bytes / GIB,
            "pinned" if self._on_cuda else "plain",
            num_slots,
            self.num_ring_bytes / GIB,
        )

    @property
    def num_offloaded_bytes(self) -> int:
        """Bytes of the packed host buffers (parameters plus alignment padding)."""
        return len(self.host_buffers) * self.bytes_per_slot

    @property
    def num_ring_bytes(self) -> int:
        """Device bytes the offloaded layers take: the ring."""
        return len(self.ring) * self.bytes_per_slot

    def _pre_hook(self, j: int):
        return lambda _module, _args: self._wait_for_copy(j)

    def _post_hook(self, j: int):
        return lambda _module, _args, _output: self._after_layer(j)

    def _begin_pass(self) -> None:
        """Top of a forward pass: start the copies of the first offloaded layers."""
        if self._on_cuda:
            # The ring is free once the kernels queued so far (the previous pass) ran; in
            # a graph capture this wait is what joins the copy stream to the capture.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        for j in range(min(len(self.ring), len(self.host_buffers))):
            self._start_copy(j)

    def _start_copy(self, j: int) -> None:
        """Copy offloaded layer j into its ring slot (on the copy stream on CUDA)."""
        slot_buffer = self.ring[j % len(self.ring)]
        if self._on_cuda:
            with torch.cuda.stream(self._copy_stream):
                slot_buffer.copy_(self.host_buffers[j], non_blocking=True)
                # a fresh event per pass: events recorded inside a graph capture are not reused
                done = torch.cuda.Event()
                done.record(self._copy_stream)
            self._copy_done[j] = done
        else:
            slot_buffer.copy_(self.host_buffers[j])
        self.num_layer_copies += 1

    def _wait_for_copy(self, j: int) -> None:
        """Before offloaded layer j runs: its weights must have arrived."""
        if self._on_cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copy_done[j])
            self._copy_done[j] = None

    def _after_layer(self, j: int) -> None:
        """After offloaded layer j's kernels are queued: its slot takes layer j + ring size
        once they ran."""
        following = j + len(self.ring)
        if following >= len(self.host_buffers):
            return
        if self._on_cuda:
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.device))
            self._copy_stream.wait_event(computed)
        self._start_copy(following)

    def time_all_copies(self, num_repeats: int = 3) -> float:
        """Seconds to copy every offloaded layer host→device back to back (best of
        `num_repeats`): the lower bound of a pass's time when the copies dominate.
        Benchmarks only; must not run during a forward pass (it overwrites the ring)."""
        best = math.inf
        for _ in range(num_repeats):
            if self._on_cuda:
                stream = self._copy_stream
                stream.wait_stream(torch.cuda.current_stream(self.device))
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    for j, host in enumerate(self.host_buffers):
                        self.ring[j % len(self.ring)].copy_(host, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            else:
                began = time.perf_counter()
                for j, host in enumerate(self.host_buffers):
                    self.ring[j % len(self.ring)].copy_(host)
                best = min(best, time.perf_counter() - began)
        return best
