"""Small random-weight Hugging Face checkpoints, built locally for tests and demos.

``make_tiny_model(dir, arch=...)`` writes ``config.json``, ``model.safetensors``
and a byte-level BPE tokenizer trained on an embedded text, all without any hub
access. The result loads with ``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` offline, so tests can compare kvstash against Hugging Face.

The shapes are tiny (a few MB) but keep what matters for the engine: GQA
(fewer KV heads than query heads), at least two layers, the family's own
features (Qwen2 QKV bias, Qwen3 q/k norms, Llama-3 RoPE scaling, tied
embeddings on Qwen2).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
TINY_VOCAB_SIZE = 512

# Shapes shared by every tiny arch; per-arch differences live in _arch_config.
_TINY_SHAPES = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    # Wider than the usual 0.02 so that logits are peaked: greedy argmax then has
    # clear winners and float32 parity with Hugging Face is not decided by noise.
    initializer_range=0.2,
)

# Larger shapes for `kvstash bench` on a CPU: prefill must cost enough that a
# cache hit visibly beats recomputation, while a multi-round run stays minutes.
_SIZE_PRESETS = {
    "tiny": {},
    # Wide layers but few KV heads: per token, prefill costs ~50 MFLOP while its KV is
    # only 4 KiB, so on a CPU loading a context's KV is far cheaper than recomputing it.
    "bench": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=4,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=16384,
        initializer_range=0.05,
    ),
}

_SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tokenizer: plain English about the project's own domain,
# enough for a few hundred merges. Deterministic input gives a deterministic vocab.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A cache hit turns hundreds of
milliseconds of prefill into a few milliseconds of loading. Users ask several
questions about a long shared context: a document, a conversation, a set of
retrieved passages, or the notes of an agent. The engine keeps the key and value
tensors of every token in paged blocks of sixteen tokens. When the blocks run
out, a request is preempted and recomputed later. The connector stores chunks of
two hundred and fifty six tokens in memory, on disk, in Redis or in a cache
server, and loads them back when the same prefix appears again. Every chunk is
named by a chain of hashes over its tokens, so the same text always maps to the
same key on every machine. A corrupt or missing chunk is a miss that is
recomputed; the output never changes. What is the capital of France? Paris is the
capital of France. How many days are in a week? There are seven days in a week.
Please summarize the following text in one sentence. Translate this paragraph
into French. Write a short poem about the sea, the wind and the stars. Explain
why the sky is blue and why sunsets are red. The numbers one two three four five
six seven eight nine ten eleven twelve. Monday Tuesday Wednesday Thursday Friday
Saturday Sunday. January February March April May June July August September
October November December. def main(): print("hello world") return 0
import torch; x = torch.zeros(4, 8); y = x + 1; for i in range(10): pass
"""


def _arch_config(arch: str, vocab_size: int, bos_id: int, eos_id: int, pad_id: int, size: str = "tiny"):
    """Return a transformers config object for ``arch`` with the shapes of preset ``size``."""
    if size not in _SIZE_PRESETS:
        raise ValueError(f"unknown tiny-model size {size!r}; choose one of {', '.join(_SIZE_PRESETS)}")
    shapes = dict(_TINY_SHAPES, **_SIZE_PRESETS[size])
    common = dict(shapes, vocab_size=vocab_size, bos_token_id=bos_id, eos_token_id=eos_id)
    common["pad_token_id"] = pad_id
    if arch == "llama":
        from transformers import LlamaConfig

        # Llama 3 style RoPE scaling, so the engine must follow what the config says.
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
        return LlamaConfig(**common, rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=False)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False)
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**common, rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")


def _build_tokenizer(vocab_size: int):
    """Train a byte-level BPE on the embedded corpus and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = _CHAT_TEMPLATE
    return fast


def make_tiny_model(directory: str | Path, arch: str = "llama", seed: int = 0, size: str = "tiny") -> Path:
    """Write a tiny random-weight checkpoint of family ``arch`` into ``directory``.

    ``size`` is ``"tiny"`` (tests: ~0.2M parameters) or ``"bench"`` (~25M
    parameters, 16k context: the default model of ``kvstash bench``).
    Deterministic for a given ``(arch, seed, size)``. Creates the folder if needed and
    overwrites the files it writes. Returns the folder's path.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE)
    vocab = tokenizer.get_vocab()
    config = _arch_config(
        arch,
        vocab_size=TINY_VOCAB_SIZE,
        bos_id=vocab["<|bos|>"],
        eos_id=vocab["<|eos|>"],
        pad_id=vocab["<|pad|>"],
        size=size,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    # A marker that says how the checkpoint was made (read by nothing that changes outputs).
    (path / "kvstash_tiny_model.json").write_text(
        json.dumps({"arch": arch, "seed": seed, "size": size}) + "\n"
    )
    return path
