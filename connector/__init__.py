"""The connector: chunk hashing, masked store/retrieve, tiers, and the role-split
engine hooks (docs/architecture.md, Connector). ``engine`` builds its two connector objects with
:func:`create_kv_connector` (``connector/factory.py``).

The package's names are loaded on first use (PEP 562): ``from connector.config import
OffloadConfig`` or ``from connector import OffloadConfig`` imports no torch, so the CLI can
check offload flags before anything heavy loads (issue 35).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from connector.cache_engine import CacheEngine
    from connector.config import OffloadConfig
    from connector.factory import create_cache_engine, create_kv_connector, create_worker_connector

__all__ = [
    "CacheEngine",
    "OffloadConfig",
    "create_cache_engine",
    "create_kv_connector",
    "create_worker_connector",
]

#: public name -> the module that defines it
_NAME_TO_MODULE = {
    "CacheEngine": "connector.cache_engine",
    "OffloadConfig": "connector.config",
    "create_cache_engine": "connector.factory",
    "create_kv_connector": "connector.factory",
    "create_worker_connector": "connector.factory",
}


def __getattr__(name: str):
    module_name = _NAME_TO_MODULE.get(name)
    if module_name is None:
        raise AttributeError(f"module 'connector' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
