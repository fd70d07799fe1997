"""Fixtures the cache server's test modules share."""

from __future__ import annotations

import pytest

from protos import kvstash_pb2
from tests.cache_server.helpers import Stubs


@pytest.fixture
def stubs(server):
    """Stubs to the module's ``server`` fixture, the server emptied first (a module may
    define its own ``stubs``: tenants' metadata, a clear by another route)."""
    with Stubs(server.address) as stubs:
        stubs.admin.Clear(kvstash_pb2.ClearRequest(), timeout=30)
        yield stubs
