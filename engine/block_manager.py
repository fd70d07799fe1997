"""The KV block pool: reference counts, prefix caching by chained block hashes,
and an LRU queue of free blocks whose cached contents stay reusable until the
block is handed out again.

Called only by the scheduler, a few times per request per step. Never touches
tensors: a block is an id; its KV lives in the model runner's KV tensor at
slots `block_id * block_size + offset`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from engine.request import Request

_ROOT_HASH = b"kvstash-gpu-prefix-v1"
#: domain separator of a salted chain's root (docs/architecture.md, Connector: salts never share blocks)
_SALT_DOMAIN = b"kvstash-gpu-prefix-salt-v1\0"
#: blocks `find_cached_prefix` hashes at a time (then as many again as it has: it doubles)
LOOKUP_BATCH_BLOCKS = 16


def root_hash(cache_salt: str | None) -> bytes:
    """The parent hash of a request's first block: the same for every unsalted request,
    one per salt otherwise, so blocks of different salts never match."""
    if cache_salt is None:
        return _ROOT_HASH
    encoded = cache_salt.encode("utf-8", errors="surrogatepass")
    return hashlib.blake2b(_SALT_DOMAIN + encoded, digest_size=16).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full block: blake2b(parent || token ids as little-endian int64)."""
    payload = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(parent_hash + payload, digest_size=16).digest()


class BlockManager:
    """Pool of `num_blocks` blocks of `block_size` tokens.

    Free blocks sit in `free_block_ids` in eviction order (front first). A freed
    block that holds a cached full block goes to the back, so the least recently
    used cached blocks are overwritten first; a freed block with nothing cached
    goes to the front."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_id_to_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block_id: dict[bytes, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: told ``(kind, block hashes as hex)`` when cached blocks are registered
        #: (``stored``), overwritten (``removed``) or all forgotten (``cleared``): the
        #: engine's KV events. None: nobody listens.
        self.on_change: Callable[[str, list[str]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def hash_blocks(self, request: Request, max_num_blocks: int | None = None) -> None:
        """Extend `request.block_hashes` to every full block of its known tokens, or to the
        first `max_num_blocks` blocks: the chain of `hash_block`, over the new blocks'
        tokens converted once (per block, the conversion cost more than the hash: ~1 ms
        per 8k-token prompt). The scheduler calls it for a step's requests while the
        device runs the step (`Scheduler.hash_blocks_of`); `cache_computed_blocks` calls it
        for what is still missing."""
        bs = self.block_size
        hashes = request.block_hashes
        first, end = len(hashes), request.num_tokens // bs
        if max_num_blocks is not None:
            end = min(end, max_num_blocks)
        if first >= end:
            return
        payload = np.asarray(request.all_token_ids[first * bs : end * bs], dtype="<i8").tobytes()
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        block_bytes = bs * 8
        for offset in range(0, len(payload), block_bytes):
            parent = hashlib.blake2b(parent + payload[offset : offset + block_bytes], digest_size=16).digest()
            hashes.append(parent)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Side-effect free on the pool: ids of the longest run of leading full blocks
        already cached, possibly every token's block. The scheduler still computes at
        least the last token (so the admitting step produces logits); when that token's
        block is one of these, the runner reads its KV from the block and leaves the
        shared block unwritten.

        Hashes only as far as the search goes (in growing batches, from
        `LOOKUP_BATCH_BLOCKS`): a prompt that misses on the GPU, as a prompt whose KV
        is loaded from the tiers does, costs one batch here, not its whole chain (~1 ms
        per 8k tokens on an H100's host, before the load's first copy)."""
        if not self.enable_prefix_caching:
            return []
        hashes = request.block_hashes
        block_ids: list[int] = []
        while True:
            if len(block_ids) == len(hashes):
                self.hash_blocks(request, len(hashes) + max(LOOKUP_BATCH_BLOCKS, len(hashes)))
                if len(block_ids) == len(hashes):
                    return block_ids  # every full block is cached
            block_id = self.hash_to_block_id.get(hashes[len(block_ids)])
            if block_id is None:
                return block_ids
            block_ids.append(block_id)

    def allocate_slots(
        self, request: Request, num_total_tokens: int, cached_block_ids: Sequence[int] = ()
    ) -> bool:
        """Make `request.block_ids` cover `num_total_tokens` tokens, first appending
        `cached_block_ids` (a prefix hit, only at admission). Returns False and
        changes nothing when too few blocks are free."""
        num_needed = -(-num_total_tokens // self.block_size) - len(request.block_ids) - len(cached_block_ids)
        num_needed = max(num_needed, 0)
        num_revived = sum(1 for block_id in cached_block_ids if self.ref_counts[block_id] == 0)
        if num_needed + num_revived > self.num_free_blocks:
            return False
        for block_id in cached_block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
            request.block_ids.append(block_id)
        if cached_block_ids:
            # Only at admission: later calls must not count blocks still being filled as
            # cached, or cache_computed_blocks would never register them.
            request.num_cached_blocks = len(request.block_ids)
        removed_hashes = []
        for _ in range(num_needed):
            block_id, _ = self.free_block_ids.popitem(last=False)
            old_hash = self.block_id_to_hash[block_id]
            if old_hash is not None:
                # The block is overwritten now: its cached content is gone.
                if self.hash_to_block_id.get(old_hash) == block_id:
                    del self.hash_to_block_id[old_hash]
                    removed_hashes.append(old_hash.hex())
                self.block_id_to_hash[block_id] = None
            self.ref_counts[block_id] = 1
            request.block_ids.append(block_id)
        if removed_hashes and self.on_change is not None:
            self.on_change("removed", removed_hashes)
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed (after a step)."""
        if not self.enable_prefix_caching:
            return
        self.hash_blocks(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        stored_hashes = []
        for i in range(request.num_cached_blocks, num_full):
            block_hash = request.block_hashes[i]
            block_id = request.block_ids[i]
            # A twin computed in the same step keeps the first registration.
            if block_hash not in self.hash_to_block_id and self.block_id_to_hash[block_id] is None:
                self.hash_to_block_id[block_hash] = block_id
                self.block_id_to_hash[block_id] = block_hash
                stored_hashes.append(block_hash.hex())
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)
        if stored_hashes and self.on_change is not None:
            self.on_change("stored", stored_hashes)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, so later requests find no GPU prefix hit.
        Refused (returns False) while any block is in use, since running requests
        still read their registered blocks; the blocks themselves stay free."""
        if any(self.ref_counts):
            return False
        self.hash_to_block_id.clear()
        self.block_id_to_hash = [None] * self.num_blocks
        if self.on_change is not None:
            self.on_change("cleared", [])
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks (finish or preemption); tail blocks first so
        a shared prefix outlives the tails in the LRU order."""
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids[block_id] = None
                if self.block_id_to_hash[block_id] is None:
                    self.free_block_ids.move_to_end(block_id, last=False)
        request.block_ids = []
        request.num_cached_blocks = 0
