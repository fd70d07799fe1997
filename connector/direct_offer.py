"""What a producer's answer says of the direct path (``kv_transfer_params["direct"]``):
where a consumer's NIXL agent reads the handed-over chunks from (docs/architecture.md,
"Disaggregated prefill and decode"). Plain data, no torch, no NIXL: the contract between
:mod:`connector.direct_export` (the producer) and :mod:`connector.direct_peer` (the consumer).
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any, NamedTuple

#: ``KVTransferParams.tier`` of a hand-over by the direct path
DIRECT_TIER = "nixl"
#: the memory kinds an offer may name (NIXL's segment names)
MEM_TYPES = ("DRAM", "VRAM")


class OfferedChunk(NamedTuple):
    """One chunk the producer holds for the consumer: its key, where its bytes lie in the
    producer's registered memory (``address``, ``num_bytes``) and its tokens."""

    key: str
    address: int
    num_bytes: int
    num_tokens: int


class DirectOffer(NamedTuple):
    """A hand-over's chunks, pinned in the producer's memory registered with its NIXL agent
    ``agent`` (``metadata``: the agent's NIXL metadata, what a peer loads to reach it) under
    ``transfer_id`` until the consumer says it is done (a NIXL notification with the id) or
    ``hold_s`` seconds passed. ``chunks`` are the prompt's leading chunks, in order."""

    agent: str
    metadata: bytes
    transfer_id: str
    hold_s: float
    mem_type: str
    device_id: int
    chunks: tuple[OfferedChunk, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode("ascii"),
            "transfer_id": self.transfer_id,
            "hold_s": self.hold_s,
            "mem_type": self.mem_type,
            "device_id": self.device_id,
            "chunks": [list(chunk) for chunk in self.chunks],
        }

    @classmethod
    def from_dict(cls, value: object) -> DirectOffer:
        """Parse ``kv_transfer_params.direct``; ValueError names what is wrong."""
        where = "kv_transfer_params.direct"
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {type(value).__name__}")
        texts = {}
        for name in ("agent", "metadata", "transfer_id", "mem_type"):
            item = value.get(name)
            if not isinstance(item, str) or not item:
                raise ValueError(f"{where}.{name} must be a non-empty string, got {item!r}")
            texts[name] = item
        if texts["mem_type"] not in MEM_TYPES:
            raise ValueError(
                f"{where}.mem_type must be one of {', '.join(MEM_TYPES)}, got {texts['mem_type']!r}"
            )
        try:
            metadata = base64.b64decode(texts["metadata"], validate=True)
        except (binascii.Error, ValueError):
            raise ValueError(f"{where}.metadata must be base64") from None
        hold_s = value.get("hold_s")
        if isinstance(hold_s, bool) or not isinstance(hold_s, (int, float)) or not 0 < hold_s < math.inf:
            raise ValueError(f"{where}.hold_s must be a positive number of seconds, got {hold_s!r}")
        device_id = value.get("device_id")
        if isinstance(device_id, bool) or not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"{where}.device_id must be an integer >= 0, got {device_id!r}")
        items = value.get("chunks")
        if not isinstance(items, list):
            raise ValueError(f"{where}.chunks must be a list, got {type(items).__name__}")
        chunks = []
        for index, item in enumerate(items):
            if (
                not isinstance(item, list)
                or len(item) != 4
                or not isinstance(item[0], str)
                or not item[0]
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in item[1:])
            ):
                raise ValueError(
                    f"{where}.chunks[{index}] must be [key, address, num_bytes, num_tokens] "
                    f"(a string and three positive integers), got {item!r}"
                )
            chunks.append(OfferedChunk(*item))
        return cls(
            texts["agent"],
            metadata,
            texts["transfer_id"],
            float(hold_s),
            texts["mem_type"],
            device_id,
            tuple(chunks),
        )
