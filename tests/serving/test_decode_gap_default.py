"""`kvstash serve` caps decode gaps by default (50 ms, engine.server.cli), while `LLM`,
`kvstash generate` and `kvstash bench` keep the cap off (issue 31, item 3). The commands'
flags are parsed by the real `kvstash` group (nothing is served or benchmarked), and the
parsed values build the engine's real `EngineArgs` and, over the tiny model, a real engine
whose scheduler holds the cap."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bench.settings import bench_settings
from engine import LLM, EngineArgs, EngineCore
from engine.cli import main
from engine.engine_flags import engine_args_from_options
from engine.server.cli import SERVE_MAX_DECODE_GAP_MS


def parse(command_name: str, *args: str) -> dict:
    """`kvstash COMMAND ARGS` parsed as the command line would be, its callback not run."""
    group_context = click.Context(main, info_name="kvstash", **main.context_settings)
    command = main.get_command(group_context, command_name)
    return command.make_context(command_name, list(args), parent=group_context).params


def engine_args(params: dict) -> EngineArgs:
    """The `EngineArgs` a command builds from its parsed options (validated)."""
    args = EngineArgs(**engine_args_from_options(params))
    args.validate()
    return args


def help_default(command_name: str, flag: str) -> str:
    """The `[default: ...]` that `kvstash COMMAND --help` shows for `flag`."""
    result = CliRunner().invoke(main, [command_name, "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    match = re.search(re.escape(flag) + r" \w+ .*?\[default: ([^\]]+)\]", text)
    assert match, text
    return match.group(1)


def test_serve_caps_decode_gaps_at_50_ms_by_default(tmp_path: Path) -> None:
    assert SERVE_MAX_DECODE_GAP_MS == 50.0
    params = parse("serve", str(tmp_path))
    assert params["max_decode_gap_ms"] == 50.0
    assert engine_args(params).max_decode_gap_ms == 50.0
    assert help_default("serve", "--max-decode-gap-ms") == "50.0"


@pytest.mark.parametrize("value", ["0", "0.0"])
def test_serve_with_max_decode_gap_ms_0_turns_the_cap_off(tmp_path: Path, value: str) -> None:
    params = parse("serve", str(tmp_path), "--max-decode-gap-ms", value)
    assert params["max_decode_gap_ms"] == 0.0
    assert engine_args(params).max_decode_gap_ms == 0.0


def test_serve_takes_another_gap_and_refuses_a_bad_one(tmp_path: Path) -> None:
    assert engine_args(parse("serve", str(tmp_path), "--max-decode-gap-ms", "120")).max_decode_gap_ms == 120.0
    with pytest.raises(ValueError, match=r"max_decode_gap_ms must be 0 \(off\)"):
        engine_args(parse("serve", str(tmp_path), "--max-decode-gap-ms", "0.5"))


def test_the_engine_serve_builds_holds_the_cap(tiny_model_dir) -> None:
    """What `serve` does with its parsed options, `EngineArgs` then `EngineCore`, over the
    tiny model: the scheduler's prefill cap has serve's default, or 0 when turned off."""
    model_dir = str(tiny_model_dir("llama"))
    for flags, expected in (((), 50.0), (("--max-decode-gap-ms", "0"), 0.0)):
        params = parse("serve", model_dir, "--device", "cpu", "--num-gpu-blocks", "16", *flags)
        engine = EngineCore(model_dir, engine_args(params))
        assert engine.scheduler.prefill_cap.max_decode_gap_ms == expected


@pytest.mark.parametrize("command_name", ["generate", "bench"])
def test_generate_and_bench_keep_the_cap_off(tmp_path: Path, command_name: str) -> None:
    args = [str(tmp_path), "--prompt", "hi"] if command_name == "generate" else []
    params = parse(command_name, *args)
    assert params["max_decode_gap_ms"] == 0.0
    assert engine_args(params).max_decode_gap_ms == 0.0
    assert help_default(command_name, "--max-decode-gap-ms") == "0.0"


@pytest.mark.parametrize(("device", "model_size"), [("cpu", None), ("cuda", None), ("cpu", "8b")])
def test_bench_presets_keep_the_cap_off(device: str, model_size: str | None) -> None:
    """`kvstash bench` resolves its preset's engine arguments over the parsed flags: none of
    its presets turns the cap on."""
    params = parse("bench", "--device", device)
    workload = {name: params[name] for name in ("num_users", "context_len", "num_rounds")}
    workload |= {name: params[name] for name in ("question_len", "answer_len", "system_prompt_len")}
    workload["seed"] = params["workload_seed"]
    settings = bench_settings(None, "llama", model_size, workload, engine_args_from_options(params), set())
    assert settings.engine_args["max_decode_gap_ms"] == 0.0


def test_the_offline_llm_keeps_the_cap_off(tiny_model_dir) -> None:
    assert EngineArgs().max_decode_gap_ms == 0.0
    llm = LLM(str(tiny_model_dir("llama")), device="cpu", num_gpu_blocks=16)
    assert llm.engine.scheduler.prefill_cap.max_decode_gap_ms == 0.0
