"""The model runner of one tensor-parallel rank.

It is a pipeline stage's `StageRunner` (every layer when there is one stage: inputs,
paged attention over the rank's KV heads, connector hooks, sampling) over a
`TensorParallelStageModel`, run eagerly, with three changes:
- before the forward pass every rank agrees on the step (`TensorParallelGroup.agree`):
  a rank whose step failed before its forward says so and every rank ends the step;
  the load failures of every rank are merged into one mask, so a chunk is a hit only
  when every rank had its shard, no rank saves a request whose load stopped early on
  any rank, and every rank reports (and the engine recomputes) the same tokens;
- the input ids come from rank 0 (`broadcast_from_first_`): the other ranks hold no
  token history, and with async scheduling only rank 0 has the previous step's
  samples;
- only rank 0 samples; the others join the logits gather with the same rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.pipeline.failure import mark_breaks_group
from engine.pipeline.stage_runner import StageRunner
from engine.runner_output import RunnerOutput
from engine.scheduler import SchedulerOutput
from engine.spec_decode.verify import draft_layout
from engine.step_inputs import HostInputs
from engine.tensor_parallel.comm import TensorParallelGroup


class PeerRankError(RuntimeError):
    """Another rank failed this step before its forward pass: this rank ends it too."""

    #: the executor raises the failing rank's own error instead
    failed_elsewhere = True


class TensorParallelSteps:
    """The tensor-parallel part of a runner, mixed into `StageRunner` (a pipeline stage's
    layers, every layer when there is one stage). Called once per step on every rank of the
    group with the same plan; `tp_init` first, once."""

    def tp_init(self, group: TensorParallelGroup, embeds_tokens: bool) -> None:
        self.group = group
        #: the model embeds input ids (not a later pipeline stage): they come from rank 0
        self.embeds_tokens = embeds_tokens
        self._agreed = False
        #: ranks after the first: the rows whose logits rank 0 gathers this step
        self._logits_rows: list[int] = []

    def execute(
        self, plan: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """One step on this rank (`ModelRunner.execute`). A rank whose step fails before the
        agreement still joins it (saying so), so no rank waits for it there, and the engine
        may retry the step. A failure after it (inside the forward pass, or anywhere before
        the step's last collective) leaves the others waiting in a collective: the error is
        marked `breaks_group` (engine.pipeline.failure) and the process group is torn down
        (the engine's process stops, another rank's process records it and exits)."""
        self._agreed = False
        try:
            return super().execute(plan, while_device_runs)
        except BaseException as error:
            if plan.requests and not self._agreed:
                self._agreed = True
                self.group.agree([r.request_id for r in plan.requests], False, {})
            elif self._agreed and not isinstance(error, PeerRankError):
                mark_breaks_group(error)
            raise

    def _graphs_for(self, plan, host):
        return None  # eager: collectives run between the layers

    def _prepare(self, plan: SchedulerOutput) -> tuple[HostInputs, list[int]]:
        host, logits_rows = super()._prepare(plan)
        if self.group.rank == 0:
            return host, logits_rows
        # no token history here: the input ids come from rank 0 (`_fill_missing_input_ids`)
        host.input_ids = np.zeros(len(host.positions), dtype=np.int64)
        host.missing_indices = np.zeros(0, dtype=np.int64)
        host.missing_request_ids = ()
        rows = [row for row in logits_rows if row >= 0]
        if rows and plan.request_id_to_spec_token_ids:
            rows += draft_layout(plan.requests, plan.request_id_to_spec_token_ids, logits_rows).draft_rows
        self._logits_rows = rows
        return host, [-1] * len(logits_rows)  # only rank 0 samples

    def _run_model(self, plan: SchedulerOutput, host: HostInputs) -> torch.Tensor:
        connector = self.connector
        own = connector.load_failures() if connector is not None else {}
        request_ids = [r.request_id for r in plan.requests]
        self._agreed = True
        agreement = self.group.agree(request_ids, True, own)
        if not agreement.ok:
            raise PeerRankError("another tensor-parallel rank failed this step before its forward pass")
        if connector is not None and agreement.load_failures:
            connector.add_load_failures(agreement.load_failures)
        hidden = super()._run_model(plan, host)
        if self.group.rank != 0 and self._logits_rows:
            rows = torch.tensor(self._logits_rows, device=hidden.device)
            self.model.compute_logits(hidden[rows])  # joins rank 0's gather
        return hidden

    def _fill_missing_input_ids(self, host: HostInputs, input_ids: torch.Tensor) -> None:
        if self.group.rank == 0:
            super()._fill_missing_input_ids(host, input_ids)
        if self.embeds_tokens:
            self.group.broadcast_from_first_(input_ids)


class TensorParallelStageRunner(TensorParallelSteps, StageRunner):
    """A rank of a pipeline stage: `StageRunner` (hidden states from the previous stage's
    rank of the same number, sent on to the next stage's) whose layers are sharded. The
    engine's process runs stage 0's rank 0; with one stage, every rank runs every layer."""

    def __init__(self, model, config, layout, link, *args, group: TensorParallelGroup, **kwargs) -> None:
        super().__init__(model, config, layout, link, *args, **kwargs)
        if group.rank != 0 and self.input_batch is not None:
            self.input_batch = None  # only the engine's process holds the requests
        self.tp_init(group, embeds_tokens=layout.is_first)
