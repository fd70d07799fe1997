"""RoPE as the config names it: each scaling type, in the transformers 5.x layout
(`rope_parameters`) and the 4.x layout (`rope_scaling` + top-level `rope_theta`),
gives Hugging Face's greedy tokens at positions past the original context."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, SamplingParams
from tests.engine.hf_reference import hf_greedy, random_prompt

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 10000.0,
    },
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
        "rope_theta": 500000.0,
    },
}
PROMPTS = [random_prompt(300, seed=400), random_prompt(40, seed=401)]


def _write_config(model_dir, rope: dict, layout: str) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.pop("rope_parameters", None)
    config.pop("rope_scaling", None)
    if layout == "v5":
        config["rope_parameters"] = dict(rope)
    else:
        rope = dict(rope)
        config["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")  # the oldest spelling of the key
        config["rope_scaling"] = None if rope["type"] == "default" else rope
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("layout", ["v5", "v4"])
@pytest.mark.parametrize("rope_name", sorted(ROPES))
def test_rope_scaling_matches_hf(tiny_model_dir, tmp_path, rope_name, layout):
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    _write_config(model_dir, ROPES[rope_name], layout)
    expected = hf_greedy(model_dir, PROMPTS, 8)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    assert llm.engine.model.rotary.rope_type == ROPES[rope_name]["rope_type"]
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
