"""The collectives of one engine's tensor-parallel ranks, over their own process group
(never the process-global default group: two engines may run in one process).

Every rank calls the same collectives in the same order each step: the step's
agreement (`agree`: did every rank get here, and the merged load failures), the input
ids (`broadcast_from_first`), one all-reduce per row-parallel layer and per embedding,
and the gather of the logits to rank 0. With NCCL the tensors stay on the device;
with gloo they go through host memory (ranks that share one GPU, or CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.pipeline.failure import run_collective

#: a request's entry in the agreement when its loads did not stop early on a rank
_NO_FAILURE = torch.iinfo(torch.int64).max


class StepAgreement(NamedTuple):
    """What every rank learns before a step's forward pass."""

    #: False when some rank failed the step before its forward pass: every rank ends it
    ok: bool
    #: request id -> leading tokens truly in the cache on every rank (the smallest count)
    load_failures: dict[str, int]


class TensorParallelGroup:
    """One rank's end of the group. Used by one thread of its process."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int, backend: str) -> None:
        self.group = group
        self.rank = rank
        self.size = size
        self.backend = backend

    def _to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        # gloo moves host tensors; NCCL device tensors
        if self.backend == "gloo" and tensor.device.type != "cpu":
            return tensor.cpu()
        return tensor

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        wire = self._to_wire(tensor)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        run_collective(self.group.allreduce, [wire], opts)
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def broadcast_from_first_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's ``tensor`` (same shape and dtype), in place."""
        wire = self._to_wire(tensor)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        run_collective(self.group.broadcast, [wire], opts)
        if wire is not tensor:
            tensor.copy_(wire)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (same shape on every rank) as a list on rank 0, in
        rank order, on ``tensor``'s device; None on the other ranks."""
        wire = self._to_wire(tensor.contiguous())
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            outputs = [torch.empty_like(wire) for _ in range(self.size)]
            run_collective(self.group.gather, [outputs], [wire], opts)
            return [output.to(tensor.device) for output in outputs]
        run_collective(self.group.gather, [], [wire], opts)
        return None

    def agree(self, request_ids: list[str], ok: bool, load_failures: dict[str, int]) -> StepAgreement:
        """Called by every rank once per step with requests, after its connector planned its
        loads and before its forward pass (or, when its step failed before that, with ``ok``
        False): one all-reduce (MIN) of ``[ok, valid tokens of each request]``."""
        values = [1 if ok else 0] + [load_failures.get(r, _NO_FAILURE) for r in request_ids]
        tensor = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        if self.backend == "nccl":
            tensor = tensor.cuda()
        run_collective(self.group.allreduce, [tensor], opts)
        merged = tensor.tolist()
        failures = {
            request_id: num_valid
            for request_id, num_valid in zip(request_ids, merged[1:], strict=True)
            if num_valid != _NO_FAILURE
        }
        return StepAgreement(merged[0] == 1, failures)
