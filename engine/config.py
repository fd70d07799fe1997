"""User-facing configuration: `EngineArgs`, `SamplingParams` and the model config reader.

`EngineArgs` field names are also the CLI flags (with `-`). `ModelConfig` is what
the engine needs to know about a checkpoint, read once at start-up from
`config.json` through transformers (so both the 4.x and 5.x config layouts work).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from connector import OffloadConfig

#: Hugging Face `architectures` names this engine implements → model family.
ARCHITECTURE_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

_DTYPE_NAMES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}

SPECULATIVE_METHODS = ("ngram",)


@dataclass
class EngineArgs:
    """Everything that configures one engine. CLI flags use the same names with `-`.

    `dtype` "auto" means float32 on CPU and the checkpoint's dtype on CUDA.
    `device` "auto" means CUDA when available, else CPU. The KV pool has
    `num_gpu_blocks` blocks when given, else it takes `gpu_memory_utilization`
    of the GPU memory (on CUDA) or `cpu_kv_cache_bytes` (on CPU).
    `load_format` "dummy" initialises random weights instead of reading
    safetensors (benchmarks of full-size shapes). `enforce_eager` turns off the
    CUDA graphs that otherwise replay pure-decode steps."""

    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 128 << 20
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_offload: OffloadConfig | None = None
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
    #: never use CUDA graphs (they replay pure-decode steps on CUDA)
    enforce_eager: bool = False
    #: compile and plan every kernel variant and shape class at start-up on CUDA
    #: (engine.warmup); off, the first requests of each shape pay it
    warmup: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.dtype != "auto" and self.dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_kv_cache_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
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
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.speculative is not None and self.num_speculative_tokens < 1:
            raise ValueError(f"speculative={self.speculative!r} needs num_speculative_tokens >= 1")
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError(
                f"ngram sizes need 1 <= ngram_min_n <= ngram_max_n, got {self.ngram_min_n} and {self.ngram_max_n}"
            )

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return _DTYPE_NAMES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


#: temperatures below this sample greedily: dividing logits by a tinier one overflows
#: float32 to inf, and the NaN probabilities that follow would fail the whole step
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    temperature 0 (or below GREEDY_TEMPERATURE) is greedy. top_k 0 and top_p 1.0 disable those filters.
    `seed` gives the request its own torch.Generator: the same seed, prompt and
    params give the same tokens. `stop` strings end generation; the returned text
    stops before the stop string. `ignore_eos` keeps generating past EOS."""

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
        else:
            self.stop_strings = tuple(self.stop)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature < float("inf"):  # also rejects NaN
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


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
            dtype = _DTYPE_NAMES.get(dtype)
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
            checkpoint_dtype=dtype if isinstance(dtype, torch.dtype) else None,
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
