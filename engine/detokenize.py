"""A request's text, and its stop strings: decoded from its output tokens.

Called by the engine core once per request that got tokens in a step
(`EngineCore._finish_step`), after the scheduler took the step's tokens. Without a
tokenizer (an in-memory model) it does nothing. May change the request only: its
`text`, and when a stop string appears, its output tokens (cut after the token that
completed it) and its end (finished through the scheduler with reason "stop").
"""

from __future__ import annotations

from typing import Any

from engine.request import Request
from engine.scheduler import Scheduler


def detokenize_and_check_stop(
    tokenizer: Any, scheduler: Scheduler, request: Request, num_new_tokens: int
) -> None:
    """Update `request.text`; a stop string ends the request, the text cut before it.
    When a step appended several tokens (speculative decoding), the output keeps only
    the tokens up to the first one that completes a stop string."""
    if tokenizer is None:
        return
    stop_strings = request.sampling_params.stop_strings
    if not stop_strings and not request.is_finished:
        return  # decode once at the end unless stop strings need the text now
    num_outputs = len(request.output_token_ids)
    first_kept = num_outputs - num_new_tokens + 1 if stop_strings else num_outputs
    for num_kept in range(first_kept, num_outputs + 1):
        text = tokenizer.decode(request.output_token_ids[:num_kept], skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=-1)
        if cut >= 0:
            del request.output_token_ids[num_kept:]
            del request.all_token_ids[request.num_prompt_tokens + num_kept :]
            break
    if cut >= 0:
        text = text[:cut]
        if not request.is_finished:
            scheduler.finish_request(request, "stop")
        request.finish_reason = "stop"
    request.text = text
