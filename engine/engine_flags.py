"""Click options for every `EngineArgs` field (flag = field name with `-`), shared
by the commands that start an engine (`generate`, `serve`, `bench`). A command may give
some fields defaults of its own (`serve` caps decode gaps: engine.server.cli); the others
are `EngineArgs`' defaults."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from engine.config import EngineArgs

_DEFAULTS = EngineArgs()

#: field -> (click type, help); `kv_offload` is configured by the connector's own flags.
_FIELD_OPTIONS: dict[str, tuple[Any, str]] = {
    "dtype": (click.Choice(["auto", "float32", "bfloat16", "float16"]), "Weights and KV dtype."),
    "device": (str, "'auto', 'cpu' or 'cuda[:N]'."),
    "block_size": (int, "Tokens per KV block."),
    "num_gpu_blocks": (int, "KV blocks in the pool (default: from memory)."),
    "gpu_memory_utilization": (float, "Fraction of GPU memory the engine may use."),
    "cpu_kv_cache_bytes": (int, "KV cache bytes when running on CPU."),
    "max_num_seqs": (int, "Most requests running at once."),
    "max_num_batched_tokens": (int, "Token budget per step (chunked prefill)."),
    "long_prefill_token_threshold": (
        int,
        "At most this many prompt tokens of one request per step (vLLM's; 0: off).",
    ),
    "max_decode_gap_ms": (
        float,
        "While a request decodes, cap other prompts' chunks so a step lasts about 3/4 of "
        "this (from the measured prefill rate); a prompt with nothing decoding keeps its full "
        "chunk. 0: off.",
    ),
    "max_model_len": (int, "Context limit (default: the model's)."),
    "enable_prefix_caching": (bool, "Reuse KV of shared prefixes on the GPU."),
    "speculative": (click.Choice(["ngram"]), "Speculative decoding method."),
    "num_speculative_tokens": (int, "Draft tokens per step."),
    "ngram_min_n": (int, "Shortest n-gram the ngram proposer matches."),
    "ngram_max_n": (int, "Longest n-gram the ngram proposer matches (tried first)."),
    "load_format": (click.Choice(["auto", "dummy"]), "'dummy' = random weights."),
    "model_id": (
        str,
        "Model identity for the KV offload namespace instead of the hash of the weight files "
        "(the operator's responsibility: checkpoints given one id share KV).",
    ),
    "seed": (int, "Engine seed."),
    "enforce_eager": (bool, "Never use CUDA graphs (decode steps and small mixed steps)."),
    "max_graph_tokens": (
        int,
        "Steps of up to this many new tokens (prefill chunks, suffixes after a cache hit, "
        "speculative verification) replay a CUDA graph; 0: only pure-decode steps do.",
    ),
    "warmup": (bool, "Compile and plan every kernel shape at start-up (CUDA)."),
    "cpu_offload_gb": (
        float,
        "GiB of weights (whole decoder layers, the last ones) kept in pinned CPU memory and "
        "streamed to the GPU one layer ahead of the compute.",
    ),
    "async_scheduling": (
        bool,
        "Schedule the next step while the device runs the current one (two steps in flight; "
        "with pipeline stages, one micro-batch of disjoint requests per stage; speculative "
        "decoding stays synchronous).",
    ),
    "deterministic": (
        bool,
        "Batch-invariant kernels: the same tokens whatever the batch, chunking, step kind or "
        "KV source, in bf16 too (slower; docs/deterministic.md).",
    ),
    "pipeline_parallel_size": (int, "Pipeline stages: one process per contiguous range of layers."),
    "tensor_parallel_size": (
        int,
        "Tensor-parallel ranks: one process each, every layer's heads and MLP split over them "
        "(must divide the attention heads).",
    ),
    "nnodes": (
        int,
        "Hosts the tensor x pipeline parallel processes are split over, evenly; node 0 serves, "
        "the others run their ranks only.",
    ),
    "node_rank": (int, "This host's place among --nnodes (0: the host that schedules and serves)."),
    "dist_init_addr": (
        str,
        "HOST:PORT of node 0, the same on every node (needed with --nnodes > 1): the "
        "torch.distributed rendezvous listens on PORT, node 0's control channel on PORT + 1.",
    ),
    "dist_init_timeout": (float, "Seconds a node waits for the other nodes at start-up."),
    "kv_events_endpoint": (
        str,
        "Publish what the caches hold (GPU prefix cache, offload tiers) as KV events on this "
        "ZeroMQ PUB endpoint, e.g. tcp://*:5557 (a router follows them; docs/serving.md).",
    ),
    "kv_events_replay_endpoint": (
        str,
        "ZeroMQ ROUTER endpoint answering KV event replays, e.g. tcp://*:5558.",
    ),
    "engine_id": (str, "The engine's name in its KV events (default: host name and process id)."),
}


def engine_options(command: Callable | None = None, /, **defaults: Any) -> Callable:
    """Decorate a click command with one option per `EngineArgs` field: `@engine_options`,
    or `@engine_options(field=value, ...)` for a command whose defaults of those fields
    differ from `EngineArgs`' (its --help shows its own)."""
    unknown = sorted(set(defaults) - set(_FIELD_OPTIONS))
    if unknown:
        raise TypeError(f"engine_options: no engine flag for {unknown}")
    if command is None:
        return lambda decorated: engine_options(decorated, **defaults)
    for name, (option_type, help_text) in reversed(_FIELD_OPTIONS.items()):
        flag = name.replace("_", "-")
        default = defaults.get(name, getattr(_DEFAULTS, name))
        if option_type is bool:
            option = click.option(
                f"--{flag}/--no-{flag}", name, default=default, show_default=True, help=help_text
            )
        else:
            option = click.option(
                f"--{flag}", name, type=option_type, default=default, show_default=True, help=help_text
            )
        command = option(command)
    return command


def engine_args_from_options(options: dict[str, Any]) -> dict[str, Any]:
    """The `EngineArgs` keyword arguments among a command's parsed options."""
    return {name: options[name] for name in _FIELD_OPTIONS if name in options}
