"""A request's prompt as token ids, as `kvstash serve` makes it and `kvstash router` must make
it too (the router hashes the same tokens the engine will cache): the model folder's tokenizer,
a completion's text encoded as is, a chat through the model's chat template. Imports no torch
(loading the tokenizer through ``AutoTokenizer`` may, when it runs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ChatTemplateError(ValueError):
    """The model's chat template refused the messages (a 400 naming ``messages``)."""


def load_tokenizer(model_dir: str) -> Any:
    """The Hugging Face tokenizer of a local model folder (never fetched from a hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """A completion's text prompt as token ids (special tokens as the tokenizer adds them)."""
    return list(tokenizer.encode(prompt))


def chat_token_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """``messages`` (``role``, text ``content``) as the prompt's token ids: the model's chat
    template when it has one (``ChatTemplateError`` when it refuses them); otherwise
    ``role: content`` lines and an ``assistant:`` cue."""
    messages = list(messages)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # a template may reject a conversation (e.g. role order)
            raise ChatTemplateError(f"the model's chat template rejected the messages: {error}") from error
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return list(tokenizer.encode(text))
