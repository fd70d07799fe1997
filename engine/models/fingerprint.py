"""Model identity for the offload namespace: which weights produced a KV cache.

The connector keys chunks under a namespace that includes this identity, so KV
computed by one set of weights is never served to another. A folder path is not
enough (a checkpoint can be replaced in place, two machines can hold different
models at the same path), and samples of the weights are not enough either (a
fine-tune of a few layers differs only in some bytes), so the identity hashes
the config and every byte of every ``*.safetensors`` file with XXH3-128
(``xxhash``: several GB/s on one core).

Hashing a large checkpoint still takes seconds, so each file's digest is cached
by its identity (resolved path, size, ``st_mtime_ns``, inode) in a small JSON
file (``$KVSTASH_CACHE_DIR`` or ``~/.cache/kvstash``, ``weight_hashes.json``):
a restart over unchanged files reads none of their bytes. A file rewritten in
place changes its mtime (or size, or inode) and is hashed again. The cache file
is written atomically (temp file + rename); an unreadable or malformed one is
ignored (everything is hashed again) and a cache directory that cannot be
written costs only the re-hashing next time.

An operator can name the model instead (``EngineArgs.model_id`` /
``--model-id``): no weight is read, and two checkpoints given one id share KV.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

logger = logging.getLogger(__name__)

#: environment variable naming kvstash's cache directory (default ``~/.cache/kvstash``)
CACHE_DIR_ENV = "KVSTASH_CACHE_DIR"
CACHE_FILE_NAME = "weight_hashes.json"
_CACHE_FORMAT = "kvstash-weight-hashes-v1"
_READ_BYTES = 8 << 20


def default_cache_dir() -> Path:
    """``$KVSTASH_CACHE_DIR``, else ``~/.cache/kvstash``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "kvstash"


def file_digest(path: Path) -> str:
    """XXH3-128 hex digest of every byte of ``path`` (read in 8 MiB pieces)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while num_read := file.readinto(buffer):
            digest.update(view[:num_read])
    return digest.hexdigest()


class WeightHashCache:
    """Per-file digests keyed by file identity, persisted in ``cache_dir/weight_hashes.json``.

    Used by :func:`model_fingerprint` once per engine start; ``num_files_hashed`` counts
    the files whose bytes were read by this instance (tests use it to prove a cache hit).
    Not shared between threads.
    """

    def __init__(self, cache_dir: Path | None = None, hash_file: Callable[[Path], str] = file_digest) -> None:
        self.path = (cache_dir if cache_dir is not None else default_cache_dir()) / CACHE_FILE_NAME
        self._hash_file = hash_file
        self._identity_to_digest = self._load()
        self.num_files_hashed = 0

    def _load(self) -> dict[str, str]:
        try:
            document = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("ignoring the weight hash cache %s: %s", self.path, exc)
            return {}
        if not isinstance(document, dict) or document.get("format") != _CACHE_FORMAT:
            entries = None
        else:
            entries = document.get("files")
        if not isinstance(entries, dict):
            logger.warning("ignoring the weight hash cache %s: not a %s file", self.path, _CACHE_FORMAT)
            return {}
        return {key: value for key, value in entries.items() if isinstance(value, str)}

    @staticmethod
    def _identity(path: Path) -> str:
        resolved = path.resolve()
        status = resolved.stat()
        return f"{resolved}|{status.st_size}|{status.st_mtime_ns}|{status.st_ino}"

    def cached_digest(self, path: Path) -> tuple[str, str | None]:
        """``(identity, digest)`` of ``path`` now: the digest from the cache, or None when
        its identity (path, size, mtime, inode) has none."""
        identity = self._identity(path)
        return identity, self._identity_to_digest.get(identity)

    def digest(self, path: Path) -> str:
        """The digest of ``path``'s bytes: from the cache when its identity is unchanged, else hashed."""
        identity, cached = self.cached_digest(path)
        if cached is not None:
            return cached
        digest = self._hash_file(path)
        self.record(path, identity, digest)
        return digest

    def record(self, path: Path, identity: str, digest: str) -> None:
        """Keep ``digest``, hashed by the caller from ``path`` whose identity was ``identity``
        before it was read (the weight loader hashes while it reads). Counted in
        ``num_files_hashed``; ``save`` writes it."""
        self.num_files_hashed += 1
        # A file that changed while it was read gets no entry (its identity moved on).
        if self._identity(path) == identity:
            # One entry per path: the file's older identities can never match again.
            path_prefix = identity.rsplit("|", 3)[0] + "|"
            for stale in [key for key in self._identity_to_digest if key.startswith(path_prefix)]:
                del self._identity_to_digest[stale]
            self._identity_to_digest[identity] = digest
        return digest

    def save(self) -> None:
        """Write the cache atomically; a failure is logged and costs only a re-hash next time."""
        document = {"format": _CACHE_FORMAT, "files": self._identity_to_digest}
        tmp_name = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, prefix=".weight_hashes-", suffix=".tmp", delete=False
            ) as tmp:
                tmp_name = tmp.name
                json.dump(document, tmp)
            os.replace(tmp_name, self.path)
        except OSError as exc:
            logger.warning("could not write the weight hash cache %s: %s", self.path, exc)
            if tmp_name is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp_name)


def model_fingerprint(model_dir: Path, cache: WeightHashCache | None = None) -> str:
    """Hex digest identifying the weights in ``model_dir``: the config and every byte of
    every safetensors file (digests cached by file identity in ``cache``, default
    :class:`WeightHashCache` in :func:`default_cache_dir`). Called once per engine start."""
    cache = cache if cache is not None else WeightHashCache()
    digest = hashlib.blake2b(digest_size=16)
    config = json.loads((model_dir / "config.json").read_text())
    digest.update(json.dumps(config, sort_keys=True).encode())
    paths = sorted(model_dir.glob("*.safetensors"))
    for path in paths:
        digest.update(f"{path.name}:{path.stat().st_size}:{cache.digest(path)}\n".encode())
    if cache.num_files_hashed:
        cache.save()
    return "model-" + digest.hexdigest()


def dummy_model_fingerprint(hf_config: Any) -> str:
    """Identity of random weights made from an in-memory config (``load_format="dummy"``,
    seeded, so equal configs give equal weights)."""
    text = (
        hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string") else repr(hf_config)
    )
    return "dummy-" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
