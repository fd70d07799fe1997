"""What one `kvstash bench` run will do, resolved from its flags and preset before any
engine starts: the workload, the engine arguments, the model (and the folder a generated
one is made in), and the default offload tiers."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from bench.presets import ModelPreset, llama31_8b_config, resolve_preset
from bench.results import Workload

#: default tiers hold every user's longest conversation (and the warm-up's) with this headroom
TIER_HEADROOM = 1.25


@dataclass
class BenchSettings:
    """What one `kvstash bench` run will do, resolved from its flags and preset."""

    preset: ModelPreset
    #: why this preset (printed at start, kept in bench.json)
    reason: str
    workload: Workload
    engine_args: dict[str, Any]
    #: a model folder, or an in-memory transformers config (the 8b preset); None until made
    model_source: Any
    model_label: str
    #: the generated preset whose folder must be made (or found) in the cache folder
    model_dir_to_make: str | None = None


def bench_settings(
    model: str | None,
    arch: str,
    model_size: str | None,
    workload_flags: dict[str, int | None],
    engine_args: dict[str, Any],
    explicit_engine_args: set[str],
) -> BenchSettings:
    """Resolve the preset (by `model_size`, else by device), the workload (flags that are
    None take the preset's defaults), the engine arguments (the preset's, unless in
    `explicit_engine_args`; a KV pool of one user's longest conversation) and the model.
    Makes nothing and starts nothing. Raises ValueError on bad settings."""
    preset, reason = resolve_preset(
        model_size, _resolves_to_cuda(engine_args["device"]), own_model=model is not None
    )
    defaults = asdict(preset.workload)
    workload = Workload(
        **{name: value if value is not None else defaults[name] for name, value in workload_flags.items()}
    )
    workload.validate()
    engine_args = dict(engine_args)
    if model is None:
        for name, value in preset.engine_defaults.items():
            if name not in explicit_engine_args:
                engine_args[name] = value
    if engine_args.get("num_gpu_blocks") is None:
        engine_args["num_gpu_blocks"] = workload.default_num_gpu_blocks(engine_args["block_size"])
    settings = BenchSettings(preset, reason, workload, engine_args, model, model or "")
    if model is not None:
        return settings
    if preset.generates_full_size:
        if arch != "llama":
            raise ValueError(
                f"the 8b preset is the Llama-3.1-8B shape; --arch {arch} needs --model-size bench"
            )
        if engine_args.get("load_format") != "dummy":
            raise ValueError(
                "the 8b preset has no weights to read: it needs --load-format dummy (its default)"
            )
        settings.model_source, settings.model_label = (
            llama31_8b_config(),
            "llama-3.1-8b shape (random weights)",
        )
    else:
        settings.model_dir_to_make = preset.name
    return settings


def _resolves_to_cuda(device: str) -> bool:
    """Whether the engine's `--device` means a GPU here ("auto": CUDA when available)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def cache_dir() -> Path:
    """kvstash's folder in the user's cache directory (`$XDG_CACHE_HOME/kvstash`, else `~/.cache/kvstash`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstash"


def ensure_bench_model(arch: str, size: str) -> Path:
    """The generated model of `kvstash bench` (made once, then reused from the cache folder)."""
    import json

    from bench.tiny_model import make_tiny_model

    directory = cache_dir() / "models" / f"{size}-{arch}"
    marker = directory / "kvstash_tiny_model.json"
    wanted = {"arch": arch, "seed": 0, "size": size}
    if (
        marker.is_file()
        and json.loads(marker.read_text()) == wanted
        and (directory / "config.json").is_file()
    ):
        return directory
    click.echo(f"making a {size} {arch} model in {directory} (once)", err=True)
    return make_tiny_model(directory, arch=arch, seed=0, size=size)


def default_offload_config(workload: Workload, bytes_per_token: int):
    """CPU memory + a local disk folder under the cache folder (emptied first, so the
    on-run starts cold like the off-run), each sized for every user's longest
    conversation and the warm-up's (at least 0.5 GiB of CPU memory and 2 GiB of disk)."""
    from connector.config import GIB, OffloadConfig

    chunk_size = OffloadConfig.chunk_size
    tokens_per_user = math.ceil(workload.max_prompt_len / chunk_size) * chunk_size
    wanted = math.ceil((workload.num_users + 1) * tokens_per_user * bytes_per_token * TIER_HEADROOM)
    disk_path = cache_dir() / "bench" / "kv-disk"
    shutil.rmtree(disk_path, ignore_errors=True)
    disk_path.mkdir(parents=True)
    return OffloadConfig(
        cpu_bytes=max(GIB // 2, wanted), disk_path=str(disk_path), disk_bytes=max(2 * GIB, wanted)
    )
