"""Runner-side verification: turn the target model's logits at the draft positions into
the tokens each request emits, through the rejection sampler."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from engine.config import SamplingParams
from engine.host_copy import host_to_device
from engine.sampler import sampling_probs


def verify_drafts(
    draft_logits: torch.Tensor,  # float32 [num_draft_tokens_total, vocab]
    draft_token_ids: Sequence[Sequence[int]],  # per request, at least one draft each
    bonus_token_ids: torch.Tensor,  # int [num_requests] on the device, sampled after each last draft
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    row_wise: bool = False,
    to_host: Callable[[torch.Tensor], list] = torch.Tensor.tolist,
) -> list[list[int]]:
    """Per request, the accepted drafts followed by one more token (recovered or bonus).

    Called by the model runner once per step that carries drafts. Row ``j`` of a request's
    slice of ``draft_logits`` holds the logits of the position before its draft ``j`` (the
    target distribution that draft is checked against). Greedy requests compare drafts with
    the argmax; sampled requests use the speculative-sampling rule on the distribution
    ``engine.sampler.sample`` would draw from, with random numbers from the request's own
    generator (or the global one), so seeded requests are reproducible. N-gram drafts have
    no draft distribution: it is a point mass on the draft. `row_wise`: see
    `engine.sampler.sampling_probs` (the deterministic mode); `to_host` reads the
    verdict (the model runner's passes it through a kernel, not a copy engine)."""
    device = draft_logits.device
    vocab_size = draft_logits.shape[1]
    num_draft_tokens = [len(ids) for ids in draft_token_ids]
    is_greedy = [p.greedy for p in params]
    row_is_greedy = [greedy for greedy, n in zip(is_greedy, num_draft_tokens, strict=True) for _ in range(n)]
    target_probs = torch.zeros_like(draft_logits)
    sampled_rows = [i for i, greedy in enumerate(row_is_greedy) if not greedy]
    if sampled_rows:
        row_params = [p for p, n in zip(params, num_draft_tokens, strict=True) for _ in range(n)]
        rows = host_to_device(torch.tensor(sampled_rows), device)
        target_probs[rows] = sampling_probs(
            draft_logits[rows], [row_params[i] for i in sampled_rows], row_wise=row_wise
        )

    # Greedy verification draws no random numbers: its rows keep these neutral values.
    uniform_samples = torch.zeros(len(row_is_greedy), device=device)
    recovery_noise = torch.ones(len(params), vocab_size, device=device)
    start = 0
    for index, (greedy, generator, num_drafts) in enumerate(
        zip(is_greedy, generators, num_draft_tokens, strict=True)
    ):
        if not greedy:
            uniform_samples[start : start + num_drafts] = torch.rand(
                num_drafts, generator=generator, device=device
            )
            recovery_noise[index].exponential_(generator=generator)
        start += num_drafts
    # The residual sampler divides by the noise: keep it strictly positive.
    recovery_noise.clamp_min_(torch.finfo(torch.float32).tiny)

    if device.type == "cuda":
        from kernels import rejection_sample
    else:
        from kernels.rejection_sampler import rejection_sample_ref as rejection_sample
    # host inputs go through pinned memory: a pageable copy would wait for the forward pass
    out = rejection_sample(
        host_to_device(torch.tensor([t for ids in draft_token_ids for t in ids], dtype=torch.int64), device),
        num_draft_tokens,
        None,
        target_probs,
        draft_logits.argmax(dim=-1),
        bonus_token_ids.to(torch.int64),
        host_to_device(torch.tensor(is_greedy, dtype=torch.bool), device),
        uniform_samples,
        recovery_noise,
        max_spec_len=max(num_draft_tokens),
    )
    return [[t for t in row if t >= 0] for row in to_host(out)]
