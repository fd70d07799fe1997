"""Runner-side verification: turn the target model's logits at the draft positions into
the tokens each request emits, through the rejection sampler.

The model runner calls `draft_layout` and `verify_layout` once per step that carries
drafts: the first says which logits rows check which drafts (host only), the second
verifies them (`verify_drafts`) and reads the verdict. They change nothing but the state
of the random generators that sampled requests draw from (their own, or torch's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

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


class DraftLayout(NamedTuple):
    """A verification step's drafts, laid out by `draft_layout`."""

    requests: list  # the requests with drafts, in plan order
    draft_token_ids: list[list[int]]  # their drafts
    draft_rows: list[int]  # per draft, the flat row whose logits check it
    sample_indices: list[int]  # per request, its index among the step's sampled tokens


def draft_layout(
    requests: Sequence, request_id_to_spec_token_ids: Mapping[str, list[int]], logits_rows: list[int]
) -> DraftLayout:
    """Where each request's drafts are checked (host only): the logits row before each
    draft, and the request's index among the step's samples (rows >= 0). ``requests`` and
    ``request_id_to_spec_token_ids`` are the step plan's; ``logits_rows`` the row of each
    request's last token (-1: it samples nothing)."""
    layout = DraftLayout([], [], [], [])
    sample_index = 0
    for request, last_row in zip(requests, logits_rows, strict=True):
        if last_row < 0:
            continue
        spec_token_ids = request_id_to_spec_token_ids.get(request.request_id)
        if spec_token_ids:
            layout.requests.append(request)
            layout.draft_token_ids.append(spec_token_ids)
            layout.draft_rows.extend(range(last_row - len(spec_token_ids), last_row))
            layout.sample_indices.append(sample_index)
        sample_index += 1
    return layout


def verify_layout(
    layout: DraftLayout,
    draft_logits: torch.Tensor,  # float32 [len(layout.draft_rows), vocab]
    sampled_token_ids: torch.Tensor,  # [num_sampling_requests], on the device
    device: torch.device,
    *,
    row_wise: bool,
    to_host: Callable[[torch.Tensor], list],
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Check every request's drafts against the logits of the positions before them;
    the token after its accepted drafts replaces its sampled (bonus) token.
    `sampled_token_ids` holds the step's samples; they stay on the device: the host
    waits once, for the verdict (`row_wise`, `to_host`: see `verify_drafts`).
    Returns (request id -> accepted drafts, request id -> its token after them)."""
    requests = layout.requests
    emitted = verify_drafts(
        draft_logits,
        layout.draft_token_ids,
        sampled_token_ids[host_to_device(torch.tensor(layout.sample_indices), device)],
        [r.sampling_params for r in requests],
        [r.generator for r in requests],
        row_wise=row_wise,
        to_host=to_host,
    )
    request_id_to_accepted_draft_ids, request_id_to_last_token = {}, {}
    for request, tokens in zip(requests, emitted, strict=True):
        request_id_to_last_token[request.request_id] = tokens[-1]
        request_id_to_accepted_draft_ids[request.request_id] = tokens[:-1]
    return request_id_to_accepted_draft_ids, request_id_to_last_token
