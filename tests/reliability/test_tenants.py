"""Issue #17's tenant attack, replayed against a cache server started with ``--tenants``.

Before: one shared token let a second client list, read and overwrite another
engine's chunks with well-formed ones of the same shape, which that engine then
loaded. Now each engine writes under its tenant's key prefix with its own token;
the attacker (another tenant's token) is refused every step, over gRPC and over the
bulk channel, and the owner's next engine still loads exactly its own KV.
"""

from __future__ import annotations

import grpc
import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from connector import OffloadConfig
from protos import bulk_wire as wire
from protos import kvstash_pb2
from storage_backends.bulk_channel import BulkClient
from storage_backends.bulk_errors import BulkStatusError
from tests.cache_server.helpers import Stubs, rpc_error
from tests.cache_server.test_tenants import TENANTS_YAML, TOKEN_A, TOKEN_B, TOKEN_OPS, bearer, listed
from tests.reliability.engine_stream import (
    CHUNK_SIZE,
    StreamTally,
    full_hits,
    make_prompts,
    new_llm,
    tiers_of,
)


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    process = CacheServerProcess("--memory-gb", "0.2", "--tenants", str(path)).start()
    yield process
    process.stop()


def test_another_tenant_cannot_list_read_overwrite_or_evict_an_engines_chunks(
    tenants_server, model_dir, reference, reliability_report
):
    url = f"{tenants_server.url}?token={TOKEN_A}&timeout=10"
    offload = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, staging_bytes=0, remote_url=url, key_prefix="team-a/"
    )
    prompts = make_prompts(3, seed=17)
    owner = new_llm(model_dir, offload)
    tally = StreamTally()
    tally.run(owner, prompts, reference)
    tiers_of(owner).flush()
    with Stubs(tenants_server.address, metadata=bearer(TOKEN_OPS)) as ops:
        victim_keys = listed(ops, "team-a/")
        # A well-formed value of the same shape: another of the owner's own chunks.
        forged = ops.get(victim_keys[1])
    assert len(victim_keys) >= 2

    attempts = 0
    with Stubs(tenants_server.address, metadata=bearer(TOKEN_B)) as attacker:
        md = attacker.metadata
        assert listed(attacker) == []  # the attacker's own listing shows none of the owner's keys
        attacks = [
            lambda: listed(attacker, "team-a/"),
            lambda: listed(attacker, "team"),
            lambda: attacker.get(victim_keys[0]),
            lambda: attacker.put(victim_keys[0], forged),
            lambda: attacker.kv.Contains(kvstash_pb2.ContainsRequest(keys=victim_keys[:1]), metadata=md),
            lambda: attacker.kv.Delete(kvstash_pb2.DeleteRequest(key=victim_keys[0]), metadata=md),
            lambda: attacker.admin.Evict(kvstash_pb2.EvictRequest(prefix="team-a/"), metadata=md),
            lambda: attacker.admin.Clear(kvstash_pb2.ClearRequest(), metadata=md),
            lambda: attacker.admin.Stats(kvstash_pb2.StatsRequest(), metadata=md),
        ]
        for attack in attacks:
            assert rpc_error(attack).code() == grpc.StatusCode.PERMISSION_DENIED
            attempts += 1
        port = attacker.kv.GetBulkEndpoint(kvstash_pb2.BulkEndpointRequest(), metadata=md).port
    bulk = BulkClient("127.0.0.1", port, token=TOKEN_B, timeout_s=10)
    try:
        for attack in (lambda: bulk.get(victim_keys[0]), lambda: bulk.put(victim_keys[0], forged)):
            with pytest.raises(BulkStatusError) as caught:
                attack()
            assert caught.value.code == wire.STATUS_PERMISSION_DENIED
            attempts += 1
    finally:
        bulk.close()

    # The owner's next engine loads its own chunks, unchanged: full hits, reference tokens.
    again = new_llm(model_dir, offload)
    assert tally.run(again, prompts, reference) == full_hits(prompts)
    tally.assert_clean()
    reliability_report.record(
        "tenant isolation",
        "another tenant's token lists, reads, overwrites (gRPC and bulk), checks, deletes, evicts, clears",
        num_attacks=attempts,
        num_attacks_refused=attempts,
        num_requests=tally.num_requests,
        num_failed=tally.num_failed,
        num_tokens_compared=tally.num_tokens_compared,
        num_tokens_differing=tally.num_tokens_differing,
    )
