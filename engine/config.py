"""User-facing configuration: `EngineArgs`, `SamplingParams` and the model config reader.

`EngineArgs` field names are also the CLI flags (with `-`). `ModelConfig` is what
the engine needs to know about a checkpoint, read once at start-up from
`config.json` through transformers (so both the 4.x and 5.x config layouts work).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

#: roles of disaggregated prefill/decode (`EngineArgs.kv_role`): the connector's names
from connector.config import KV_ROLES
from engine.nodes import check_nodes

if TYPE_CHECKING:
    import torch

    from connector import OffloadConfig

#: the default of `EngineArgs.max_graph_tokens` (see engine.mixed_graphs). Here, not there,
#: so that reading the engine's flags imports no torch (issue 35: `kvstash serve` checks its
#: flags and takes its port before anything heavy loads).
DEFAULT_MAX_GRAPH_TOKENS = 512

#: Hugging Face `architectures` names this engine implements → model family.
ARCHITECTURE_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

#: dtype names a user may give -> the torch dtype's attribute name (torch is imported only
#: where a dtype is resolved)
_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype a user's dtype name stands for (None for a name not in _DTYPE_NAMES)."""
    import torch

    attribute = _DTYPE_NAMES.get(name)
    return None if attribute is None else getattr(torch, attribute)


SPECULATIVE_METHODS = ("ngram",)
#: the shortest decode gap one can ask for: a step's own fixed costs (launches, sampling,
#: the host's bookkeeping) take about a millisecond already
MIN_DECODE_GAP_MS = 1.0


def check_cpu_offload_gb(value: object) -> None:
    """Raise ValueError unless `value` is a finite number >= 0 (GiB). Called by
    `EngineArgs.validate`; the model-dependent bounds are checked by
    `engine.models.weight_offload.plan_weight_offload`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"cpu_offload_gb must be a number of GiB (e.g. 8 or 0.5), got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"cpu_offload_gb must be a finite number of GiB >= 0, got {value!r}")


@dataclass
class EngineArgs:
    """Everything that configures one engine. CLI flags use the same names with `-`.

    `dtype` "auto" means float32 on CPU and the checkpoint's dtype on CUDA.
    `device` "auto" means CUDA when available, else CPU. The KV pool has
    `num_gpu_blocks` blocks when given, else it takes `gpu_memory_utilization`
    of the GPU memory (on CUDA) or `cpu_kv_cache_bytes` (on CPU).
    `load_format` "dummy" initialises random weights instead of reading
    safetensors (benchmarks of full-size shapes). `enforce_eager` turns off the
    CUDA graphs that otherwise replay pure-decode steps and the other steps of up to
    `max_graph_tokens` new tokens. `cpu_offload_gb` keeps
    that many GiB of weights (whole decoder layers, the last ones) in pinned CPU
    memory, streamed to the device layer by layer (engine.models.weight_offload)."""

    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 128 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    #: vLLM's: a prompt gets at most this many tokens per step (0: off, only the budget)
    long_prefill_token_threshold: int = 0
    #: while a request decodes, size other requests' prompt chunks so that a step lasts
    #: about 3/4 of this, from the measured prefill rate: the decode's gap between two
    #: tokens stays near or under it. A prompt with nothing decoding keeps its full chunk.
    #: 0: off, the default here (`LLM`, `kvstash generate`, `kvstash bench`); `kvstash
    #: serve` defaults to 50 (engine.server.cli.SERVE_MAX_DECODE_GAP_MS: docs/serving.md)
    max_decode_gap_ms: float = 0.0
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_offload: OffloadConfig | None = None
    #: disaggregated prefill/decode (vLLM's kv_producer / kv_consumer / kv_both): a
    #: "producer" computes prompts and makes their KV durable in the shared tier before a
    #: request's answer; a "consumer" loads what a producer handed over (a request's
    #: ``kv_transfer_params``) instead of computing it; "both" (the default) is either.
    #: producer and consumer need ``kv_offload`` with a ``remote_url`` (the tier they share)
    kv_role: str = "both"
    speculative: str | None = None
    num_speculative_tokens: int = 0
    #: n-gram sizes the `ngram` proposer matches, longest first
    ngram_min_n: int = 2
    ngram_max_n: int = 4
    load_format: str = "auto"
    #: the model's identity in the KV offload namespace instead of the hash of its weights
    #: (no weight byte is read). The operator's responsibility: two different checkpoints
    #: given one id share KV, and would serve each other wrong tokens.
    model_id: str | None = None
    seed: int = 0
    #: never use CUDA graphs (on CUDA they replay pure-decode steps, and every other step
    #: of up to `max_graph_tokens` new tokens whose attention is paged)
    enforce_eager: bool = False
    #: steps of up to this many new tokens (chunks over a cached prefix, a prompt's suffix
    #: after a hit, prefills beside decodes, speculative verification) replay a CUDA graph
    #: captured per token bucket at start-up (engine.mixed_graphs); 0: only pure-decode
    #: steps do, the others run eagerly
    max_graph_tokens: int = DEFAULT_MAX_GRAPH_TOKENS
    #: compile and plan every kernel variant and shape class at start-up on CUDA
    #: (engine.warmup); off, the first requests of each shape pay it
    warmup: bool = True
    #: GiB of weights kept in CPU memory: the most whole decoder layers (from the last
    #: one backwards) that fit; 0 = every weight on the device
    cpu_offload_gb: float = 0.0
    #: schedule and submit step N+1 while step N runs on the device (engine.batch_queue,
    #: up to two steps in flight; with pipeline stages, one micro-batch of disjoint
    #: requests per stage); speculative decoding runs synchronous steps regardless
    async_scheduling: bool = False
    #: pipeline stages: the layers split into this many contiguous ranges, one process
    #: each (engine.pipeline); 1 runs the whole model in the engine's process
    pipeline_parallel_size: int = 1
    #: tensor-parallel ranks: every layer's attention heads, MLP columns and vocabulary
    #: split over this many processes (engine.tensor_parallel); it must divide the
    #: model's attention heads (checked against the model at start-up)
    tensor_parallel_size: int = 1
    #: hosts the tensor_parallel_size x pipeline_parallel_size processes are split over,
    #: evenly (engine.pipeline.nodes); node 0 serves, the others run their ranks only
    nnodes: int = 1
    #: this host's place among the `nnodes` (0: the engine that schedules and serves)
    node_rank: int = 0
    #: HOST:PORT of node 0 that every node reaches: torch.distributed's rendezvous store
    #: listens on PORT, node 0's control channel to the other nodes' ranks on PORT + 1
    dist_init_addr: str | None = None
    #: seconds a node waits for the others at start-up (node 0 for the other nodes' ranks,
    #: another node for node 0) before it fails with an error
    dist_init_timeout: float = 300.0

    #: batch-invariant kernels (engine.deterministic): a request's tokens do not depend on
    #: the batch, the chunking, the step kind or where its prefix's KV came from, in bf16
    #: too; costs some throughput (docs/deterministic.md)
    deterministic: bool = False
    #: publish what the engine's caches hold (GPU prefix cache, CPU and disk tiers, writes
    #: to a shared tier) as KV events on this ZeroMQ PUB endpoint (kv_events; a router
    #: follows them), e.g. ``tcp://*:5557``; None: no events
    kv_events_endpoint: str | None = None
    #: the ROUTER endpoint that answers replay and snapshot requests (needed with events)
    kv_events_replay_endpoint: str | None = None
    #: the engine's name in its KV events (default: host name and process id)
    engine_id: str | None = None

    def __post_init__(self) -> None:
        # the connector acts on the engine's P/D role (a producer offers, a consumer takes)
        if self.kv_offload is not None and getattr(self.kv_offload, "kv_role", self.kv_role) != self.kv_role:
            self.kv_offload = dataclasses.replace(self.kv_offload, kv_role=self.kv_role)

    def _check_handoff_path(self) -> None:
        """A producer or consumer needs a way to hand KV over: the shared tier (a remote_url)
        or the direct path (NIXL and a CPU tier), as ``kv_offload.kv_transfer`` asks."""
        offload = self.kv_offload
        from connector.nixl_import import wants_direct

        split = self.pipeline_parallel_size > 1 or self.tensor_parallel_size > 1
        if offload is not None and offload.kv_transfer == "direct":
            wants_direct("direct", cpu_bytes=offload.cpu_bytes, split=split)  # ValueError says what lacks
        elif offload is None or (
            offload.remote_url is None
            and not (
                offload.kv_transfer == "auto"
                and wants_direct("auto", cpu_bytes=offload.cpu_bytes, split=split)
            )
        ):
            how = "serve: --kv-offload --kv-offload-remote redis://HOST:PORT or grpc://HOST:PORT"
            raise ValueError(
                f"kv_role {self.kv_role!r} needs a tier shared by producers and consumers: kv_offload "
                f"with a remote_url ({how}), or the direct path (kv_transfer direct or auto, with NIXL installed)"
            )

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if (self.kv_events_endpoint is None) != (self.kv_events_replay_endpoint is None):
            raise ValueError(
                "kv_events_endpoint and kv_events_replay_endpoint go together: give both "
                f"(got {self.kv_events_endpoint!r} and {self.kv_events_replay_endpoint!r})"
            )
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_role != "both":
            self._check_handoff_path()
        if self.dtype != "auto" and self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "cpu_kv_cache_bytes",
            "pipeline_parallel_size",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        threshold = self.long_prefill_token_threshold
        if not _is_int(threshold) or threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be an integer >= 0 (0: off), got {threshold!r}"
            )
        gap_ms = self.max_decode_gap_ms
        if not _is_real(gap_ms) or not (gap_ms == 0 or MIN_DECODE_GAP_MS <= gap_ms < math.inf):
            raise ValueError(
                f"max_decode_gap_ms must be 0 (off) or a finite number of milliseconds >= "
                f"{MIN_DECODE_GAP_MS:g}, got {gap_ms!r}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.model_id is not None and not (isinstance(self.model_id, str) and self.model_id.strip()):
            raise ValueError(f"model_id must be a non-empty string when given, got {self.model_id!r}")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be None or one of {SPECULATIVE_METHODS}, got {self.speculative!r}"
            )
        if not _is_int(self.max_graph_tokens) or self.max_graph_tokens < 0:
            raise ValueError(
                f"max_graph_tokens must be an integer >= 0 (0: graphs for pure decode only), "
                f"got {self.max_graph_tokens!r}"
            )
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"speculative={self.speculative!r} needs num_speculative_tokens >= 1")
        check_cpu_offload_gb(self.cpu_offload_gb)
        if self.pipeline_parallel_size > 1 and self.cpu_offload_gb:
            raise ValueError("cpu_offload_gb is not supported with pipeline_parallel_size > 1")
        if self.pipeline_parallel_size > 1 and self.deterministic:
            raise ValueError("deterministic is not supported with pipeline_parallel_size > 1")
        check_nodes(
            self.nnodes,
            self.node_rank,
            self.dist_init_addr,
            self.tensor_parallel_size * self.pipeline_parallel_size,
            self.dist_init_timeout,
        )
        if self.tensor_parallel_size > 1:
            unsupported = {
                "cpu_offload_gb": bool(self.cpu_offload_gb),
                "deterministic": self.deterministic,
            }
            for name, is_set in unsupported.items():
                if is_set:
                    raise ValueError(f"{name} is not supported with tensor_parallel_size > 1 (yet)")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(
                f"ngram sizes need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n} and {self.ngram_max_n}"
            )

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return dtype_from_name(self.dtype)
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


#: temperatures below this sample greedily: dividing logits by a tinier one overflows
#: float32 to inf, and the NaN probabilities that follow would fail the whole step
GREEDY_TEMPERATURE = 1e-5
#: bounds of the integer sampling fields: the sampler holds top_k in an int64 tensor and
#: torch.Generator.manual_seed takes a seed in [-2**63, 2**64); max_tokens is bounded
#: further by the model's context when the engine admits the request
MAX_INT32 = 2**31 - 1
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
#: stop strings are searched in the output text at every step: their number and length are bounded
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024


class SamplingParamsError(ValueError):
    """A sampling field is invalid; `field` names it (the server's 400 answer names it too)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _as_float32(value: float) -> float:
    """`value` as the sampler's float32 tensors hold it (overflow gives inf, underflow 0)."""
    if not math.isfinite(value):
        return value
    with np.errstate(over="ignore"):
        return float(np.float32(value))


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    temperature 0 (or below GREEDY_TEMPERATURE) is greedy. top_k 0 or -1 and top_p 1.0
    disable those filters (a top_k above the vocabulary keeps every token). `seed` gives
    the request its own torch.Generator: the same seed, prompt and params give the same
    tokens. `stop` strings end generation; the returned text stops before the stop
    string. `ignore_eos` keeps generating past EOS.

    Every field is checked in the dtype the sampler uses (`validate`), so a value that
    passes can never fail an engine step: top_p must stay above 0 in float32 (1e-300 does
    not), temperature finite in float32, top_k and max_tokens within int32."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        elif self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, list | tuple):
            self.stop_strings = tuple(self.stop)
        else:
            raise SamplingParamsError(
                "stop", f"stop must be a string or a list of strings, got {self.stop!r}"
            )
        self.validate()

    def validate(self) -> None:
        """Raise SamplingParamsError (a ValueError) naming the first bad field. Called at
        construction and again by the engine when it admits a request."""
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT32:
            raise SamplingParamsError(
                "max_tokens", f"max_tokens must be an integer in [1, {MAX_INT32}], got {self.max_tokens!r}"
            )
        if not _is_real(self.temperature) or not 0.0 <= _as_float32(self.temperature) < math.inf:
            raise SamplingParamsError(
                "temperature",
                f"temperature must be a number >= 0 that is finite in float32, got {self.temperature!r}",
            )
        if not _is_real(self.top_p) or not 0.0 < _as_float32(self.top_p) <= 1.0:
            raise SamplingParamsError(
                "top_p", f"top_p must be in (0, 1] and above 0 in float32, got {self.top_p!r}"
            )
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT32:
            raise SamplingParamsError(
                "top_k",
                f"top_k must be an integer in [-1, {MAX_INT32}] (0 or -1 disables it), got {self.top_k!r}",
            )
        if self.seed is not None and (not _is_int(self.seed) or not MIN_SEED <= self.seed <= MAX_SEED):
            raise SamplingParamsError(
                "seed", f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {self.seed!r}"
            )
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise SamplingParamsError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop_strings)}"
            )
        if any(not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop_strings):
            raise SamplingParamsError(
                "stop",
                f"stop must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters, "
                f"got {_shorten(self.stop)}",
            )
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos", f"ignore_eos must be a boolean, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def _shorten(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}..."


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads from a checkpoint's config (any supported family)."""

    family: str
    hf_config: Any  # transformers.PretrainedConfig
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    checkpoint_dtype: torch.dtype | None

    @staticmethod
    def from_hf_config(hf_config: Any) -> ModelConfig:
        """Build from an in-memory transformers config (benchmarks with random weights)."""
        architectures = getattr(hf_config, "architectures", None) or []
        family = next((ARCHITECTURE_TO_FAMILY[a] for a in architectures if a in ARCHITECTURE_TO_FAMILY), None)
        if family is None:
            model_type = getattr(hf_config, "model_type", None)
            family = model_type if model_type in ARCHITECTURE_TO_FAMILY.values() else None
        if family is None:
            raise ValueError(
                f"unknown architecture {architectures or getattr(hf_config, 'model_type', None)!r}; "
                f"supported: {sorted(ARCHITECTURE_TO_FAMILY)}"
            )
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
        dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = dtype_from_name(dtype)
        max_model_len = hf_config.max_position_embeddings
        sliding_window = getattr(hf_config, "sliding_window", None)
        if family in ("qwen2", "qwen3") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        if sliding_window is not None and sliding_window < max_model_len:
            # Attention here is full causal: within the window that equals sliding-window
            # attention, so the context is capped at the window rather than drifting from HF.
            max_model_len = sliding_window
        return ModelConfig(
            family=family,
            hf_config=hf_config,
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=eos_ids,
            checkpoint_dtype=dtype if _is_torch_dtype(dtype) else None,
        )

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` EOS ids) from a local folder."""
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ValueError(f"no config.json in model folder {str(model_dir)!r}")
        raw = json.loads(config_path.read_text())
        architectures = raw.get("architectures") or []
        if not any(a in ARCHITECTURE_TO_FAMILY for a in architectures):
            raise ValueError(
                f"unknown architecture {architectures or raw.get('model_type')!r} in {config_path}; "
                f"supported: {sorted(ARCHITECTURE_TO_FAMILY)}"
            )
        from transformers import AutoConfig

        config = ModelConfig.from_hf_config(AutoConfig.from_pretrained(model_dir, local_files_only=True))
        generation_path = model_dir / "generation_config.json"
        if generation_path.is_file():
            eos = json.loads(generation_path.read_text()).get("eos_token_id")
            if eos is not None:
                extra = {eos} if isinstance(eos, int) else set(eos)
                config = _replace_eos(config, config.eos_token_ids | extra)
        return config


def _replace_eos(config: ModelConfig, eos_ids: frozenset[int] | set[int]) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=frozenset(eos_ids))


def _is_torch_dtype(value: object) -> bool:
    import torch

    return isinstance(value, torch.dtype)
