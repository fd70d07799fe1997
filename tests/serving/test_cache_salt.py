"""`cache_salt` through a real `kvstash serve` (issue #17, tenants): requests with
different salts share no GPU prefix-cache block and no offloaded chunk, requests
with the same salt do, and a salt that is not a non-empty string is a 400."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from engine import SamplingParams
from tests.serving.server_process import ServeProcess

MAX_TOKENS = 4


def long_prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(200)]


def complete(url: str, prompt, cache_salt=None, path="/v1/completions") -> httpx.Response:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def hits(response: httpx.Response) -> tuple[int, int]:
    assert response.status_code == 200, response.text
    details = response.json()["usage"]["kvstash"]
    return details["gpu_hit_tokens"], details["external_hit_tokens"]


def test_gpu_prefix_cache_hits_only_within_a_salt(server, reference_llm) -> None:
    prompt = long_prompt(101)
    expected = reference_llm.generate(
        [prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )[0]
    first = complete(server.url, prompt, "tenant-a")
    assert hits(first) == (0, 0)
    assert hits(complete(server.url, prompt, "tenant-b")) == (0, 0)
    assert hits(complete(server.url, prompt))[0] == 0
    same = complete(server.url, prompt, "tenant-a")
    assert hits(same)[0] >= 192
    assert first.json()["choices"][0]["text"] == same.json()["choices"][0]["text"] == expected.text


def test_chat_completions_take_the_salt_too(server) -> None:
    text = " ".join(f"word{index}" for index in range(120))
    assert hits(complete(server.url, text, "chat-a", path="/v1/chat/completions"))[0] == 0
    assert hits(complete(server.url, text, "chat-b", path="/v1/chat/completions"))[0] == 0
    assert hits(complete(server.url, text, "chat-a", path="/v1/chat/completions"))[0] > 0


@pytest.mark.parametrize(
    "bad, message",
    [(7, "cache_salt"), (["a"], "cache_salt"), ("", "must not be empty"), ("x" * 1025, "limit")],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_salt_is_a_400(server, bad, message, path) -> None:
    response = complete(server.url, "hello there", bad, path=path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def offload_server(serving_model_dir) -> Iterator[ServeProcess]:
    """Offload to the CPU tier, no GPU prefix cache: every hit is an external hit."""
    process = ServeProcess(
        serving_model_dir,
        "--no-enable-prefix-caching",
        "--kv-offload",
        "--kv-offload-chunk-size",
        "64",
        "--kv-offload-cpu-gb",
        "0.1",
    ).start()
    yield process
    process.close()


def test_offload_tier_hits_only_within_a_salt(offload_server) -> None:
    prompt = long_prompt(202)
    first = complete(offload_server.url, prompt, "tenant-a")
    assert hits(first) == (0, 0)
    assert hits(complete(offload_server.url, prompt, "tenant-b")) == (0, 0)
    assert hits(complete(offload_server.url, prompt)) == (0, 0)
    same = complete(offload_server.url, prompt, "tenant-a")
    assert hits(same) == (0, 199)
    assert hits(complete(offload_server.url, prompt)) == (0, 199)
    assert first.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
