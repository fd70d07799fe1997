"""Security of the cache server and of sharing it: bearer token on every kvstash RPC,
TLS with a self-signed certificate made here, namespace isolation between engines
whose KV is incompatible, and the per-request limits with their status codes."""

from __future__ import annotations

import shutil
import subprocess
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.support.cache_server_process import CacheServerProcess
from benchmarks.support.cache_server_values import make_value
from connector import OffloadConfig
from protos import kvstash_pb2
from storage_backends.grpc_channel import make_channel
from tests.cache_server.helpers import Stubs, status_of
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    Reference,
    StreamTally,
    cache_engine_of,
    full_hits,
    make_prompts,
    new_llm,
    tiers_of,
)
from tests.reliability.rpc_calls import METHODS, raw_call, sample_request

TOKEN = "reliability-token-7f3a"
GOOD = (("authorization", f"Bearer {TOKEN}"),)
BAD_CREDENTIALS = {
    "none": (),
    "wrong token": (("authorization", "Bearer not-the-token"),),
    "no Bearer scheme": (("authorization", TOKEN),),
    "token as a prefix": (("authorization", f"Bearer {TOKEN}x"),),
}


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.fail("the openssl CLI is needed to make the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-days", "1", "-subj", "/CN=kvstash-test", "-addext", "subjectAltName=IP:127.0.0.1"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


@pytest.fixture(scope="module")
def secure_server(tls_files):
    """One cache server with TLS and a bearer token for this module."""
    cert, key = tls_files
    server = CacheServerProcess(
        "--memory-gb", "0.1", "--tls-cert", cert, "--tls-key", key, "--auth-token", TOKEN
    ).start(tls_ca=cert)
    yield server
    server.close()


@pytest.fixture
def tls_channel(secure_server, tls_files):
    with make_channel(secure_server.address, secure=True, ca_path=tls_files[0]) as channel:
        yield channel


@pytest.mark.parametrize("credentials", list(BAD_CREDENTIALS))
def test_every_rpc_needs_the_token(tls_channel, credentials):
    value = make_value(1, key="ns-a:k")
    for method in METHODS:
        code, details = raw_call(
            tls_channel, method, sample_request(method, "ns-a:k", value), BAD_CREDENTIALS[credentials]
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED, f"{method.path} with {credentials}: {code} {details}"


def test_the_token_opens_every_rpc_and_nothing_leaks_without_it(tls_channel):
    value = make_value(2, key="ns-a:k")
    calls = {method.name: method for method in METHODS}
    assert raw_call(tls_channel, calls["Put"], sample_request(calls["Put"], "ns-a:k", value), GOOD)[0] == (
        grpc.StatusCode.OK
    )
    for method in METHODS:
        code, details = raw_call(tls_channel, method, sample_request(method, "ns-a:k", value), GOOD)
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), f"{method.path}: {code} {details}"
    # A client without the token cannot list another tenant's namespace.
    list_keys = calls["ListKeys"]
    request = [kvstash_pb2.ListKeysRequest(prefix="ns-a:").SerializeToString()]
    assert raw_call(tls_channel, list_keys, request)[0] == grpc.StatusCode.UNAUTHENTICATED
    # Health stays open (load balancers probe it without credentials).
    reply = health_pb2_grpc.HealthStub(tls_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tls_is_required_and_verified(secure_server, tls_files):
    with make_channel(secure_server.address, secure=False) as plaintext:
        code, _ = raw_call(plaintext, METHODS[0], [b""], GOOD, timeout_s=5)
        assert code == grpc.StatusCode.UNAVAILABLE
    # The system roots do not trust a self-signed certificate.
    with make_channel(secure_server.address, secure=True) as untrusted:
        code, _ = raw_call(untrusted, METHODS[0], [b""], GOOD, timeout_s=5)
        assert code == grpc.StatusCode.UNAVAILABLE


def test_namespaces_keep_incompatible_kv_apart(
    secure_server, tls_files, tiny_model_dir, tmp_path_factory, model_dir, reference, reliability_report
):
    """Four engines share one server over grpcs:// with the token: the first stores, the
    others (another model, another dtype, another KV shape) must never be served its chunks."""
    from bench.tiny_model import make_tiny_model

    url = f"grpcs://{secure_server.address}?token={TOKEN}&ca={tls_files[0]}"
    offload = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, remote_url=url)
    prompts = make_prompts(4, seed=41)
    owner = new_llm(model_dir, offload)
    tally = StreamTally()
    tally.run(owner, prompts, reference)
    tiers_of(owner).flush()
    assert tally.run(owner, prompts, reference) == full_hits(prompts)
    owner_namespace = cache_engine_of(owner).token_db.namespace

    bench_dir = make_tiny_model(tmp_path_factory.mktemp("bench-shape"), arch="llama", size="bench")
    others = {
        "another model (same shapes, other weights)": (tiny_model_dir("llama", seed=1), "float32"),
        "another dtype (bfloat16)": (model_dir, "bfloat16"),
        "another KV shape (4 layers, head_dim 32)": (bench_dir, "float32"),
    }
    namespaces = {owner_namespace}
    for name, (other_dir, dtype) in others.items():
        other = new_llm(other_dir, offload, dtype=dtype)
        other_tally = StreamTally()
        hits = other_tally.run(other, prompts, Reference(other_dir, dtype=dtype))
        assert hits == [0] * len(prompts), f"{name} was served another namespace's chunks"
        other_tally.assert_clean()
        namespaces.add(cache_engine_of(other).token_db.namespace)
        tally.num_requests += other_tally.num_requests
        tally.num_tokens_compared += other_tally.num_tokens_compared
    assert len(namespaces) == 1 + len(others)
    # Every key on the server sits under one of the four namespaces.
    with Stubs(secure_server.address, metadata=GOOD, tls_ca=tls_files[0]) as stubs:
        keys = [
            e.key
            for e in stubs.admin.ListKeys(kvstash_pb2.ListKeysRequest(page_size=10000), metadata=GOOD).entries
        ]
    assert keys and all(key.split(":", 1)[0] in namespaces for key in keys)
    tally.assert_clean()
    reliability_report.record(
        "namespace isolation",
        "4 engines on one TLS+token cache server: owner, other weights, bfloat16, other KV shape",
        num_requests=tally.num_requests,
        num_failed=tally.num_failed,
        num_tokens_compared=tally.num_tokens_compared,
        num_tokens_differing=tally.num_tokens_differing,
        num_foreign_hits=0,
        num_namespaces=len(namespaces),
    )


@pytest.fixture(scope="module")
def limited_server():
    """Value cap 1 MiB, memory 0.5 MiB, two streams at once."""
    server = CacheServerProcess(
        "--memory-gb", str(0.5 / 1024), "--max-value-mb", "1", "--max-concurrent-streams", "2"
    ).start()
    yield server
    server.close()


def test_limits_hold_with_their_status_codes(limited_server):
    with Stubs(limited_server.address) as stubs:
        assert (
            status_of(lambda: stubs.put("k", make_value(3, 2 << 20, key="k")))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        assert (
            status_of(lambda: stubs.put("k", make_value(4, 700 << 10, key="k")))
            == grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert (
            status_of(lambda: stubs.put("k" * 1025, make_value(5, key="k" * 1025)))
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        too_many = kvstash_pb2.ContainsRequest(keys=[f"k{i}" for i in range(65537)])
        assert status_of(lambda: stubs.kv.Contains(too_many, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
        big_page = kvstash_pb2.ListKeysRequest(page_size=10001)
        assert (
            status_of(lambda: stubs.admin.ListKeys(big_page, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
        )
        value = make_value(6, key="k")
        short = [kvstash_pb2.PutRequest(key="k", total_size=len(value) + 10, data=value)]
        assert status_of(lambda: stubs.kv.Put(iter(short), timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT

        # Two Put streams held open fill both slots: a third stream is refused, not queued.
        release = threading.Event()
        held_results: list[grpc.StatusCode] = []

        def held_put(key: str) -> None:
            def requests():
                yield kvstash_pb2.PutRequest(key=key, total_size=len(value))
                release.wait(30)  # the stream stays open, holding its slot
                yield kvstash_pb2.PutRequest(data=make_value(6, key=key))

            try:
                stubs.kv.Put(requests(), timeout=60)
                held_results.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                held_results.append(error.code())

        holders = [threading.Thread(target=held_put, args=(f"held{i}",)) for i in range(2)]
        for holder in holders:
            holder.start()
        num_active = 0
        for _ in range(100):
            num_active = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10).num_active_streams
            if num_active == 2:
                break
            release.wait(0.05)
        assert num_active == 2
        third_value = make_value(6, key="third")
        assert status_of(lambda: stubs.put("third", third_value)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert status_of(lambda: stubs.get("held0")) == grpc.StatusCode.RESOURCE_EXHAUSTED
        release.set()
        for holder in holders:
            holder.join(60)
        assert held_results == [grpc.StatusCode.OK] * 2
        stubs.put("third", third_value)
        assert stubs.get("third") == third_value
        # The refusals did not cost the memory tier its cap.
        stats = stubs.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10)
        memory = stats.tiers[0]
        assert memory.bytes_used <= memory.capacity_bytes and stats.num_rejected >= 8
