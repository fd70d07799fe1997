"""The model runner of one pipeline stage.

It is the engine's `ModelRunner` (inputs, paged attention, connector hooks,
sampling) over a `PipelineStageModel`, with three changes: a later stage takes its
input hidden states from the previous stage instead of embedding tokens; a stage
that is not last sends its output hidden states on instead of sampling; and a
request whose load stopped early on an earlier stage is treated here as failed
too (nothing saved, the smaller valid length reported), so every stage agrees on
one mask before the engine uses a token of that request.
"""

from __future__ import annotations

import torch

from connector.base import KVConnectorWorker
from engine.config import ModelConfig
from engine.model_runner import ModelRunner
from engine.pipeline.comm import StageLink
from engine.pipeline.failure import breaks_group
from engine.pipeline.layer_split import StageLayout
from engine.pipeline.messages import merge_load_failures
from engine.pipeline.stage_model import PipelineStageModel
from engine.runner_output import RunnerOutput
from engine.scheduler import SchedulerOutput
from engine.step_inputs import HostInputs


class UpstreamStageError(RuntimeError):
    """An earlier stage's step failed: this stage ends its step too."""


class StageRunner(ModelRunner):
    """Called by its stage's process once per step (`execute_stage`). No CUDA graphs:
    a stage's forward is bracketed by host-side sends and receives."""

    def __init__(
        self,
        model: PipelineStageModel,
        config: ModelConfig,
        layout: StageLayout,
        link: StageLink | None,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        connector: KVConnectorWorker | None,
    ) -> None:
        # the KV tensor and the connector hold this stage's layers only
        stage_config = _with_num_layers(config, layout.num_layers)
        # Later stages get `StageRequest`s, not the scheduler's requests: they build their
        # inputs from the plan each step (the persistent batch reads request histories).
        super().__init__(
            model,
            stage_config,
            num_blocks,
            block_size,
            device,
            dtype,
            connector,
            persistent_batch=layout.is_first,
        )
        self.layout = layout
        self.link = link
        self._step_id = -1
        self._request_ids: list[str] = []
        self._upstream_failures: dict[str, int] = {}
        self._sent = False
        self._received = False
        #: last stage: the generators of seeded requests, kept across steps until they finish
        self._request_id_to_generator: dict[str, torch.Generator] = {}

    def execute_stage(self, plan: SchedulerOutput, step_id: int) -> RunnerOutput:
        """Run this stage's part of one step; a stage before the last sends its hidden
        states (or, when the step fails here or upstream, an error) to the next stage.
        The output's `load_failures` cover this stage and every earlier one."""
        self._step_id = step_id
        self._request_ids = [r.request_id for r in plan.requests]
        self._upstream_failures = {}
        self._sent = False
        self._received = False
        if self.layout.is_last:
            self._bind_generators(plan)
        try:
            output = self.execute(plan)
        except BaseException as error:
            # (a group out of step is torn down instead: its links may never answer)
            if plan.requests and not breaks_group(error):
                # keep the links in step: take what the previous stage sends for this step,
                # and tell the next one that no hidden states come
                if not self.layout.is_first and not self._received:
                    self.link.receive(step_id, self._request_ids)
                if not self.layout.is_last and not self._sent:
                    self.link.send(step_id, self._request_ids, None, self._upstream_failures)
            raise
        output.load_failures = merge_load_failures(self._upstream_failures, output.load_failures)
        return output

    def _bind_generators(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self._request_id_to_generator.pop(request_id, None)
        for request in plan.requests:
            seed = request.sampling_params.seed
            if seed is None or request.generator is not None:
                continue  # the first stage's own request objects carry their generator
            generator = self._request_id_to_generator.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(seed)
                self._request_id_to_generator[request.request_id] = generator
            request.generator = generator

    def _prepare(self, plan: SchedulerOutput) -> tuple[HostInputs, list[int]]:
        host, logits_rows = super()._prepare(plan)
        if not self.layout.is_last:
            logits_rows = [-1] * len(logits_rows)  # only the last stage samples
        return host, logits_rows

    def _run_model(self, plan: SchedulerOutput, host: HostInputs) -> torch.Tensor:
        """Receive (later stages), run this stage's layers, send on (earlier stages).
        Runs after the connector started its loads and before it queues its saves."""
        connector = self.connector
        if not self.layout.is_first:
            received = self.link.receive(self._step_id, self._request_ids)
            self._received = True
            self._upstream_failures = received.load_failures
            if not received.ok:
                raise UpstreamStageError(f"an earlier pipeline stage failed step {self._step_id}")
            if connector is not None and received.load_failures:
                connector.add_load_failures(received.load_failures)
            self.model.input_hidden = received.hidden
        hidden = super()._run_model(plan, host)
        if not self.layout.is_last:
            own_failures = connector.load_failures() if connector is not None else {}
            failures = merge_load_failures(self._upstream_failures, own_failures)
            self.link.send(self._step_id, self._request_ids, hidden, failures)
            self._sent = True
        return hidden


def _with_num_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, num_layers=num_layers)
