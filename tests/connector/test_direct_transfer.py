"""The direct path's parts with real NIXL agents (UCX on CPU memory, two agents in this
process): a producer's offer of CPU-tier chunks, a consumer's nixl tier reading them into its
own CPU-tier slots, the producer's unpinning on the consumer's word or its hold's end; and the
checks of what enters (an offer's fields, the settings, what the direct path needs)."""

from __future__ import annotations

import time

import pytest
import torch

from connector.base import KVTransferParams
from connector.config import OffloadConfig
from connector.direct_offer import DirectOffer
from connector.nixl_import import nixl_available, wants_direct
from connector.token_db import KV_LAYOUT, TokenDatabase
from storage_backends.chunk import KVChunk

needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install 'kvstash[nixl]')"
)

CHUNK_SHAPE = (2, 2, 16, 2, 8)  # [num_layers, 2, chunk_size, num_kv_heads, head_dim]


def pool():
    from connector.cpu_tier import PinnedChunkPool

    return PinnedChunkPool(1 << 20, CHUNK_SHAPE, torch.float32, pin_memory=False, layout=KV_LAYOUT)


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` became true within ``timeout_s`` (a bound, not a timing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@needs_nixl
def test_a_consumer_reads_the_offered_chunks_and_its_word_unpins_them():
    from connector.direct_export import DirectExporter
    from connector.direct_peer import DirectPeerTier

    producer_pool, consumer_pool = pool(), pool()
    spans = TokenDatabase("ns", 16, True).chunk_spans(list(range(40)))  # 16 + 16 + 8 tokens
    chunks = [torch.randn(2, 2, span.end - span.start, 2, 8) for span in spans]
    for span, tensor in zip(spans[:2], chunks, strict=False):  # the third is not in the CPU tier
        producer_pool.put(span.key, KVChunk(tensor, KV_LAYOUT))
    exporter = DirectExporter(producer_pool, hold_s=60)
    peer = DirectPeerTier(consumer_pool, fetch_deadline_s=30)
    try:
        offer = exporter.offer(spans)
        assert [chunk.num_tokens for chunk in offer.chunks] == [16, 16]
        assert producer_pool.pin_counts().get("export") == 2
        offer = DirectOffer.from_dict(offer.to_dict())  # as it crosses HTTP
        keys = [span.key for span in spans]
        assert peer.contains(keys) == 0
        assert peer.expect("r1", offer, keys) == 2
        assert peer.contains(keys) == 2
        for span, tensor in zip(spans[:2], chunks, strict=False):
            reservation = consumer_pool.reserve(span.key, tuple(tensor.shape))
            read = peer.get_into(span.key, reservation.buffer)
            assert read is not None and torch.equal(read.tensor, tensor)
        assert peer.get_into(spans[2].key, torch.empty(4096)) is None  # never offered: a miss
        peer.finish("r1")
        assert peer.contains(keys) == 0
        assert wait_until(lambda: exporter.num_holds() == 0)
        assert exporter.num_released_done == 1 and not producer_pool.pin_counts().get("export")
    finally:
        peer.close()
        exporter.close()


@needs_nixl
def test_an_offer_nobody_takes_is_unpinned_after_its_hold_and_a_gone_producer_is_a_miss():
    from connector.direct_export import DirectExporter
    from connector.direct_peer import DirectPeerTier

    producer_pool, consumer_pool = pool(), pool()
    (span,) = TokenDatabase("ns", 16, True).chunk_spans(list(range(16)))
    producer_pool.put(span.key, KVChunk(torch.ones(CHUNK_SHAPE), KV_LAYOUT))
    exporter = DirectExporter(producer_pool, hold_s=0.2)
    peer = DirectPeerTier(consumer_pool, fetch_deadline_s=30)
    try:
        offer = exporter.offer([span])
        assert wait_until(lambda: exporter.num_holds() == 0)
        assert exporter.num_released_expired == 1
        # the consumer stops reading at half the hold: an offer this old is a miss
        assert peer.expect("r2", offer, [span.key]) == 1
        time.sleep(0.15)
        assert peer.contains([span.key]) == 0
        assert peer.get_into(span.key, torch.empty(CHUNK_SHAPE)) is None
        # a producer whose agent is gone: its metadata no longer leads anywhere
        stale = offer._replace(agent="kvstash-producer-gone", metadata=b"not metadata")
        assert peer.expect("r3", stale, [span.key]) == 0
        assert peer.stats()["unreachable"] == 1
    finally:
        peer.close()
        exporter.close()


def test_an_offer_and_the_hand_over_settings_are_checked():
    offer = {"agent": "a", "metadata": "AAAA", "transfer_id": "t", "hold_s": 60, "mem_type": "DRAM"}
    offer |= {"device_id": 0, "chunks": [["k", 4096, 1024, 16]]}
    assert DirectOffer.from_dict(offer).chunks[0].num_tokens == 16
    for bad, words in [
        (offer | {"mem_type": "HBM"}, "mem_type must be one of DRAM, VRAM"),
        (offer | {"metadata": "%%%"}, "metadata must be base64"),
        (offer | {"hold_s": 0}, "hold_s must be a positive number"),
        (offer | {"chunks": [["k", 0, 1024, 16]]}, "chunks[0] must be [key, address, num_bytes, num_tokens]"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            DirectOffer.from_dict(bad)
    params = {"kvstash_version": 1, "durable": True, "namespace": "n", "chunk_size": 16, "tier": "nixl"}
    params |= {"num_chunks": 2, "num_tokens": 20, "direct": offer}
    with pytest.raises(ValueError, match="direct.chunks must list num_chunks chunks"):
        KVTransferParams.from_dict(params)
    assert KVTransferParams.from_dict(params | {"num_chunks": 1, "num_tokens": 16}).direct.agent == "a"
    for name, value, words in [
        ("kv_transfer", "nccl", "kv_transfer must be one of auto, direct, shared"),
        ("handoff_fetch_deadline_s", 0, "handoff_fetch_deadline_s must be a positive, finite"),
        ("handoff_durable_timeout_s", float("inf"), "handoff_durable_timeout_s must be a positive, finite"),
        ("direct_hold_s", -1, "direct_hold_s must be a positive, finite"),
        ("kv_role", "decoder", "kv_role must be one of both, producer, consumer"),
    ]:
        with pytest.raises(ValueError, match=words):
            OffloadConfig(**{name: value})
    with pytest.raises(ValueError, match=r"kv_transfer 'direct' needs a CPU tier"):
        wants_direct("direct", cpu_bytes=0, split=False)
    with pytest.raises(ValueError, match="an engine in one process"):
        wants_direct("direct", cpu_bytes=1, split=True)
    assert not wants_direct("auto", cpu_bytes=0, split=False)
    assert not wants_direct("shared", cpu_bytes=1, split=False)
