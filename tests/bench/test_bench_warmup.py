"""`kvstash bench` end to end on the tiny preset (CPU, float32): both engines run the
same warm-up, through the paths the timed run takes, before anything is timed; the
report carries where loaded tokens came from and the bound of each hit."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from bench.cli import bench
from bench.results import Workload
from bench.workload import make_conversations

QUESTION_LEN, ANSWER_LEN, CONTEXT_LEN = 16, 4, 600
FLAGS = [
    "--model-size",
    "tiny",
    "--device",
    "cpu",
    "--users",
    "2",
    "--context-len",
    str(CONTEXT_LEN),
    "--rounds",
    "3",
    "--question-len",
    str(QUESTION_LEN),
    "--answer-len",
    str(ANSWER_LEN),
]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> tuple[dict, str]:
    root = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        result = CliRunner().invoke(bench, [*FLAGS, "--out", str(root / "out")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads((root / "out" / "bench.json").read_text()), result.output


def test_preset_is_printed_and_recorded(report) -> None:
    data, output = report
    assert output.startswith("preset tiny:") and "why: chosen with --model-size" in output
    assert data["preset"]["name"] == "tiny" and data["preset"]["reason"]
    assert data["dtype"] == "float32" and data["device"] == "cpu" and data["copy_kind"] == "host memcpy"


def test_both_engines_ran_the_same_warmup_prompts(report) -> None:
    data, _ = report
    off, on = data["warmup"]["off"], data["warmup"]["on"]
    assert [w["step"] for w in off] == [w["step"] for w in on]
    assert [w["prompt_digest"] for w in off] == [w["prompt_digest"] for w in on]
    assert [w["num_prompt_tokens"] for w in off] == [w["num_prompt_tokens"] for w in on]
    # The warm-up's rounds have the timed rounds' prompt lengths ...
    round_lengths = [w["num_prompt_tokens"] for w in on if w["step"].startswith("round")]
    timed_lengths = sorted({t["num_prompt_tokens"] for t in data["turns"]["on"]})
    assert round_lengths == timed_lengths
    # ... and none of the timed prompts.
    warmup_digests = {w["prompt_digest"] for w in on}
    timed_digests = {t["prompt_digest"] for t in data["turns"]["off"] + data["turns"]["on"]}
    assert len(timed_digests) == 6 and not warmup_digests & timed_digests


def test_warmup_prompts_share_no_prefix_with_the_workload() -> None:
    workload = Workload(num_users=3, context_len=300, num_rounds=2, system_prompt_len=40)
    conversations = make_conversations(workload, list(range(10, 500)), chunk_size=64)
    steps = conversations.warmup
    assert [len(step.prompt) for step in steps[:2]] == [workload.prompt_len(0), workload.prompt_len(1)]
    assert len(steps[-1].prompt) == 65 and steps[-1].drop_cpu_tier and steps[-1].reset
    # not even the shared system prompt: the tiers must hold nothing of round 1 afterwards
    for step in steps:
        for context in conversations.contexts:
            assert step.prompt[:16] != context[:16]


def test_warmup_takes_every_path_of_the_timed_run(report) -> None:
    data, _ = report
    off = {w["step"]: w for w in data["warmup"]["off"]}
    on = {w["step"]: w for w in data["warmup"]["on"]}
    assert list(on) == ["round 1", "round 2", "round 3", "GPU prefix hit", "disk tier"]
    # round 1: a full prefill in both engines
    assert on["round 1"]["num_external_hit_tokens"] == 0
    assert on["round 1"]["num_computed_tokens"] == off["round 1"]["num_computed_tokens"]
    # later rounds: the on engine loads the history from the CPU tier, the off engine recomputes
    for step in ("round 2", "round 3"):
        assert on[step]["tier_to_loaded_tokens"].get("cpu", 0) >= 256
        assert off[step]["num_external_hit_tokens"] == 0
        assert off[step]["num_computed_tokens"] == off[step]["num_prompt_tokens"] + ANSWER_LEN - 1
    # a prefill over a GPU-cached prefix, in both engines
    for engine in (on, off):
        hit = engine["GPU prefix hit"]
        assert hit["num_computed_tokens"] <= QUESTION_LEN + 16 + ANSWER_LEN
    # the disk tier's load path (the CPU tier was emptied first)
    assert on["disk tier"]["tier_to_loaded_tokens"] == {"disk": 256}
    assert off["disk tier"]["num_external_hit_tokens"] == 0


def test_round_one_is_like_for_like_and_later_rounds_load(report) -> None:
    data, output = report
    rows = data["rounds"]
    first = rows[0]
    assert first["external_hit_tokens_on"] == 0 and first["tier_to_loaded_tokens_on"] == {}
    assert first["computed_tokens_on"] == first["computed_tokens_off"]
    assert first["bound_ms"] is None
    for row in rows[1:]:
        assert row["external_hit_tokens_on"] > 0
        assert sum(row["tier_to_loaded_tokens_on"].values()) == pytest.approx(row["loaded_tokens_on"])
        assert set(row["tier_to_loaded_tokens_on"]) == {"cpu"}  # the CPU tier holds every user
        assert row["hit_bytes_on"] == pytest.approx(
            row["external_hit_tokens_on"] * data["kv_bytes_per_token"]
        )
        assert row["copy_gbps"] > 0 and row["decode_step_ms"] > 0
        assert row["bound_ms"] == pytest.approx(
            row["hit_bytes_on"] / row["copy_gbps"] / 1e6 + row["decode_step_ms"]
        )
        # the planner loads the whole CPU-tier hit and recomputes at most the rest of the prompt
        assert 0 < row["planned_recompute_tokens_on"] <= row["prompt_tokens"] - row["loaded_tokens_on"]
    for turn in data["turns"]["on"]:
        assert sum(turn["tier_to_loaded_tokens"].values()) == turn["num_loaded_tokens"]
    assert "loaded" in output and "bound" in output and "cpu" in output
    assert data["outputs_identical"] is True and data["outputs_must_match"] is True


def test_in_memory_config_runs_like_the_8b_preset(tmp_path, monkeypatch) -> None:
    """The 8b preset's path (an in-memory config, random weights made by the engine, no
    folder, no tokenizer) with a tiny shape on CPU: both engines, warm-ups, bounds."""
    from transformers import LlamaConfig

    from bench.runner import run_bench
    from connector import OffloadConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=2048,
        eos_token_id=299,
    )
    config.architectures = ["LlamaForCausalLM"]
    workload = Workload(num_users=2, context_len=300, num_rounds=2, question_len=8, answer_len=3)
    offload = OffloadConfig(
        chunk_size=64, cpu_bytes=8 << 20, disk_path=str(tmp_path / "disk"), disk_bytes=16 << 20
    )
    engine_args = {
        "device": "cpu",
        "dtype": "float32",
        "load_format": "dummy",
        "num_gpu_blocks": workload.default_num_gpu_blocks(16),
    }
    result = run_bench(config, workload, engine_args, offload, model_label="tiny in-memory")
    assert result.outputs_identical and result.model == "tiny in-memory"
    assert result.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert [w.prompt_digest for w in result.warmup_off] == [w.prompt_digest for w in result.warmup_on]
    assert result.warmup_on[-1].tier_to_loaded_tokens == {"disk": 64}
    second = [t for t in result.turns_on if t.round == 1]
    for turn in second:
        assert turn.num_gpu_hit_tokens + turn.num_external_hit_tokens >= 256
        assert turn.tier_to_loaded_tokens.get("cpu", 0) == turn.num_external_hit_tokens > 0
    assert result.bounds[1].bound_s is not None and result.bounds[0].bound_s is None
