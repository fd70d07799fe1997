"""Per-tenant authorization on the real cache server (issue #17, tenants): a token
touches only keys under its tenant's prefixes, over gRPC and over the bulk channel;
Clear and server-wide Stats need an admin; bad tenants files stop the server at start."""

from __future__ import annotations

import json

import grpc
import pytest
from click.testing import CliRunner

from benchmarks.support.cache_server_process import CacheServerProcess, repo_env
from benchmarks.support.cache_server_values import make_value
from cache_server.cli import cache_server as cache_server_command
from cache_server.tenants import Tenant, build_registry, load_tenants
from protos import bulk_wire as wire
from protos import kvstash_pb2
from storage_backends import BackendError
from storage_backends.bulk_channel import BulkClient
from storage_backends.bulk_errors import BulkStatusError
from storage_backends.grpc_backend import GrpcBackend
from tests.cache_server.helpers import Stubs, rpc_error, run_kvstash
from tests.cache_server.server_process import run_cache_server_briefly

TOKEN_A = "token-of-team-a-0123456789"
TOKEN_B = "token-of-team-b-0123456789"
TOKEN_OPS = "token-of-the-operators-0123"
AUTH_TOKEN = "the-auth-token-admin"
TENANTS_YAML = f"""
- name: team-a
  token: {TOKEN_A}
  prefixes: ["team-a/"]
- name: team-b
  token: {TOKEN_B}
  prefixes: ["team-b/", "shared-b/"]
- name: ops
  token: {TOKEN_OPS}
  prefixes: []
  admin: true
"""
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    return str(path)


@pytest.fixture(scope="module")
def server(tenants_file):
    """--tenants plus --auth-token (the token is one more admin tenant)."""
    process = CacheServerProcess(
        "--memory-gb", "0.1", "--tenants", tenants_file, "--auth-token", AUTH_TOKEN
    ).start()
    yield process
    process.stop()


@pytest.fixture
def stubs(server):
    """Stubs per tenant, over a server holding team-a/k1 and team-b/k1 (and nothing else)."""
    with (
        Stubs(server.address, metadata=bearer(TOKEN_A)) as a,
        Stubs(server.address, metadata=bearer(TOKEN_B)) as b,
        Stubs(server.address, metadata=bearer(TOKEN_OPS)) as ops,
        Stubs(server.address, metadata=bearer(AUTH_TOKEN)) as auth_admin,
    ):
        ops.admin.Clear(kvstash_pb2.ClearRequest(), timeout=10, metadata=ops.metadata)
        a.put("team-a/k1", make_value(1, key="team-a/k1"))
        b.put("team-b/k1", make_value(2, key="team-b/k1"))
        yield {"a": a, "b": b, "ops": ops, "auth": auth_admin}


def listed(stubs: Stubs, prefix: str = "") -> list[str]:
    page = stubs.admin.ListKeys(
        kvstash_pb2.ListKeysRequest(prefix=prefix, page_size=100), timeout=10, metadata=stubs.metadata
    )
    return [entry.key for entry in page.entries]


def test_a_tenant_cannot_read_overwrite_check_list_or_evict_anothers_keys(stubs) -> None:
    b, md = stubs["b"], stubs["b"].metadata
    attacks = {
        "get": lambda: b.get("team-a/k1"),
        "put": lambda: b.put("team-a/k1", make_value(99, key="team-a/k1")),
        "contains": lambda: b.kv.Contains(
            kvstash_pb2.ContainsRequest(keys=["team-b/k1", "team-a/k1"]), timeout=10, metadata=md
        ),
        "delete": lambda: b.kv.Delete(kvstash_pb2.DeleteRequest(key="team-a/k1"), timeout=10, metadata=md),
        "info": lambda: b.admin.Info(kvstash_pb2.InfoRequest(key="team-a/k1"), timeout=10, metadata=md),
        "evict key": lambda: b.admin.Evict(
            kvstash_pb2.EvictRequest(key="team-a/k1"), timeout=10, metadata=md
        ),
        "evict prefix": lambda: b.admin.Evict(
            kvstash_pb2.EvictRequest(prefix="team-a/"), timeout=10, metadata=md
        ),
        "evict a wider prefix": lambda: b.admin.Evict(
            kvstash_pb2.EvictRequest(prefix="team-"), timeout=10, metadata=md
        ),
        "list prefix": lambda: listed(b, "team-a/"),
        "list a wider prefix": lambda: listed(b, "team"),
        "clear": lambda: b.admin.Clear(kvstash_pb2.ClearRequest(), timeout=10, metadata=md),
        "stats": lambda: b.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10, metadata=md),
    }
    for name, attack in attacks.items():
        error = rpc_error(attack)
        assert error.code() == PERMISSION_DENIED, (name, error.details())
        assert "tenant 'team-b' may not" in error.details(), name
        assert TOKEN_B not in error.details()
    # Nothing changed: team-a's value is intact and still there for its owner.
    assert stubs["a"].get("team-a/k1") == make_value(1, key="team-a/k1")
    assert listed(stubs["a"]) == ["team-a/k1"]


def test_a_tenant_works_within_its_prefixes(stubs) -> None:
    b, md = stubs["b"], stubs["b"].metadata
    b.put("shared-b/k2", make_value(3, key="shared-b/k2"))
    assert b.get("team-b/k1") == make_value(2, key="team-b/k1")
    assert (
        b.kv.Contains(
            kvstash_pb2.ContainsRequest(keys=["team-b/k1", "shared-b/k2", "team-b/none"]),
            timeout=10,
            metadata=md,
        ).num_hits
        == 2
    )
    # No prefix: the tenant's own keys under each of its prefixes, nobody else's.
    assert sorted(listed(b)) == ["shared-b/k2", "team-b/k1"]
    assert listed(b, "team-b/") == ["team-b/k1"]
    info = b.admin.Info(kvstash_pb2.InfoRequest(key="team-b/k1"), timeout=10, metadata=md)
    assert info.size_bytes == len(make_value(2, key="team-b/k1"))
    evicted = b.admin.Evict(kvstash_pb2.EvictRequest(prefix="shared-b/"), timeout=10, metadata=md)
    assert evicted.num_evicted == 1
    b.kv.Delete(kvstash_pb2.DeleteRequest(key="team-b/k1"), timeout=10, metadata=md)
    assert listed(b) == []
    assert listed(stubs["a"]) == ["team-a/k1"]


@pytest.mark.parametrize("admin", ["ops", "auth"])
def test_admins_touch_every_key(stubs, admin) -> None:
    ops, md = stubs[admin], stubs[admin].metadata
    assert ops.get("team-a/k1") == make_value(1, key="team-a/k1")
    assert sorted(listed(ops)) == ["team-a/k1", "team-b/k1"]
    stats = ops.admin.Stats(kvstash_pb2.StatsRequest(), timeout=10, metadata=md)
    assert stats.tiers[0].num_keys == 2
    ops.put("anything/k", make_value(4, key="anything/k"))
    assert ops.admin.Clear(kvstash_pb2.ClearRequest(), timeout=10, metadata=md).num_evicted == 3


def test_unknown_tokens_stay_unauthenticated(stubs, server) -> None:
    with Stubs(server.address, metadata=bearer("token-of-nobody-0123456789")) as nobody:
        assert rpc_error(lambda: nobody.get("team-a/k1")).code() == grpc.StatusCode.UNAUTHENTICATED


def bulk_client(stubs: Stubs, token: str) -> BulkClient:
    port = stubs.kv.GetBulkEndpoint(
        kvstash_pb2.BulkEndpointRequest(), timeout=10, metadata=stubs.metadata
    ).port
    return BulkClient("127.0.0.1", port, token=token, timeout_s=10)


def test_the_bulk_channel_applies_the_same_rules_per_request(stubs) -> None:
    as_b = bulk_client(stubs["b"], TOKEN_B)
    as_a = bulk_client(stubs["a"], TOKEN_A)
    as_ops = bulk_client(stubs["ops"], TOKEN_OPS)
    try:
        for attack in (
            lambda: as_b.get("team-a/k1"),
            lambda: as_b.put("team-a/k1", make_value(98, key="team-a/k1")),
        ):
            with pytest.raises(BulkStatusError) as caught:
                attack()
            assert caught.value.code == wire.STATUS_PERMISSION_DENIED
            assert "tenant 'team-b' may not" in caught.value.message
        # The refused requests left the connection usable, and the tenant's own keys work.
        as_b.put("team-b/bulk", make_value(5, key="team-b/bulk"))
        assert bytes(as_b.get("team-b/bulk")) == make_value(5, key="team-b/bulk")
        assert bytes(as_a.get("team-a/k1")) == make_value(1, key="team-a/k1")
        assert bytes(as_ops.get("team-b/bulk")) == make_value(5, key="team-b/bulk")
        with pytest.raises(BulkStatusError) as caught:
            bulk_client(stubs["a"], "token-of-nobody-0123456789").get("team-a/k1")
        assert caught.value.code == wire.STATUS_UNAUTHENTICATED
    finally:
        for client in (as_a, as_b, as_ops):
            client.close()


def test_the_grpc_tier_of_another_tenant_gets_errors_not_data(stubs, server) -> None:
    """What an engine's grpc tier sees (bulk channel first, then gRPC): a BackendError."""
    backend = GrpcBackend(server.address, token=TOKEN_B, timeout_s=10)
    try:
        with pytest.raises(BackendError, match="PERMISSION_DENIED"):
            backend.get_encoded("team-a/k1")
        with pytest.raises(BackendError, match="PERMISSION_DENIED"):
            backend.put_encoded("team-a/k1", make_value(97, key="team-a/k1"))
        with pytest.raises(BackendError, match="PERMISSION_DENIED"):
            backend.contains(["team-a/k1"])
        assert backend.keys() == ["team-b/k1"]
        # Server-wide gauges are admin-only: a tenant's tier reports them as unknown.
        num_errors = backend.stats()["errors"]
        assert backend.stats()["num_keys"] is None
        assert backend.stats()["errors"] == num_errors
    finally:
        backend.close()
    assert stubs["a"].get("team-a/k1") == make_value(1, key="team-a/k1")


def test_kvstash_admin_with_a_tenant_token(stubs, server) -> None:
    env = repo_env(KVSTASH_AUTH_TOKEN=TOKEN_B)
    listing = run_kvstash("admin", "--server", server.address, "ls", "--json", env=env)
    assert listing.returncode == 0, listing.stderr
    assert [entry["key"] for entry in json.loads(listing.stdout)["keys"]] == ["team-b/k1"]
    for args in (("stats",), ("clear", "--yes"), ("ls", "--prefix", "team-a/"), ("evict", "team-a/k1")):
        result = run_kvstash("admin", "--server", server.address, *args, env=env)
        assert result.returncode != 0, args
        assert "permission_denied: tenant 'team-b' may not" in result.stderr, (args, result.stderr)
    as_ops = run_kvstash("admin", "--server", server.address, "--auth-token", TOKEN_OPS, "stats", "--json")
    assert as_ops.returncode == 0, as_ops.stderr
    assert stubs["a"].get("team-a/k1") == make_value(1, key="team-a/k1")


@pytest.mark.parametrize(
    "text, message",
    [
        ("- name: a\n  token: [unclosed\n", "is not valid YAML"),
        ("name: a\n", "must hold a list"),
        ("[]\n", "the list is empty"),
        (
            f"- {{name: a, token: {TOKEN_A}, prefixes: [a/]}}\n- {{name: a, token: {TOKEN_B}, prefixes: [b/]}}\n",
            "'a' appears twice",
        ),
        (
            f"- {{name: a, token: {TOKEN_A}, prefixes: [a/]}}\n- {{name: b, token: {TOKEN_A}, prefixes: [b/]}}\n",
            "same token as an earlier tenant",
        ),
        (f"- {{name: a, token: {TOKEN_A}, prefixes: []}}\n", "is not an admin and has no prefixes"),
        (f"- {{name: a, token: {TOKEN_A}}}\n", "is not an admin and has no prefixes"),
        (f"- {{name: a, token: {TOKEN_A}, prefixes: ['']}}\n", "empty prefix"),
        ("- {name: a, token: short, prefixes: [a/]}\n", "at least 16 characters"),
        (f"- {{name: a, token: {TOKEN_A}, prefixes: a/}}\n", "prefixes must be a list"),
        (f"- {{name: a, token: {TOKEN_A}, prefixes: [a/], admin: 'yes'}}\n", "admin must be true or false"),
        (f"- {{name: a, token: {TOKEN_A}, prefixes: [a/], role: x}}\n", "unknown field"),
    ],
)
def test_bad_tenants_files_stop_the_server_with_a_clear_error(tmp_path, text, message) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    result = CliRunner().invoke(cache_server_command, ["--port", "0", "--tenants", str(path)])
    assert result.exit_code == 2
    assert message in result.output, result.output


def test_auth_token_equal_to_a_tenants_token_is_refused(tmp_path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    result = CliRunner().invoke(
        cache_server_command, ["--port", "0", "--tenants", str(path), "--auth-token", TOKEN_A]
    )
    assert result.exit_code == 2
    assert "same token as an earlier tenant" in result.output


def test_a_missing_tenants_file_exits_non_zero_in_a_real_process(tmp_path) -> None:
    result = run_cache_server_briefly("--tenants", str(tmp_path / "none.yaml"))
    assert result.returncode == 2
    assert "cannot read tenants file" in result.stderr


def test_the_registry_matches_whole_tokens_only() -> None:
    registry = build_registry(load_tenants_text(TENANTS_YAML), AUTH_TOKEN)
    assert registry.tenant_for_token(TOKEN_A).name == "team-a"
    assert registry.tenant_for_token(TOKEN_OPS.encode()).name == "ops"
    assert registry.tenant_for_token(AUTH_TOKEN).name == "auth-token"
    for wrong in (TOKEN_A + "x", TOKEN_A[:-1], "", TOKEN_A.upper(), f"Bearer {TOKEN_A}"):
        assert registry.tenant_for_token(wrong) is None, wrong
    assert registry.tenant_for_metadata((("authorization", f"Bearer {TOKEN_B}"),)).name == "team-b"
    assert registry.tenant_for_metadata((("authorization", TOKEN_B),)) is None
    assert registry.tenant_for_metadata(None) is None
    assert build_registry((), None) is None


def test_prefix_rules() -> None:
    team_b = Tenant(name="team-b", token=TOKEN_B, prefixes=("team-b/", "shared-b/"))
    assert team_b.may_access_key("team-b/x") and team_b.may_access_key("shared-b/")
    assert not team_b.may_access_key("team-a/x") and not team_b.may_access_key("team-b")
    assert team_b.may_list_prefix("team-b/") and team_b.may_list_prefix("shared-b/sub")
    assert not team_b.may_list_prefix("") and not team_b.may_list_prefix("team-")
    admin = Tenant(name="ops", token=TOKEN_OPS, admin=True)
    assert admin.may_access_key("anything") and admin.may_list_prefix("")


def load_tenants_text(text: str) -> list[Tenant]:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as file:
        file.write(text)
        file.flush()
        return load_tenants(file.name)
