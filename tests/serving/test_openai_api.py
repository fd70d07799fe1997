"""The official `openai` client against a real `kvstash serve` process: completions,
chat, streaming (exact SSE framing), models, and concurrent clients whose outputs
must equal the offline `engine.LLM` for the same prompts."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from engine import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "What is the capital of France?",
    "A cache hit turns hundreds of milliseconds",
    "Monday Tuesday Wednesday",
    "Translate this paragraph into French.",
    "def main(): print(",
    "The numbers one two three",
    "Users ask several questions about a long shared context",
]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


def test_completion_matches_offline_llm(client, reference_llm) -> None:
    expected = reference_llm.generate(PROMPTS[0], greedy(12))[0]
    completion = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = completion.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == len(expected.prompt_token_ids) + 12
    assert completion.model == "tiny" and completion.object == "text_completion"


def test_completion_with_token_id_prompt(client, reference_llm) -> None:
    token_ids = [7, 42, 99, 311, 12, 5, 260]
    expected = reference_llm.generate([token_ids], greedy(6))[0]
    completion = client.completions.create(
        model="tiny", prompt=token_ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == expected.text
    assert completion.usage.prompt_tokens == len(token_ids)


def test_chat_uses_the_chat_template(client, reference_llm) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "How many days are in a week?"},
    ]
    tokenizer = reference_llm.tokenizer
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_text.endswith("<|im_start|>assistant\n")
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    expected = reference_llm.generate([prompt_ids], greedy(10))[0]
    chat = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected.text
    assert chat.usage.prompt_tokens == len(prompt_ids)


def test_streamed_completion_equals_the_whole_one(client) -> None:
    kwargs = dict(
        model="tiny", prompt=PROMPTS[2], max_tokens=14, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 14


def test_streamed_chat_equals_the_whole_one(client) -> None:
    messages = [{"role": "user", "content": "Write a short poem about the sea"}]
    kwargs = dict(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_stream_framing_is_server_sent_events_ending_with_done(server) -> None:
    body = {"model": "tiny", "prompt": PROMPTS[3], "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(p["object"] == "text_completion" for p in payloads)


def test_stop_string_cuts_the_text_streamed_or_not(client, reference_llm) -> None:
    full = reference_llm.generate(PROMPTS[4], greedy(16))[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: no usable stop string in {full!r}"
    expected = full[: full.find(stop)]
    kwargs = dict(model="tiny", prompt=PROMPTS[4], max_tokens=16, temperature=0, stop=[stop])
    kwargs["extra_body"] = {"ignore_eos": True}
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.text == expected and whole.finish_reason == "stop"
    streamed = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_models_lists_the_served_name(client, server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health", timeout=30).json() == {"status": "ok"}


def test_concurrent_clients_get_their_own_outputs(client, reference_llm) -> None:
    """8 threads at once: greedy outputs equal the offline engine's; seeded sampling
    is reproducible per request whatever the batch around it."""
    seeds = list(range(100, 100 + len(PROMPTS)))
    expected_greedy = [o.text for o in reference_llm.generate(PROMPTS, greedy(10))]

    def ask(index: int) -> tuple[str, str]:
        prompt = PROMPTS[index]
        common = dict(model="tiny", prompt=prompt, max_tokens=10, extra_body={"ignore_eos": True})
        greedy_text = client.completions.create(temperature=0, **common).choices[0].text
        sampled_text = client.completions.create(temperature=1.0, seed=seeds[index], **common).choices[0].text
        return greedy_text, sampled_text

    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        answers = list(pool.map(ask, range(len(PROMPTS))))
    assert [greedy_text for greedy_text, _ in answers] == expected_greedy
    # A seeded request alone gives the same sample as it did inside the concurrent batch.
    for index in (0, 5):
        alone = client.completions.create(
            model="tiny",
            prompt=PROMPTS[index],
            max_tokens=10,
            temperature=1.0,
            seed=seeds[index],
            extra_body={"ignore_eos": True},
        )
        assert alone.choices[0].text == answers[index][1]
