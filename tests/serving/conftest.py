"""Fixtures of the serving tests: one `kvstash serve` process per module and the
offline `LLM` over the same tiny model as the reference for outputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.server_process import ServeProcess

#: engine flags of the served model and of its offline reference (same KV pool)
NUM_GPU_BLOCKS = 256
MAX_NUM_SEQS = 16


@pytest.fixture(scope="module")
def serving_model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(serving_model_dir) -> Iterator[ServeProcess]:
    """A plain `kvstash serve` (no offload) for the whole module."""
    process = ServeProcess(
        serving_model_dir, "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS)
    ).start()
    yield process
    process.close()


@pytest.fixture(scope="module")
def reference_llm(serving_model_dir):
    """`engine.LLM` over the served model: what the server must answer."""
    from engine import LLM

    return LLM(str(serving_model_dir), num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
