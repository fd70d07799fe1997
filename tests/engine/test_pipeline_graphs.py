"""Pipeline stages replay decode graphs (engine.pipeline.stage_runner), checked on CPU:
each stage process builds its runner with decode graphs whose capture and replay are
swapped for eager calls over the same static buffers (a later stage's input hidden
states included), and the engine of 2 stages still gives one stage's greedy tokens
while every stage replays. The GPU test in test_pipeline_parallel.py replays real
CUDA graphs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs, GraphSizes
from engine.pipeline.stage_builder import PipelineStageBuilder
from engine.pipeline.stage_runner import StageRunner
from tests.engine.hf_reference import random_prompt

MAX_BATCH_SIZE = 4
MAX_MODEL_LEN = 512
PROMPTS = [random_prompt(n, seed=500 + n) for n in (1, 17, 60, 130, 9)]
#: requests end at different steps: decode steps of 5, 4, 3 and 2 sequences
GREEDY = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 8, 12, 6)]


class CountedEagerReplay(DecodeGraphs):
    """Runs the recorded call again at replay time; counts replays in a file of the
    process (stage processes are spawned: the test reads their counts from disk)."""

    def _capture(self, size, forward, args):
        self.calls = getattr(self, "calls", {})
        self.calls[size] = (forward, args)

    def _replay(self, size):
        folder = Path(os.environ["KVSTASH_TEST_REPLAY_DIR"])
        with open(folder / f"replays-{os.getpid()}", "a") as file:
            file.write(f"{size}\n")
        forward, args = self.calls[size]
        return forward(*args)


class EagerGraphStageBuilder(PipelineStageBuilder):
    """Builds every stage's runner with the static graph input (GraphSizes, which a CPU
    engine never passes) and emulated decode graphs. Picklable: spawned stages get it."""

    def build_runner(self, spec, groups, model, num_blocks, block_size, connector, graph_sizes=None):
        sizes = GraphSizes(MAX_BATCH_SIZE, 0, MAX_BATCH_SIZE, MAX_MODEL_LEN)
        runner = super().build_runner(spec, groups, model, num_blocks, block_size, connector, sizes)
        max_blocks = -(-MAX_MODEL_LEN // block_size)
        runner.decode_graphs = CountedEagerReplay(
            runner._forward_with_metadata,
            AttentionMetadata,
            runner.device,
            MAX_BATCH_SIZE,
            max_blocks_per_seq=max_blocks,
            max_seq_len=MAX_MODEL_LEN,
        )
        return runner


def test_two_stages_replaying_decode_graphs_give_one_stage_tokens(tiny_model_dir, tmp_path, monkeypatch):
    model_dir = tiny_model_dir("llama")
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": MAX_MODEL_LEN}
    expected = [o.token_ids for o in LLM(model_dir, **kwargs).generate(PROMPTS, GREEDY)]
    monkeypatch.setenv("KVSTASH_TEST_REPLAY_DIR", str(tmp_path))
    monkeypatch.setattr("engine.pipeline.executor.PipelineStageBuilder", EagerGraphStageBuilder)
    llm = LLM(model_dir, pipeline_parallel_size=2, **kwargs)
    try:
        runner = llm.engine.pipeline.runner
        assert isinstance(runner, StageRunner) and runner._graph_hidden is None  # the first stage embeds
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert llm.engine.stats.num_step_errors == 0  # no step failed and was retried eagerly
    finally:
        llm.engine.shutdown()
    counts = {path.name: path.read_text().split() for path in tmp_path.glob("replays-*")}
    assert len(counts) == 2, counts  # both stages replayed (the first one in this process)
    # decode steps of 5 sequences exceed the 4-seat graphs and run eagerly; the 8 steps of
    # 4, 4, 3, 3, 2, 2, 2, 2 sequences replay (padded to 4, 4, 4, 4, 2, 2, 2, 2), in both stages
    replays = list(counts.values())
    assert replays[0] == replays[1] == ["4"] * 4 + ["2"] * 4


def test_a_later_stage_replay_without_received_hidden_states_is_an_error(tiny_model_dir):
    """The copy into the graph's input refuses to replay over stale buffer contents."""
    import torch

    from engine.pipeline.layer_split import split_layers
    from engine.pipeline.stage_model import load_stage_model

    model_dir = tiny_model_dir("llama")
    from engine.config import ModelConfig

    config = ModelConfig.from_dir(model_dir)
    layout = split_layers(config.num_layers, 2)[1]
    model = load_stage_model(config, model_dir, layout, torch.device("cpu"), torch.float32)
    runner = StageRunner(
        model,
        config,
        layout,
        None,
        8,
        16,
        torch.device("cpu"),
        torch.float32,
        None,
        graph_sizes=GraphSizes(MAX_BATCH_SIZE, 0, MAX_BATCH_SIZE, MAX_MODEL_LEN),
    )
    assert runner._graph_hidden.shape == (MAX_BATCH_SIZE, config.hidden_size)
    runner.decode_graphs = CountedEagerReplay(
        runner._forward_with_metadata, AttentionMetadata, runner.device, MAX_BATCH_SIZE, 8, MAX_MODEL_LEN
    )

    class Host:
        dense_spans = ()
        seq_lens = [3]
        block_tables = torch.zeros((1, 1), dtype=torch.int32).numpy()
        max_query_len = 1
        input_ids = [5]

    class Plan:
        class connector_meta:
            loads = ()

    with pytest.raises(RuntimeError, match="without input hidden states"):
        runner._graphs_for(Plan, Host)
    hidden = torch.randn(1, config.hidden_size)
    runner.model.input_hidden = hidden
    assert runner._graphs_for(Plan, Host) is runner.decode_graphs and runner._replaying
    assert torch.equal(runner._graph_hidden[:1], hidden) and runner.model.input_hidden is None
