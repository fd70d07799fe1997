"""Graceful SIGTERM, a restart that keeps the disk tier's data, and Redis below the server."""

from __future__ import annotations

import signal
import subprocess
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.support.cache_server_process import REPO_ROOT, CacheServerProcess, repo_env
from benchmarks.support.cache_server_values import make_value
from protos import kvstash_pb2
from storage_backends import create_backend
from storage_backends.grpc_codec import PIECE_BYTES
from tests.cache_server.helpers import Stubs, put_requests
from tests.cache_server.server_process import kvstash_command


def test_sigterm_lets_in_flight_calls_finish_and_turns_health_not_serving() -> None:
    server = CacheServerProcess("--memory-gb", "0.1", "--grace-s", "5").start()
    try:
        with Stubs(server.address) as stubs:
            statuses: list[int] = []
            watch = health_pb2_grpc.HealthStub(stubs.channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=30
            )

            def follow_health() -> None:
                try:
                    for reply in watch:
                        statuses.append(reply.status)
                except grpc.RpcError:
                    pass  # the stream ends when the server stops

            threading.Thread(target=follow_health, daemon=True).start()
            value = make_value(5, num_bytes=3 * PIECE_BYTES, key="ns/in-flight")
            release = threading.Event()

            def slow_put():
                requests = put_requests("ns/in-flight", value)
                yield next(requests)
                release.wait(20)
                yield from requests

            in_flight = stubs.kv.Put.future(slow_put(), timeout=30)
            deadline = time.monotonic() + 20
            while stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10).num_active_streams < 1:
                assert time.monotonic() < deadline, "the Put never reached the server"
                time.sleep(0.05)

            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while health_pb2.HealthCheckResponse.NOT_SERVING not in statuses:
                assert time.monotonic() < deadline, f"health never turned NOT_SERVING: {statuses}"
                time.sleep(0.05)
            assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
            # New calls are refused while the old one is still open...
            deadline = time.monotonic() + 10
            while True:
                try:
                    stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=["ns/x"]), timeout=2)
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                    break
                assert time.monotonic() < deadline, "new calls were still accepted after SIGTERM"
                time.sleep(0.05)
            # ...and the in-flight Put still completes.
            release.set()
            assert in_flight.result().num_bytes == len(value)
            watch.cancel()
        assert server.stop(timeout_s=30) == 0
        log = server.log()
        assert "shutting down" in log and "Traceback" not in log
    finally:
        server.close()


def test_a_restart_with_a_disk_tier_keeps_the_data(tmp_path) -> None:
    disk_args = ("--memory-gb", "0.1", "--disk-path", str(tmp_path / "disk"), "--disk-gb", "0.5")
    values = {f"ns/{i}": make_value(i, num_bytes=(i + 1) << 20, key=f"ns/{i}") for i in range(3)}
    first = CacheServerProcess(*disk_args).start()
    try:
        with Stubs(first.address) as stubs:
            for key, value in values.items():
                stubs.put(key, value)
            stubs.kv.Delete(kvstash_pb2.DeleteRequest(key="ns/2"), timeout=10)
        assert first.stop() == 0
    finally:
        first.close()

    second = CacheServerProcess(*disk_args).start()
    try:
        with Stubs(second.address) as stubs:
            keys = ["ns/0", "ns/1", "ns/2"]
            assert stubs.kv.Contains(kvstash_pb2.ContainsRequest(keys=keys), timeout=10).num_hits == 2
            assert stubs.admin.Info(kvstash_pb2.InfoRequest(key="ns/1"), timeout=10).entry.tier == "disk"
            assert stubs.get("ns/1") == values["ns/1"]
            # A disk hit is copied into memory.
            assert stubs.admin.Info(kvstash_pb2.InfoRequest(key="ns/1"), timeout=10).entry.tier == "memory"
            stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
            assert [tier.name for tier in stats.tiers] == ["memory", "disk"]
            assert stats.tiers[1].num_keys == 2
        assert second.stop() == 0
    finally:
        second.close()


def test_redis_below_the_server_serves_after_a_restart(redis_url) -> None:
    value = make_value(11, num_bytes=2 << 20, key="ns/r")
    first = CacheServerProcess("--memory-gb", "0.1", "--redis-url", redis_url).start()
    try:
        with Stubs(first.address) as stubs:
            stubs.put("ns/r", value)
        assert first.stop() == 0
    finally:
        first.close()
    redis_tier = create_backend(redis_url)
    try:
        assert redis_tier.get_encoded("ns/r") == value  # written through to Redis
    finally:
        redis_tier.close()

    second = CacheServerProcess("--memory-gb", "0.1", "--redis-url", redis_url).start()
    try:
        with Stubs(second.address) as stubs:
            assert stubs.admin.Info(kvstash_pb2.InfoRequest(key="ns/r"), timeout=10).entry.tier == "redis"
            assert stubs.get("ns/r") == value
            listed = stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(prefix="ns/"), timeout=10)
            assert [(entry.key, entry.tier) for entry in listed.entries] == [("ns/r", "memory")]
            assert stubs.admin.Evict(kvstash_pb2.EvictRequest(key="ns/r"), timeout=10).num_evicted == 1
        assert second.stop() == 0
    finally:
        second.close()
    redis_tier = create_backend(redis_url)
    try:
        assert redis_tier.contains(["ns/r"]) == 0  # eviction reaches every tier
    finally:
        redis_tier.close()


def test_disk_path_without_disk_gb_is_a_usage_error_and_the_help_says_so(tmp_path) -> None:
    """Issue #17: the help said "default: unbounded", but the server refused to start without it."""
    command = kvstash_command("cache-server", "--port", "0", "--disk-path", str(tmp_path / "disk"))
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr  # click's usage error, before anything is started
    assert "--disk-path needs --disk-gb" in result.stderr
    help_text = subprocess.run(
        kvstash_command("cache-server", "--help"),
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    help_text = " ".join(help_text.split())  # click wraps long help lines
    assert "required with --disk-path" in help_text and "unbounded" not in help_text
