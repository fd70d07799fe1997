"""Fuzzing the OpenAI-compatible HTTP API of ``kvstash serve``: hypothesis-generated
JSON bodies (right and wrong types, out-of-range numbers, odd prompts and messages)
and raw garbage bytes to every endpoint, for a bounded number of examples.

The server must answer each with a success or a 4xx (never a 5xx, never a dropped
connection), stay healthy, and keep its resident memory within a margin of where
it started.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving.server_process import ServeProcess

NUM_EXAMPLES = 60
NUM_GARBAGE_EXAMPLES = 30
RSS_MARGIN_BYTES = 200 << 20
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# Scalars of every JSON type, including values no field accepts.
any_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
token_ids = st.lists(st.integers(-10, 1000), max_size=60)
prompt = st.one_of(
    st.text(max_size=200),
    token_ids,
    st.lists(st.text(max_size=20), max_size=3),
    st.lists(token_ids, max_size=3),
    any_scalar,
)
# Always sent and small (or invalid): an accepted request stays a few tokens long.
max_tokens = st.one_of(
    st.integers(-3, 6), st.text(alphabet="ab -", max_size=5), st.floats(-10, 10), st.none(), st.booleans()
)
sampling = {
    "temperature": st.one_of(st.floats(-2, 5, allow_nan=False), any_scalar),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), any_scalar),
    # unbounded integers too: values past int32/int64 once failed the engine step (issue #17)
    "top_k": st.one_of(st.integers(-5, 600), st.integers(), any_scalar),
    "seed": st.one_of(st.integers(), any_scalar),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=5), any_scalar),
    "stream": st.one_of(st.booleans(), any_scalar),
    "n": st.one_of(st.integers(-1, 3), any_scalar),
    "logprobs": any_scalar,
    "echo": st.booleans(),
    "unknown_field": any_scalar,
}
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), any_scalar),
        "content": st.one_of(
            st.text(max_size=100),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=20)}
                ),
                max_size=2,
            ),
            any_scalar,
        ),
    },
)
# Bodies whose every field has a valid type and range: they reach the engine (edge values
# of each range included), so the accepted paths, streaming among them, are fuzzed too.
valid_sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 600),
    "seed": st.integers(0, 1 << 31),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
}
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "max_tokens": st.integers(1, 6),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=200), st.lists(st.integers(0, 511), min_size=1, max_size=300)
        ),
    },
    optional=valid_sampling,
)
valid_chat = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "max_tokens": st.integers(1, 6),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=100)}
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional=valid_sampling,
)
completion_body = st.one_of(
    valid_completion,
    st.fixed_dictionaries(
        {"max_tokens": max_tokens},
        optional={"model": st.one_of(st.just("tiny"), any_scalar), "prompt": prompt, **sampling},
    ),
)
chat_body = st.one_of(
    valid_chat,
    st.fixed_dictionaries(
        {"max_tokens": max_tokens},
        optional={
            "model": st.one_of(st.just("tiny"), any_scalar),
            "messages": st.one_of(st.lists(message, max_size=3), any_scalar),
            **sampling,
        },
    ),
)


@pytest.fixture(scope="module")
def serve(model_dir):
    process = ServeProcess(
        model_dir, "--dtype", "float32", "--device", "cpu", "--num-gpu-blocks", "128", "--max-num-seqs", "8"
    ).start()
    process.rss_at_start = psutil.Process(process.process.pid).memory_info().rss
    yield process
    process.close()


@pytest.fixture(scope="module")
def http_codes(reliability_report):
    counts: Counter = Counter()
    yield counts
    reliability_report.record(
        "HTTP fuzzing",
        f"hypothesis JSON bodies ({NUM_EXAMPLES} per endpoint) to /v1/completions and /v1/chat/completions, "
        f"raw garbage ({NUM_GARBAGE_EXAMPLES} per path) to every path",
        num_requests=sum(counts.values()),
        num_failed=sum(n for code, n in counts.items() if code >= 500),
        status_codes={str(code): n for code, n in sorted(counts.items())},
    )


def post(serve, path: str, content: bytes, content_type: str = "application/json") -> int:
    """POST and read the whole answer (a stream to its end); returns the status code."""
    with httpx.stream(
        "POST", serve.url + path, content=content, headers={"content-type": content_type}, timeout=120
    ) as response:
        response.read()
        return response.status_code


def assert_healthy(serve) -> None:
    assert serve.process.poll() is None
    assert httpx.get(f"{serve.url}/health", timeout=30).status_code == 200
    rss = psutil.Process(serve.process.pid).memory_info().rss
    assert rss <= serve.rss_at_start + RSS_MARGIN_BYTES, (rss, serve.rss_at_start)


@pytest.mark.parametrize("path", ENDPOINTS)
def test_generated_json_bodies(serve, http_codes, path):
    bodies = completion_body if path == "/v1/completions" else chat_body

    @FUZZ_SETTINGS
    @given(body=bodies)
    def fuzz(body):
        code = post(serve, path, json.dumps(body).encode())
        http_codes[code] += 1
        assert code == 200 or 400 <= code < 500, f"{path} answered {code} to {body!r}"

    fuzz()
    assert_healthy(serve)


@pytest.mark.parametrize("path", [*ENDPOINTS, "/v1/models", "/health", "/metrics", "/v1/nothing-here"])
def test_raw_garbage_bodies(serve, http_codes, path):
    @settings(FUZZ_SETTINGS, max_examples=NUM_GARBAGE_EXAMPLES)
    @given(
        body=st.binary(max_size=2000),
        content_type=st.sampled_from(["application/json", "text/plain", "application/octet-stream", ""]),
    )
    def fuzz(body, content_type):
        code = post(serve, path, body, content_type)
        http_codes[code] += 1
        assert 400 <= code < 500 or code == 200 and not path.startswith("/v1/c"), f"{path} answered {code}"

    fuzz()
    assert_healthy(serve)
