"""Fill one tensor-parallel rank's weights: its slices of the checkpoint's tensors, read
by name (safetensors' `get_slice` reads only the slice), or the whole model's random
weights (`load_format="dummy"`) sliced the same way, so N ranks compute what one
engine does.

Which slice a parameter takes follows from its name: q/k/v (weights and biases) and
gate/up take the rank's output rows (heads, KV heads, MLP columns), o_proj and
down_proj the rank's input columns, the embedding and LM head the rank's vocabulary
rows (zero past the vocabulary); norms and o_proj's bias are whole.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.llama import LlamaFamilyForCausalLM
from engine.tensor_parallel.layout import TensorParallelLayout


def shard_of(name: str, layout: TensorParallelLayout, config: ModelConfig) -> tuple[int, int, int] | None:
    """``(dim, start, end)``: the slice of checkpoint tensor ``name`` that the rank holds
    (rows past ``end`` up to the shard's size are padding), None when it holds it whole."""
    head_dim = config.head_dim
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return 0, layout.head_start * head_dim, layout.head_end * head_dim
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return 0, layout.kv_head_start * head_dim, layout.kv_head_end * head_dim
    if name.endswith("o_proj.weight"):
        return 1, layout.head_start * head_dim, layout.head_end * head_dim
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return 0, layout.intermediate_start, layout.intermediate_end
    if name.endswith("down_proj.weight"):
        return 1, layout.intermediate_start, layout.intermediate_end
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, layout.vocab_start, layout.vocab_end
    return None


def fill_rank_weights(
    model: torch.nn.Module,
    config: ModelConfig,
    model_dir: Path | None,
    layout: TensorParallelLayout,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool,
):
    """A rank's model built on the meta device (the whole model's layers, or a pipeline
    stage's), materialized on `device` with its slices of the weights; returns it."""
    model = model.to_empty(device=device)
    model.set_rope_device(device)
    if dummy:
        _init_random_like_whole_model(model, config, layout, dtype)
    else:
        if model_dir is None:
            raise ValueError("a model folder is needed unless load_format='dummy'")
        _load_shards(model, Path(model_dir), config, layout)
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def _copy_shard(param: torch.Tensor, shard: torch.Tensor, name: str, where: str) -> None:
    """``param`` = ``shard``, zero-padded along dim 0 (the vocabulary shards' last rows)."""
    if (
        shard.dim() != param.dim()
        or tuple(shard.shape[1:]) != tuple(param.shape[1:])
        or (shard.shape[0] > param.shape[0])
    ):
        raise ValueError(
            f"weight {name} in {where}: slice of shape {tuple(shard.shape)}, expected {tuple(param.shape)}"
        )
    if shard.shape[0] < param.shape[0]:
        param.zero_()
    param[: shard.shape[0]].copy_(shard.to(device=param.device, dtype=param.dtype))


def _load_shards(
    model: torch.nn.Module, model_dir: Path, config: ModelConfig, layout: TensorParallelLayout
) -> None:
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {str(model_dir)!r}")
    name_to_param = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    param = name_to_param.get(name)
                    if param is None:
                        continue  # e.g. rotary inv_freq buffers, or lm_head when tied
                    shard = shard_of(name, layout, config)
                    if shard is None:
                        tensor = f.get_tensor(name)
                    else:
                        dim, start, end = shard
                        whole = f.get_slice(name)
                        tensor = whole[start:end] if dim == 0 else whole[:, start:end]
                    _copy_shard(param, tensor, name, path.name)
                    loaded.add(name)
    missing = sorted(set(name_to_param) - loaded)
    if missing:
        raise ValueError(f"weights missing from {str(model_dir)!r}: {', '.join(missing[:8])}")


def _init_random_like_whole_model(
    model: torch.nn.Module, config: ModelConfig, layout: TensorParallelLayout, dtype: torch.dtype
) -> None:
    """Draw the whole model's random weights in its order (engine.models.loader's rule),
    one full tensor at a time, and keep the rank's slice of each it holds."""
    with torch.device("meta"):
        whole = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    name_to_param = dict(model.named_parameters())
    device = next(iter(name_to_param.values())).device
    std = float(getattr(config.hf_config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, meta_param in whole.named_parameters():
            param = name_to_param.get(name)  # None: another pipeline stage's
            if name.endswith(("norm.weight", ".bias")):
                if param is not None:
                    param.fill_(1.0 if name.endswith("norm.weight") else 0.0)
                continue
            full = torch.empty(meta_param.shape, dtype=dtype, device=device).normal_(
                0.0, std, generator=generator
            )
            if param is None:
                continue
            shard = shard_of(name, layout, config)
            if shard is not None:
                dim, start, end = shard
                full = full.narrow(dim, start, end - start)
            _copy_shard(param, full, name, "random weights")
