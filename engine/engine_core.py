"""The engine core: a step loop that an offline `LLM` or an async HTTP server drives.

`add_request` validates and queues; `step` runs one scheduler plan through the
model runner and returns the updated requests' outputs; `abort_request` ends a
request at once. Not thread-safe: one caller drives it (a server runs it in one
task and feeds it through a queue).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from connector.base import KVTransferParams
from engine.batch_queue import BatchQueue, latest_per_request
from engine.block_manager import BlockManager
from engine.cache_salt import check_cache_salt
from engine.config import EngineArgs, ModelConfig, SamplingParams
from engine.cuda_graphs import GraphSizes
from engine.detokenize import detokenize_and_check_stop
from engine.engine_stats import EngineStats
from engine.host_threads import limit_host_threads
from engine.kv_cache_size import num_kv_blocks
from engine.model_folder import ModelFolder
from engine.model_runner import ModelRunner
from engine.models import load_model
from engine.prefill_cap import PrefillCap
from engine.request import Request, RequestOutput, index_of_token_outside_vocab
from engine.scheduler import Scheduler
from engine.spec_decode import NgramProposer
from engine.startup_phases import StartupPhases
from engine.step_recovery import PROBE_REQUEST_ID_PREFIX, StepRecovery, StepSnapshot
from engine.step_recovery import EngineStepError as EngineStepError  # raised by step(); importable here
from engine.step_time import StepTimeModel
from engine.warmup import WarmupLimits, warm_up

logger = logging.getLogger(__name__)


class EngineCore:
    """`model` is a local Hugging Face folder, or an in-memory transformers config
    with `load_format="dummy"` (random weights, no tokenizer)."""

    def __init__(
        self,
        model: str | Path | Any,
        engine_args: EngineArgs | None = None,
        startup: StartupPhases | None = None,
    ) -> None:
        """``startup``: where the phases of this start are timed (``kvstash serve`` passes
        one holding its own); kept as ``self.startup``."""
        self.startup = startup if startup is not None else StartupPhases()
        args = engine_args or EngineArgs()
        args.validate()
        if args.node_rank > 0:
            raise ValueError(
                f"node_rank {args.node_rank} runs its share of the ranks only, no engine: start it "
                "with LLM(...), `kvstash serve` or `kvstash generate` (engine.pipeline.node)"
            )
        proposer = None
        if args.speculative == "ngram":
            proposer = NgramProposer(args.num_speculative_tokens, args.ngram_min_n, args.ngram_max_n)
        folder = None
        if isinstance(model, str | Path):
            self.model_dir: Path | None = Path(model)
            folder = ModelFolder.open(
                self.model_dir, self.startup, prefetch_weights=args.load_format != "dummy"
            )
            self.model_config = folder.config
        else:
            self.model_dir = None
            self.model_config = ModelConfig.from_hf_config(model)
            if args.load_format != "dummy":
                raise ValueError("an in-memory model config needs load_format='dummy' (random weights)")
        config = self.model_config
        self.args = args
        self.device = args.resolve_device()
        limit_host_threads(self.device)
        self.dtype = args.resolve_dtype(self.device, config.checkpoint_dtype)
        self.max_model_len = min(args.max_model_len or config.max_model_len, config.max_model_len)
        #: the stage processes when `pipeline_parallel_size` > 1 (engine.pipeline), or the
        #: rank processes when `tensor_parallel_size` > 1 (engine.tensor_parallel); this
        #: process then runs stage 0 (rank 0) and `model` is None
        self.pipeline = None
        # every setting was checked above (EngineArgs.validate, OffloadConfig at construction)
        logger.info("loading the model from %s", self.model_dir or "an in-memory config")
        weight_hashes = None
        if args.kv_offload is not None and args.model_id is None and self.model_dir is not None:
            from engine.models.fingerprint import WeightHashCache

            weight_hashes = WeightHashCache()  # filled while the weights are read: no second pass
        mark = self.startup.now()
        if args.pipeline_parallel_size > 1 or args.tensor_parallel_size > 1:
            from engine.pipeline import PipelineExecutor

            builder = None  # one process per stage; with tensor parallelism, N per stage
            if args.tensor_parallel_size > 1:
                from engine.tensor_parallel import TensorParallelStageBuilder, check_tensor_parallel_size

                check_tensor_parallel_size(config, args.tensor_parallel_size)
                builder = TensorParallelStageBuilder(args.tensor_parallel_size)
            self.model = None
            self.pipeline = PipelineExecutor(
                config,
                self.model_dir,
                num_stages=args.pipeline_parallel_size,
                device=self.device,
                dtype=self.dtype,
                dummy_weights=args.load_format == "dummy",
                builder=builder,
                nnodes=args.nnodes,
                dist_init_addr=args.dist_init_addr,
                dist_init_timeout_s=args.dist_init_timeout,
            )
        else:
            self.model = load_model(
                config,
                self.model_dir,
                self.device,
                self.dtype,
                dummy=args.load_format == "dummy",
                cpu_offload_gb=args.cpu_offload_gb,
                weight_hashes=weight_hashes,
            )
            self.startup.weight_read_stats = self.model.weight_read_stats
        self.startup.add_since("weights", mark)
        if folder is not None:
            folder.weights_read()
        if self.model is not None and self.device.type == "cuda" and self.dtype != torch.float32:
            # float32 stays with torch's glue: the mode whose tokens must equal Hugging Face's
            # exactly; with enforce_eager too (the kernels are eager launches, not graphs)
            self.model.use_glue_kernels()
        if args.deterministic:
            from engine.deterministic import make_batch_invariant

            make_batch_invariant(self.model)
        with self.startup.phase("kv_cache"):
            num_blocks = num_kv_blocks(args, config, self.device, self.dtype, self.max_model_len)
        self.block_size = args.block_size
        self.tokenizer = None
        if folder is not None:
            with self.startup.phase("tokenizer"):  # only what its thread had left to do
                self.tokenizer = folder.tokenizer()

        #: how long a step takes, fitted from this engine's steps; the connector's planner
        #: and the scheduler's prefill cap plan with it
        self.step_times = StepTimeModel(chunk_tokens=args.max_num_batched_tokens)
        #: the last step returned before its device work ended (it sampled nothing): the
        #: next step's time includes that work
        self._device_work_left_over = False
        scheduler_connector = worker_connector = model_id = None
        #: stage 0's cache engine, its tiers (metrics read them; the scheduler side their index)
        self.offload_cache_engine = None
        if args.kv_offload is not None:
            from connector import create_kv_connector
            from engine.models.fingerprint import dummy_model_fingerprint, model_fingerprint

            with self.startup.phase("fingerprint"):
                if args.model_id is not None:
                    model_id = "operator-" + args.model_id  # never equal to a weight hash
                elif self.model_dir is not None:
                    model_id = model_fingerprint(self.model_dir, weight_hashes)
                else:
                    model_id = dummy_model_fingerprint(model)
            mark = self.startup.now()
            if self.pipeline is not None:
                scheduler_connector, worker_connector = self.pipeline.create_connectors(
                    args.kv_offload, model_id, args.block_size
                )
            else:
                scheduler_connector, worker_connector = create_kv_connector(
                    args.kv_offload,
                    model_id=model_id,
                    dtype=self.dtype,
                    num_layers=config.num_layers,
                    num_kv_heads=config.num_kv_heads,
                    head_dim=config.head_dim,
                    block_size=args.block_size,
                    device=self.device,
                    step_times=self.step_times,
                    grow_cpu_tier=self.device.type == "cuda",  # pinning is slow: after ready
                )
                self.startup.cpu_tier = worker_connector.cache_engine.tiers.cpu
            self.offload_cache_engine = worker_connector.cache_engine
            self.startup.add_since("tiers", mark)
        self.block_manager = BlockManager(num_blocks, args.block_size, args.enable_prefix_caching)
        #: the KV event stream (kv_events), when `kv_events_endpoint` is set
        self.kv_events = None
        if args.kv_events_endpoint is not None:
            from engine.kv_event_stream import start_kv_events

            self.kv_events = start_kv_events(args, self.block_manager, worker_connector)
        self.scheduler = Scheduler(
            self.block_manager,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            connector=scheduler_connector,
            proposer=proposer,
            prefill_cap=PrefillCap(
                block_size=args.block_size,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_decode_gap_ms=args.max_decode_gap_ms,
                step_times=self.step_times,
            ),
        )
        mark = self.startup.now()
        graphs = self._graph_sizes()
        if self.pipeline is not None:
            self.runner = self.pipeline.start_runners(
                num_blocks, args.block_size, worker_connector, args.kv_offload, model_id, graphs
            )
        else:
            self.runner = ModelRunner(
                self.model,
                config,
                num_blocks,
                args.block_size,
                self.device,
                self.dtype,
                connector=worker_connector,
                cuda_graph_max_batch_size=graphs.max_batch_size if graphs is not None else 0,
                max_graph_tokens=graphs.max_graph_tokens if graphs is not None else 0,
                max_num_seqs=args.max_num_seqs,
                max_model_len=self.max_model_len,
                deterministic=args.deterministic,
            )
        self.startup.add_since("kv_cache", mark)
        mixed_graphs = getattr(self.runner, "mixed_graphs", None)
        if mixed_graphs is not None:
            # steps of up to this many tokens replay a graph: the step-time model's eager term
            self.step_times.graph_token_limit = mixed_graphs.buckets[-1]
        mark = self.startup.now()
        if args.warmup and self.device.type == "cuda" and self.pipeline is None:
            if args.deterministic:  # its GEMM tile follows the rows: compile every band's tile
                from engine.deterministic import warm_up_linear_tiles

                num_spec = args.num_speculative_tokens if args.speculative else 0
                warm_up_linear_tiles(
                    self.model, args.max_num_batched_tokens, args.max_num_seqs * (1 + num_spec)
                )
            warm_up(
                self.runner,
                WarmupLimits(
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    max_model_len=self.max_model_len,
                    max_num_seqs=args.max_num_seqs,
                    num_speculative_tokens=args.num_speculative_tokens if args.speculative else 0,
                    chunk_size=args.kv_offload.chunk_size if args.kv_offload is not None else 0,
                ),
            )
        self.startup.add_since("warmup", mark)
        #: async scheduling's steps in flight (None: every step is synchronous)
        self._batch_queue: BatchQueue | None = None
        if args.async_scheduling:
            if proposer is not None:
                logger.info("async scheduling is off: speculative decoding runs synchronous steps")
            else:
                self._batch_queue = self._new_batch_queue()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        #: ends or retries the requests of a step that raised (engine.step_recovery)
        self.recovery = StepRecovery(
            self.scheduler,
            self.runner,
            self.requests,
            self.stats,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
        )
        logger.info(
            "engine ready: %s %s on %s, %d KV blocks of %d tokens, max_model_len %d; start-up %s",
            config.family,
            self.dtype,
            self.device,
            num_blocks,
            args.block_size,
            self.max_model_len,
            self.startup.describe(),
        )
        if worker_connector is not None:
            # after the graphs were captured: pinning on another thread may break a capture
            worker_connector.start_background_allocation()

    def _graph_sizes(self) -> GraphSizes | None:
        """What to capture CUDA graphs for; None: none (not CUDA, `enforce_eager`, or a
        length-dependent RoPE, which reads the host: a pipeline stage checks its own).
        Decode graphs up to 256 sequences replay in steps without loads or whose loads
        need no per-layer hooks, and with speculative decoding in steps without drafts;
        mixed graphs take other steps of up to `max_graph_tokens` (at most the budget)."""
        args = self.args
        if self.device.type != "cuda" or args.enforce_eager:
            return None
        if self.model is not None and self.model.rotary.depends_on_length:
            return None
        max_graph_tokens = min(args.max_graph_tokens, args.max_num_batched_tokens)
        return GraphSizes(
            min(args.max_num_seqs, 256), max_graph_tokens, args.max_num_seqs, self.max_model_len
        )

    # --- the driver API -----------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        kv_transfer_params: dict | KVTransferParams | None = None,
    ) -> Request:
        """Validate and queue one request. Raises ValueError (nothing is queued) for
        a duplicate id, an empty or too long prompt, token ids outside the vocab or a
        bad ``cache_salt`` (a request shares cached KV only with requests of its salt).
        ``kv_transfer_params``: a producer's hand-over of this prompt's KV (its response's
        object, or parsed); only an engine with a connector that is no producer takes it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id.startswith(PROBE_REQUEST_ID_PREFIX):
            raise ValueError(f"request ids starting with {PROBE_REQUEST_ID_PREFIX!r} are the engine's own")
        try:
            check_cache_salt(cache_salt)
        except ValueError as error:
            raise ValueError(f"request {request_id!r}: {error}") from None
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if num_prompt >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_prompt} tokens does not fit the model's context "
                f"of {self.max_model_len} tokens (at least one token must be generated)"
            )
        vocab_size = self.model_config.vocab_size
        bad = index_of_token_outside_vocab(prompt_token_ids, vocab_size)
        if bad is not None:
            raise ValueError(
                f"request {request_id!r}: token id {prompt_token_ids[bad]!r} is outside the vocabulary [0, {vocab_size})"
            )
        num_max_tokens = min(num_prompt + params.max_tokens, self.max_model_len)
        capacity = self.block_manager.num_blocks * self.block_size
        if num_max_tokens > capacity:
            raise ValueError(
                f"request {request_id!r} may need {num_max_tokens} tokens of KV cache but the whole cache "
                f"holds {capacity}; raise num_gpu_blocks or lower max_tokens"
            )
        if isinstance(kv_transfer_params, dict):
            kv_transfer_params = KVTransferParams.from_dict(kv_transfer_params)
        if kv_transfer_params is not None and (
            self.scheduler.connector is None or self.args.kv_role == "producer"
        ):
            raise ValueError(
                "kv_transfer_params is for an engine with KV offload to the shared tier that is no producer"
            )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.model_config.eos_token_ids | self._tokenizer_eos_ids(),
            max_model_len=self.max_model_len,
            generator=generator,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def _tokenizer_eos_ids(self) -> frozenset[int]:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return frozenset() if eos is None else frozenset([eos])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now (finish_reason "abort"); unknown ids are ignored."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.finish_request(request, "abort")
        self._release_fetches()  # no step may follow: its fetch's pins go now
        return request.to_output()

    def reset_prefix_cache(self) -> bool:
        """Drop the GPU prefix cache (benchmarks, tests): the next request of a known
        prompt must find its KV in the offload tiers or recompute it. False while
        requests are running. Waits for the saves of finished requests first (they
        hold their blocks until then)."""
        self._free_sent_blocks()
        return self.block_manager.reset_prefix_cache()

    def flush_kv_offload(self) -> None:
        """Block until every save is in the CPU tier and every write-through was attempted."""
        if self.scheduler.connector is not None:
            self.runner.connector.flush()
            if self.pipeline is not None:
                self.pipeline.flush_connectors()
            self._free_sent_blocks()

    def _free_sent_blocks(self) -> None:
        """Wait for the connector's saves in flight, then free the blocks of the finished
        requests that they were reading (normally a later step does this)."""
        connector = self.runner.connector
        if connector is None:
            return
        connector.finish_saves()
        finished_sending_ids, finished_recving_ids = self.scheduler.connector.update_connector_output(
            connector.take_report()
        )
        self.scheduler.free_sent(finished_sending_ids)
        self.scheduler.readmit_received(finished_recving_ids)

    def _release_fetches(self) -> None:
        """Hand the connector's worker side the fetch releases that no step carries yet
        (a step carries those made while it was scheduled, in its metadata; these were made
        after: an abort, a request a step ended, a fetch that ended for nobody), so no CPU-tier
        pin outlives its request when no step follows. Every step submitted so far has
        planned its loads: what they read is pinned for them already."""
        connector = self.scheduler.connector
        if connector is None or self.runner.connector is None:
            return
        released = connector.take_released_fetch_ids()
        if released:
            self.runner.connector.release_fetches(released)

    def set_async_scheduling(self, enabled: bool) -> None:
        """Turn async scheduling on or off between steps (benchmarks compare one engine
        both ways). Raises ValueError while steps are in flight, or to turn it on with
        speculative decoding (which runs synchronous steps)."""
        if self.num_steps_in_flight:
            raise ValueError("async scheduling cannot change while steps are in flight")
        if enabled and self.scheduler.proposer is not None:
            raise ValueError("speculative decoding runs synchronous steps: async scheduling stays off")
        self._batch_queue = self._new_batch_queue() if enabled else None

    def _new_batch_queue(self) -> BatchQueue:
        """Up to two steps in flight in one process; with pipeline stages, up to one
        micro-batch of disjoint requests per stage."""
        return BatchQueue(self.scheduler, self.runner, num_stages=self.args.pipeline_parallel_size)

    @property
    def num_steps_in_flight(self) -> int:
        """Steps submitted and not yet collected (async scheduling; 0 otherwise)."""
        return len(self._batch_queue) if self._batch_queue is not None else 0

    def shutdown(self) -> None:
        """Stop the pipeline's stage processes (pipeline_parallel_size > 1; each closes
        its connector first) and the KV event stream. Idempotent; also happens when the
        engine is collected or the process exits."""
        if self.kv_events is not None:
            self.kv_events.close()
        if self.pipeline is not None:
            self.pipeline.shutdown()

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or steps in flight whose outputs are not out yet."""
        return self.scheduler.has_unfinished_requests() or self.num_steps_in_flight > 0

    def step(self) -> list[RequestOutput]:
        """Schedule, run and update once. Returns the outputs of the requests that got
        a token this step (cumulative state; finished ones are then forgotten).

        Raises `EngineStepError` when any part of the step raised; the engine is then
        consistent again and may step on (an exception while cleaning up propagates as
        itself: the engine must not step again). A failed step of several requests ends
        none of them: they go back to the queue and the next steps run them in halves,
        then quarters..., so only the request that fails a step alone is ended and the
        others complete with the tokens they would have had (their output tokens and
        seeded generators are restored to the state before the failed step)."""
        group = self.recovery.retry_group()
        snapshot = StepSnapshot()
        try:
            outputs = self._step(only=group, snapshot=snapshot)
            self._release_fetches()
        except Exception as error:
            self.stats.num_step_errors += 1
            if self._batch_queue is not None:
                # the steps in flight are given up with the failed one: their requests too
                in_flight = self._batch_queue.abandon(self.scheduler.apply_abandoned_report)
                step_requests = self.scheduler.step_requests
                self.scheduler.step_requests = step_requests + [
                    r for r in in_flight if r not in step_requests
                ]
            if self.pipeline is not None and self.pipeline.dead_reason is not None:
                raise self.recovery.end_all_with_error() from error
            error_to_raise = self.recovery.recover(group, snapshot)
            self._release_fetches()
            raise error_to_raise from error
        self.recovery.step_passed(group, snapshot)
        return outputs

    def device_error(self) -> str | None:
        """Whether the device can still run steps; a server calls it after a failed step.
        A sticky CUDA error (illegal address, device-side assert) fails every later call on
        the device, so a synchronize shows it: its first line, else None (always on CPU)."""
        if self.pipeline is not None and self.pipeline.dead_reason is not None:
            return self.pipeline.dead_reason
        if self.device.type != "cuda":
            return None
        try:
            torch.cuda.synchronize(self.device)
        except RuntimeError as error:
            return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return None

    def _step(self, only: set[Request] | None, snapshot: StepSnapshot) -> list[RequestOutput]:
        if self._batch_queue is not None and only is None:
            return self._batch_queue.step(self._finish_step, snapshot.take)
        # (a retried group runs synchronously, after the steps in flight)
        drained = self._batch_queue.drain(self._finish_step) if self._batch_queue is not None else []
        plan = self.scheduler.schedule(only)
        if self.scheduler.waits_only_for_transfers(plan):
            # Only background fetches are under way: sleep until one progresses, not spin.
            self.runner.connector.wait_for_transfers(0.005)
        snapshot.take(plan.requests)
        began = time.perf_counter()
        # the prefix-cache hashes that admission left out are made while the device runs
        result = self.runner.execute(plan, lambda: self.scheduler.hash_blocks_of(plan.requests))
        outputs = self._finish_step(plan, result, began)
        return latest_per_request(drained + outputs) if drained else outputs

    def _finish_step(self, plan, result, began: float) -> list[RequestOutput]:
        """Update the scheduler with a step's runner output (`began`: perf_counter when
        the step was submitted) -> the outputs of the requests that got tokens."""
        num_outputs_before = {r.request_id: len(r.output_token_ids) for r in plan.requests}
        prefill = [
            (request, n)
            for request, n in zip(plan.requests, plan.num_scheduled_tokens, strict=True)
            if request.num_computed_tokens < request.num_prompt_tokens
        ]
        has_loads = plan.connector_meta is not None and bool(plan.connector_meta.loads)
        # On CUDA a step that samples nothing (a prompt's chunk before its last) returns once
        # its work is queued: its time is the host's, and the next step's includes its device
        # work (an 8k-token chunk read 30-50 ms, the step after it 550 ms). Neither is observed.
        waited_for_device = self.device.type != "cuda" or bool(result.request_id_to_token)
        if plan.requests and not has_loads and waited_for_device and not self._device_work_left_over:
            # A step that loads KV lasts its copies too (the planner times those from the
            # tiers' own rates): it would teach the model slow tokens.
            self.step_times.observe_step(
                [(request.num_computed_tokens, n) for request, n in prefill], time.perf_counter() - began
            )
        if plan.requests:
            self._device_work_left_over = not waited_for_device
        updated = self.scheduler.update_from_result(plan, result)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens_total += result.num_computed_tokens
        for request_id, accepted_draft_ids in result.request_id_to_accepted_draft_ids.items():
            num_drafts = len(plan.request_id_to_spec_token_ids[request_id])
            self.stats.spec_decode.record(num_drafts, len(accepted_draft_ids))
        outputs = []
        for request in updated:
            num_outputs = num_outputs_before[request.request_id]
            detokenize_and_check_stop(
                self.tokenizer, self.scheduler, request, len(request.output_token_ids) - num_outputs
            )
            self.stats.num_generated_tokens_total += len(request.output_token_ids) - num_outputs
            if request.is_finished:
                self.stats.num_requests_finished += 1
                self.requests.pop(request.request_id, None)
                self._log_finished(request)
            outputs.append(request.to_output())
        return outputs

    def _log_finished(self, request: Request) -> None:
        """The one log line of a finished request. With offload on it carries the
        connector's transfer figures, which agree with the metrics: `ext_hit` tokens
        were `loaded` (`bytes` in `ms`) and `saved` tokens went to the tiers."""
        m = request.metrics
        connector = self.scheduler.connector
        transfer = connector.request_stats(request.request_id) if connector is not None else None
        offload = ""
        if transfer is not None:
            seconds = transfer.load_seconds
            rate = transfer.num_loaded_bytes / seconds / 1e9 if seconds > 0 else 0.0
            offload = (
                f" loaded={transfer.num_loaded_tokens} bytes={transfer.num_loaded_bytes}"
                f" ms={seconds * 1e3:.3f} GB/s={rate:.2f} saved={transfer.num_saved_tokens}"
            )
            if transfer.tier_to_loaded_tokens:
                offload += " by_tier=" + ",".join(
                    f"{name}:{n}" for name, n in sorted(transfer.tier_to_loaded_tokens.items())
                )
            if transfer.plan:
                offload += " " + transfer.plan
        logger.info(
            "req=%s prompt=%d gpu_hit=%d ext_hit=%d%s output=%d ttft_ms=%.1f reason=%s",
            request.request_id,
            m.num_prompt_tokens,
            m.num_local_cached_tokens,
            m.num_external_cached_tokens,
            offload,
            len(request.output_token_ids),
            1000 * (m.ttft_s or 0.0),
            request.finish_reason,
        )
