"""Bad requests get OpenAI-shaped 4xx errors, client disconnects abort their request,
and the server keeps serving afterwards."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.serving.server_process import metric_value


def post(server, path: str, body: dict | str) -> httpx.Response:
    if isinstance(body, str):
        return httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120
        )
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "words", "param"),
    [
        ({"prompt": "hi", "temperature": -1}, ["temperature"], "temperature"),
        ({"prompt": "hi", "top_p": 0}, ["top_p"], "top_p"),
        ({"prompt": "hi", "max_tokens": 0}, ["max_tokens"], "max_tokens"),
        ({"prompt": "hi", "top_k": -3}, ["top_k"], "top_k"),
        ({"prompt": "hi", "n": 2}, ["n must be 1"], "n"),
        ({"prompt": "hi", "logprobs": 2}, ["logprobs"], "logprobs"),
        ({"prompt": ""}, ["empty"], "prompt"),
        ({"prompt": ["one", "two"]}, ["one prompt per request"], "prompt"),
        ({"prompt": [3, 4, 100000]}, ["100000", "vocabulary"], None),
        ({"prompt": list(range(5, 505)) * 9}, ["4500 tokens", "context"], None),
        ({}, ["prompt", "Field required"], "prompt"),
        ({"prompt": "hi", "max_tokens": "many"}, ["max_tokens"], "max_tokens"),
    ],
)
def test_bad_completion_requests_get_400(server, body: dict, words: list[str], param: str | None) -> None:
    error = assert_openai_error(post(server, "/v1/completions", {"model": "tiny", **body}), 400, *words)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_bad_chat_requests_get_400(server) -> None:
    assert_openai_error(
        post(server, "/v1/chat/completions", {"model": "tiny", "messages": []}), 400, "messages"
    )
    bad_role = {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}
    assert_openai_error(post(server, "/v1/chat/completions", bad_role), 400, "role")
    assert_openai_error(post(server, "/v1/chat/completions", "{not json"), 400)


def test_unknown_model_and_route_get_404(server, client) -> None:
    error = assert_openai_error(
        post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "gpt-9"
    )
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert_openai_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=30), 404)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="hi", temperature=-0.5)


def _wait_for_aborts(server, num_before: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        num_aborted = metric_value(server.metrics_text(), "kvstash_requests_total", finish_reason="abort")
        if num_aborted > num_before or time.monotonic() > deadline:
            return num_aborted
        time.sleep(0.2)


def test_client_disconnect_aborts_the_request(server, client) -> None:
    long_request = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 3000, "ignore_eos": True}
    num_aborted = metric_value(server.metrics_text(), "kvstash_requests_total", finish_reason="abort")

    # Streaming: read the first event, then hang up.
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**long_request, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    num_after_stream = _wait_for_aborts(server, num_aborted)
    assert num_after_stream == num_aborted + 1

    # Not streaming: the client gives up while the engine is still generating.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=long_request, timeout=httpx.Timeout(120, read=1.0))
    assert _wait_for_aborts(server, num_after_stream) == num_after_stream + 1

    # The server is still up and serving.
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    ok = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
