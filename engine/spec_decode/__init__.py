"""Speculative decoding: the n-gram draft proposer (scheduler side), the verification of
drafts through the rejection sampler (runner side) and their counters.

Names load on first use (PEP 562), so that a request's draft back-off
(``engine.spec_decode.backoff``, read by ``engine.request``) imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.spec_decode.drafts import draft_slots_leave_room, propose_drafts
    from engine.spec_decode.metrics import SpecDecodeStats
    from engine.spec_decode.ngram import NgramProposer
    from engine.spec_decode.verify import verify_drafts

__all__ = ["NgramProposer", "SpecDecodeStats", "draft_slots_leave_room", "propose_drafts", "verify_drafts"]

#: public name -> the module that defines it
_NAME_TO_MODULE = {
    "NgramProposer": "engine.spec_decode.ngram",
    "SpecDecodeStats": "engine.spec_decode.metrics",
    "draft_slots_leave_room": "engine.spec_decode.drafts",
    "propose_drafts": "engine.spec_decode.drafts",
    "verify_drafts": "engine.spec_decode.verify",
}


def __getattr__(name: str):
    module_name = _NAME_TO_MODULE.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine.spec_decode' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
