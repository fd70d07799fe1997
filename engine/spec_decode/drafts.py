"""Scheduler-side drafting: how many drafts a decode step may carry, and which."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:  # annotations only: engine.request holds a DraftBackoff from this package
    from engine.block_manager import BlockManager
    from engine.request import Request


def propose_drafts(proposer: NgramProposer, request: Request, token_budget: int) -> list[int]:
    """Draft token ids to verify in the request's next step (no tensors).

    Called by the scheduler once per running request per step, before allocating its slots.
    Only a request whose one uncomputed token is its last known one gets drafts (a decode
    step, or the last token of a prompt whose other tokens are computed or cached).
    The count is capped so that the step, whatever it accepts, stays within ``token_budget``
    (which must also pay for the last sampled token), ``max_tokens`` and ``max_model_len``:
    a step emits at most ``num_drafts + 1`` tokens. A request whose recent drafts were
    mostly rejected gets none while its back-off pauses it (``request.draft_backoff``)."""
    if request.num_tokens - request.num_computed_tokens != 1:
        return []
    if not request.draft_backoff.may_draft():
        return []
    limit = min(
        token_budget - 1,
        request.sampling_params.max_tokens - len(request.output_token_ids) - 1,
        request.max_model_len - request.num_tokens - 1,
    )
    if limit <= 0:
        return []
    return proposer.propose(request.all_token_ids, max_num_drafts=limit, request_id=request.request_id)


def draft_slots_leave_room(
    block_manager: BlockManager, request: Request, num_total_tokens: int, num_requests_behind: int
) -> bool:
    """Whether giving ``request`` blocks for ``num_total_tokens`` tokens (its drafts included)
    still leaves one free block for each running request scheduled after it, which may need
    one for its own next token. The scheduler drops the drafts otherwise: a draft never
    causes a preemption. Side-effect free."""
    num_new_blocks = -(-num_total_tokens // block_manager.block_size) - len(request.block_ids)
    return block_manager.num_free_blocks - max(num_new_blocks, 0) >= num_requests_behind
