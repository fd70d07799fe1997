"""`kvstash serve` end to end with failing engine steps: a real server process whose model
runner raises for a marked prompt (`python -m tests.serving.step_faults serve ...`, the
`kvstash` CLI with the fault of `step_faults.py`).

The marked request gets an OpenAI-shaped 500 (streaming: an error event, then
`data: [DONE]`) that names no internals; the requests in flight beside it and those after
it get `engine.LLM`'s text; `/metrics` counts each failing step, KV block usage returns
to its baseline, the server log holds one traceback per failed request. A server whose every
step fails (the probe step after each failed request too) stops its engine after three in a
row and then answers 503 at once, `/health` included.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from engine import SamplingParams
from tests.serving.server_process import NUM_GPU_BLOCKS, ServeProcess, metric_value
from tests.serving.step_faults import FAULT_MESSAGE, POISON_PREFIX

POISONED = [*POISON_PREFIX, 20, 21, 22]
UNRELATED = [[30, 31, 32, 33, 34], [40, 41, 42], [50, 51, 52, 53, 54, 55, 56]]
NUM_TOKENS = 6


def body(prompt: list[int], stream: bool) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


async def complete(client: httpx.AsyncClient, url: str, prompt: list[int]) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json=body(prompt, stream=False))


async def stream(client: httpx.AsyncClient, url: str, prompt: list[int]) -> tuple[int, list[str]]:
    """(status, the `data:` payloads in order)."""
    async with client.stream("POST", f"{url}/v1/completions", json=body(prompt, stream=True)) as response:
        payloads = [
            line[len("data: ") :] async for line in response.aiter_lines() if line.startswith("data: ")
        ]
        return response.status_code, payloads


def streamed_text(payloads: list[str]) -> str:
    return "".join(json.loads(p)["choices"][0]["text"] for p in payloads if p != "[DONE]")


def assert_server_error(error: dict) -> None:
    """OpenAI's error shape, type server_error, no internals of the fault."""
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["message"]
    assert FAULT_MESSAGE not in error["message"] and "Traceback" not in error["message"]


def expected_text(reference_llm, prompt: list[int]) -> str:
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return reference_llm.generate([prompt], params)[0].text


def test_serve_fails_only_the_marked_request_and_goes_on(serving_model_dir, reference_llm) -> None:
    serve = ServeProcess(
        serving_model_dir,
        *(
            "--num-gpu-blocks",
            str(NUM_GPU_BLOCKS),
            "--max-num-seqs",
            "1",
        ),  # one seat: the marked step holds only it
        cli_module="tests.serving.step_faults",
        extra_env={"KVSTASH_TEST_FAULT_AFTER_TOKENS": "2"},
    ).start()
    try:
        baseline_used = metric_value(serve.metrics_text(), "kvstash_kv_blocks_used")

        async def in_flight_together():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(
                    complete(client, serve.url, POISONED),
                    stream(client, serve.url, UNRELATED[0]),
                    complete(client, serve.url, UNRELATED[1]),
                )

        failed, (stream_status, payloads), completed = asyncio.run(in_flight_together())
        assert failed.status_code == 500, failed.text
        assert_server_error(failed.json()["error"])
        assert stream_status == 200 and payloads[-1] == "[DONE]"
        assert streamed_text(payloads) == expected_text(reference_llm, UNRELATED[0])
        assert completed.status_code == 200
        assert completed.json()["choices"][0]["text"] == expected_text(reference_llm, UNRELATED[1])

        # Streaming: the tokens before the failing step, an error event, then [DONE].
        status, payloads = asyncio.run(_stream_alone(serve.url, POISONED))
        assert status == 200
        assert payloads[-1] == "[DONE]"
        assert_server_error(json.loads(payloads[-2])["error"])
        assert all("choices" in json.loads(p) for p in payloads[:-2])

        # Later requests and /health as usual.
        later = httpx.post(f"{serve.url}/v1/completions", json=body(UNRELATED[2], stream=False), timeout=120)
        assert later.status_code == 200
        assert later.json()["choices"][0]["text"] == expected_text(reference_llm, UNRELATED[2])
        assert httpx.get(f"{serve.url}/health", timeout=30).status_code == 200

        metrics = serve.metrics_text()
        assert metric_value(metrics, "kvstash_engine_step_errors_total") == 2
        assert metric_value(metrics, "kvstash_requests_total", finish_reason="error") == 2
        assert metric_value(metrics, "kvstash_kv_blocks_used") == baseline_used
        log = serve.log()
        assert log.count("engine step failed") == 2, log[-4000:]
        assert log.count("Traceback (most recent call last)") == 2, log[-4000:]
        assert log.count(f"RuntimeError: {FAULT_MESSAGE}") == 2
        assert serve.process.poll() is None
    finally:
        serve.close()


async def _stream_alone(url: str, prompt: list[int]) -> tuple[int, list[str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return await stream(client, url, prompt)


def test_serve_whose_every_step_fails_stops_and_answers_503(serving_model_dir) -> None:
    serve = ServeProcess(
        serving_model_dir,
        *("--num-gpu-blocks", "64"),
        cli_module="tests.serving.step_faults",
        extra_env={"KVSTASH_TEST_FAULT_EVERY_STEP": "1"},
    ).start()
    try:
        url = f"{serve.url}/v1/completions"
        statuses = [httpx.post(url, json=body(p, stream=False), timeout=120).status_code for p in UNRELATED]
        assert statuses == [500, 500, 500]  # the third failure in a row stops the engine
        late = httpx.post(url, json=body(UNRELATED[0], stream=False), timeout=30)
        assert late.status_code == 503
        assert_server_error(late.json()["error"])
        health = httpx.get(f"{serve.url}/health", timeout=30)
        assert health.status_code == 503
        assert metric_value(serve.metrics_text(), "kvstash_engine_step_errors_total") == 3
        assert metric_value(serve.metrics_text(), "kvstash_engine_probe_failures_total") == 3
        log = serve.log()
        assert log.count("Traceback (most recent call last)") == 3, log[-4000:]
        assert "engine stopped: 3 requests in a row failed a step alone" in log
        assert log.count("the engine's probe step failed too") == 3
        assert serve.process.poll() is None  # the HTTP server itself stays up, answering 503
    finally:
        serve.close()


def test_serve_fails_only_the_marked_request_of_a_shared_step(serving_model_dir, reference_llm) -> None:
    # Many seats: the marked request shares its failing step with the others; the engine
    # retries them in smaller groups and only the marked one fails.
    serve = ServeProcess(
        serving_model_dir,
        *("--num-gpu-blocks", str(NUM_GPU_BLOCKS), "--max-num-seqs", "16"),
        cli_module="tests.serving.step_faults",
        extra_env={"KVSTASH_TEST_FAULT_AFTER_TOKENS": "2"},
    ).start()
    try:

        async def all_at_once():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(
                    stream(client, serve.url, UNRELATED[0]),
                    complete(client, serve.url, UNRELATED[1]),
                    complete(client, serve.url, POISONED),
                    complete(client, serve.url, UNRELATED[2]),
                )

        (stream_status, payloads), first, failed, last = asyncio.run(all_at_once())
        assert failed.status_code == 500
        assert_server_error(failed.json()["error"])
        assert stream_status == 200 and payloads[-1] == "[DONE]"
        assert streamed_text(payloads) == expected_text(reference_llm, UNRELATED[0])
        for response, prompt in ((first, UNRELATED[1]), (last, UNRELATED[2])):
            assert response.status_code == 200
            assert response.json()["choices"][0]["text"] == expected_text(reference_llm, prompt)
        metrics = serve.metrics_text()
        assert metric_value(metrics, "kvstash_requests_total", finish_reason="error") == 1
        assert metric_value(metrics, "kvstash_requests_total", finish_reason="length") == 3
        log = serve.log()
        assert log.count("Traceback (most recent call last)") == 1, log[-4000:]
        num_retries = log.count("retrying them in smaller groups")
        assert num_retries >= 1  # the marked request did share its failing step
        assert metric_value(metrics, "kvstash_engine_step_errors_total") == num_retries + 1
        assert metric_value(metrics, "kvstash_engine_retried_requests_total") >= 2
        assert metric_value(metrics, "kvstash_engine_probe_failures_total") == 0
        assert httpx.get(f"{serve.url}/health", timeout=30).status_code == 200
    finally:
        serve.close()
