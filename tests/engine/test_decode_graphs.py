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


def test_one_copy_fills_every_input_buffer_and_pads_the_rows():
    """run() writes a step's inputs and the padding rows into the graph's buffers, which
    are views of one device buffer (filled by one copy), each at an aligned offset."""
    import numpy as np
    import torch

    graphs = EagerReplay(
        lambda input_ids, positions, metadata: input_ids.clone(),
        AttentionMetadata,
        torch.device("cpu"),
        4,
        max_blocks_per_seq=5,
        max_seq_len=80,
    )
    buffers = (graphs.input_ids, graphs.positions, graphs.slot_mapping, graphs.seq_lens, graphs.block_tables)
    base = graphs._inputs.data_ptr()
    assert all(b.untyped_storage().data_ptr() == base and (b.data_ptr() - base) % 256 == 0 for b in buffers)
    assert graphs.slot_mapping.tolist() == [-1] * 4 and graphs.seq_lens.tolist() == [1] * 4

    def step(num_seqs: int, width: int, seed: int):
        rng = np.random.default_rng(seed)
        inputs = (
            rng.integers(0, 1000, num_seqs).astype(np.int64),
            rng.integers(0, 80, num_seqs).astype(np.int64),
            rng.integers(0, 80, num_seqs).astype(np.int64),
            rng.integers(0, 9, (num_seqs, width)).astype(np.int32),
            rng.integers(1, 80, num_seqs).astype(np.int32),
        )
        out = graphs.run(*inputs)
        return inputs, out

    (ids, positions, slots, tables, seq_lens), out = step(3, 4, seed=1)  # padded to 4 rows
    assert out.tolist() == ids.tolist()
    assert graphs.input_ids.tolist() == [*ids.tolist(), 0]
    assert graphs.positions.tolist() == [*positions.tolist(), 0]
    assert graphs.slot_mapping.tolist() == [*slots.tolist(), -1]
    assert graphs.seq_lens.tolist() == [*seq_lens.tolist(), 1]
    assert graphs.block_tables[:3, :4].tolist() == tables.tolist() and int(graphs.block_tables[3, 0]) == 0
    (ids, positions, slots, tables, seq_lens), out = step(1, 2, seed=2)  # the 1-row graph
    assert out.tolist() == ids.tolist() and int(graphs.slot_mapping[0]) == int(slots[0])
    assert graphs.block_tables[0, :2].tolist() == tables[0].tolist()
    assert len(graphs._host_inputs) == 1  # on CPU every copy is done when run() returns
