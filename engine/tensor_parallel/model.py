"""One tensor-parallel rank's share of a Llama-family model (or of a pipeline stage's
layers: engine.tensor_parallel.stage_model builds it).

The model is built with the rank's config (its query heads, KV heads and MLP columns:
`layout.rank_model_config`), so q/k/v and gate/up are column-parallel by construction;
`shard_modules` makes o_proj and down_proj `RowParallelLinear`, the embedding
`VocabParallelEmbedding`, and the LM head the rank's vocabulary rows; `gather_logits`
brings the logits shards to rank 0, which alone samples. Parameter names stay the
checkpoint's, so `engine.tensor_parallel.weights` loads each rank's slices by name.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.tensor_parallel.comm import TensorParallelGroup
from engine.tensor_parallel.layers import RowParallelLinear, VocabParallelEmbedding
from engine.tensor_parallel.layout import TensorParallelLayout


def shard_modules(
    model: nn.Module,
    layers: list[nn.Module],
    config: ModelConfig,
    layout: TensorParallelLayout,
    group: TensorParallelGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Make a model built with the rank's config (`rank_model_config`) a rank's share:
    o_proj and down_proj of `layers` row-parallel, the embedding (when the model has one)
    vocab-parallel, the LM head (when it has one) the rank's vocabulary rows."""
    factory = {"device": device, "dtype": dtype}
    hidden = config.hidden_size
    if hasattr(model.model, "embed_tokens"):
        model.model.embed_tokens = VocabParallelEmbedding(
            layout.vocab_shard, hidden, layout.vocab_start, group, **factory
        )
    if hasattr(model, "lm_head"):
        model.lm_head = nn.Linear(hidden, layout.vocab_shard, bias=False, **factory)
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(
            attn.o_proj.in_features, hidden, attn.o_proj.bias is not None, group, **factory
        )
        mlp.down_proj = RowParallelLinear(mlp.down_proj.in_features, hidden, False, group, **factory)


def gather_logits(group: TensorParallelGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
    """Every rank's logits shard [N, vocab_shard] gathered to rank 0 -> [N, vocab] there,
    None on the other ranks."""
    shards = group.gather_to_first(local)
    if shards is None:
        return None
    return torch.cat(shards, dim=-1)[:, :vocab_size]
