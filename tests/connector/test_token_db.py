"""Chunk keys: chained, deterministic across processes, namespaced by KV identity."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from connector.token_db import TokenDatabase, namespace_fingerprint

REPO_ROOT = Path(__file__).resolve().parents[2]
IDENTITY = {
    "model_id": "m",
    "dtype": torch.bfloat16,
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "chunk_size": 256,
}
KEYS_SCRIPT = (
    "from connector.token_db import TokenDatabase; "
    "print(' '.join(s.key for s in TokenDatabase('ns', 4, True).chunk_spans(list(range(10)))))"
)


def test_keys_are_equal_in_another_process():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "123"}
    result = subprocess.run(
        [sys.executable, "-c", KEYS_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    local = [span.key for span in TokenDatabase("ns", 4, True).chunk_spans(list(range(10)))]
    assert result.stdout.split() == local


def test_spans_cover_full_chunks_then_the_partial_tail():
    spans = TokenDatabase("ns", 4, True).chunk_spans(list(range(10)))
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    assert all(s.key.startswith("ns:") and len(s.key) == 3 + 32 for s in spans)
    assert len(TokenDatabase("ns", 4, False).chunk_spans(list(range(10)))) == 2


def test_a_key_names_the_whole_prefix():
    db = TokenDatabase("ns", 4, True)
    base = [s.key for s in db.chunk_spans(list(range(12)))]
    changed = list(range(12))
    changed[5] = 999
    other = [s.key for s in db.chunk_spans(changed)]
    assert other[0] == base[0] and other[1] != base[1] and other[2] != base[2]


def test_tensor_and_list_tokens_give_the_same_keys():
    db = TokenDatabase("ns", 256, True)
    tokens = list(range(100_000, 132_768))  # 32k tokens
    assert db.chunk_spans(tokens) == db.chunk_spans(torch.tensor(tokens))


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"dtype": torch.float16},
        {"num_layers": 16},
        {"num_kv_heads": 4},
        {"head_dim": 64},
        {"chunk_size": 128},
        {"tp_rank": 1, "tp_size": 2},
    ],
)
def test_namespace_changes_with_everything_that_makes_kv_incompatible(change):
    assert namespace_fingerprint(**IDENTITY) == namespace_fingerprint(**IDENTITY)
    assert namespace_fingerprint(**{**IDENTITY, **change}) != namespace_fingerprint(**IDENTITY)


@pytest.mark.parametrize("tokens", [[[1, 2], [3, 4]], torch.ones(3), [2**32]])
def test_bad_token_ids_are_value_errors(tokens):
    with pytest.raises(ValueError, match="token"):
        TokenDatabase("ns", 4, True).chunk_spans(tokens)


def test_a_pipeline_stage_namespace_names_its_layer_range() -> None:
    """Chunks of a pipeline stage hold its layers only: its namespace differs from the
    whole model's and from every other stage's, also for the same number of layers."""
    import torch

    from connector.token_db import namespace_fingerprint

    common = {"model_id": "m", "dtype": torch.float32, "num_kv_heads": 2, "head_dim": 8, "chunk_size": 64}
    whole = namespace_fingerprint(num_layers=4, **common)
    assert whole == namespace_fingerprint(num_layers=4, layer_range=None, **common)
    stages = {
        namespace_fingerprint(num_layers=2, layer_range=(0, 2, 4), **common),
        namespace_fingerprint(num_layers=2, layer_range=(2, 4, 4), **common),
        namespace_fingerprint(num_layers=2, **common),  # a whole 2-layer model
    }
    assert len(stages) == 3 and whole not in stages
