"""`kvstash make-tiny-model` writes checkpoints that transformers loads offline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from bench.tiny_model import TINY_ARCHS, make_tiny_model


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_loads_offline_and_generates(arch, tmp_path, monkeypatch, subprocess_env, repo_root):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "make-tiny-model", str(tmp_path), "--arch", arch, "--seed", "3"],
        cwd=repo_root,
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert f"tiny {arch} model" in out.stdout

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"], "GQA expected"
    assert config["num_hidden_layers"] >= 2
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert size < 8 * 1024 * 1024, f"tiny model is {size} bytes"

    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    text = "What is the capital of France?"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == text
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert generated.shape[1] == ids.shape[1] + 8
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n") and "hi<|im_end|>" in chat


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    a = load_file(make_tiny_model(tmp_path / "a", arch="qwen3", seed=1) / "model.safetensors")
    b = load_file(make_tiny_model(tmp_path / "b", arch="qwen3", seed=1) / "model.safetensors")
    c = load_file(make_tiny_model(tmp_path / "c", arch="qwen3", seed=2) / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("proj.weight"))


def test_family_features_present(tmp_path):
    qwen2 = json.loads((make_tiny_model(tmp_path / "q2", arch="qwen2") / "config.json").read_text())
    assert qwen2["tie_word_embeddings"] is True
    qwen3 = load_file(make_tiny_model(tmp_path / "q3", arch="qwen3") / "model.safetensors")
    assert any("q_norm" in k for k in qwen3)
    llama = json.loads((make_tiny_model(tmp_path / "l", arch="llama") / "config.json").read_text())
    rope = llama.get("rope_parameters") or llama.get("rope_scaling")
    assert rope["rope_type"] == "llama3"


def test_unknown_arch_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny-model arch 'gpt2'"):
        make_tiny_model(tmp_path, arch="gpt2")
