"""A client's request as the engine will see its prompt: the token ids (the engine's own
parsing, `engine.server.protocol`, and prompt building, `engine.prompts`) and the
``cache_salt``. What the engine would refuse has no prompt here: the router sends it by
load alone and the replica answers the error."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine.prompts import chat_token_ids, encode
from engine.server.protocol import ChatCompletionRequest, CompletionRequest

CHAT_ROUTE = "/v1/chat/completions"
#: token ids are hashed as unsigned 32-bit integers (chunk keys)
TOKEN_ID_LIMIT = 1 << 32


def request_prompt(tokenizer: Any, route: str, body: dict) -> tuple[list[int] | None, str | None]:
    """(the prompt's token ids or None when the request is malformed, its ``cache_salt``)."""
    try:
        if route == CHAT_ROUTE:
            chat = ChatCompletionRequest.model_validate(body)
            return chat_token_ids(tokenizer, chat.message_dicts()), chat.cache_salt
        completion = CompletionRequest.model_validate(body)
        prompt = completion.single_prompt()
        tokens = encode(tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
    except (ValidationError, ValueError):
        return None, None
    if not all(0 <= token < TOKEN_ID_LIMIT for token in tokens):
        return None, None  # the engine refuses these: nothing to hash
    return tokens, completion.cache_salt
