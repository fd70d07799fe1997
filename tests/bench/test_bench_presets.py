"""`kvstash bench` presets and report fields, without running a model: which preset a
device gets and why, what the 8b preset sets up (engine args, KV bytes, tier sizes),
and how the table shows loaded tiers, the bound and the planner's column."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from bench.cli import bench
from bench.model_facts import kv_bytes_per_token
from bench.presets import PRESETS, resolve_preset
from bench.report import bench_json, outputs_note, print_table, round_rows
from bench.results import BenchResult, RoundBound, Turn, Workload
from bench.settings import bench_settings, default_offload_config

NO_WORKLOAD_FLAGS = dict.fromkeys(("num_users", "context_len", "num_rounds", "question_len", "answer_len"))
WORKLOAD_FLAGS = {**NO_WORKLOAD_FLAGS, "system_prompt_len": 0, "seed": 0}
ENGINE_DEFAULTS = {
    "device": "auto",
    "dtype": "auto",
    "block_size": 16,
    "num_gpu_blocks": None,
    "max_num_seqs": 256,
    "load_format": "auto",
}


def test_default_preset_follows_the_device_and_says_why() -> None:
    preset, reason = resolve_preset(None, on_cuda=True)
    assert preset.name == "8b" and "CUDA" in reason
    preset, reason = resolve_preset(None, on_cuda=False)
    assert preset.name == "bench" and "CPU" in reason
    preset, reason = resolve_preset("8b", on_cuda=False)
    assert preset.name == "8b" and "--model-size" in reason
    with pytest.raises(ValueError, match="unknown model size"):
        resolve_preset("70b", on_cuda=True)


def test_8b_preset_on_cuda_settings() -> None:
    settings = bench_settings(
        None, "llama", None, WORKLOAD_FLAGS, {**ENGINE_DEFAULTS, "device": "cuda"}, explicit_engine_args=set()
    )
    assert settings.preset.name == "8b"
    workload = settings.workload
    assert (workload.num_users, workload.context_len, workload.num_rounds) == (6, 8192, 3)
    # Random weights made on the device; a few decode graphs (requests go one at a time).
    assert settings.engine_args["load_format"] == "dummy" and settings.engine_args["max_num_seqs"] == 4
    # The KV pool keeps one user's longest conversation, not two.
    blocks_per_user = -(-(workload.max_prompt_len + workload.answer_len) // 16)
    assert settings.engine_args["num_gpu_blocks"] == blocks_per_user
    config = settings.model_source
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (32, 4096, 8)
    assert (config.intermediate_size, config.vocab_size) == (14336, 128256)
    assert settings.model_dir_to_make is None  # nothing is written to disk

    # bf16 on CUDA: 32 layers x K and V x 8 heads x 128 x 2 bytes = 128 KiB per token.
    bytes_per_token = kv_bytes_per_token(config, settings.engine_args)
    assert bytes_per_token == 32 * 2 * 8 * 128 * 2
    # The default tiers hold every user's longest conversation and the warm-up's.
    offload = default_offload_config(workload, bytes_per_token)
    assert offload.cpu_bytes >= (workload.num_users + 1) * workload.max_prompt_len * bytes_per_token
    assert offload.disk_bytes >= offload.cpu_bytes and offload.disk_path is not None
    # ... while the GPU pool holds one user: offload matters.
    assert settings.engine_args["num_gpu_blocks"] * 16 < 2 * workload.max_prompt_len


def test_command_line_beats_the_preset() -> None:
    flags = {**WORKLOAD_FLAGS, "num_users": 2, "context_len": 4096}
    engine_args = {**ENGINE_DEFAULTS, "device": "cuda", "max_num_seqs": 8}
    settings = bench_settings(None, "llama", "8b", flags, engine_args, explicit_engine_args={"max_num_seqs"})
    assert (settings.workload.num_users, settings.workload.context_len) == (2, 4096)
    assert settings.workload.num_rounds == 3  # not given: the preset's
    assert settings.engine_args["max_num_seqs"] == 8


def test_cpu_default_is_the_bench_model_and_8b_is_selectable() -> None:
    settings = bench_settings(
        None, "llama", None, WORKLOAD_FLAGS, {**ENGINE_DEFAULTS, "device": "cpu"}, explicit_engine_args=set()
    )
    assert settings.preset.name == "bench" and settings.model_dir_to_make == "bench"
    assert (settings.workload.num_users, settings.workload.context_len) == (4, 1024)
    assert settings.engine_args["max_num_seqs"] == 256 and settings.engine_args["load_format"] == "auto"

    settings = bench_settings(
        None, "llama", "8b", WORKLOAD_FLAGS, {**ENGINE_DEFAULTS, "device": "cpu"}, explicit_engine_args=set()
    )
    assert settings.preset.name == "8b" and settings.engine_args["load_format"] == "dummy"
    # float32 on CPU ("auto"): twice the bf16 bytes
    assert kv_bytes_per_token(settings.model_source, settings.engine_args) == 32 * 2 * 8 * 128 * 4


def test_8b_preset_rejects_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="--arch qwen2"):
        bench_settings(None, "qwen2", "8b", WORKLOAD_FLAGS, ENGINE_DEFAULTS, set())
    engine_args = {**ENGINE_DEFAULTS, "load_format": "auto"}
    with pytest.raises(ValueError, match="load-format dummy"):
        bench_settings(None, "llama", "8b", WORKLOAD_FLAGS, engine_args, explicit_engine_args={"load_format"})


def test_cli_prints_nothing_heavy_on_bad_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    result = CliRunner().invoke(
        bench, ["--model-size", "8b", "--arch", "qwen3", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "--arch qwen3" in result.output
    result = CliRunner().invoke(bench, ["--model-size", "13b"])
    assert result.exit_code == 2 and "'8b'" in result.output
    assert not (tmp_path / "cache").exists()


def _turn(round_index: int, ttft_s: float, *, ext: int = 0, tiers=None, planned=None, out=(1, 2)) -> Turn:
    return Turn(
        user=0,
        round=round_index,
        num_prompt_tokens=1000,
        ttft_s=ttft_s,
        e2e_s=ttft_s + 0.01 * (len(out) - 1),
        num_gpu_hit_tokens=0,
        num_external_hit_tokens=ext,
        num_loaded_tokens=ext,
        num_computed_tokens=1000 - ext,
        output_token_ids=list(out),
        tier_to_loaded_tokens=dict(tiers or {}),
        num_planned_recompute_tokens=planned,
    )


def _result(*, planned=None, dtype="float32", on_out=(1, 2)) -> BenchResult:
    workload = Workload(num_users=1, context_len=900, num_rounds=2)
    return BenchResult(
        workload=workload,
        model="m",
        engine_args={},
        offload={},
        turns_off=[_turn(0, 0.5), _turn(1, 0.5)],
        turns_on=[
            _turn(0, 0.5),
            _turn(1, 0.05, ext=768, tiers={"cpu": 512, "disk": 256}, planned=planned, out=on_out),
        ],
        wall_s_off=1.0,
        wall_s_on=0.6,
        bounds=[RoundBound(1, 0.0, 0.0, 0.01), RoundBound(2, 768 * 4096, 0.002, 0.01)],
        dtype=dtype,
        kv_bytes_per_token=4096,
        copy_kind="host memcpy",
    )


def test_rows_carry_tiers_bound_and_planner(capsys) -> None:
    rows = round_rows(_result())
    assert rows[0]["tier_to_loaded_tokens_on"] == {} and rows[0]["bound_ms"] is None
    assert rows[1]["tier_to_loaded_tokens_on"] == {"cpu": 512, "disk": 256}
    assert rows[1]["bound_ms"] == pytest.approx(12.0)
    assert rows[1]["copy_gbps"] == pytest.approx(768 * 4096 / 0.002 / 1e9)
    assert rows[1]["decode_step_ms"] == pytest.approx(10.0)
    assert rows[1]["planned_recompute_tokens_on"] is None
    print_table(_result())
    table = capsys.readouterr().out
    assert "cpu 512" in table and "disk 256" in table and "bound" in table and "12.0" in table
    assert "planned" not in table  # no planner in this engine: no column

    rows = round_rows(_result(planned=128))
    assert rows[1]["planned_recompute_tokens_on"] == 128
    print_table(_result(planned=128))
    assert "planned" in capsys.readouterr().out


def test_bf16_mismatch_is_reported_not_fatal(capsys) -> None:
    exact = _result(on_out=(1, 3))
    assert exact.outputs_must_match and not exact.outputs_identical
    print_table(exact)
    assert "NO" in capsys.readouterr().out

    bf16 = _result(dtype="bfloat16", on_out=(1, 3))
    assert not bf16.outputs_must_match and not bf16.outputs_identical
    print_table(bf16)
    table = capsys.readouterr().out
    assert "no*" in table and "16-bit dtype" in table
    assert "bfloat16" in outputs_note(bf16) and bench_json(bf16)["outputs_must_match"] is False


def test_presets_are_named_consistently() -> None:
    assert set(PRESETS) == {"tiny", "bench", "8b"}
    assert all(name == preset.name for name, preset in PRESETS.items())


def test_documented_model_sizes_are_their_parameter_counts() -> None:
    """Issue #17: docs/bench.md called the bench model "~4M parameters"; it has ~25M. Every
    "~N M parameters" in the docs and help texts must be the tiny or the bench model's count,
    rounded as written."""
    import re
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    from bench.tiny_model import TINY_VOCAB_SIZE, _arch_config

    def num_parameters(size: str) -> int:
        with torch.device("meta"):  # shapes only, no weight is made
            model = AutoModelForCausalLM.from_config(
                _arch_config("llama", TINY_VOCAB_SIZE, bos_id=1, eos_id=2, pad_id=0, size=size)
            )
        return sum(parameter.numel() for parameter in model.parameters())

    counts = {size: num_parameters(size) for size in ("tiny", "bench")}
    assert 20e6 < counts["bench"] < 30e6 and counts["tiny"] < 1e6
    repo_root = Path(__file__).resolve().parents[2]
    files = ["docs/bench.md", "README.md", "bench/cli.py", "bench/presets.py", "engine/cli.py"]
    files.append("bench/tiny_model.py")
    claims = []
    for name in files:
        text = " ".join((repo_root / name).read_text().split())  # docs and help texts wrap lines
        claims += [(name, m) for m in re.findall(r"~(\d+(?:\.\d+)?)M parameters", text)]
    assert {name for name, _ in claims} >= {"docs/bench.md", "bench/presets.py"}

    def says(claim: str, count: int) -> bool:
        """Whether "~{claim}M" is ``count`` rounded to the digits the claim shows."""
        decimals = len(claim.partition(".")[2])
        return round(count / 1e6, decimals) == float(claim)

    wrong = [(name, claim) for name, claim in claims if not any(says(claim, n) for n in counts.values())]
    assert not wrong, f"parameter counts that are neither model's ({counts}): {wrong}"
