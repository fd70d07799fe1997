"""What the first process sends each later stage per step, and what comes back.

A plan crosses a process boundary as plain data: `StageRequest` carries exactly what
a stage's model runner reads of a request (positions, block table, sampling params),
never the scheduler's `Request` (its token history, generator, bookkeeping). Later
stages never embed tokens, so no token ids travel but the connector's own (its load
and save specs name the tokens whose chunks they move). Slot maps travel as numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from connector.base import ConnectorMetadata, LoadSpec, SaveSpec
from engine.config import SamplingParams
from engine.scheduler import SchedulerOutput


class AbsentTokenIds:
    """`all_token_ids` of a request on a stage after the first: the model runner slices
    it to build input ids, which such a stage never embeds (it starts from the previous
    stage's hidden states). Every slice is empty."""

    def __getitem__(self, index: slice) -> list[int]:
        return []


_ABSENT_TOKEN_IDS = AbsentTokenIds()


@dataclass
class StageRequest:
    """The fields of `engine.request.Request` that `ModelRunner` reads in one step."""

    request_id: str
    num_computed_tokens: int
    num_tokens: int
    num_cached_blocks: int
    block_ids: list[int]
    sampling_params: SamplingParams
    #: set by the last stage from its own per-request generators (seeded sampling)
    generator: torch.Generator | None = None
    #: tokens sampled by steps still in flight (async scheduling: 0 with pipeline stages,
    #: whose micro-batches hold disjoint requests; a tensor-parallel rank needs it to find
    #: the rows that sample)
    num_output_placeholders: int = 0

    @property
    def all_token_ids(self) -> AbsentTokenIds:
        return _ABSENT_TOKEN_IDS


@dataclass
class StagePlan:
    """One step's plan for a stage after the first (see `to_stage_plan`)."""

    step_id: int
    requests: list[StageRequest]
    num_scheduled_tokens: list[int]
    preempted_request_ids: list[str]
    finished_request_ids: set[str]
    request_id_to_spec_token_ids: dict[str, list[int]]
    #: ConnectorMetadata with numpy slot maps; None without offload
    connector_meta: ConnectorMetadata | None = None

    def to_scheduler_output(self) -> SchedulerOutput:
        """The plan as the stage's model runner takes it (slot maps back to tensors)."""
        meta = self.connector_meta
        if meta is not None:
            meta = ConnectorMetadata(
                loads=[s._replace(slot_mapping=torch.from_numpy(s.slot_mapping)) for s in meta.loads],
                saves=[s._replace(slot_mapping=torch.from_numpy(s.slot_mapping)) for s in meta.saves],
            )
        return SchedulerOutput(
            requests=self.requests,  # type: ignore[arg-type] - duck-typed Request
            num_scheduled_tokens=self.num_scheduled_tokens,
            preempted_request_ids=self.preempted_request_ids,
            finished_request_ids=self.finished_request_ids,
            connector_meta=meta,
            request_id_to_spec_token_ids=self.request_id_to_spec_token_ids,
        )


def to_stage_plan(plan: SchedulerOutput, step_id: int) -> StagePlan:
    """Called by the first process once per step for the later stages."""
    meta = plan.connector_meta
    if meta is not None:
        if meta.fetches:
            raise RuntimeError("background fetches are not planned with pipeline parallelism")
        meta = ConnectorMetadata(
            loads=[_with_numpy_slots(s) for s in meta.loads],
            saves=[_with_numpy_slots(s) for s in meta.saves],
        )
    return StagePlan(
        step_id=step_id,
        requests=[
            StageRequest(
                request_id=r.request_id,
                num_computed_tokens=r.num_computed_tokens,
                num_tokens=r.num_tokens,
                num_cached_blocks=r.num_cached_blocks,
                block_ids=list(r.block_ids),
                sampling_params=r.sampling_params,
                num_output_placeholders=r.num_output_placeholders,
            )
            for r in plan.requests
        ],
        num_scheduled_tokens=list(plan.num_scheduled_tokens),
        preempted_request_ids=list(plan.preempted_request_ids),
        finished_request_ids=set(plan.finished_request_ids),
        request_id_to_spec_token_ids={k: list(v) for k, v in plan.request_id_to_spec_token_ids.items()},
        connector_meta=meta,
    )


def _with_numpy_slots(spec: LoadSpec | SaveSpec) -> LoadSpec | SaveSpec:
    return spec._replace(
        token_ids=tuple(spec.token_ids),
        slot_mapping=np.asarray(spec.slot_mapping.cpu().numpy(), dtype=np.int64),
    )


@dataclass
class StageReply:
    """A later stage's answer to one plan. `error` set: the step failed there (or
    upstream); the stage ended its connector's step and waits for the next plan."""

    step_id: int
    error: str | None = None
    #: last stage only: sampled tokens and accepted drafts
    request_id_to_token: dict[str, int] = field(default_factory=dict)
    request_id_to_accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    #: request id -> leading tokens truly in the cache, over this stage and every earlier one
    load_failures: dict[str, int] = field(default_factory=dict)


def merge_load_failures(*failure_maps: dict[str, int]) -> dict[str, int]:
    """One consistent mask: a request that failed on any stage keeps the fewest valid tokens."""
    merged: dict[str, int] = {}
    for failures in failure_maps:
        for request_id, num_valid in failures.items():
            merged[request_id] = min(num_valid, merged.get(request_id, num_valid))
    return merged
