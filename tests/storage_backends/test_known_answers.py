"""Known answers: fixed token ids give exact chunk keys, a fixed chunk gives exact bytes.

A change of key derivation or of the chunk format orphans every stored cache (nothing
already stored is found again). That may be intended, but never silent: it must fail
here, and the change then updates these answers (and, for the format, FORMAT_VERSION).
"""

from __future__ import annotations

import hashlib

import torch

from connector.token_db import TokenDatabase, namespace_fingerprint
from storage_backends.chunk import FORMAT_VERSION, KVChunk, decode_chunk, encode_chunk

NAMESPACE = namespace_fingerprint(
    model_id="kat-model", dtype=torch.bfloat16, num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=4
)
CHUNK_KEY = "ns:known"


def known_chunk() -> KVChunk:
    return KVChunk(torch.arange(2 * 2 * 3 * 1 * 2, dtype=torch.float16).reshape(2, 2, 3, 1, 2))


def test_namespace_and_chain_hash_keys_are_fixed() -> None:
    assert NAMESPACE == "kvstash-b99c0a1e9c66d44a"
    spans = TokenDatabase(NAMESPACE, chunk_size=4, save_partial_chunks=True).chunk_spans(list(range(10)))
    assert [(span.start, span.end, span.key) for span in spans] == [
        (0, 4, "kvstash-b99c0a1e9c66d44a:35ce1b7dc4da8ce51a7591561b3595db"),
        (4, 8, "kvstash-b99c0a1e9c66d44a:29d97b3f27d3692fd728ae911c6112e0"),
        (8, 10, "kvstash-b99c0a1e9c66d44a:a559ed64d7695f4344e2201a650ac31f"),  # the partial chunk
    ]


def test_encoded_bytes_of_a_fixed_chunk_are_fixed() -> None:
    encoded = encode_chunk(known_chunk(), "none", key=CHUNK_KEY)
    assert FORMAT_VERSION == 2
    # magic, version 2, header length 93, float16, codec none, 5 dims, layout of 5, payload and
    # raw length 48, then the key hash
    assert encoded[:44].hex() == (
        "4b56534302005d000200050530000000000000003000000000000000cc66b51075b1085fadcf39a81c4cc3a8"
    )
    assert len(encoded) == 141
    assert (
        hashlib.sha256(encoded).hexdigest()
        == "bb9b47f8c0d89dd17e934eac8b9cc6e55fbffe338f4db71cdce32a1df5c8b8e0"
    )


def test_fixed_lz4_bytes_decode_to_the_fixed_chunk() -> None:
    # Compressed output may differ between lz4 releases, so this answer is on the decode side:
    # bytes written by this format version must stay readable, under their key only.
    recorded = bytes.fromhex(
        "4b56534302005d000201050532000000000000003000000000000000cc66b51075b1085fadcf39a81c4cc3a8"
        "48fb7a35020000000000000002000000000000000300000000000000010000000000000002000000000000004c4b5448"
        "44f0210000003c0040004200440045004600470048804800498049004a804a004b804b004c404c804cc04c004d404d804dc04d"
    )
    assert decode_chunk(recorded, key=CHUNK_KEY).equal(known_chunk())
