"""Build a model and fill its weights: from `*.safetensors` by name, or random
(`load_format="dummy"`, for full-size benchmarks where values do not matter).
With `cpu_offload_gb` the last layers are built in CPU memory and streamed to the
device per pass (engine.models.weight_offload)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.weight_offload import WeightOffloader, materialize, plan_weight_offload
from engine.models.weight_reader import WeightReadStats, read_checkpoint

if TYPE_CHECKING:
    from engine.models.fingerprint import WeightHashCache


def load_model(
    config: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool = False,
    cpu_offload_gb: float = 0.0,
    weight_hashes: WeightHashCache | None = None,
) -> LlamaFamilyForCausalLM:
    """Called once at engine start. Raises ValueError when a weight is missing, has
    the wrong shape, or no safetensors file exists, or for a bad `cpu_offload_gb`.
    The model's `weight_offloader` is its `WeightOffloader`, or None; its
    `weight_read_stats` what reading the files took (None for dummy weights). With
    `weight_hashes`, files whose digest it lacks are hashed as they are read and recorded
    there, so that `fingerprint.model_fingerprint` reads no byte again."""
    plan = plan_weight_offload(config, dtype, cpu_offload_gb) if cpu_offload_gb else None
    cpu_layer_ids = plan.offloaded_layer_ids if plan is not None else ()
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    materialize(model, device, cpu_layer_ids)
    model.set_rope_device(device)
    model.weight_read_stats = None
    if dummy:
        _init_random(model, config)
    else:
        if model_dir is None:
            raise ValueError("a model folder is needed unless load_format='dummy'")
        model.weight_read_stats = _load_safetensors(model, Path(model_dir), weight_hashes)
    model.fuse_projections()
    model = model.eval().requires_grad_(False)
    model.weight_offloader = None
    if cpu_layer_ids:
        model.weight_offloader = WeightOffloader(model.model.layers, cpu_layer_ids, device)
        if device.type == "cuda":
            # the temporaries of a random init of CPU layers: give them back before the
            # engine measures free memory for the KV cache
            torch.cuda.empty_cache()
    return model


def _init_random(model: LlamaFamilyForCausalLM, config: ModelConfig) -> None:
    std = float(getattr(config.hf_config, "initializer_range", 0.02))
    device = model.model.embed_tokens.weight.device
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif param.device == device:
                param.normal_(0.0, std, generator=generator)
            else:
                # an offloaded layer in CPU memory: the same values as on the device
                param.copy_(torch.empty_like(param, device=device).normal_(0.0, std, generator=generator))


def _load_safetensors(
    model: torch.nn.Module, model_dir: Path, weight_hashes: WeightHashCache | None = None
) -> WeightReadStats:
    """Fill every parameter of ``model`` from ``model_dir``'s safetensors files, each file
    read once by a thread of its own (engine.models.weight_reader); hash the files
    ``weight_hashes`` has no digest for and record them there."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(model_dir)!r}")
    name_to_param = dict(model.named_parameters())
    path_to_identity = {}
    if weight_hashes is not None:
        for path in files:
            identity, cached = weight_hashes.cached_digest(path)
            if cached is None:
                path_to_identity[path] = identity
    with torch.no_grad():
        stats, loaded_names = read_checkpoint(files, name_to_param, hash_paths=frozenset(path_to_identity))
    for path, identity in path_to_identity.items():
        weight_hashes.record(path, identity, stats.path_to_digest[path])
    missing = sorted(set(name_to_param) - loaded_names)
    if missing:
        raise ValueError(f"weights missing from {str(model_dir)!r}: {', '.join(missing[:8])}")
    return stats
