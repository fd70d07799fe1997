"""Per-request cache salts (issue #17, tenants) and the engine's key prefix.

A salt seeds the chain hash of the GPU prefix cache and of the tier chunk keys:
requests with different salts never hit (or time) each other's KV, requests with
the same salt share it, and keys without a salt are those of earlier releases.
"""

from __future__ import annotations

import random

import pytest

from connector import OffloadConfig
from connector.token_db import TokenDatabase
from engine import LLM, SamplingParams
from engine.block_manager import root_hash
from engine.cache_salt import MAX_CACHE_SALT_BYTES

CHUNK_SIZE = 64
PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
NAMESPACE = "kvstash-0123456789abcdef"
#: keys of tokens 0..9 in chunks of 4 under NAMESPACE, as every release before salts made them
KNOWN_UNSALTED_KEYS = [
    f"{NAMESPACE}:35ce1b7dc4da8ce51a7591561b3595db",
    f"{NAMESPACE}:29d97b3f27d3692fd728ae911c6112e0",
    f"{NAMESPACE}:a559ed64d7695f4344e2201a650ac31f",
]
#: the same tokens under the salt "tenant-a": a change of the salted derivation fails here
KNOWN_SALTED_KEYS = [
    f"{NAMESPACE}:a21dc68c966374daf8b63474dd69ffea",
    f"{NAMESPACE}:41ff429dc813036e03970ec6ee77b521",
    f"{NAMESPACE}:26bc6bc1419622f7565448d177a01781",
]


def keys(db: TokenDatabase, tokens, cache_salt=None) -> list[str]:
    return [span.key for span in db.chunk_spans(tokens, cache_salt)]


# ---- keys ----------------------------------------------------------------------------
def test_unsalted_keys_are_byte_identical_to_earlier_releases():
    assert keys(TokenDatabase(NAMESPACE, 4, True), list(range(10))) == KNOWN_UNSALTED_KEYS


def test_salted_keys_are_known_and_differ_from_unsalted_and_other_salts():
    db = TokenDatabase(NAMESPACE, 4, True)
    tokens = list(range(10))
    assert keys(db, tokens, "tenant-a") == KNOWN_SALTED_KEYS
    salted_a, salted_b = keys(db, tokens, "tenant-a"), keys(db, tokens, "tenant-b")
    unsalted = keys(db, tokens)
    assert not set(salted_a) & set(salted_b)
    assert not set(salted_a) & set(unsalted)
    # The recent-spans cache is keyed by salt too: asking again gives the same answers.
    assert keys(db, tokens, "tenant-a") == salted_a and keys(db, tokens) == unsalted


def test_key_prefix_is_plain_text_in_front_of_the_unchanged_key():
    db = TokenDatabase(NAMESPACE, 4, True, key_prefix="tenant-a/")
    assert keys(db, list(range(10))) == [f"tenant-a/{key}" for key in KNOWN_UNSALTED_KEYS]


def test_gpu_root_hash_is_per_salt_and_unchanged_without_one():
    assert root_hash(None) == b"kvstash-gpu-prefix-v1"
    assert len({root_hash(None), root_hash("a"), root_hash("b")}) == 3
    assert root_hash("a") == root_hash("a")


@pytest.mark.parametrize(
    "key_prefix, message",
    [
        ("tenant a/", "printable ASCII"),
        ("tenant-\u00e9/", "printable ASCII"),
        ("t\n", "printable ASCII"),
        ("x" * 129, "more than 128"),
        (7, "must be a string"),
    ],
)
def test_bad_key_prefixes_are_refused(key_prefix, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(key_prefix=key_prefix)


def test_key_prefix_from_env_and_yaml(tmp_path):
    assert OffloadConfig.from_env({"KVSTASH_KV_OFFLOAD_KEY_PREFIX": "tenant-a/"}).key_prefix == "tenant-a/"
    path = tmp_path / "offload.yaml"
    path.write_text("key_prefix: tenant-b/\n")
    assert OffloadConfig.from_yaml(path).key_prefix == "tenant-b/"


# ---- the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(17)
    return [rng.randrange(3, 500) for _ in range(200)]


@pytest.fixture(scope="module")
def reference(model_dir, prompt) -> list[int]:
    """Greedy tokens of ``prompt`` without salt, offload or prefix cache."""
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False)
    return llm.generate(prompt, PARAMS)[0].token_ids


def run(llm: LLM, prompt: list[int], cache_salt: str | None):
    request = (
        {"prompt_token_ids": prompt}
        if cache_salt is None
        else {"prompt_token_ids": prompt, "cache_salt": cache_salt}
    )
    (output,) = llm.generate([request], PARAMS)
    return output


def test_gpu_prefix_cache_is_shared_only_within_a_salt(model_dir, prompt, reference):
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=True)
    first = run(llm, prompt, "tenant-a")
    other_salt = run(llm, prompt, "tenant-b")
    no_salt = run(llm, prompt, None)
    same_salt = run(llm, prompt, "tenant-a")
    assert first.metrics.num_local_cached_tokens == 0
    assert other_salt.metrics.num_local_cached_tokens == 0
    assert no_salt.metrics.num_local_cached_tokens == 0
    assert same_salt.metrics.num_local_cached_tokens >= 192
    again_no_salt = run(llm, prompt, None)
    assert again_no_salt.metrics.num_local_cached_tokens >= 192
    for output in (first, other_salt, no_salt, same_salt, again_no_salt):
        assert output.token_ids == reference


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_offload_tiers_are_shared_only_within_a_salt(model_dir, prompt, reference, tier, tmp_path):
    if tier == "cpu":
        config = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=64 << 20)
    else:
        config = OffloadConfig(
            chunk_size=CHUNK_SIZE, cpu_bytes=0, disk_path=str(tmp_path / "disk"), load_policy="always"
        )
    llm = LLM(str(model_dir), dtype="float32", device="cpu", enable_prefix_caching=False, kv_offload=config)
    first = run(llm, prompt, "tenant-a")
    llm.flush_kv_offload()
    other_salt = run(llm, prompt, "tenant-b")
    no_salt = run(llm, prompt, None)
    llm.flush_kv_offload()
    same_salt = run(llm, prompt, "tenant-a")
    again_no_salt = run(llm, prompt, None)
    assert first.metrics.num_external_cached_tokens == 0
    assert other_salt.metrics.num_external_cached_tokens == 0
    assert no_salt.metrics.num_external_cached_tokens == 0
    assert same_salt.metrics.num_external_cached_tokens == 199  # all but the last prompt token
    assert again_no_salt.metrics.num_external_cached_tokens == 199
    for output in (first, other_salt, no_salt, same_salt, again_no_salt):
        assert output.token_ids == reference


def test_plain_prompts_still_work_and_equal_dict_prompts(model_dir, prompt, reference):
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    text = llm.tokenizer.decode(prompt[:40])
    plain = llm.generate([text, prompt], PARAMS)
    as_dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": prompt, "cache_salt": "s"}], PARAMS)
    assert [o.token_ids for o in plain] == [o.token_ids for o in as_dicts]
    assert plain[1].token_ids == reference
    assert llm.generate({"prompt_token_ids": prompt, "cache_salt": "s"}, PARAMS)[0].token_ids == reference


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt_token_ids": [5, 6], "cache_salt": 3}, "cache_salt must be a string"),
        ({"prompt_token_ids": [5, 6], "cache_salt": ""}, "must not be empty"),
        ({"prompt_token_ids": [5, 6], "cache_salt": "x" * (MAX_CACHE_SALT_BYTES + 1)}, "limit"),
        ({"prompt_token_ids": [5, 6], "salt": "x"}, "unknown key"),
        ({"prompt": "hi", "prompt_token_ids": [5]}, "exactly one"),
        ({"cache_salt": "x"}, "exactly one"),
        ({"prompt": [5, 6]}, "'prompt' must be a string"),
    ],
)
def test_bad_dict_prompts_are_refused_before_anything_runs(model_dir, bad, message):
    llm = LLM(str(model_dir), dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [7, 8, 9]}, bad], PARAMS)
    assert not llm.engine.requests


@pytest.mark.gpu
@pytest.mark.parametrize("layerwise", [False, True])
def test_salts_on_cuda_with_prefix_cache_and_the_cpu_tier(model_dir, prompt, layerwise):
    """On CUDA (pinned CPU tier, Triton kernels): GPU prefix-cache and external hits only
    within a salt, and the tokens of every request equal the unsalted CUDA reference
    (no prefix cache, no offload)."""
    plain = LLM(str(model_dir), dtype="float32", device="cuda", enable_prefix_caching=False)
    reference = plain.generate(prompt, PARAMS)[0].token_ids
    del plain
    config = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=64 << 20, layerwise=layerwise)
    llm = LLM(str(model_dir), dtype="float32", device="cuda", enable_prefix_caching=True, kv_offload=config)
    first = run(llm, prompt, "tenant-a")
    other_salt = run(llm, prompt, "tenant-b")
    same_salt = run(llm, prompt, "tenant-a")
    assert (other_salt.metrics.num_local_cached_tokens, other_salt.metrics.num_external_cached_tokens) == (
        0,
        0,
    )
    assert same_salt.metrics.num_local_cached_tokens >= 192
    assert llm.reset_prefix_cache()
    from_tier = run(llm, prompt, "tenant-a")
    other_from_tier = run(llm, prompt, "tenant-c")
    assert from_tier.metrics.num_external_cached_tokens == 199
    assert other_from_tier.metrics.num_external_cached_tokens == 0
    for output in (first, other_salt, same_salt, from_tier, other_from_tier):
        assert output.token_ids == reference
