"""The decode-graph path's static buffers and padding, checked on CPU: the same
class with capture/replay swapped for an eager call over the static buffers gives
the tokens of the ordinary eager path (the GPU tests replay real CUDA graphs)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from tests.engine.hf_reference import random_prompt


class EagerReplay(DecodeGraphs):
    """Runs the recorded call again at replay time instead of a CUDA graph."""

    def _capture(self, size, forward, args):
        self.calls = getattr(self, "calls", {})
        self.calls[size] = (forward, args)
        self.num_replays = 0

    def _replay(self, size):
        self.num_replays += 1
        forward, args = self.calls[size]
        return forward(*args)


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("max_batch_size,num_replays", [(3, 6), (8, 11)])
def test_static_buffer_decode_gives_the_eager_tokens(tiny_model_dir, max_batch_size, num_replays):
    model_dir = tiny_model_dir("qwen2")
    prompts = [random_prompt(n, seed=300 + n) for n in (1, 20, 47, 130, 5)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 8, 12, 6)]
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(model_dir, dtype="float32", device="cpu")
    runner = llm.engine.runner
    graphs = EagerReplay(
        runner._forward_with_metadata,
        AttentionMetadata,
        runner.device,
        max_batch_size,
        max_blocks_per_seq=16,
        max_seq_len=16 * runner.block_size,
    )
    runner.decode_graphs = graphs
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # one prefill step, then 11 decode steps of 5, 5, 5, 4, 4, 3, 3, 2, 2, 2, 2 sequences:
    # a 3-seat graph serves the last 6 (padding 2 -> 3), an 8-seat graph all 11 (padding to 8)
    assert graphs.num_replays == num_replays
