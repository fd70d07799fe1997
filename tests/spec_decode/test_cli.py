"""`kvstash generate --speculative ngram` end to end, and bad speculative settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat"


def run_cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "engine.cli", *args]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_generate_with_ngram_speculation_prints_the_plain_greedy_text(tiny_model_dir, subprocess_env):
    model_dir = tiny_model_dir("qwen2")
    [want] = LLM(model_dir, dtype="float32", device="cpu").generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    flags = ["--device", "cpu", "--dtype", "float32", "--max-tokens", "12", "--ignore-eos"]
    result = run_cli(
        [
            "generate",
            str(model_dir),
            "--prompt",
            PROMPT,
            *flags,
            "--speculative",
            "ngram",
            "--num-speculative-tokens",
            "3",
        ],
        subprocess_env,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == want.text


def test_generate_rejects_speculation_without_draft_tokens(tiny_model_dir, subprocess_env):
    result = run_cli(
        [
            "generate",
            str(tiny_model_dir("llama")),
            "--prompt",
            "hi",
            "--device",
            "cpu",
            "--speculative",
            "ngram",
        ],
        subprocess_env,
    )
    assert result.returncode == 2
    assert "speculative='ngram' needs num_speculative_tokens >= 1" in result.stderr


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        ({"speculative": "eagle", "num_speculative_tokens": 2}, "speculative must be None or one of"),
        (
            {"speculative": "ngram", "num_speculative_tokens": 2, "ngram_min_n": 0},
            "1 <= ngram_min_n <= ngram_max_n",
        ),
        ({"speculative": "ngram", "num_speculative_tokens": 2, "ngram_min_n": 5}, "got 5 and 4"),
    ],
)
def test_bad_speculative_settings_raise(tiny_model_dir, engine_args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model_dir("llama"), dtype="float32", device="cpu", **engine_args)
