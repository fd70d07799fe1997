"""`kvstash serve` against the clients of issue #17 item 6, on real server processes:
sampling values that used to fail engine steps get 400 naming the field (and never stop
the engine), oversized bodies get 413 before they are read, a huge prompt is tokenized
off the event loop (`/health` answers meanwhile), and `--api-key` guards `/v1` and
`/metrics`."""

from __future__ import annotations

import asyncio
import socket

import httpx
import openai
import pytest

from engine import SamplingParams
from engine.server.guards import DEFAULT_MAX_REQUEST_BYTES
from tests.serving.server_process import NUM_GPU_BLOCKS, ServeProcess, metric_value

API_KEY = "test-key-4f1c"
#: a prompt of text the tokenizer needs seconds for (the issue's attack)
HUGE_PROMPT = "hello world, this is a test " * (4 * 1024 * 1024 // 28)


@pytest.fixture(scope="module")
def keyed_server(serving_model_dir):
    """A server with an API key (from KVSTASH_API_KEY) and a body limit that lets the
    huge prompt in."""
    process = ServeProcess(
        serving_model_dir,
        *("--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--max-request-bytes", str(8 * 1024 * 1024)),
        extra_env={"KVSTASH_API_KEY": API_KEY},
    )
    # ServeProcess.start waits for /health, which needs no key
    process.start()
    yield process
    process.close()


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_p", 1e-300),  # 0 in float32: the sampler kept no token
        ("top_k", 10**23),  # a JSON integer: overflowed the sampler's int64 tensor
        ("top_k", 1e23),  # a JSON float: not an integer
        ("temperature", 1e39),  # inf in float32
        ("seed", 2**64),
        ("max_tokens", 2**40),
        ("stop", ["x"] * 33),
        ("stop", ["x" * 1025]),
    ],
)
def test_sampling_values_that_failed_steps_get_400_and_never_stop_the_engine(
    server, reference_llm, field, value
) -> None:
    body = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, field: value}
    for _ in range(4):  # three in a row used to stop the engine
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and field in error["message"]
        assert error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert ok.status_code == 200
    expected = reference_llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    )
    assert ok.json()["choices"][0]["text"] == expected[0].text


def test_chat_names_max_completion_tokens(server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**40}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_completion_tokens"


def test_a_4_mib_body_gets_413(server) -> None:
    body = {"model": "tiny", "prompt": HUGE_PROMPT}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def _raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    """Send `head` (and `body`) on a fresh connection -> the server's answer: its head
    and a body of its Content-Length (or all it sends before closing). Not read until the
    server closes: with part of a refused body unread, closing is the server's choice."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            head_end = answer.find(b"\r\n\r\n")
            if head_end < 0:
                continue
            lengths = [
                int(line.split(b":", 1)[1])
                for line in answer[:head_end].split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ]
            if lengths and len(answer) >= head_end + 4 + lengths[0]:
                break
    return answer


def test_an_announced_oversized_body_gets_413_before_it_is_sent(server) -> None:
    # Only the headers go out: the answer comes although not one byte of the body did.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 4194304\r\n\r\n"
    )
    answer = _raw_request(server.port, head)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer


def test_a_chunked_oversized_body_gets_413(server) -> None:
    # No Content-Length: the limit trips while the body is read.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    body = chunk * (DEFAULT_MAX_REQUEST_BYTES // len(piece) + 2) + b"0\r\n\r\n"
    answer = _raw_request(server.port, head, body)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


def test_health_answers_while_a_huge_prompt_is_tokenized(keyed_server) -> None:
    """The huge prompt's tokenization takes seconds: `/health` and `/v1/models` must
    answer many times before that request's own answer (a 400: the prompt is longer
    than the context) comes back. On the event loop they waited for it."""

    async def scenario() -> tuple[int, int, str]:
        async with httpx.AsyncClient(timeout=600, headers=auth()) as client:
            big = asyncio.ensure_future(
                client.post(
                    f"{keyed_server.url}/v1/completions", json={"model": "tiny", "prompt": HUGE_PROMPT}
                )
            )
            num_answered_meanwhile = 0
            while not big.done():
                health = await client.get(f"{keyed_server.url}/health")
                models = await client.get(f"{keyed_server.url}/v1/models")
                assert health.status_code == 200 and models.status_code == 200
                if not big.done():
                    num_answered_meanwhile += 1
            response = await big
            return num_answered_meanwhile, response.status_code, response.text

    num_answered_meanwhile, status, text = asyncio.run(scenario())
    assert status == 400 and "context" in text
    assert num_answered_meanwhile >= 20


def test_api_key_guards_v1_and_metrics_and_leaves_health_open(keyed_server) -> None:
    url = keyed_server.url
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    completion = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, auth("wrong-key"), {"Authorization": API_KEY}, {"Authorization": "Basic " + API_KEY}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            response = httpx.request(method, f"{url}{path}", json=completion, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert response.headers["www-authenticate"] == "Bearer"
        # an unknown /v1 route tells nothing either
        assert httpx.get(f"{url}/v1/nothing", headers=headers, timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/nothing", headers=auth(), timeout=30).status_code == 404
    metrics = httpx.get(f"{url}/metrics", headers=auth(), timeout=30)
    assert metrics.status_code == 200
    assert metric_value(metrics.text, "kvstash_kv_blocks_total") == NUM_GPU_BLOCKS

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
    answer = client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    assert answer.usage.completion_tokens >= 1
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert [chunk for chunk in stream][-1].choices[0].finish_reason is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
