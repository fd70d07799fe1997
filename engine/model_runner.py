"""The model runner: owns the weights and the one KV tensor, turns a scheduler
plan into flat model inputs (engine.step_inputs), runs the forward pass through paged
attention and samples (drafts verified by engine.spec_decode.verify). Called by the
engine core once per step.

KV tensor: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`;
layer l uses the view `kv_cache[l]`; slot = block_id * block_size + offset.
Attention goes through `kernels` on CUDA and `kernels.reference` on CPU.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

import torch

from connector.base import KVConnectorWorker
from engine import attention
from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.cuda_graphs import DecodeGraphs
from engine.host_copy import host_to_device
from engine.host_readback import HostReadback
from engine.input_batch import InputBatch
from engine.mixed_graphs import MixedGraphs
from engine.models.llama import LlamaFamilyForCausalLM, fuse_rotary_into_attention
from engine.runner_output import RunnerOutput
from engine.sampler import sample_on_device
from engine.scheduler import SchedulerOutput
from engine.spec_decode.verify import draft_layout, verify_layout
from engine.step_future import DeviceTimeline, StepFuture
from engine.step_inputs import HostInputs, build_host_inputs, gather_host_inputs
from kernels.rotary_cache import rotary_and_cache

logger = logging.getLogger(__name__)


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element_size


class ModelRunner:
    def __init__(
        self,
        model: LlamaFamilyForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        connector: KVConnectorWorker | None = None,
        *,
        cuda_graph_max_batch_size: int = 0,
        max_graph_tokens: int = 0,
        max_num_seqs: int = 256,
        max_model_len: int = 0,
        persistent_batch: bool = True,
        deterministic: bool = False,
    ) -> None:
        """`cuda_graph_max_batch_size` > 0 (CUDA only) captures decode graphs for up to
        that many sequences, with block tables wide enough for `max_model_len` tokens.
        `max_graph_tokens` > 0 (CUDA only) captures graphs for the other steps of up to
        that many new tokens over up to `max_num_seqs` sequences (engine.mixed_graphs).
        `persistent_batch` keeps each running request's row across steps
        (engine.input_batch); off, every step builds its inputs from the requests.
        `deterministic` (a model made batch-invariant by engine.deterministic): one
        attention kernel for every step kind, sampling row by row."""
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.connector = connector
        self.scale = config.head_dim**-0.5
        self.dtype = dtype
        self.deterministic = deterministic
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._on_cuda = device.type == "cuda"
        if self._on_cuda:
            from kernels import reshape_and_cache

            self._paged_attention = None  # engine.attention picks the kernel per sequence
            if not deterministic:
                # layers with the one-launch RoPE hand it to `_attention`'s cache write
                fuse_rotary_into_attention(model)
        else:
            from kernels.reference import paged_attention_ref
            from kernels.reference import reshape_and_cache_ref as reshape_and_cache

            self._paged_attention = paged_attention_ref
            if deterministic:
                from engine.deterministic import attention_fn

                self._paged_attention = attention_fn(device)
        self._reshape_and_cache = reshape_and_cache
        self._metadata: AttentionMetadata | None = None
        self.input_batch = InputBatch(block_size) if persistent_batch else None
        #: the latest submitted step's sampled tokens on the device, and each request's
        #: index in them: the next step's inputs take a token the host lacks from there
        self._prev_request_id_to_sample_index: dict[str, int] = {}
        self._prev_sampled_token_ids: torch.Tensor | None = None
        #: input ids taken from the previous step's samples on the device (async scheduling)
        self.num_device_filled_input_ids = 0
        #: set by benchmarks: when each step's device work began and ended
        self.timeline: DeviceTimeline | None = None
        #: sampled ids and draft verdicts reach the host through a kernel, not a copy engine
        self._readback = HostReadback() if self.device.type == "cuda" else None
        if connector is not None:
            connector.register_kv_caches(self.kv_cache)
        #: how many steps ran as a decode graph, a mixed graph or eagerly (benchmarks, tests)
        self.step_kinds: Counter[str] = Counter()
        self.decode_graphs: DecodeGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        #: CUDA only, with mixed graphs: one event per layer that a mixed graph waits for
        #: before the layer's attention (an event-wait node of the graph), recorded anew in
        #: each step with loads once that layer's loaded KV is in place (`_signal_layer_loads`)
        self._layer_loaded_events: list[torch.cuda.Event] | None = None
        self._load_signal_stream: torch.cuda.Stream | None = None
        #: recorded after the latest mixed-graph replay: its waits have run once it is done
        self._mixed_replay_done: torch.cuda.Event | None = None
        if self._on_cuda and (cuda_graph_max_batch_size > 0 or max_graph_tokens > 0):
            self._capture_graphs(cuda_graph_max_batch_size, max_graph_tokens, max_num_seqs, max_model_len)

    def _capture_graphs(
        self, max_batch_size: int, max_graph_tokens: int, max_num_seqs: int, max_model_len: int
    ) -> None:
        """Capture the mixed graphs, then the decode graphs, into one memory pool (the
        largest first: the smaller ones reuse its memory; one graph replays at a time).
        A graph set that fails to capture is left out: its steps run eagerly."""
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = torch.cuda.graph_pool_handle()
        max_blocks_per_seq = -(-max_model_len // self.block_size)
        if max_graph_tokens > 0:
            self.mixed_graphs = self._capture_mixed_graphs(
                max_graph_tokens, max_num_seqs, max_blocks_per_seq, max_model_len, pool
            )
        if max_batch_size > 0:
            try:
                self.decode_graphs = DecodeGraphs(
                    self._forward_with_metadata,
                    AttentionMetadata,
                    self.device,
                    max_batch_size,
                    max_blocks_per_seq=max_blocks_per_seq,
                    max_seq_len=max_model_len,
                    pool=pool,
                )
            except RuntimeError as error:
                logger.warning("decode CUDA graphs could not be captured, running eagerly: %s", error)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "CUDA graphs: mixed steps of up to %d tokens (buckets %s, up to %d sequences), "
            "decode batches %s; captured in %.1f s, %.0f MiB of GPU memory",
            max_graph_tokens if self.mixed_graphs is not None else 0,
            self.mixed_graphs.buckets if self.mixed_graphs is not None else [],
            max_num_seqs,
            self.decode_graphs.sizes if self.decode_graphs is not None else [],
            time.perf_counter() - started,
            used / (1 << 20),
        )

    def _capture_mixed_graphs(
        self, max_graph_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, pool
    ) -> MixedGraphs | None:
        """Mixed graphs that wait per layer for loads (external CUDA events); where this
        torch cannot capture such waits, graphs that wait for whole loads; None when
        neither captures (those steps run eagerly)."""

        def capture(forward) -> MixedGraphs:
            return MixedGraphs(
                forward,
                AttentionMetadata,
                self.device,
                max_graph_tokens,
                max_num_seqs,
                max_blocks_per_seq=max_blocks_per_seq,
                max_seq_len=max_model_len,
                block_size=self.block_size,
                pool=pool,
            )

        try:
            events = [torch.cuda.Event(external=True) for _ in range(self.config.num_layers)]
            for event in events:
                event.record()  # created now: a capture skips the wait on a never-recorded event
            self._layer_loaded_events = events
            self._load_signal_stream = torch.cuda.Stream(self.device)
            return capture(self._forward_waiting_per_layer)
        except (TypeError, RuntimeError) as error:  # no external events in this torch
            logger.warning(
                "mixed CUDA graphs without per-layer load waits (they wait for whole loads): %s", error
            )
            self._layer_loaded_events = self._load_signal_stream = None
        try:
            return capture(self._forward_with_metadata)
        except RuntimeError as error:
            logger.warning("mixed CUDA graphs could not be captured, those steps run eagerly: %s", error)
            return None

    def _forward_with_metadata(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        """The forward pass without the connector's per-layer hooks: what a decode graph
        records, and what a step without loads needs (saves are packed after the pass)."""
        self._metadata = metadata
        return self.model(input_ids, positions, self._attention)

    def _forward_waiting_per_layer(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        """What a mixed graph records (CUDA): `_forward_with_metadata` with a wait before
        each layer's attention for that layer's event, so a step with loads computes the
        first layers while the later ones still load."""
        self._metadata = metadata
        return self.model(input_ids, positions, self._attention_after_layer_event)

    def _attention_after_layer_event(self, layer_idx: int, query, key, value, *rotary) -> torch.Tensor:
        torch.cuda.current_stream(self.device).wait_event(self._layer_loaded_events[layer_idx])
        return self._attention(layer_idx, query, key, value, *rotary)

    def _signal_layer_loads(self) -> bool:
        """Record each layer's event once the connector's load of that layer is done: a
        side stream waits for the loads layer by layer (the connector's hooks, run with it
        as the current stream) and records the events the mixed graph waits for.

        Returns False, recording nothing, while the previous mixed-graph replay may not
        have passed its waits (async scheduling: two steps in flight): its waits must
        keep the records they were launched with. The caller then waits for the whole
        load before the replay."""
        done = self._mixed_replay_done
        if done is not None and not done.query():
            return False
        stream = self._load_signal_stream
        with torch.cuda.stream(stream):
            for layer, event in enumerate(self._layer_loaded_events):
                self.connector.wait_for_layer_load(layer)
                event.record(stream)
        return True

    def _forward_with_loads(self, input_ids, positions, metadata: AttentionMetadata) -> torch.Tensor:
        """The forward pass with the connector's per-layer hooks (a step with loads)."""
        self._metadata = metadata
        return self.model(input_ids, positions, self._attention_with_loads)

    def _prepare(self, plan: SchedulerOutput) -> tuple[HostInputs, list[int]]:
        """-> the step's inputs on the host, and the logits row of each scheduled request
        (-1 when it samples nothing; with drafts, the row of the last draft).

        The flat batch holds the paged-attention sequences first and the whole-prompt
        prefills (engine.attention's dense path, CUDA only) after them; rows still
        follow plan.requests' order in the returned list."""
        num_requests = len(plan.requests)
        dense = [
            self._on_cuda
            and not self.deterministic
            and attention.is_dense_prefill(
                request.num_computed_tokens,
                num_new,
                len(plan.request_id_to_spec_token_ids.get(request.request_id, ())),
                self.dtype,
            )
            for request, num_new in zip(plan.requests, plan.num_scheduled_tokens, strict=True)
        ]
        order = [i for i in range(num_requests) if not dense[i]] + [
            i for i in range(num_requests) if dense[i]
        ]
        num_paged_seqs = num_requests - sum(dense)
        if self.input_batch is not None:
            return gather_host_inputs(self.input_batch, plan, order, dense, num_paged_seqs)
        return build_host_inputs(plan, order, dense, num_paged_seqs, self.block_size)

    def _fill_missing_input_ids(self, host: HostInputs, input_ids: torch.Tensor) -> None:
        """Copy the previous step's sampled tokens into the input ids the host lacks
        (async scheduling), on the device: the host never waits for them."""
        if not host.missing_request_ids:
            return
        index_of = self._prev_request_id_to_sample_index
        sampled = self._prev_sampled_token_ids
        if sampled is None or any(request_id not in index_of for request_id in host.missing_request_ids):
            raise RuntimeError(
                "a step needs a token the previous step did not sample "
                f"(requests {sorted(set(host.missing_request_ids))})"
            )
        sources = host_to_device(torch.tensor([index_of[r] for r in host.missing_request_ids]), self.device)
        targets = host_to_device(host.missing_indices, self.device)
        input_ids[targets] = sampled[sources].to(input_ids.dtype)
        self.num_device_filled_input_ids += len(host.missing_request_ids)

    def _graphs_for(self, plan: SchedulerOutput, host: HostInputs) -> DecodeGraphs | MixedGraphs | None:
        """The captured graphs that can replay this step, None when it runs eagerly:
        decode graphs for one new token per sequence, mixed graphs for other steps of
        few enough tokens. Never for fused whole-prompt spans, nor for loads that need
        the connector's per-layer hooks."""
        connector = self.connector
        if host.dense_spans or (
            connector is not None and plan.connector_meta.loads and connector.needs_layer_hooks
        ):
            return None
        num_seqs = len(host.seq_lens)
        width = host.block_tables.shape[1]
        decode = self.decode_graphs
        mixed = self.mixed_graphs
        # A step with loads replays a mixed graph where one fits: it waits for each layer's
        # load, where a decode graph would wait for the whole load before its first layer.
        loads_per_layer = (
            connector is not None
            and bool(plan.connector_meta.loads)
            and self._layer_loaded_events is not None
            and mixed is not None
            and mixed.can_run(len(host.input_ids), num_seqs, width)
        )
        if (
            decode is not None
            and host.max_query_len == 1
            and not loads_per_layer
            and decode.can_run(num_seqs, width)
        ):
            return decode
        if mixed is not None and mixed.can_run(len(host.input_ids), num_seqs, width):
            return mixed
        return None

    def _run_model(self, plan: SchedulerOutput, host: HostInputs) -> torch.Tensor:
        """Forward pass -> final hidden states [T, hidden]: a CUDA graph replay when the
        step allows it (`_graphs_for`), else eager."""
        graphs = self._graphs_for(plan, host)
        connector = self.connector
        has_loads = connector is not None and bool(plan.connector_meta.loads)
        if graphs is not None:
            layers = range(self.config.num_layers)

            def before_replay() -> None:
                self._fill_missing_input_ids(host, graphs.input_ids[: len(host.input_ids)])
                if not has_loads:
                    return
                if (
                    graphs is self.mixed_graphs
                    and self._layer_loaded_events is not None
                    and self._signal_layer_loads()
                ):
                    return  # the graph waits per layer
                for layer in layers:  # the whole pass waits for every layer's load
                    connector.wait_for_layer_load(layer)

            is_decode = graphs is self.decode_graphs
            self.step_kinds["decode_graph" if is_decode else "mixed_graph"] += 1
            # a mixed graph also takes the sequences' query starts (several tokens each)
            query_start_loc = () if is_decode else (host.query_start_loc,)
            hidden = graphs.run(
                host.input_ids,
                host.positions,
                host.slot_mapping,
                host.block_tables,
                host.seq_lens,
                *query_start_loc,
                before_replay=before_replay,
            )
            if not is_decode and self._layer_loaded_events is not None:
                self._mixed_replay_done = torch.cuda.Event()
                self._mixed_replay_done.record()
            if has_loads:
                for layer in layers:
                    connector.save_kv_layer(layer)
            return hidden
        self.step_kinds["eager"] += 1
        device = self.device
        metadata = AttentionMetadata(
            slot_mapping=host_to_device(host.slot_mapping, device),
            block_tables=host_to_device(host.block_tables, device),
            seq_lens=host_to_device(host.seq_lens, device),
            query_start_loc=host_to_device(host.query_start_loc, device),
            max_query_len=host.max_query_len,
            max_seq_len=host.max_seq_len,
            num_paged_seqs=host.num_paged_seqs,
            dense_spans=host.dense_spans,
        )
        input_ids = host_to_device(host.input_ids, device)
        self._fill_missing_input_ids(host, input_ids)
        positions = host_to_device(host.positions, device)
        if has_loads:
            return self._forward_with_loads(input_ids, positions, metadata)
        return self._forward_with_metadata(input_ids, positions, metadata)

    def _attention_with_loads(self, layer_idx: int, query, key, value, *rotary) -> torch.Tensor:
        """`_attention` once the connector made layer `layer_idx`'s loaded KV ready."""
        self.connector.wait_for_layer_load(layer_idx)
        out = self._attention(layer_idx, query, key, value, *rotary)
        self.connector.save_kv_layer(layer_idx)
        return out

    def _attention(self, layer_idx: int, query, key, value, cos=None, sin=None) -> torch.Tensor:
        """Write this step's K/V [T, KVH, D] into the layer's blocks, then attend
        with query [T, H, D] over each sequence's whole paged KV. Given `cos` and `sin`
        (layers of `fuse_rotary_into_attention`), query and key come before RoPE: on CUDA
        one kernel rotates them and writes the cache (kernels.rotary_cache)."""
        md = self._metadata
        kv_layer = self.kv_cache[layer_idx]
        if cos is not None and not self._on_cuda:
            from kernels.elementwise import rotary_qk  # the layer's own RoPE, unfused

            query, key = rotary_qk(query, key, cos, sin)
        if self._on_cuda:
            # The metadata was built here from the scheduler's plan: skip the kernels'
            # value checks, which would sync the stream once per layer; the input checks
            # run at a pass's first layer (every layer passes the same kinds of tensors).
            if cos is not None:
                query, key = rotary_and_cache(
                    query, key, value, cos, sin, kv_layer, md.slot_mapping, check_inputs=layer_idx == 0
                )
            else:
                self._reshape_and_cache(
                    key, value, kv_layer, md.slot_mapping, check_values=False, check_inputs=layer_idx == 0
                )
            out = attention.attend(
                query, key, value, kv_layer, md, self.scale, batch_invariant=self.deterministic
            )
        elif not self.deterministic:
            out = attention.attend_reference(layer_idx, query, key, value, kv_layer, md, self.scale)
        else:
            self._reshape_and_cache(key.contiguous(), value.contiguous(), kv_layer, md.slot_mapping)
            out = self._paged_attention(
                query, kv_layer, md.block_tables, md.seq_lens, md.query_start_loc, self.scale
            )
        return out

    def _to_host(self, values: torch.Tensor) -> list:
        """``values.tolist()``; on CUDA through `HostReadback` (never behind the
        connector's copies on a copy engine)."""
        return self._readback.read(values) if self._readback is not None else values.tolist()

    def execute(
        self, plan: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> RunnerOutput:
        """Run one step and wait for its sampled tokens (`submit(plan).result()`)."""
        return self.submit(plan, while_device_runs).result()

    @torch.inference_mode()
    def submit(
        self, plan: SchedulerOutput, while_device_runs: Callable[[], None] | None = None
    ) -> StepFuture:
        """Queue one step on the device: connector loads, forward, connector saves,
        sampling. Returns once the work is queued (on CPU: done); the future's `result()`
        waits for the sampled tokens. Called once per step by the engine core, in step
        order; the next `submit` may come before this step's `result()` (async
        scheduling), and then takes a token it lacks from this step's samples on the
        device. A step that verifies drafts reads its tokens before returning.

        `while_device_runs` (host work of the engine core that this step's device work
        does not need) is called once, after the step's forward pass and sampling are
        queued and before anything of the step waits for the device: a step that loads
        KV would otherwise spend that host time before its first copy or after its
        last kernel."""
        connector = self.connector
        if connector is not None:
            if plan.preempted_request_ids:
                # Preemption freed blocks that this step may rewrite: earlier saves must have read them.
                connector.finish_saves()
            connector.bind_connector_metadata(plan.connector_meta)
            connector.start_load_kv()
        request_id_to_token: dict[str, int] | None = None
        request_id_to_accepted_draft_ids: dict[str, list[int]] = {}
        sampled_request_ids: list[str] = []
        token_ids = None
        saves_queued = False
        if plan.requests:
            host, logits_rows = self._prepare(plan)
            if self.timeline is not None:
                self.timeline.begin()
            hidden = self._run_model(plan, host)
            if connector is not None and plan.request_id_to_spec_token_ids:
                # Verifying drafts below waits for the device: queue the saves first, while
                # the GPU still runs the forward pass, or their host bookkeeping would add to
                # the step. Other steps queue sampling first (it never waits for the device):
                # `wait_for_save` waits for the step's loads, and the sampling kernels must
                # already be queued when the last load lands, or the GPU idles until the host
                # queues them.
                connector.wait_for_save()
                saves_queued = True
            sampling = [(i, row) for i, row in enumerate(logits_rows) if row >= 0]
            if sampling:
                # non_blocking from host memory: the host queues sampling behind the forward
                # pass instead of waiting for it here (the sampled ids are read once, at the end).
                row_ids = [row for _, row in sampling]
                layout = None
                if plan.request_id_to_spec_token_ids:
                    # one LM-head pass for the sampled rows and the rows before the drafts
                    layout = draft_layout(plan.requests, plan.request_id_to_spec_token_ids, logits_rows)
                    row_ids += layout.draft_rows
                if (
                    layout is None
                    and len(row_ids) == hidden.shape[0]
                    and row_ids == list(range(len(row_ids)))
                ):
                    # every row samples, in order (a decode step): no gather, no index copy
                    all_logits = self.model.compute_logits(hidden)
                else:
                    rows = host_to_device(torch.tensor(row_ids), self.device)
                    all_logits = self.model.compute_logits(hidden[rows])
                logits = all_logits[: len(sampling)]
                requests = [plan.requests[i] for i, _ in sampling]
                token_ids = sample_on_device(
                    logits,
                    [r.sampling_params for r in requests],
                    [r.generator for r in requests],
                    row_wise=self.deterministic,
                )
                sampled_request_ids = [r.request_id for r in requests]
                if while_device_runs is not None:
                    while_device_runs()
                    while_device_runs = None
                if layout is not None:
                    # The token sampled after the last draft is the bonus token; verified
                    # before the samples are read, so the host waits for the device once.
                    request_id_to_accepted_draft_ids, request_id_to_last_token = verify_layout(
                        layout,
                        all_logits[len(sampling) :],
                        token_ids,
                        self.device,
                        row_wise=self.deterministic,
                        to_host=self._to_host,
                    )
                    request_id_to_token = dict(
                        zip(sampled_request_ids, self._to_host(token_ids), strict=True)
                    )
                    request_id_to_token.update(request_id_to_last_token)
            if self.timeline is not None:
                self.timeline.end()
        self._prev_request_id_to_sample_index = {r: i for i, r in enumerate(sampled_request_ids)}
        self._prev_sampled_token_ids = token_ids if request_id_to_token is None else None
        if while_device_runs is not None:  # the step samples nothing
            while_device_runs()
        load_failures: dict[str, int] = {}
        report = None
        if connector is not None:
            if not saves_queued:
                connector.wait_for_save()
            report = connector.take_report()
            load_failures = dict(report.load_failures)
        self._metadata = None
        output = RunnerOutput(
            request_id_to_token=request_id_to_token or {},
            request_id_to_accepted_draft_ids=request_id_to_accepted_draft_ids,
            load_failures=load_failures,
            num_computed_tokens=plan.total_num_scheduled_tokens,
            connector_report=report,
        )
        if request_id_to_token is not None or token_ids is None:
            return StepFuture.done(output)
        if self._readback is not None:
            return StepFuture(output, sampled_request_ids, self._readback.queue(token_ids))
        return StepFuture(output, sampled_request_ids, token_ids)
