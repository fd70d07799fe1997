"""The model runner of one pipeline stage.

It is the engine's `ModelRunner` (inputs, paged attention, connector hooks,
sampling) over a `PipelineStageModel`, with three changes: a later stage takes its
input hidden states from the previous stage instead of embedding tokens; a stage
that is not last sends its output hidden states on instead of sampling; and a
request whose load stopped early on an earlier stage is treated here as failed
too (nothing saved, the smaller valid length reported), so every stage agrees on
one mask before the engine uses a token of that request.

On CUDA a stage captures its decode and mixed graphs over its own layers, as a
one-stage engine does (issue 34: eager stages decoded 4.7x slower than one GPU). The
receive and send stay outside the graph: a later stage's graph reads its input hidden
states from a static buffer the received ones are copied into before the replay, and
a stage sends a copy of the graph's output (the next replay overwrites it).
"""

from __future__ import annotations

import numpy as np
import torch

from connector.base import KVConnectorWorker
from engine.config import ModelConfig
from engine.cuda_graphs import GraphSizes
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
    """Called by its stage's process once per step (`execute_stage`)."""

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
        *,
        graph_sizes: GraphSizes | None = None,
    ) -> None:
        """`graph_sizes` (CUDA; None: eager) as the engine's own runner takes them, unless
        this stage's RoPE depends on the sequence length (it reads the host)."""
        # the KV tensor and the connector hold this stage's layers only
        stage_config = _with_num_layers(config, layout.num_layers)
        # set before the base class captures graphs: the capture's forward reads them
        self.layout = layout
        #: a later stage's graph input: the received hidden states are copied in here
        self._graph_hidden: torch.Tensor | None = None
        #: whether this step replays a graph (its output is then copied before it is sent)
        self._replaying = False
        if graph_sizes is not None and model.rotary is not None and model.rotary.depends_on_length:
            graph_sizes = None
        if graph_sizes is not None and not layout.is_first:
            num_rows = max(graph_sizes.max_batch_size, graph_sizes.max_graph_tokens)
            self._graph_hidden = torch.zeros(num_rows, config.hidden_size, dtype=dtype, device=device)
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
            cuda_graph_max_batch_size=graph_sizes.max_batch_size if graph_sizes is not None else 0,
            max_graph_tokens=graph_sizes.max_graph_tokens if graph_sizes is not None else 0,
            max_num_seqs=graph_sizes.max_num_seqs if graph_sizes is not None else 256,
            max_model_len=graph_sizes.max_model_len if graph_sizes is not None else 0,
            persistent_batch=layout.is_first,
        )
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
        if not self.layout.is_first and len(host.input_ids) != len(host.positions):
            # a later stage has no token ids (it starts from hidden states): zeros give the
            # step its token count, which the graphs' buffers and buckets go by
            host.input_ids = np.zeros(len(host.positions), dtype=np.int64)
        if not self.layout.is_last:
            logits_rows = [-1] * len(logits_rows)  # only the last stage samples
        return host, logits_rows

    def _forward_with_metadata(self, input_ids, positions, metadata) -> torch.Tensor:
        self._feed_capture(input_ids.shape[0])
        return super()._forward_with_metadata(input_ids, positions, metadata)

    def _forward_waiting_per_layer(self, input_ids, positions, metadata) -> torch.Tensor:
        self._feed_capture(input_ids.shape[0])
        return super()._forward_waiting_per_layer(input_ids, positions, metadata)

    def _feed_capture(self, num_tokens: int) -> None:
        """A later stage's forward without received hidden states is a graph's capture
        (or its warm-up): it reads the static buffer the replays are fed through."""
        if self._graph_hidden is not None and self.model.input_hidden is None:
            self.model.input_hidden = self._graph_hidden[:num_tokens]

    def _graphs_for(self, plan: SchedulerOutput, host: HostInputs):
        """The base class's choice; for a replay on a later stage the received hidden
        states move into the graph's input buffer (on the stream, before the replay)."""
        graphs = super()._graphs_for(plan, host)
        self._replaying = graphs is not None
        if graphs is not None and self._graph_hidden is not None:
            received, self.model.input_hidden = self.model.input_hidden, None
            if received is None:
                raise RuntimeError("a later pipeline stage replays a graph without input hidden states")
            self._graph_hidden[: received.shape[0]].copy_(received, non_blocking=True)
        return graphs

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
        if self._replaying and not self.layout.is_last:
            hidden = hidden.clone()  # a view of the graph's output: the next replay writes it
        if not self.layout.is_last:
            own_failures = connector.load_failures() if connector is not None else {}
            failures = merge_load_failures(self._upstream_failures, own_failures)
            self.link.send(self._step_id, self._request_ids, hidden, failures)
            self._sent = True
        return hidden


def _with_num_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(config, num_layers=num_layers)
