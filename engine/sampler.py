"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded
torch.Generator. Called by the model runner once per step on the logits of the
requests that produce a token."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.config import SamplingParams
from engine.host_copy import host_to_device


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits float32 [N, V]; top_k int64 [N] (0 = off); top_p float32 [N] (1.0 = off).
    Returns logits with the filtered-out tokens set to -inf. top-k keeps the k largest
    logits (ties at the k-th value kept); top-p then keeps the smallest set of most
    likely tokens whose probability reaches top_p (always at least one)."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), torch.full_like(top_k, vocab_size))
    kth_value = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # probability mass strictly before each token; a token is dropped once that already reaches top_p
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)


def sampling_probs(
    logits: torch.Tensor,  # float32 [N, V]
    params: Sequence[SamplingParams],  # N non-greedy params
    *,
    row_wise: bool = False,
) -> torch.Tensor:  # float32 [N, V]
    """The distribution each row samples from: softmax(logits / temperature) after
    top-k/top-p. Also the target distribution of speculative verification.
    `row_wise` (the deterministic mode) computes each row alone, so its softmax and
    cumulative sums cannot depend on the other rows' number."""
    if row_wise and logits.shape[0] > 1:
        return torch.cat([sampling_probs(logits[i : i + 1], [p]) for i, p in enumerate(params)])
    device = logits.device
    temperature = host_to_device(torch.tensor([p.temperature for p in params]), device)
    scaled = logits / temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = host_to_device(torch.tensor([p.top_k for p in params], dtype=torch.int64), device)
        top_p = host_to_device(torch.tensor([p.top_p for p in params], dtype=torch.float32), device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


def sample(
    logits: torch.Tensor,  # float32 [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    row_wise: bool = False,
) -> list[int]:
    """One token id per row. Greedy rows take the argmax; the others sample from
    softmax(logits / temperature) after top-k/top-p, drawing from their own
    generator (seeded requests) or the global RNG. `row_wise`: see `sampling_probs`."""
    return sample_on_device(logits, params, generators, row_wise=row_wise).tolist()


def sample_on_device(
    logits: torch.Tensor,  # float32 [N, V]
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    row_wise: bool = False,
) -> torch.Tensor:  # int64 [N], on the logits' device
    """`sample` without reading the tokens back: the host does not wait for the device
    (the model runner reads them later, or feeds them to the next step on the device)."""
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = host_to_device(torch.tensor(random_rows), logits.device)
        probs = sampling_probs(logits[rows], [params[i] for i in random_rows], row_wise=row_wise)
        for row_index, i in enumerate(random_rows):
            token_ids[i] = torch.multinomial(probs[row_index], 1, generator=generators[i])[0]
    return token_ids
