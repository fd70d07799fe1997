"""Speculative decoding: the n-gram draft proposer and the verification glue of the engine."""

from engine.spec_decode.ngram import NgramProposer

__all__ = ["NgramProposer"]
