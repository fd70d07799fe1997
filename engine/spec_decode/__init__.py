"""Speculative decoding: the n-gram draft proposer (scheduler side), the verification of
drafts through the rejection sampler (runner side) and their counters."""

from engine.spec_decode.drafts import draft_slots_leave_room, propose_drafts
from engine.spec_decode.metrics import SpecDecodeStats
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.verify import verify_drafts

__all__ = ["NgramProposer", "SpecDecodeStats", "draft_slots_leave_room", "propose_drafts", "verify_drafts"]
