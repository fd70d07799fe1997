"""End to end: the engine with offload on, for each tier set, on a tiny float32
model with greedy sampling. Runs prompts, empties the GPU cache (prefix caching
off, a new engine or a new process), runs them again, and checks identical
tokens, the external hit counts and that the model computed only the misses."""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from connector import OffloadConfig
from engine import LLM, SamplingParams
from storage_backends.disk_backend import key_to_filename

REPO_ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
CHUNK_SIZE = 64
PROMPT_LENGTHS = (300, 130, 64, 17)
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
LOG_LINE = re.compile(
    r"req=(\S+) prompt=(\d+) gpu_hit=(\d+) ext_hit=(\d+) loaded=(\d+) bytes=(\d+) ms=([\d.]+) GB/s=([\d.]+) saved=(\d+)"
)


def make_prompts(lengths=PROMPT_LENGTHS, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in lengths]


def new_llm(model_dir, kv_offload, **engine_args) -> LLM:
    args = {"dtype": "float32", "device": "cpu", "enable_prefix_caching": False, **engine_args}
    return LLM(str(model_dir), kv_offload=kv_offload, **args)


def cache_engine_of(llm: LLM):
    return llm.engine.offload_cache_engine


def token_ids(outputs) -> list[list[int]]:
    return [output.token_ids for output in outputs]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def baseline(model_dir) -> list[list[int]]:
    """Greedy tokens without any offload."""
    return token_ids(new_llm(model_dir, None).generate(make_prompts(), PARAMS))


def run_generate_cli(model_dir, prompts: list[str], *flags: str) -> tuple[str, list[tuple]]:
    """`kvstash generate` in a new process; returns its output and connector log lines."""
    command = [sys.executable, "-m", "engine.cli", "generate", str(model_dir)]
    for prompt in prompts:
        command += ["--prompt", prompt]
    command += ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--dtype", "float32", "--device", "cpu"]
    command += [
        "--no-enable-prefix-caching",
        "--kv-offload",
        "--kv-offload-chunk-size",
        str(CHUNK_SIZE),
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, LOG_LINE.findall(result.stderr)


def text_prompts() -> list[str]:
    rng = random.Random(3)
    words = ["cache", "token", "chunk", "tier", "disk", "block", "prefix", "model", "layer", "load"]
    return [" ".join(rng.choice(words) for _ in range(num_words)) for num_words in (120, 45, 9)]


def assert_second_run_hits(first, second, num_computed_second, lengths=PROMPT_LENGTHS):
    assert token_ids(first) == token_ids(second)
    assert [o.metrics.num_external_cached_tokens for o in second] == [n - 1 for n in lengths]
    # Only the last prompt token and the decode steps ran through the model.
    assert num_computed_second == len(lengths) * MAX_TOKENS


@pytest.mark.parametrize("layerwise", [False, True])
def test_cpu_tier_round_trip(model_dir, baseline, layerwise, caplog):
    llm = new_llm(model_dir, OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=32 << 20, layerwise=layerwise))
    prompts = make_prompts()
    first = llm.generate(prompts, PARAMS)
    assert token_ids(first) == baseline
    assert [o.metrics.num_external_cached_tokens for o in first] == [0] * len(prompts)
    computed_before = llm.stats.num_computed_tokens_total
    with caplog.at_level(logging.INFO, logger="engine"):
        second = llm.generate(prompts, PARAMS)
    assert_second_run_hits(first, second, llm.stats.num_computed_tokens_total - computed_before)

    # The log line and request_stats agree with the metrics and with each other.
    bytes_per_token = cache_engine_of(llm).bytes_per_token
    lines = {m[0]: m for m in LOG_LINE.findall(caplog.text)}
    for output in second:
        _, prompt, gpu_hit, ext_hit, loaded, num_bytes, _, _, saved = lines[output.request_id]
        assert (int(prompt), int(gpu_hit), int(saved)) == (output.metrics.num_prompt_tokens, 0, 0)
        assert int(ext_hit) == int(loaded) == output.metrics.num_external_cached_tokens
        assert int(num_bytes) == int(loaded) * bytes_per_token
        stats = llm.engine.scheduler.connector.request_stats(output.request_id)
        assert stats.num_loaded_tokens == int(loaded) and stats.num_loaded_bytes == int(num_bytes)


def test_partial_gpu_hit_loads_exactly_the_missing_tokens(model_dir, caplog):
    """The GPU prefix cache keeps only a prefix of the prompt that is not chunk-aligned;
    the load covers exactly the tokens after it."""
    config = OffloadConfig(chunk_size=CHUNK_SIZE, cpu_bytes=32 << 20)
    llm = new_llm(model_dir, config, enable_prefix_caching=True, num_gpu_blocks=20, block_size=16)
    (prompt,) = make_prompts([230], seed=1)
    (first,) = llm.generate([prompt], PARAMS)
    llm.generate(make_prompts([150], seed=2), PARAMS)  # evicts the tail blocks of the first prompt
    computed_before = llm.stats.num_computed_tokens_total
    with caplog.at_level(logging.INFO, logger="engine"):
        (second,) = llm.generate([prompt], PARAMS)
    assert second.token_ids == first.token_ids
    num_gpu_hit = second.metrics.num_local_cached_tokens
    assert 0 < num_gpu_hit < 229 and num_gpu_hit % CHUNK_SIZE != 0
    needed = 229 - num_gpu_hit
    assert second.metrics.num_external_cached_tokens == needed
    (line,) = [m for m in LOG_LINE.findall(caplog.text) if m[0] == second.request_id]
    assert (int(line[2]), int(line[3]), int(line[4])) == (num_gpu_hit, needed, needed)
    assert llm.stats.num_computed_tokens_total - computed_before == MAX_TOKENS


def test_disk_tier_in_a_new_process(model_dir, tmp_path):
    """`kvstash generate` stores on disk in its own process; an engine here, whose CPU
    tier starts empty, can only hit on disk."""
    disk = tmp_path / "kv"
    prompts = text_prompts()
    printed, writer_lines = run_generate_cli(
        model_dir, prompts, "--kv-offload-cpu-gb", "0", "--kv-offload-disk-path", str(disk)
    )
    lengths = [int(line[1]) for line in writer_lines]
    assert [int(line[8]) for line in writer_lines] == lengths  # every prompt token saved
    assert len(list(disk.glob("*.kvc"))) == sum((n + CHUNK_SIZE - 1) // CHUNK_SIZE for n in lengths)

    baseline = new_llm(model_dir, None).generate(prompts, PARAMS)
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=32 << 20, disk_path=str(disk), load_policy="always"
    )
    reader = new_llm(model_dir, config)
    outputs = reader.generate(prompts, PARAMS)
    assert [o.text for o in outputs] == [o.text for o in baseline]
    assert "".join(o.text + "\n" for o in outputs) == printed
    prompt_lengths = [o.metrics.num_prompt_tokens for o in outputs]
    assert sorted(prompt_lengths) == sorted(lengths)
    assert_second_run_hits(baseline, outputs, reader.stats.num_computed_tokens_total, prompt_lengths)


def flush_and_close(llm: LLM) -> None:
    """Finish the write-through to lower tiers (a process exit does the same)."""
    llm.engine.runner.connector.close()


def test_redis_tier(model_dir, baseline, redis_url):
    # load_policy always: every hit is loaded (through the staging area), whatever the measured rates
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, remote_url=redis_url, codec="lz4", load_policy="always"
    )
    writer = new_llm(model_dir, config)
    first = writer.generate(make_prompts(), PARAMS)
    assert token_ids(first) == baseline
    flush_and_close(writer)
    reader = new_llm(model_dir, config)  # a new engine: nothing on its GPU, no CPU tier
    second = reader.generate(make_prompts(), PARAMS)
    assert_second_run_hits(first, second, reader.stats.num_computed_tokens_total)


def test_two_processes_share_one_cache_server(model_dir, cache_server_url):
    """An engine in another process stores into the real cache server; an engine in
    this process gets its hits from there (no CPU tier on either side)."""
    prompts = text_prompts()
    flags = ("--kv-offload-cpu-gb", "0", "--kv-offload-remote", cache_server_url)
    printed, writer_lines = run_generate_cli(model_dir, prompts, *flags)
    assert [int(line[3]) for line in writer_lines] == [0] * len(prompts)
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, remote_url=cache_server_url, load_policy="always"
    )
    reader = new_llm(model_dir, config)
    outputs = reader.generate(prompts, PARAMS)
    assert "".join(o.text + "\n" for o in outputs) == printed
    lengths = [o.metrics.num_prompt_tokens for o in outputs]
    assert [o.metrics.num_external_cached_tokens for o in outputs] == [n - 1 for n in lengths]
    assert reader.stats.num_computed_tokens_total == len(prompts) * MAX_TOKENS


def test_corrupt_chunk_is_recomputed_never_a_wrong_token(model_dir, baseline, tmp_path, caplog):
    config = OffloadConfig(
        chunk_size=CHUNK_SIZE, cpu_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 30, load_policy="always"
    )
    prompts = make_prompts()
    writer = new_llm(model_dir, config)
    writer.generate(prompts, PARAMS)
    flush_and_close(writer)
    # Flip one byte in the third chunk of the 300-token prompt.
    key = cache_engine_of(writer).token_db.chunk_spans(prompts[0])[2].key
    path = tmp_path / key_to_filename(key)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10
    path.write_bytes(bytes(data))

    reader = new_llm(model_dir, config)
    with caplog.at_level(logging.INFO, logger="engine"):
        outputs = reader.generate(prompts, PARAMS)
    assert token_ids(outputs) == baseline
    line = [m for m in LOG_LINE.findall(caplog.text) if m[0] == outputs[0].request_id][0]
    assert int(line[3]) == int(line[4]) == 2 * CHUNK_SIZE  # ext_hit == loaded == what was really loaded
    assert [o.metrics.num_external_cached_tokens for o in outputs] == [2 * CHUNK_SIZE] + [
        n - 1 for n in PROMPT_LENGTHS[1:]
    ]
    # The first prompt recomputed everything after its two good chunks. Without a CPU tier the
    # fetch into the staging area finds the corrupt chunk before the request is admitted, so
    # no step is discarded (read inside the step, staging_bytes 0, its last prompt token ran
    # in the step that found it and was computed twice).
    expected = (300 - 2 * CHUNK_SIZE) + (MAX_TOKENS - 1) + (len(PROMPT_LENGTHS) - 1) * MAX_TOKENS
    assert reader.stats.num_computed_tokens_total == expected
