"""Backend factories for the storage tests: every tier built from its URL, against real servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from storage_backends import StorageBackend, create_backend
from tests.storage_backends.helpers import CAPPED_KINDS, BackendFactory


@pytest.fixture
def backend_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[BackendFactory]:
    """``backend_factory(kind, capacity=None)`` builds a backend of ``kind`` on fresh storage; closed after the test."""
    created: list[StorageBackend] = []

    def factory(kind: str, capacity: int | None = None, **params: str) -> StorageBackend:
        query = dict(params)
        if kind in CAPPED_KINDS:
            query["capacity"] = str(capacity or 64 << 20)
        if kind == "cpu":
            query.setdefault("slot_bytes", "4096")
            url = "cpu://"
        elif kind.startswith("disk"):
            if kind == "disk-lz4":
                query["codec"] = "lz4"
            url = f"file://{tmp_path / 'disk'}"
        elif kind == "redis":
            url = request.getfixturevalue("redis_url")
        elif kind == "redis-cluster":
            url = request.getfixturevalue("redis_cluster_url")
        elif kind == "grpc":
            url = request.getfixturevalue("cache_server_url")
        else:
            raise ValueError(f"unknown backend kind {kind!r}")
        if query:
            url += ("&" if "?" in url else "?") + "&".join(f"{name}={value}" for name, value in query.items())
        backend = create_backend(url)
        created.append(backend)
        return backend

    yield factory
    for backend in created:
        backend.close()
