"""Model-size presets of `kvstash bench`: which model it runs, with which workload.

A preset fixes the generated model and the workload's defaults (flags given on the
command line win). On CUDA the default is `8b`, the Llama-3.1-8B shape with random
weights made on the GPU (bf16): on a GPU the bench-size model recomputes 8k tokens
in ~20 ms, less than loading their KV costs, so a small model would say offloading
does not pay where it pays most. On CPU the default stays `bench`, whose prefill
already costs what a real model's costs on a GPU (hundreds of ms per 1k tokens).

Called once per `kvstash bench` run, before any engine starts; no state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: names accepted by `--model-size`
PRESET_NAMES = ("tiny", "bench", "8b")


@dataclass(frozen=True)
class WorkloadDefaults:
    """Defaults of the workload flags (`--users`, `--context-len`, ...)."""

    num_users: int
    context_len: int
    num_rounds: int = 3
    question_len: int = 32
    answer_len: int = 16


@dataclass(frozen=True)
class ModelPreset:
    name: str
    #: one line for the start-up banner and bench.json
    description: str
    workload: WorkloadDefaults
    #: engine arguments the preset sets unless the command line gives them
    engine_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def generates_full_size(self) -> bool:
        """Whether the model is an in-memory full-size config with random weights
        (made on the device, nothing written to disk) rather than a generated folder."""
        return self.name == "8b"


PRESETS = {
    "tiny": ModelPreset(
        "tiny",
        "tiny random-weight Llama (~0.2M parameters; tests, seconds)",
        WorkloadDefaults(num_users=4, context_len=1024),
    ),
    "bench": ModelPreset(
        "bench",
        "bench-size random-weight Llama (~25M parameters, 16k context), saved under the cache folder",
        WorkloadDefaults(num_users=4, context_len=1024),
    ),
    # 6 users x ~8.3k tokens: the engine's KV pool keeps one user (1 GiB of bf16 KV), the
    # CPU tier all of them; 18 timed requests per run take seconds on an H100, so engine
    # start-up (compilation, CUDA graphs) dominates the couple of minutes.
    "8b": ModelPreset(
        "8b",
        "Llama-3.1-8B shape (32 layers, 4096 hidden, 8 KV heads, 128k vocab), random weights made on the device",
        WorkloadDefaults(num_users=6, context_len=8192),
        # Requests go one at a time: capture decode CUDA graphs for a few sequences, not 256.
        engine_defaults={"max_num_seqs": 4, "load_format": "dummy"},
    ),
}


def resolve_preset(
    model_size: str | None, on_cuda: bool, *, own_model: bool = False
) -> tuple[ModelPreset, str]:
    """-> (preset, the reason it was chosen, printed at start). `model_size` None picks by
    device: `8b` on CUDA, `bench` on CPU. With `own_model` (`--model DIR`) the preset only
    gives the workload defaults. Raises ValueError for an unknown name."""
    if model_size is not None:
        if model_size not in PRESETS:
            raise ValueError(f"unknown model size {model_size!r}; choose one of {', '.join(PRESET_NAMES)}")
        reason = "chosen with --model-size"
        preset = PRESETS[model_size]
    elif on_cuda:
        preset = PRESETS["8b"]
        reason = (
            "the default on CUDA: a GPU recomputes the bench-size model's prompts faster than it "
            "loads their KV, while an 8B model's prefill costs what real models cost"
        )
    else:
        preset = PRESETS["bench"]
        reason = "the default on CPU: its prefill costs what a real model's costs on a GPU, and a run takes minutes"
    if own_model:
        reason += "; your --model replaces the preset's model, the preset gives the workload defaults"
    return preset, reason


#: Llama-3.1-8B's shapes
LLAMA31_8B_SHAPES = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
}


def llama31_config(**shapes):
    """An in-memory transformers config of the Llama-3.1 family (llama3 RoPE scaling, norms,
    untied embeddings; no download) with ``shapes`` (and token ids) over the 8B ones. The
    benchmarks use it with smaller shapes too."""
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    defaults = {**LLAMA31_8B_SHAPES, "bos_token_id": 128000, "eos_token_id": 128001}
    config = LlamaConfig(
        **{**defaults, **shapes},
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=rope,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def llama31_8b_config():
    """Llama-3.1-8B's config (random weights are made from it; no download)."""
    return llama31_config()
