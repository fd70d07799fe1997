"""Model folders that ``kvstash serve`` can serve, made on the spot for a benchmark: the tiny
test model, the ``bench`` size, or the Llama-3.1-8B shape with random weights.

Used by ``benchmarks/soak.py``, ``benchmarks/disaggregated.py`` and ``benchmarks/router.py``
(once per run, before any process starts). Writes only under the folder it is given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

#: ``--model-size`` choices
MODEL_SIZES = ("tiny", "bench", "8b")


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV bytes one token takes in every layer (keys and values) for an HF ``config.json`` dict."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def make_8b_folder(directory: Path) -> Path:
    """A folder `kvstash serve --load-format dummy` can serve: the Llama-3.1-8B config and
    a tokenizer whose vocabulary covers every id of it (the tiny model's, padded with
    plain added tokens), so that generated text decodes token for token."""
    from bench.presets import llama31_8b_config
    from bench.tiny_model import TINY_VOCAB_SIZE, _build_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE)
    config = llama31_8b_config()
    tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), config.vocab_size)])
    vocab = tokenizer.get_vocab()
    config.bos_token_id, config.eos_token_id = vocab["<|bos|>"], vocab["<|eos|>"]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@dataclass
class ModelFolder:
    """A made model: its folder, the serve flags it needs, and its config."""

    path: Path
    size: str
    serve_flags: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def max_model_len(self) -> int:
        return int(self.config.get("max_position_embeddings", 4096))

    def kv_bytes_per_token(self, dtype: str) -> int:
        return kv_bytes_per_token(self.config, 4 if dtype == "float32" else 2)


def make_model_folder(size: str, directory: Path) -> ModelFolder:
    """Make the ``size`` model in ``directory``: ``tiny`` (~0.2M parameters) or ``bench``
    (~25M) with weights on disk, ``8b`` as a config and tokenizer served with random
    weights made on the device (``--load-format dummy``)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}: choose one of {', '.join(MODEL_SIZES)}")
    if size == "8b":
        path = make_8b_folder(directory)
        return ModelFolder(path, size, ["--load-format", "dummy", "--model-id", "llama-3.1-8b-shape-dummy"])
    from bench.tiny_model import make_tiny_model

    return ModelFolder(Path(make_tiny_model(directory, size=size)), size)
