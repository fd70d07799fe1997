"""Token database: cut token ids into chunks and name each chunk (docs/architecture.md, Connector).

Chunk ``i`` covers tokens ``[i * chunk_size, (i + 1) * chunk_size)``; its key is
``key_prefix + namespace:hex(h_i)`` with the chain hash
``h_i = blake2b(h_{i-1} || ids_i)`` over the chunk's token ids as little-endian
uint32, so a key names the whole prefix up to the chunk's end, not just the
chunk's own tokens. Keys are equal across processes and machines (no Python
``hash()``) and cannot be forged without a blake2b collision. A trailing
partial chunk hashes fewer bytes than a full one, so it can never share a full
chunk's key.

The chain starts from ``h_{-1} = b""``, or, for a request with a ``cache_salt``,
from ``blake2b(SALT_DOMAIN || salt)``: requests with different salts share no
key (so they cannot hit or probe each other's chunks), and keys without a salt
stay those of earlier releases (stored caches stay valid).

``key_prefix`` (``OffloadConfig.key_prefix``, a tenant's prefix on a shared
cache server) is plain text in front of every key; the chain hash does not
depend on it.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

#: bytes of each chain hash (128-bit: collision-safe for any realistic cache)
DIGEST_BYTES = 16
#: layout of the tensors stored under our keys: [layers, K/V, tokens, kv heads, head dim]
KV_LAYOUT = "LKTHD"
_MAX_TOKEN_ID = (1 << 32) - 1
#: token sequences whose spans ``TokenDatabase`` keeps (a few requests' prompts)
NUM_RECENT_SEQUENCES = 64
#: array typecode of a 4-byte unsigned int
_UINT32 = next(code for code in ("I", "L") if array.array(code).itemsize == 4)
#: domain separator of a salted chain's seed (never equal to an unsalted chain's empty seed)
SALT_DOMAIN = b"kvstash-cache-salt-v1\0"


def salt_seed(cache_salt: str | None) -> bytes:
    """The chain's first parent hash: empty without a salt (the keys of every earlier
    release), else a digest of the salt under a domain separator."""
    if cache_salt is None:
        return b""
    encoded = cache_salt.encode("utf-8", errors="surrogatepass")
    return hashlib.blake2b(SALT_DOMAIN + encoded, digest_size=DIGEST_BYTES).digest()


class ChunkSpan(NamedTuple):
    """One chunk of a token sequence: tokens ``[start, end)`` stored under ``key``."""

    start: int
    end: int
    key: str


def namespace_fingerprint(
    *,
    model_id: str,
    dtype: torch.dtype,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    chunk_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    layer_range: tuple[int, int, int] | None = None,
) -> str:
    """A short name for everything that makes stored KV incompatible.

    Two engines share chunks exactly when all these agree; it prefixes every key
    so that ``keys(prefix)`` lists one model's chunks. ``layer_range`` is a pipeline
    stage's ``(first_layer, end_layer, num_model_layers)``: its chunks hold only those
    layers, so they never meet a whole-model engine's (None, the whole model, leaves
    the fingerprint as it always was).
    """
    identity = {
        "model_id": model_id,
        "dtype": str(dtype).removeprefix("torch."),
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "layout": KV_LAYOUT,
        "tp_rank": tp_rank,
        "tp_size": tp_size,
        "chunk_size": chunk_size,
    }
    if layer_range is not None:
        identity["layer_range"] = list(layer_range)
    digest = hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=8).hexdigest()
    return f"kvstash-{digest}"


def token_ids_to_bytes(tokens: Sequence[int] | torch.Tensor) -> memoryview:
    """Token ids as little-endian uint32 bytes; ``ValueError`` for ids outside [0, 2**32).

    Called on every lookup, store and retrieve, so lists go through ``array`` (about 3x
    faster than numpy for Python ints). Imports no torch: a tensor exists only once torch is
    imported (`kvstash router` hashes prompts without it)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}")
        ids = tokens.detach().cpu().numpy().astype(np.int64, copy=False)
        if ids.size and (ids.min() < 0 or ids.max() > _MAX_TOKEN_ID):
            raise ValueError("token ids must lie in [0, 2**32)")
        return memoryview(ids.astype("<u4").tobytes())
    try:
        ids = array.array(_UINT32, tokens)
    except OverflowError:
        raise ValueError("token ids must lie in [0, 2**32)") from None
    except TypeError:
        raise ValueError("tokens must be a flat sequence of integer token ids") from None
    if sys.byteorder == "big":
        ids.byteswap()
    return memoryview(ids).cast("B")


class TokenDatabase:
    """Maps token sequences to chunk spans and keys. Thread-safe; called by the cache
    engine on every lookup, store and retrieve — one request hashes the same prompt
    several times (match, pin, load, saves), so recent results are kept in a small
    cache keyed by the token bytes and the salt."""

    def __init__(
        self, namespace: str, chunk_size: int, save_partial_chunks: bool, *, key_prefix: str = ""
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.namespace = namespace
        self.key_prefix = key_prefix
        self.chunk_size = chunk_size
        self.save_partial_chunks = save_partial_chunks
        self._recent: OrderedDict[tuple[bytes, str | None], tuple[ChunkSpan, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def chunk_spans(
        self, tokens: Sequence[int] | torch.Tensor, cache_salt: str | None = None
    ) -> list[ChunkSpan]:
        """Spans of every keyed chunk of ``tokens`` in order: all full chunks, then the
        trailing partial chunk when ``save_partial_chunks`` (else it is left out).
        ``cache_salt`` (a request's, see :func:`salt_seed`) seeds the chain."""
        recent_key = (token_ids_to_bytes(tokens).tobytes(), cache_salt)
        with self._lock:
            spans = self._recent.get(recent_key)
            if spans is not None:
                self._recent.move_to_end(recent_key)
                return list(spans)
        spans = self._hash_chunks(recent_key[0], salt_seed(cache_salt))
        with self._lock:
            self._recent[recent_key] = spans
            if len(self._recent) > NUM_RECENT_SEQUENCES:
                self._recent.popitem(last=False)
        return list(spans)

    def _hash_chunks(self, data: bytes, seed: bytes) -> tuple[ChunkSpan, ...]:
        num_tokens = len(data) // 4
        spans = []
        previous = seed
        key_head = f"{self.key_prefix}{self.namespace}:"
        for start in range(0, num_tokens, self.chunk_size):
            end = min(start + self.chunk_size, num_tokens)
            if end - start < self.chunk_size and not self.save_partial_chunks:
                break
            digest = hashlib.blake2b(previous, digest_size=DIGEST_BYTES)
            digest.update(data[4 * start : 4 * end])
            previous = digest.digest()
            spans.append(ChunkSpan(start, end, key_head + previous.hex()))
        return tuple(spans)
