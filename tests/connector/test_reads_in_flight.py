"""A fetch keeps as many reads of a tier in flight as the tier runs at once, and the planner
plans with that count (issue 31: the fetcher ran 8 reads of the cache server over its 4 bulk
connections while the planner and the prober counted 8)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from connector.config import OffloadConfig, backend_urls, reads_in_flight_for
from connector.factory import tier_reads_in_flight
from connector.planner import LoadPlanner
from engine.step_time import StepTimeModel
from storage_backends.grpc_backend import GrpcBackend

MIB = 1 << 20


def test_the_cache_server_gets_a_bulk_connection_per_read_in_flight():
    config = OffloadConfig(remote_url="grpc://cache:50051", remote_reads_in_flight=6)
    assert backend_urls(config) == ["grpc://cache:50051?codec=none&bulk_connections=6"]
    # what the URL names stays
    named = OffloadConfig(remote_url="grpcs://cache:50051?bulk_connections=2&codec=lz4")
    assert backend_urls(named) == ["grpcs://cache:50051?bulk_connections=2&codec=lz4"]
    # Redis has no bulk connections
    redis = OffloadConfig(remote_url="redis://cache:6379/0?codec=lz4")
    assert backend_urls(redis) == ["redis://cache:6379/0?codec=lz4"]


def test_the_grpc_tier_runs_as_many_reads_as_it_has_bulk_connections():
    with_bulk = GrpcBackend("127.0.0.1:1", bulk_connections=3, timeout_s=1)
    over_grpc = GrpcBackend("127.0.0.1:1", bulk=False, timeout_s=1)
    try:
        assert with_bulk.max_reads_in_flight == 3
        assert over_grpc.max_reads_in_flight is None  # one HTTP/2 channel: no bound of its own
    finally:
        with_bulk.close()
        over_grpc.close()


def test_reads_in_flight_are_bounded_by_what_the_tier_runs_at_once():
    assert reads_in_flight_for("grpc", local=4, remote=8) == 8
    assert reads_in_flight_for("grpc", local=4, remote=8, limit=2) == 2
    assert reads_in_flight_for("disk", local=4, remote=8, limit=16) == 4
    tiers = SimpleNamespace(
        lower=[SimpleNamespace(name="disk"), SimpleNamespace(name="grpc", max_reads_in_flight=2)]
    )
    assert tier_reads_in_flight(tiers, OffloadConfig()) == {"disk": 4, "grpc": 2}


def test_a_fetch_is_planned_at_the_count_the_tier_runs():
    """Measured with its 2 connections busy, the tier delivers that rate to a fetch of any
    size: a plan of 8 chunks must not scale it up to 8 connections."""
    planner = LoadPlanner(
        bytes_per_token=MIB, step_times=StepTimeModel(), tier_to_reads_in_flight={"grpc": 2}
    )
    assert planner.reads_in_flight_for("grpc") == 2 and planner.reads_in_flight_for("redis") == 8
    planner.observe_read("grpc", 2 * 256 * MIB, 1.0, connections=2)
    decision = planner.plan(
        ["grpc"] * 8, [256 * (i + 1) for i in range(8)], num_computed=0, num_prompt_tokens=8 * 256 + 1
    )
    assert decision.rates["grpc"] == pytest.approx(2 * 256 * MIB)
