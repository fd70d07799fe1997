"""What an engine would run, read without starting one: the model's config, the device
and dtype that engine arguments resolve to, and the KV bytes of one token."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def engine_device_dtype(model, engine_args: dict[str, Any]):
    """(torch.device, torch.dtype) of the engine that `engine_args` would start on `model`
    (a folder or an in-memory config), without starting it."""
    from engine.config import EngineArgs

    args = EngineArgs(**engine_args)
    device = args.resolve_device()
    return device, args.resolve_dtype(device, model_config(model).checkpoint_dtype)


def kv_bytes_per_token(model, engine_args: dict[str, Any]) -> int:
    """KV bytes of one token in the engine that `engine_args` would start (all layers, K and V)."""
    from engine.model_runner import kv_bytes_per_block

    _, dtype = engine_device_dtype(model, engine_args)
    return kv_bytes_per_block(model_config(model), 1, dtype)


def model_config(model):
    """The engine's `ModelConfig` of `model`: a model folder or an in-memory transformers config."""
    from engine.config import ModelConfig

    return ModelConfig.from_dir(model) if isinstance(model, str | Path) else ModelConfig.from_hf_config(model)
