"""Build a model and fill its weights: from `*.safetensors` by name, or random
(`load_format="dummy"`, for full-size benchmarks where values do not matter)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.llama import LlamaFamilyForCausalLM


def load_model(
    config: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool = False,
) -> LlamaFamilyForCausalLM:
    """Called once at engine start. Raises ValueError when a weight is missing, has
    the wrong shape, or no safetensors file exists."""
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    model = model.to_empty(device=device)
    model.set_rope_device(device)
    if dummy:
        _init_random(model, config)
    else:
        if model_dir is None:
            raise ValueError("a model folder is needed unless load_format='dummy'")
        _load_safetensors(model, Path(model_dir))
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def _init_random(model: LlamaFamilyForCausalLM, config: ModelConfig) -> None:
    std = float(getattr(config.hf_config, "initializer_range", 0.02))
    generator = torch.Generator(device=model.model.embed_tokens.weight.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)


def _load_safetensors(model: LlamaFamilyForCausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(model_dir)!r}")
    name_to_param = dict(model.named_parameters())
    loaded_names: set[str] = set()
    device = next(iter(name_to_param.values())).device
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name not in name_to_param:
                        # e.g. rotary inv_freq buffers of old checkpoints, or lm_head when tied
                        continue
                    tensor = f.get_tensor(name)
                    param = name_to_param[name]
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"weight {name} in {path.name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                        )
                    param.copy_(tensor.to(device=device, dtype=param.dtype))
                    loaded_names.add(name)
    missing = sorted(set(name_to_param) - loaded_names)
    if missing:
        raise ValueError(f"weights missing from {str(model_dir)!r}: {', '.join(missing[:8])}")
