"""URL scheme → backend factory. Adding a tier is one entry in ``SCHEME_TO_FACTORY``.

Factories are named as ``"module:Class.from_url"`` strings and imported only when
used, so optional client libraries (redis-py, grpcio) load only for their tier.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from urllib.parse import urlsplit

from storage_backends.base import StorageBackend

SCHEME_TO_FACTORY = MappingProxyType(
    {
        "cpu": "storage_backends.cpu_backend:CPUBackend.from_url",
        "file": "storage_backends.disk_backend:DiskBackend.from_url",
        "redis": "storage_backends.redis_backend:RedisBackend.from_url",
        "rediss": "storage_backends.redis_backend:RedisBackend.from_url",
        "redis+cluster": "storage_backends.redis_backend:RedisBackend.from_url",
        "rediss+cluster": "storage_backends.redis_backend:RedisBackend.from_url",
        "grpc": "storage_backends.grpc_backend:GrpcBackend.from_url",
        "grpcs": "storage_backends.grpc_backend:GrpcBackend.from_url",
    }
)


def create_backend(url: str) -> StorageBackend:
    """Build the backend that ``url``'s scheme names, e.g. ``cpu://?capacity=4GiB``.

    Raises ValueError for an unknown scheme or bad parameters (the message names them).
    """
    if not isinstance(url, str):
        raise TypeError(f"create_backend needs a URL string, got {type(url).__name__}")
    scheme = urlsplit(url).scheme
    factory_path = SCHEME_TO_FACTORY.get(scheme)
    if factory_path is None:
        known = ", ".join(f"{name}://" for name in SCHEME_TO_FACTORY)
        raise ValueError(
            f"unknown storage URL scheme {scheme + '://' if scheme else '(none)'} in {url!r}; known: {known}"
        )
    module_name, _, attribute_path = factory_path.partition(":")
    factory = importlib.import_module(module_name)
    for attribute in attribute_path.split("."):
        factory = getattr(factory, attribute)
    return factory(url)
