"""Engines as tenants of one real cache server started with ``--tenants`` (issue #17):
an engine whose ``key_prefix`` is its tenant's gets hits for its own chunks; one
whose prefix is not its tenant's is refused by the server, which the connector
answers as misses (tokens still equal recompute, the tier's error logged once)."""

from __future__ import annotations

import logging
import random

import pytest

from benchmarks.support.cache_server_process import CacheServerProcess
from connector import OffloadConfig
from engine import LLM, SamplingParams
from tests.cache_server.helpers import Stubs
from tests.cache_server.test_tenants import TENANTS_YAML, TOKEN_A, TOKEN_B, TOKEN_OPS, bearer, listed

CHUNK_SIZE = 64
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    process = CacheServerProcess("--memory-gb", "0.2", "--tenants", str(path)).start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(3, 500) for _ in range(200)]


@pytest.fixture(scope="module")
def reference(model_dir, prompt) -> list[int]:
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    return llm.generate(prompt, PARAMS)[0].token_ids


def remote_engine(model_dir, server, token: str, key_prefix: str) -> LLM:
    """An engine whose only tier is the cache server (no CPU tier, no GPU prefix cache)."""
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE,
        cpu_bytes=0,
        remote_url=f"{server.url}?token={token}&timeout=10",
        key_prefix=key_prefix,
        load_policy="always",  # every hit loaded (through the staging area), whatever the rates
    )
    return LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False, kv_offload=config)


def test_an_engine_with_its_tenants_prefix_hits_its_own_chunks(model_dir, server, prompt, reference):
    writer = remote_engine(model_dir, server, TOKEN_A, "team-a/")
    first = writer.generate(prompt, PARAMS)[0]
    writer.flush_kv_offload()
    reader = remote_engine(model_dir, server, TOKEN_A, "team-a/")
    second = reader.generate(prompt, PARAMS)[0]
    assert first.metrics.num_external_cached_tokens == 0
    assert second.metrics.num_external_cached_tokens == 199
    assert first.token_ids == second.token_ids == reference
    with Stubs(server.address, metadata=bearer(TOKEN_OPS)) as ops:
        keys = listed(ops)
    assert keys and all(key.startswith("team-a/kvstash-") for key in keys)
    # team-b's engine, with its own token and prefix, shares none of them.
    other = remote_engine(model_dir, server, TOKEN_B, "team-b/")
    assert other.generate(prompt, PARAMS)[0].metrics.num_external_cached_tokens == 0


def test_an_engine_outside_its_tenants_prefixes_gets_misses_not_a_crash(
    model_dir, server, prompt, reference, caplog
):
    caplog.set_level(logging.WARNING, logger="connector.tiers")
    with Stubs(server.address, metadata=bearer(TOKEN_A)) as as_a:
        team_a_before = {key: as_a.get(key) for key in listed(as_a)}
    intruder = remote_engine(model_dir, server, TOKEN_B, "team-a/")  # team-b's token, team-a's keys
    outputs = intruder.generate([prompt, prompt], PARAMS)
    intruder.flush_kv_offload()
    again = intruder.generate(prompt, PARAMS)[0]
    for output in (*outputs, again):
        assert output.token_ids == reference
        assert output.metrics.num_external_cached_tokens == 0
    tiers = intruder.engine.offload_cache_engine.tiers
    assert tiers.stats()["tiers"]["grpc"]["connector_errors"] >= 1
    failing = [record for record in caplog.records if "tier grpc failing" in record.getMessage()]
    assert len(failing) == 1 and "PERMISSION_DENIED" in failing[0].getMessage()
    # Nothing of team-a's was overwritten or added by the intruder.
    with Stubs(server.address, metadata=bearer(TOKEN_A)) as as_a:
        assert {key: as_a.get(key) for key in listed(as_a)} == team_a_before
