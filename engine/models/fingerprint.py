"""Model identity for the offload namespace: which weights produced a KV cache.

The connector keys chunks under a namespace that includes this identity, so KV
computed by one set of weights is never served to another. A folder path is not
enough (a checkpoint can be replaced in place, two machines can hold different
models at the same path), so the identity hashes what the weights are: the
config, each safetensors file's size and header (tensor names, dtypes, shapes,
offsets) and samples of its bytes spread over the file. Reading the samples
costs a few MiB per file, once per engine start.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

#: bytes read per sample, and samples per weight file
SAMPLE_BYTES = 64 * 1024
NUM_SAMPLES = 16


def _hash_safetensors(path: Path, digest: Any) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}:{size}".encode())
    with path.open("rb") as file:
        (header_len,) = struct.unpack("<Q", file.read(8))
        digest.update(file.read(min(header_len, size)))
        for i in range(NUM_SAMPLES):
            file.seek(max(0, (size - SAMPLE_BYTES) * i // max(1, NUM_SAMPLES - 1)))
            digest.update(file.read(SAMPLE_BYTES))


def model_fingerprint(model_dir: Path) -> str:
    """Hex digest identifying the weights in ``model_dir`` (config + safetensors)."""
    digest = hashlib.blake2b(digest_size=16)
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    for path in sorted(model_dir.glob("*.safetensors")):
        _hash_safetensors(path, digest)
    return "model-" + digest.hexdigest()


def dummy_model_fingerprint(hf_config: Any) -> str:
    """Identity of random weights made from an in-memory config (``load_format="dummy"``,
    seeded, so equal configs give equal weights)."""
    text = (
        hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else repr(hf_config)
    )
    return "dummy-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
