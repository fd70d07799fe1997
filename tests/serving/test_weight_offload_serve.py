"""`kvstash serve --cpu-offload-gb`: a real server with its last decoder layer in CPU
memory answers what the offline engine without offload answers."""

from __future__ import annotations

import httpx

from tests.engine.test_weight_offload import layer_gib
from tests.serving.server_process import MAX_NUM_SEQS, NUM_GPU_BLOCKS, ServeProcess


def test_served_completion_with_offloaded_layer_equals_the_plain_engine(serving_model_dir, reference_llm):
    from engine import SamplingParams

    prompt = "the cache keeps the prefix of every prompt"
    expected = reference_llm.generate(
        prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    flags = ("--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--max-num-seqs", str(MAX_NUM_SEQS))
    server = ServeProcess(
        serving_model_dir, *flags, "--cpu-offload-gb", repr(layer_gib(serving_model_dir, 1))
    )
    try:
        server.start()
        assert "weight offload: layers 1-1" in server.log()
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected.text
        server.stop()
    finally:
        server.close()
