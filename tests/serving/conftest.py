"""Fixtures of the serving tests: one `kvstash serve` process for the session and the
offline `LLM` over the same tiny model as the reference for outputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.serving.server_process import MAX_NUM_SEQS, NUM_GPU_BLOCKS, ServeProcess


@pytest.fixture(scope="session")
def serving_model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def server(serving_model_dir) -> Iterator[ServeProcess]:
    """A plain `kvstash serve` (no offload) shared by the serving tests."""
    process = ServeProcess(
        serving_model_dir, "--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS)
    ).start()
    yield process
    process.close()


@pytest.fixture(scope="session")
def reference_llm(serving_model_dir):
    """`engine.LLM` over the served model: what the server must answer."""
    from engine import LLM

    return LLM(str(serving_model_dir), num_gpu_blocks=NUM_GPU_BLOCKS, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
