"""Fuzzing the cache server: hypothesis-generated messages and raw garbage bytes to every
RPC, then a flood of valid values three times its memory cap.

Whatever arrives, the server answers with a status from the contract (OK,
INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED; never INTERNAL or UNKNOWN), stays SERVING, keeps its memory tier under the cap and
its resident memory under the cap plus a margin.
"""

from __future__ import annotations

from collections import Counter

import grpc
import psutil
import pytest
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from protos import kvstash_pb2
from storage_backends.grpc_channel import make_channel
from tests.cache_server.helpers import Stubs
from tests.reliability.rpc_calls import METHODS, Method, raw_call

MEMORY_CAP_BYTES = 8 << 20
#: resident memory the server may use beyond its cap: interpreter, torch, gRPC buffers, messages in flight
RSS_MARGIN_BYTES = 160 << 20
NUM_EXAMPLES = 40
WELL_FORMED_CODES = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# Bytes that are not a protobuf message are INVALID_ARGUMENT (cache_server/malformed.py);
# garbage that happens to parse gets the well-formed answers.
GARBAGE_CODES = WELL_FORMED_CODES
FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def fuzz_server():
    server = CacheServerProcess(
        "--memory-gb",
        str(MEMORY_CAP_BYTES / (1 << 30)),
        "--max-value-mb",
        "4",
        "--max-concurrent-streams",
        "8",
    ).start()
    process = psutil.Process(server.process.pid)
    server.rss_at_start = process.memory_info().rss
    yield server
    server.close()


@pytest.fixture(scope="module")
def fuzz_channel(fuzz_server):
    with make_channel(fuzz_server.address, secure=False) as channel:
        yield channel


@pytest.fixture(scope="module")
def code_counts(reliability_report):
    """Status codes seen, per kind of input, recorded in the report at the end of the module."""
    counts: dict[str, Counter] = {"well-formed": Counter(), "garbage": Counter()}
    yield counts
    reliability_report.record(
        "fuzzing",
        f"hypothesis messages and raw garbage, {NUM_EXAMPLES} examples each per RPC and kind",
        num_calls={kind: sum(c.values()) for kind, c in counts.items()},
        status_codes={kind: {code.name: n for code, n in c.items()} for kind, c in counts.items()},
        num_server_crashes=0,
    )


def _field_strategy(field: FieldDescriptor):
    if field.type == FieldDescriptor.TYPE_STRING:
        # Keys near and past the 1024-byte limit, prefixes, page tokens (valid and not).
        value = st.one_of(st.text(max_size=40), st.text(min_size=1000, max_size=1100), st.just(""))
    elif field.type == FieldDescriptor.TYPE_BYTES:
        value = st.one_of(st.binary(max_size=256), st.builds(make_value, st.integers(0, 1000), st.just(512)))
    elif field.type == FieldDescriptor.TYPE_UINT64:
        value = st.one_of(st.integers(0, 1 << 16), st.integers(0, (1 << 64) - 1))
    elif field.type == FieldDescriptor.TYPE_UINT32:
        value = st.integers(0, (1 << 32) - 1)
    else:
        raise AssertionError(f"no strategy for field {field.full_name} of type {field.type}")
    # protobuf 6 replaced FieldDescriptor.label with is_repeated
    repeated = (
        field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED
    )
    return st.lists(value, max_size=20) if repeated else value


def message_strategy(method: Method):
    """Serialized requests of ``method`` with arbitrary field values (1..4 messages for a stream)."""
    fields = {f.name: _field_strategy(f) for f in method.request_class.DESCRIPTOR.fields}
    one = st.fixed_dictionaries({}, optional=fields).map(
        lambda v: method.request_class(**v).SerializeToString()
    )
    return st.lists(one, min_size=1, max_size=4) if method.client_streaming else one.map(lambda m: [m])


def garbage_strategy(method: Method):
    one = st.one_of(st.binary(max_size=64), st.binary(min_size=1000, max_size=5000))
    return st.lists(one, min_size=1, max_size=3) if method.client_streaming else one.map(lambda m: [m])


def assert_healthy(server, channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert server.process.poll() is None
    stats = kvstash_pb2.StatsResponse.FromString(
        channel.unary_unary("/kvstash.v1.Admin/Stats")(b"", timeout=10)
    )
    memory = stats.tiers[0]
    assert memory.capacity_bytes == MEMORY_CAP_BYTES and memory.bytes_used <= MEMORY_CAP_BYTES
    rss = psutil.Process(server.process.pid).memory_info().rss
    assert rss <= server.rss_at_start + MEMORY_CAP_BYTES + RSS_MARGIN_BYTES, (rss, server.rss_at_start)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_well_formed_messages_with_arbitrary_fields(fuzz_server, fuzz_channel, code_counts, method):
    @FUZZ_SETTINGS
    @given(messages=message_strategy(method))
    def fuzz(messages):
        code, details = raw_call(fuzz_channel, method, messages)
        code_counts["well-formed"][code] += 1
        assert code in WELL_FORMED_CODES, f"{method.path}: {code} {details}"

    fuzz()
    assert_healthy(fuzz_server, fuzz_channel)


@pytest.mark.parametrize("method", METHODS, ids=[m.name for m in METHODS])
def test_raw_garbage_bytes(fuzz_server, fuzz_channel, code_counts, method):
    @FUZZ_SETTINGS
    @given(messages=garbage_strategy(method))
    def fuzz(messages):
        code, details = raw_call(fuzz_channel, method, messages)
        code_counts["garbage"][code] += 1
        assert code in GARBAGE_CODES, f"{method.path}: {code} {details}"

    fuzz()
    assert_healthy(fuzz_server, fuzz_channel)


def test_a_flood_three_times_the_cap_stays_under_it(fuzz_server, fuzz_channel):
    value_bytes = 256 << 10
    num_values = 3 * MEMORY_CAP_BYTES // value_bytes
    with Stubs(fuzz_server.address) as stubs:
        for index in range(num_values):
            stubs.put(f"flood:{index}", make_value(index, value_bytes, key=f"flood:{index}"))
        assert stubs.get(f"flood:{num_values - 1}") == make_value(
            num_values - 1, value_bytes, key=f"flood:{num_values - 1}"
        )
        stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
    assert stats.tiers[0].evictions >= num_values - MEMORY_CAP_BYTES // value_bytes
    assert_healthy(fuzz_server, fuzz_channel)
