"""A user's ``cache_salt``, checked where a request enters the engine (``LLM.generate``,
``EngineCore.add_request``, the server's request models).

The salt itself is the connector's and the block manager's business: it seeds their
chain hashes (``connector/token_db.py``, ``engine/block_manager.py``), so requests with
different salts share no cached KV. This module only says which salts are valid.
"""

from __future__ import annotations

#: longest ``cache_salt`` accepted, in UTF-8 bytes
MAX_CACHE_SALT_BYTES = 1024


def check_cache_salt(cache_salt: object) -> str | None:
    """``cache_salt`` when it is None or a non-empty string of at most ``MAX_CACHE_SALT_BYTES``
    UTF-8 bytes; ``ValueError`` otherwise. Called where a request enters the engine."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    if not cache_salt:
        raise ValueError("cache_salt must not be empty (leave it out for no salt)")
    num_bytes = len(cache_salt.encode("utf-8", errors="surrogatepass"))
    if num_bytes > MAX_CACHE_SALT_BYTES:
        raise ValueError(f"cache_salt has {num_bytes} bytes, more than the limit of {MAX_CACHE_SALT_BYTES}")
    return cache_salt
