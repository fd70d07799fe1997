"""The server's engine loop with async scheduling (in-process, no HTTP): streamed
outputs are cumulative and end exactly as with synchronous steps, a consumer that stops
early aborts its request mid-flight, and the engine loop goes idle with nothing in flight."""

from __future__ import annotations

import asyncio
import time

from engine import LLM, EngineArgs, EngineCore, SamplingParams
from engine.server.async_engine import AsyncEngine

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(20, 61)), "c": [300, 301]}
MAX_TOKENS = {"a": 7, "b": 12, "c": 3}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_streams_with_async_scheduling_equal_the_synchronous_engine(serving_model_dir) -> None:
    plain = LLM(serving_model_dir, num_gpu_blocks=64)
    expected = {
        request_id: output.token_ids
        for request_id, output in zip(
            PROMPTS,
            plain.generate(list(PROMPTS.values()), [greedy(MAX_TOKENS[r]) for r in PROMPTS]),
            strict=True,
        )
    }
    core = EngineCore(serving_model_dir, EngineArgs(num_gpu_blocks=64, async_scheduling=True))
    engine = AsyncEngine(core)
    engine.start()
    try:

        async def collect(request_id: str):
            stream = engine.generate(request_id, PROMPTS[request_id], greedy(MAX_TOKENS[request_id]))
            return [output async for output in stream]

        async def early_stop():
            stream = engine.generate("long", [5, 6, 7, 8], greedy(500))
            first = await anext(stream)
            await stream.aclose()
            return first

        async def scenario():
            return await asyncio.gather(early_stop(), *(collect(r) for r in PROMPTS))

        first, *streams = asyncio.run(scenario())
        assert not first.finished
        for request_id, outputs in zip(PROMPTS, streams, strict=True):
            assert outputs[-1].finished and outputs[-1].finish_reason == "length"
            assert outputs[-1].token_ids == expected[request_id]
            assert [len(o.token_ids) for o in outputs] == list(range(1, MAX_TOKENS[request_id] + 1))
            assert sum(o.finished for o in outputs) == 1
        # the loop keeps stepping until the step in flight after the last end is collected
        deadline = time.monotonic() + 60
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not core.has_unfinished_requests()
    finally:
        engine.shutdown()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
