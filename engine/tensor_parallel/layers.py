"""The layers whose output needs the other ranks: a row-parallel linear layer (o_proj,
down_proj: each rank multiplies its slice of the input features, the partial sums are
all-reduced, the bias is added once after), and the vocab-parallel embedding (each
rank looks up the ids in its vocabulary rows, zero elsewhere; the all-reduce sums the
one non-zero row). Column-parallel layers (q/k/v, gate/up, the LM head) are plain
`nn.Linear`s over a rank's output rows: they need no communication."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.tensor_parallel.comm import TensorParallelGroup


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: ``weight`` [out, in_shard] is this rank's
    columns of the full weight; ``bias`` (full, replicated) is added after the sum."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup, **factory
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce_(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[vocab_start, vocab_start + num_rows)`` of the embedding (``weight`` has
    ``num_rows`` rows, padding past the vocabulary included); the forward returns the
    full embedding of every id, the same on every rank."""

    def __init__(
        self, num_rows: int, dim: int, vocab_start: int, group: TensorParallelGroup, **factory
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, dim, **factory))
        self.vocab_start = vocab_start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce_(out)
