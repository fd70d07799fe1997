"""Scheduler-side drafting: how many drafts a decode step may carry, and which."""

from __future__ import annotations

from engine.request import Request
from engine.spec_decode.ngram import NgramProposer


def propose_drafts(proposer: NgramProposer, request: Request, token_budget: int) -> list[int]:
    """Draft token ids to verify in the request's next step (no tensors).

    Called by the scheduler once per running request per step, before allocating its slots.
    Only a request whose one uncomputed token is its last known one gets drafts (a decode
    step, or the last token of a prompt whose other tokens are computed or cached).
    The count is capped so that the step, whatever it accepts, stays within ``token_budget``
    (which must also pay for the last sampled token), ``max_tokens`` and ``max_model_len``:
    a step emits at most ``num_drafts + 1`` tokens."""
    if request.num_tokens - request.num_computed_tokens != 1:
        return []
    limit = min(
        token_budget - 1,
        request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
        request.max_model_len - request.num_tokens - 1,
    )
    if limit <= 0:
        return []
    return proposer.propose(request.all_token_ids, max_num_drafts=limit)
