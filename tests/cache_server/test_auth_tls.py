"""Bearer token (flag and environment) and TLS with a self-signed certificate made by openssl."""

from __future__ import annotations

import shutil
import subprocess

import grpc
import pytest
from click.testing import CliRunner
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.support.cache_server_process import CacheServerProcess, repo_env
from benchmarks.support.cache_server_values import make_value
from engine.cli import main
from protos import kvstash_pb2
from storage_backends import BackendError, create_backend
from tests.cache_server.helpers import Stubs, rpc_error

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not found")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(cert), str(key)


def test_token_from_the_environment_guards_data_and_admin_rpcs_but_not_health(monkeypatch) -> None:
    server = CacheServerProcess("--memory-gb", "0.1", env=repo_env(KVSTASH_AUTH_TOKEN=TOKEN)).start()
    try:
        with (
            Stubs(server.address) as anonymous,
            Stubs(server.address, metadata=(("authorization", "Bearer nope"),)) as wrong,
        ):
            for stubs in (anonymous, wrong):
                for call in (
                    lambda s=stubs: s.put("ns/k", make_value(1, key="ns/k")),
                    lambda s=stubs: s.get("ns/k"),
                    lambda s=stubs: s.kv.Contains(
                        kvstash_pb2.ContainsRequest(keys=["ns/k"]), metadata=s.metadata
                    ),
                    lambda s=stubs: s.kv.Delete(kvstash_pb2.DeleteRequest(key="ns/k"), metadata=s.metadata),
                    lambda s=stubs: s.admin.Stats(kvstash_pb2.StatsRequest(), metadata=s.metadata),
                    lambda s=stubs: s.admin.Clear(kvstash_pb2.ClearRequest(), metadata=s.metadata),
                ):
                    error = rpc_error(call)
                    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert error.details() == "missing or wrong bearer token"
            health = health_pb2_grpc.HealthStub(anonymous.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING

        # The grpc tier takes the token from its URL, or from the same environment variable.
        backend = create_backend(f"{server.url}?token={TOKEN}")
        backend.put_encoded("ns/k", make_value(2, key="ns/k"))
        assert backend.get_encoded("ns/k") == make_value(2, key="ns/k")
        backend.close()
        monkeypatch.setenv("KVSTASH_AUTH_TOKEN", TOKEN)
        from_env = create_backend(server.url)
        assert from_env.contains(["ns/k"]) == 1
        from_env.close()
        monkeypatch.delenv("KVSTASH_AUTH_TOKEN")
        anonymous_backend = create_backend(f"{server.url}?timeout=5")
        with pytest.raises(BackendError, match="refused the auth token"):
            anonymous_backend.contains(["ns/k"])
        assert anonymous_backend.stats()["errors"] >= 1
        anonymous_backend.close()

        refused = CliRunner().invoke(main, ["admin", "--server", server.address, "stats"])
        assert refused.exit_code == 1 and "unauthenticated" in refused.stderr
        accepted = CliRunner().invoke(
            main, ["admin", "--server", server.address, "--auth-token", TOKEN, "ls"]
        )
        assert accepted.exit_code == 0 and "ns/k" in accepted.stdout
    finally:
        assert server.stop() == 0
        server.close()


def test_tls_with_a_self_signed_certificate(tls_files) -> None:
    cert, key = tls_files
    server = CacheServerProcess(
        "--memory-gb", "0.1", "--tls-cert", cert, "--tls-key", key, "--auth-token", TOKEN
    ).start(tls_ca=cert)
    try:
        assert server.url.startswith("grpcs://")
        backend = create_backend(f"{server.url}?ca={cert}&token={TOKEN}")
        backend.put_encoded("ns/tls", make_value(3, num_bytes=2 << 20, key="ns/tls"))
        assert backend.get_encoded("ns/tls") == make_value(3, num_bytes=2 << 20, key="ns/tls")
        backend.close()

        # A plaintext client cannot talk to the TLS port; a client that does not trust the CA fails too.
        with Stubs(server.address, metadata=(("authorization", f"Bearer {TOKEN}"),)) as plaintext:
            assert rpc_error(lambda: plaintext.get("ns/tls")).code() == grpc.StatusCode.UNAVAILABLE
        untrusted = create_backend(f"{server.url}?token={TOKEN}&timeout=5")
        with pytest.raises(BackendError, match="cannot reach"):
            untrusted.contains(["ns/tls"])
        untrusted.close()

        runner = CliRunner()
        info = runner.invoke(
            main,
            ["admin", "--server", server.address, "--tls-ca", cert, "--auth-token", TOKEN, "info", "ns/tls"],
        )
        assert info.exit_code == 0 and "2.0 MiB" in info.stdout
        no_token = runner.invoke(main, ["admin", "--server", server.address, "--tls-ca", cert, "stats"])
        assert no_token.exit_code == 1 and "unauthenticated" in no_token.output
    finally:
        assert server.stop() == 0
        server.close()


def test_bad_server_flags_are_usage_errors(tls_files) -> None:
    cert, _ = tls_files
    half_tls = CliRunner().invoke(main, ["cache-server", "--port", "0", "--tls-cert", cert])
    assert half_tls.exit_code == 2 and "both a certificate and a key" in half_tls.output
    negative = CliRunner().invoke(main, ["cache-server", "--port", "0", "--memory-gb", "-1"])
    assert negative.exit_code == 2 and "memory capacity must be positive" in negative.output
