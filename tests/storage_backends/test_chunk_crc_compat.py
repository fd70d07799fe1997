"""The chunk checksum is the standard CRC-32 (zlib.crc32's values), whichever library
computes it: chunks written by earlier versions or other clients stay readable."""

from __future__ import annotations

import zlib

import torch

from storage_backends.chunk import KVChunk, decode_chunk, encode_chunk


def test_checksum_field_is_zlib_crc32_of_header_and_payload():
    tensor = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    encoded = bytes(encode_chunk(KVChunk(tensor, "LKT"), key="ns:k"))
    stored = int.from_bytes(encoded[44:48], "little")
    # the header bytes before the field, then everything after it
    assert stored == zlib.crc32(encoded[48:], zlib.crc32(encoded[:44]))
    assert torch.equal(decode_chunk(encoded, key="ns:k").tensor, tensor)
