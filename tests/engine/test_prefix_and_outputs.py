"""Prefix-cache accounting, stop conditions, EOS, bad input and the CLI, on a tiny
model in float32 on CPU."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, EngineArgs, EngineCore, SamplingParams
from tests.engine.hf_reference import random_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def llm(qwen3_dir) -> LLM:
    return LLM(qwen3_dir, dtype="float32", device="cpu")


def test_second_request_reuses_a_512_token_prefix_and_computes_only_the_rest(qwen3_dir):
    prefix = random_prompt(512, seed=1)
    first_prompt, second_prompt = prefix + random_prompt(40, seed=2), prefix + random_prompt(30, seed=3)
    llm = LLM(qwen3_dir, dtype="float32", device="cpu")
    (first,) = llm.generate([first_prompt], GREEDY)
    assert first.metrics.num_local_cached_tokens == 0
    computed_before = llm.stats.num_computed_tokens_total
    (second,) = llm.generate([second_prompt], GREEDY)
    assert second.metrics.num_local_cached_tokens == 512
    assert second.metrics.num_prompt_tokens == 542
    # the model ran the 30 new prompt tokens and 7 decode steps, not the prefix
    assert llm.stats.num_computed_tokens_total - computed_before == 30 + (GREEDY.max_tokens - 1)
    # and the tokens are those of an engine that computed everything
    cold = LLM(qwen3_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    (expected,) = cold.generate([second_prompt], GREEDY)
    assert second.token_ids == expected.token_ids
    assert expected.metrics.num_local_cached_tokens == 0


def test_max_tokens_and_metrics(llm):
    (output,) = llm.generate(["The cache"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(output.token_ids) == 5 and output.finish_reason == "length"
    assert output.metrics.num_prompt_tokens == len(llm.tokenizer.encode("The cache"))
    assert output.metrics.ttft_s is not None and output.metrics.ttft_s > 0
    assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text_before_it(llm):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (full,) = llm.generate(["KV blocks move between tiers"], params)
    # pick a stop string that first appears in the middle of the greedy text
    stop = next(
        full.text[i : i + 3]
        for i in range(4, len(full.text) - 3)
        if full.text[i : i + 3].strip() and full.text.find(full.text[i : i + 3]) == i
    )
    cut = full.text.find(stop)
    stopped_params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    (stopped,) = llm.generate(["KV blocks move between tiers"], stopped_params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)


def test_eos_ends_the_request_unless_ignored(qwen3_dir):
    prompt = random_prompt(20, seed=9)
    engine = EngineCore(qwen3_dir, EngineArgs(dtype="float32", device="cpu"))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("ignore", prompt, params)
    outputs = _run(engine)
    tokens = outputs["ignore"].token_ids
    eos = tokens[4]  # pretend the 5th generated token is EOS
    request = engine.add_request("stops", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    request.eos_token_ids = frozenset({eos})
    out = _run(engine)["stops"]
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: tokens.index(eos) + 1]


def _run(engine: EngineCore) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 1e-300}, "top_p"),
        ({"top_k": 10**23}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_before_anything_is_queued(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine prompt", ""], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[5, 6], []], GREEDY)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[7] * 4096], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[5, 100000]], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_other_requests_keep_running_after_a_rejected_one(qwen3_dir, llm):
    prompts = {"a": random_prompt(50, seed=4), "b": random_prompt(70, seed=5)}
    engine = EngineCore(qwen3_dir, EngineArgs(dtype="float32", device="cpu"))
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    engine.step()
    for bad_prompt in ([], [1] * 5000):
        with pytest.raises(ValueError, match="request 'bad'"):
            engine.add_request("bad", bad_prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", prompts["a"], GREEDY)
    outputs = _run(engine)
    assert set(outputs) == {"a", "b"}
    expected = llm.generate(list(prompts.values()), GREEDY)
    assert [outputs[k].token_ids for k in prompts] == [e.token_ids for e in expected]


def test_abort_ends_a_request_and_frees_its_blocks(qwen3_dir):
    engine = EngineCore(qwen3_dir, EngineArgs(dtype="float32", device="cpu", num_gpu_blocks=64))
    engine.add_request("a", random_prompt(100, seed=6), GREEDY)
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    output = engine.abort_request("a")
    assert output.finished and output.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == 64 and not engine.has_unfinished_requests()


def test_unknown_architecture_is_a_value_error(qwen3_dir, tmp_path):
    model_dir = tmp_path / "gpt2ish"
    shutil.copytree(qwen3_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown architecture.*GPT2LMHeadModel"):
        LLM(model_dir)


def test_bad_engine_args_are_value_errors(qwen3_dir):
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(qwen3_dir, num_blocks=3)
    with pytest.raises(ValueError, match="dtype"):
        LLM(qwen3_dir, dtype="int8")
    with pytest.raises(ValueError, match="block_size"):
        LLM(qwen3_dir, block_size=0)


def test_cli_generate_prints_the_greedy_text(qwen3_dir, llm, subprocess_env):
    prompt = "The quick brown fox"
    (expected,) = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    command = [sys.executable, "-m", "engine.cli", "--log-level", "WARNING", "generate", str(qwen3_dir)]
    command += [
        "--prompt",
        prompt,
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--dtype",
        "float32",
        "--device",
        "cpu",
    ]
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.text + "\n"


def test_cli_generate_reports_bad_input(qwen3_dir):
    from click.testing import CliRunner

    from engine.cli import main

    result = CliRunner().invoke(main, ["generate", str(qwen3_dir), "--prompt", "hi", "--top-p", "2"])
    assert result.exit_code != 0
    assert "top_p must be in (0, 1]" in result.output


def test_each_step_finishes_its_prefix_hashes_in_the_runners_device_time(qwen3_dir, monkeypatch):
    from engine.block_manager import LOOKUP_BATCH_BLOCKS

    llm = LLM(qwen3_dir, dtype="float32", device="cpu")
    block_size = llm.engine.block_size
    num_prompt = (LOOKUP_BATCH_BLOCKS + 3) * block_size + 5
    scheduler = llm.engine.scheduler
    hash_blocks_of = scheduler.hash_blocks_of
    hashes_before_each_call = []

    def record(requests):
        requests = list(requests)
        hashes_before_each_call.append([len(r.block_hashes) for r in requests])
        hash_blocks_of(requests)

    monkeypatch.setattr(scheduler, "hash_blocks_of", record)
    prefix = random_prompt(num_prompt, seed=9)
    steps_before = llm.stats.num_steps
    llm.generate([prefix], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # once per step; admission hashed one batch, the step's hook the rest
    assert len(hashes_before_each_call) == llm.stats.num_steps - steps_before == 3
    assert hashes_before_each_call[0] == [LOOKUP_BATCH_BLOCKS]
    # every full block of the prompt was registered: a second prompt finds them all
    (second,) = llm.generate([prefix[:-5] + random_prompt(7, seed=10)], GREEDY)
    assert second.metrics.num_local_cached_tokens == (LOOKUP_BATCH_BLOCKS + 3) * block_size
