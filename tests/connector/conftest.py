"""Fixtures of the connector tests."""

from __future__ import annotations

import pytest

from tests.connector.kv_helpers import make_cache_engine


@pytest.fixture
def cache_engine():
    """A CPU-only cache engine over the small synthetic KV shape of ``kv_helpers``."""
    engine = make_cache_engine()
    yield engine
    engine.tiers.close()
