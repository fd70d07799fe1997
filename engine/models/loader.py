"""Build a model and fill its weights: from `*.safetensors` by name, or random
(`load_format="dummy"`, for full-size benchmarks where values do not matter).
With `cpu_offload_gb` the last layers are built in CPU memory and streamed to the
device per pass (engine.models.weight_offload)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.llama import LlamaFamilyForCausalLM
from engine.models.weight_offload import WeightOffloader, materialize, plan_weight_offload


def load_model(
    config: ModelConfig,
    model_dir: Path | None,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool = False,
    cpu_offload_gb: float = 0.0,
) -> LlamaFamilyForCausalLM:
    """Called once at engine start. Raises ValueError when a weight is missing, has
    the wrong shape, or no safetensors file exists, or for a bad `cpu_offload_gb`.
    The model's `weight_offloader` is its `WeightOffloader`, or None."""
    plan = plan_weight_offload(config, dtype, cpu_offload_gb) if cpu_offload_gb else None
    cpu_layer_ids = plan.offloaded_layer_ids if plan is not None else ()
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    materialize(model, device, cpu_layer_ids)
    model.set_rope_device(device)
    if dummy:
        _init_random(model, config)
    else:
        if model_dir is None:
            raise ValueError("a model folder is needed unless load_format='dummy'")
        _load_safetensors(model, Path(model_dir))
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


def _load_safetensors(model: LlamaFamilyForCausalLM, model_dir: Path) -> None:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(model_dir)!r}")
    name_to_param = dict(model.named_parameters())
    loaded_names: set[str] = set()
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
                    param.copy_(tensor.to(device=param.device, dtype=param.dtype))
                    loaded_names.add(name)
    missing = sorted(set(name_to_param) - loaded_names)
    if missing:
        raise ValueError(f"weights missing from {str(model_dir)!r}: {', '.join(missing[:8])}")
