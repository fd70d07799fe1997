"""Start-up warm-up: every kernel variant and shape class compiled and planned before
the engine reports ready, so no user request pays a Triton compile or a per-shape
attention plan (vLLM's profile run and graph capture play this part there).

Called once by the engine core, right after the model runner is built and before
the first request; never afterwards. It runs synthetic steps straight through
:meth:`ModelRunner.execute` (no scheduler, no connector: nothing is stored,
registered in the prefix cache or counted) over block ids of the still-empty KV
cache, then plans the fused prefill path at every length bucket and compiles the
connector's pack/unpack kernels. The KV cache holds garbage afterwards, in blocks
that no request owns yet.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import torch

from engine import attention
from engine.config import SamplingParams
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

#: a greedy row and a sampled one in the same batch: both sampler paths compile
_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
_SAMPLED = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=20, seed=0)


@dataclass(frozen=True)
class WarmupLimits:
    """The engine's limits that decide which shapes a request can produce."""

    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int
    num_speculative_tokens: int = 0
    #: tokens per connector chunk (pack/unpack warm-up); 0 when offloading is off
    chunk_size: int = 0


@dataclass
class WarmupReport:
    num_steps: int
    num_dense_buckets: int
    num_transfer_shapes: int
    seconds: float
    #: its steps by kind (runner.step_kinds), which it leaves at zero for the engine's steps
    step_kinds: dict[str, int] = field(default_factory=dict)


class _SyntheticRequests:
    """Requests over block ids of the empty KV cache: all share blocks from id 0 on
    (they write garbage KV that nobody reads back)."""

    def __init__(self, runner: ModelRunner, limits: WarmupLimits) -> None:
        self.block_size = runner.block_size
        self.num_blocks = runner.kv_cache.shape[2]
        self.vocab_size = runner.config.vocab_size
        self.max_model_len = limits.max_model_len
        self._ids = itertools.count()
        self._generator = torch.Generator(device=runner.device)
        self._generator.manual_seed(0)

    @property
    def max_tokens(self) -> int:
        """The longest sequence the cache holds."""
        return min(self.max_model_len, self.num_blocks * self.block_size)

    def make(
        self, num_tokens: int, num_computed: int, params: SamplingParams, num_drafts: int = 0
    ) -> Request:
        """A request of `num_tokens` known tokens, `num_computed` of them in the cache,
        with blocks for `num_drafts` more (speculative drafts verified this step)."""
        num_tokens = max(1, min(num_tokens, self.max_tokens - num_drafts))
        request = Request(
            request_id=f"warmup-{next(self._ids)}",
            prompt_token_ids=[(7 * i + 3) % self.vocab_size for i in range(num_tokens)],
            sampling_params=params,
            eos_token_ids=frozenset(),
            max_model_len=self.max_model_len,
        )
        request.num_computed_tokens = min(num_computed, num_tokens - 1)
        request.block_ids = list(range(-(-(num_tokens + num_drafts) // self.block_size)))
        if not params.greedy:
            request.generator = self._generator
        return request


def _plan(requests: list[Request], spec: dict[str, list[int]] | None = None) -> SchedulerOutput:
    spec = spec or {}
    return SchedulerOutput(
        requests=requests,
        num_scheduled_tokens=[
            r.num_tokens - r.num_computed_tokens + len(spec.get(r.request_id, ())) for r in requests
        ],
        preempted_request_ids=[],
        finished_request_ids=set(),
        request_id_to_spec_token_ids=spec,
    )


def _step_plans(factory: _SyntheticRequests, limits: WarmupLimits) -> list[SchedulerOutput]:
    """One plan per shape class a scheduler can produce."""
    budget = min(limits.max_num_batched_tokens, factory.max_tokens)
    longest = factory.max_tokens
    make = factory.make
    plans = [
        # short paged prefills, a token count that is and one that is not a multiple of 16
        _plan([make(17, 0, _GREEDY)]),
        _plan([make(256, 0, _GREEDY), make(33, 0, _SAMPLED)]),
        # a later chunk of a prompt, over a cached prefix
        _plan([make(min(longest, 512 + 100), 512, _GREEDY)]),
        # the longest first chunk the budget allows (the fused path from DENSE_PREFILL_MIN_TOKENS)
        _plan([make(budget, 0, _GREEDY)]),
        # a prefill while others decode over long contexts (split-KV decode beside a prefill)
        _plan(
            [
                make(longest, longest - 1, _GREEDY),
                make(longest // 2 + 1, longest // 2, _SAMPLED),
                make(max(1, budget - 2), 0, _GREEDY),
            ]
        ),
    ]
    # the paged kernel's tile variants: every query-tile size a step of q new tokens per
    # sequence picks, over a long context (split-KV) and a short one (one split)
    for q in (1, 2, 4, 8, 16):
        plans.append(_plan([make(longest, longest - q, _GREEDY)]))
        plans.append(_plan([make(q + 40, 40, _GREEDY), make(q + 7, 7, _SAMPLED)]))
    # eager decode batches (graphs cover the common ones; these cover steps with loads,
    # batches past the largest graph and the first replays)
    for num_seqs in sorted({1, 3, min(limits.max_num_seqs, 64)}):
        plans.append(
            _plan(
                [make(longest - i, longest - i - 1, _GREEDY if i % 2 else _SAMPLED) for i in range(num_seqs)]
            )
        )
    if limits.num_speculative_tokens:
        k = limits.num_speculative_tokens
        verify = [make(64 + i, 63 + i, _GREEDY if i % 2 else _SAMPLED, num_drafts=k) for i in range(3)]
        plans.append(_plan(verify, {r.request_id: [5] * k for r in verify}))
    return plans


def _warm_dense_buckets(runner: ModelRunner, max_tokens: int) -> int:
    """Plan the fused prefill kernel at every bucket a whole prompt can take."""
    if (
        runner.device.type != "cuda"
        or runner.dtype not in attention.DENSE_PREFILL_DTYPES
        or runner.deterministic  # the deterministic mode never takes the dense path
    ):
        return 0
    config = runner.config
    lens = attention.dense_bucket_lens(max_tokens)
    if not lens:
        return 0
    query = torch.zeros(
        (lens[-1], config.num_heads, config.head_dim), dtype=runner.dtype, device=runner.device
    )
    kv = torch.zeros(
        (lens[-1], config.num_kv_heads, config.head_dim), dtype=runner.dtype, device=runner.device
    )
    for length in lens:
        attention.dense_causal_attention(query[:length], kv[:length], kv[:length], runner.scale)
    return len(lens)


def _warm_transfers(runner: ModelRunner, chunk_size: int) -> int:
    """Compile the connector's pack/unpack kernels (whole cache, a slice of layers, one
    layer) for a full and a partial chunk."""
    if runner.device.type != "cuda" or chunk_size <= 0:
        return 0
    import kernels

    kv_cache = runner.kv_cache
    num_shapes = 0
    for num_tokens in sorted({chunk_size, max(1, chunk_size // 2 + 1)}):
        slots = torch.arange(num_tokens, dtype=torch.int64, device=runner.device)
        for caches in (kv_cache, kv_cache[:1]):
            chunk = kernels.pack_kv(caches, slots, check_values=False)
            kernels.unpack_kv(chunk, caches, slots, check_values=False)
        layer_chunk = kernels.pack_kv_layer(kv_cache[0], slots, check_values=False)
        kernels.unpack_kv_layer(layer_chunk, kv_cache[0], slots, check_values=False)
        num_shapes += 1
    return num_shapes


def warm_up(runner: ModelRunner, limits: WarmupLimits) -> WarmupReport:
    """Run every shape class once; logs one line with what ran and how long it took."""
    started = time.perf_counter()
    factory = _SyntheticRequests(runner, limits)
    connector, runner.connector = runner.connector, None  # nothing of this reaches a tier
    try:
        plans = _step_plans(factory, limits)
        # Eagerly, graphs set aside: the captured graphs compiled their own kernels at
        # capture, and every shape must also be ready for the steps that run eagerly
        # (loads with per-layer hooks, steps larger than the graphs).
        graphs = runner.decode_graphs, runner.mixed_graphs
        runner.decode_graphs = runner.mixed_graphs = None
        try:
            for plan in plans:
                runner.execute(plan)
        finally:
            runner.decode_graphs, runner.mixed_graphs = graphs
        # then a few again through the graphs: their first replays (a short prefill, a
        # prefill pair, a decode batch or a verification)
        replayed = (plans[0], plans[1], plans[-1])
        for plan in replayed:
            runner.execute(plan)
        num_buckets = _warm_dense_buckets(runner, min(limits.max_num_batched_tokens, factory.max_tokens))
        num_transfer_shapes = _warm_transfers(runner, limits.chunk_size)
    finally:
        runner.connector = connector
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    report = WarmupReport(
        len(plans) + len(replayed),
        num_buckets,
        num_transfer_shapes,
        time.perf_counter() - started,
        step_kinds=dict(runner.step_kinds),
    )
    runner.step_kinds.clear()  # they count the engine's steps
    logger.info(
        "warm-up: %d step shapes, %d fused-prefill length buckets, %d transfer shapes in %.1f s",
        report.num_steps,
        report.num_dense_buckets,
        report.num_transfer_shapes,
        report.seconds,
    )
    return report
