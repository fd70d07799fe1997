"""The part of a Llama-family model that one pipeline stage computes.

A stage holds the decoder layers of its range (under their checkpoint names, so
weights load by name), the embedding when it is the first stage, and the final
norm and LM head when it is the last (a tied head keeps the embedding there too).
Its layers number their KV from 0 (the stage's own KV tensor and connector); the
model runner sees a model of `layout.num_layers` layers.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.models.llama import (
    AttentionFn,
    DecoderLayer,
    LlamaFamilyForCausalLM,
    RMSNorm,
    empty_embedding,
    final_hidden,
    final_norm,
    run_layers,
)
from engine.models.loader import _load_safetensors
from engine.models.rope import RotaryEmbedding
from engine.pipeline.layer_split import StageLayout


class PipelineStageModel(nn.Module):
    """`forward(input_ids [T], positions [T], attention)` like the whole model: the first
    stage embeds `input_ids`; a later stage starts from the hidden states its runner put
    in `input_hidden` (set once per step before the forward, cleared by it). The last
    stage returns normed final hidden states, the others the residual stream [T, hidden]
    that the next stage starts from. `compute_logits` exists on the last stage only."""

    def __init__(
        self, config: ModelConfig, layout: StageLayout, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.config = config
        self.layout = layout
        factory = {"device": device, "dtype": dtype}
        hf = config.hf_config
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        self.model = nn.Module()
        if layout.is_first or (layout.is_last and self.tie_word_embeddings):
            self.model.embed_tokens = empty_embedding(config.vocab_size, config.hidden_size, **factory)
        # keyed by the global layer index (checkpoint names), numbered from 0 for the KV
        self.model.layers = nn.ModuleDict(
            {
                str(layer): DecoderLayer(config, layer - layout.first_layer, **factory)
                for layer in range(layout.first_layer, layout.end_layer)
            }
        )
        if layout.is_last:
            self.model.norm = RMSNorm(config.hidden_size, hf.rms_norm_eps, **factory)
            if not self.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        self.rotary: RotaryEmbedding | None = None
        self.input_hidden: torch.Tensor | None = None

    def set_rope_device(self, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config.hf_config, device)

    def fuse_projections(self) -> None:
        for layer in self.model.layers.values():
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        if self.layout.is_first:
            hidden = self.model.embed_tokens(input_ids)
        else:
            hidden, self.input_hidden = self.input_hidden, None
            if hidden is None:
                raise RuntimeError("a later pipeline stage ran its forward without input hidden states")
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        hidden, residual = run_layers(self.model.layers.values(), hidden, cos, sin, attention)
        if self.layout.is_last:
            return final_norm(self.model.norm, hidden, residual)
        return final_hidden(hidden, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.layout.is_last:
            raise RuntimeError("only the last pipeline stage computes logits")
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()


def load_stage_model(
    config: ModelConfig,
    model_dir: Path | None,
    layout: StageLayout,
    device: torch.device,
    dtype: torch.dtype,
    *,
    dummy: bool = False,
) -> PipelineStageModel:
    """Called once per stage at engine start: only the stage's weights are allocated and
    read. Random (`dummy`) weights equal the whole model's (`engine.models.loader`), so
    an engine of N stages computes what one of 1 stage does."""
    with torch.device("meta"):
        model = PipelineStageModel(config, layout, torch.device("meta"), dtype)
    model = model.to_empty(device=device)
    model.set_rope_device(device)
    if dummy:
        _init_random_like_whole_model(model, config, dtype)
    else:
        if model_dir is None:
            raise ValueError("a model folder is needed unless load_format='dummy'")
        _load_safetensors(model, Path(model_dir))
    model.fuse_projections()
    return model.eval().requires_grad_(False)


def _init_random_like_whole_model(model: PipelineStageModel, config: ModelConfig, dtype: torch.dtype) -> None:
    """Draw the whole model's random weights in its order (engine.models.loader's rule),
    keeping the stage's: one throwaway tensor at a time for the others."""
    with torch.device("meta"):
        whole = LlamaFamilyForCausalLM(config, torch.device("meta"), dtype)
    name_to_param = dict(model.named_parameters())
    device = next(iter(name_to_param.values())).device
    std = float(getattr(config.hf_config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, meta_param in whole.named_parameters():
            param = name_to_param.get(name)
            if param is None:
                param = torch.empty(meta_param.shape, dtype=dtype, device=device)
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.normal_(0.0, std, generator=generator)
