"""The mixed-graph path (engine.mixed_graphs) checked on CPU: token buckets, the
padding of a step, and whole generations where every small non-decode step goes
through the static buffers of a bucket (capture/replay swapped for an eager call
over them, as tests/engine/test_decode_graphs.py does for decode graphs) and still
gives the tokens of the ordinary eager path. On CPU the reference attention
validates the padded metadata at every step. The GPU tests replay real CUDA graphs:
tests/engine/test_gpu_mixed_graphs.py."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM, OffloadConfig, SamplingParams
from engine.attention import AttentionMetadata
from engine.cuda_graphs import DecodeGraphs
from engine.mixed_graphs import MixedGraphs, pad_step, token_buckets
from engine.spec_decode.replay import ReplayProposer
from tests.engine.hf_reference import random_prompt


class _EagerReplayMixin:
    """Runs the recorded call again at replay time instead of a CUDA graph."""

    def _capture(self, size, forward, args):
        self.calls = getattr(self, "calls", {})
        self.calls[size] = (forward, args)
        self.replayed_sizes = []

    def _replay(self, size):
        self.replayed_sizes.append(size)
        forward, args = self.calls[size]
        return forward(*args)


class EagerMixed(_EagerReplayMixin, MixedGraphs):
    pass


class EagerDecode(_EagerReplayMixin, DecodeGraphs):
    pass


def attach_graphs(
    llm: LLM, max_graph_tokens: int, decode: bool = True
) -> tuple[EagerMixed, EagerDecode | None]:
    """Give a CPU engine's runner mixed graphs (and decode graphs) over static buffers."""
    runner = llm.engine.runner
    max_blocks = 64
    mixed = EagerMixed(
        runner._forward_with_metadata,
        AttentionMetadata,
        runner.device,
        max_graph_tokens,
        llm.engine.args.max_num_seqs,
        max_blocks_per_seq=max_blocks,
        max_seq_len=max_blocks * runner.block_size,
        block_size=runner.block_size,
    )
    runner.mixed_graphs = mixed
    runner.step_kinds.clear()
    decode_graphs = None
    if decode:
        decode_graphs = EagerDecode(
            runner._forward_with_metadata,
            AttentionMetadata,
            runner.device,
            8,
            max_blocks_per_seq=max_blocks,
            max_seq_len=max_blocks * runner.block_size,
        )
        runner.decode_graphs = decode_graphs
    return mixed, decode_graphs


def test_token_buckets():
    assert token_buckets(0) == []
    assert token_buckets(5) == [5]
    assert token_buckets(40) == [8, 16, 32, 40]
    assert token_buckets(512) == [8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert token_buckets(200) == [8, 16, 32, 64, 128, 192, 200]


def test_pad_step_puts_padding_in_one_sequence_and_empty_seats():
    step = pad_step(
        input_ids=np.array([5, 6, 7, 8], dtype=np.int64),
        positions=np.array([40, 41, 42, 9], dtype=np.int64),
        slot_mapping=np.array([100, 101, -1, 7], dtype=np.int64),
        seq_lens=np.array([43, 10], dtype=np.int32),
        query_start_loc=np.array([0, 3, 4], dtype=np.int32),
        num_tokens=8,
        num_seats=5,
    )
    assert step.input_ids.tolist() == [5, 6, 7, 8, 0, 0, 0, 0]
    assert step.positions.tolist() == [40, 41, 42, 9, 0, 0, 0, 0]
    assert step.slot_mapping.tolist() == [100, 101, -1, 7, -1, -1, -1, -1]
    # seat 2 is the padding sequence of 4 tokens (no prefix); seats 3, 4 hold no token
    assert step.seq_lens.tolist() == [43, 10, 4, 0, 0]
    assert step.query_start_loc.tolist() == [0, 3, 4, 8, 8, 8]
    assert step.padding_seat == 2


def test_pad_step_rejects_steps_that_do_not_fit():
    ids = np.arange(9, dtype=np.int64)
    with pytest.raises(ValueError, match="does not fit"):
        pad_step(ids, ids, ids, np.array([9], np.int32), np.array([0, 9], np.int32), 8, 3)
    with pytest.raises(ValueError, match="does not fit"):  # no seat left for the padding sequence
        pad_step(ids[:2], ids[:2], ids[:2], np.array([1, 1], np.int32), np.array([0, 1, 2], np.int32), 8, 2)
    with pytest.raises(ValueError, match="query_start_loc"):
        pad_step(ids[:2], ids[:2], ids[:2], np.array([2], np.int32), np.array([0, 1], np.int32), 8, 3)


def test_chunked_prefill_beside_decodes_gives_the_eager_tokens(tiny_model_dir):
    """A small token budget: prompts are cut into chunks over their cached prefix and
    run beside other requests' decodes; all those steps replay the mixed graphs."""
    model_dir = tiny_model_dir("qwen2")
    prompts = [random_prompt(n, seed=700 + n) for n in (150, 9, 61, 3)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 12, 7, 9)]
    expected = [
        o.token_ids
        for o in LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=40).generate(
            prompts, params
        )
    ]
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=40)
    mixed, decode = attach_graphs(llm, 40)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    kinds = llm.engine.runner.step_kinds
    assert kinds["eager"] == 0, "every step fits a graph"
    assert kinds["mixed_graph"] == len(mixed.replayed_sizes) >= 5
    assert kinds["decode_graph"] == len(decode.replayed_sizes) > 0
    assert set(mixed.replayed_sizes) <= {8, 16, 32, 40} and 40 in mixed.replayed_sizes


def test_steps_larger_than_the_graphs_run_eagerly(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=720 + n) for n in (70, 20)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(model_dir, dtype="float32", device="cpu")
    mixed, _ = attach_graphs(llm, 32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    kinds = llm.engine.runner.step_kinds
    assert kinds["eager"] == 1  # the 90-token first step
    assert kinds["mixed_graph"] == 0 and not mixed.replayed_sizes


def test_suffix_after_a_cpu_tier_hit_replays_a_mixed_graph_with_its_load(tiny_model_dir):
    """The prompt's prefix comes from the CPU tier (a step with connector loads), its
    suffix runs in the graph after the stream waited for every layer's load."""
    model_dir = tiny_model_dir("qwen3")
    prefix = random_prompt(96, seed=730)
    prompt = prefix + random_prompt(21, seed=731)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(model_dir, dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
    offload = OffloadConfig(cpu_bytes=64 << 20, chunk_size=32)
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload)
    llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    mixed, _ = attach_graphs(llm, 64)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == expected
    assert out.metrics.num_external_cached_tokens == 96
    # the 21-token suffix (with the loads) in the 32-token bucket, then 5 decodes
    assert mixed.replayed_sizes == [32]
    assert llm.engine.runner.step_kinds["eager"] == 0


@pytest.mark.parametrize("corrupt_fraction", [0.0, 0.4])
def test_speculative_verification_replays_mixed_graphs(tiny_model_dir, corrupt_fraction):
    """Replayed drafts (accepted, or partly corrupted and rolled back): verification
    steps replay the mixed graphs, steps without drafts the decode graphs; the tokens
    are plain decoding's."""
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=740 + n) for n in (30, 7, 12)]
    params = SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        speculative="ngram",
        num_speculative_tokens=4,
        block_size=4,
    )
    llm.engine.scheduler.proposer = ReplayProposer(
        4,
        {tuple(p): c for p, c in zip(prompts, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
        corrupt_fraction=corrupt_fraction,
        seed=5,
    )
    mixed, _ = attach_graphs(llm, 64)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    kinds = llm.engine.runner.step_kinds
    assert kinds["eager"] == 0
    assert kinds["mixed_graph"] >= 4
    stats = llm.stats.spec_decode
    assert stats.num_accepted_tokens > 0
    if corrupt_fraction:
        assert stats.acceptance_rate < 1.0


def test_ngram_speculation_with_graphs_gives_plain_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    text = random_prompt(24, seed=750)
    prompts = [text * 3, text[:10] + random_prompt(20, seed=751) + text[:10], [77]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    llm = LLM(
        model_dir, dtype="float32", device="cpu", speculative="ngram", num_speculative_tokens=4, ngram_min_n=1
    )
    attach_graphs(llm, 128)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.runner.step_kinds["eager"] == 0
    assert llm.engine.runner.step_kinds["mixed_graph"] > 0


@pytest.mark.parametrize("value", [-1, 2.5, True, "64"])
def test_bad_max_graph_tokens_is_rejected(value):
    from engine.config import EngineArgs

    with pytest.raises(ValueError, match="max_graph_tokens must be an integer >= 0"):
        EngineArgs(max_graph_tokens=value).validate()


def test_the_cli_flag_reaches_the_engine(tiny_model_dir):
    from click.testing import CliRunner

    from engine.cli import main

    args = ["generate", str(tiny_model_dir("llama")), "--prompt", "hi", "--device", "cpu"]
    result = CliRunner().invoke(main, [*args, "--max-graph-tokens", "-4"])
    assert result.exit_code != 0
    assert "max_graph_tokens must be an integer >= 0" in result.output
    result = CliRunner().invoke(main, [*args, "--max-graph-tokens", "64", "--max-tokens", "2"])
    assert result.exit_code == 0, result.output


def test_warm_up_runs_every_shape_eagerly_then_replays_the_graphs(tiny_model_dir):
    """The warm-up sets the graphs aside for its eager pass (every kernel shape of the
    eager steps compiles), then replays them and attaches them again."""
    from engine.warmup import WarmupLimits, warm_up

    llm = LLM(tiny_model_dir("llama"), dtype="float32", device="cpu", max_model_len=512)
    mixed, decode = attach_graphs(llm, 64)
    runner = llm.engine.runner
    report = warm_up(runner, WarmupLimits(max_num_batched_tokens=256, max_model_len=512, max_num_seqs=8))
    assert runner.mixed_graphs is mixed and runner.decode_graphs is decode
    # replayed: the 17-token prefill (a mixed graph), the 289-token prefill pair (too
    # large for these graphs: eager), the decode batch (a decode graph)
    assert report.step_kinds == {"eager": report.num_steps - 2, "mixed_graph": 1, "decode_graph": 1}
    assert mixed.replayed_sizes == [32]
    assert not runner.step_kinds, "the counts start at zero for the engine's steps"


def test_async_scheduling_fills_the_graph_inputs_from_the_previous_step(tiny_model_dir):
    """With async scheduling, a mixed step's decode rows take the token the step before
    samples, on the device, in the graph's static input buffer."""
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(n, seed=760 + n) for n in (90, 4, 33)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 24}
    expected = [o.token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, async_scheduling=True, **kwargs)
    attach_graphs(llm, 24)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    runner = llm.engine.runner
    assert runner.num_device_filled_input_ids > 0
    assert runner.step_kinds["mixed_graph"] > 0 and runner.step_kinds["eager"] == 0


def test_a_padded_step_writes_only_its_own_slots_and_gives_the_eager_hidden_states(tiny_model_dir):
    """One step straight through the static buffers of an 8-token bucket (7 real tokens,
    two sequences): the KV cache changes at the real tokens' slots only, and the hidden
    states equal the eager pass over the unpadded inputs."""
    import torch

    llm = LLM(tiny_model_dir("qwen3"), dtype="float32", device="cpu")
    runner = llm.engine.runner
    mixed, _ = attach_graphs(llm, 16, decode=False)
    block_size = runner.block_size
    kv_cache = runner.kv_cache
    kv_cache.normal_(generator=torch.Generator().manual_seed(0))
    # sequence 0: a 5-token prompt in block 3; sequence 1: 2 tokens after a 16-token prefix (blocks 1, 2)
    positions = np.array([0, 1, 2, 3, 4, 16, 17], dtype=np.int64)
    slots = np.array([3 * block_size + p for p in range(5)] + [2 * block_size, 2 * block_size + 1])
    block_tables = np.array([[3, 0], [1, 2]], dtype=np.int32)
    seq_lens = np.array([5, 18], dtype=np.int32)
    query_start_loc = np.array([0, 5, 7], dtype=np.int32)
    input_ids = np.array([11, 12, 13, 14, 15, 21, 22], dtype=np.int64)
    before = kv_cache.clone()

    with torch.inference_mode():
        hidden = mixed.run(input_ids, positions, slots, block_tables, seq_lens, query_start_loc).clone()
        after_graph = kv_cache.clone()
        kv_cache.copy_(before)
        metadata = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(block_tables),
            seq_lens=torch.from_numpy(seq_lens),
            query_start_loc=torch.from_numpy(query_start_loc),
            max_query_len=5,
            max_seq_len=18,
            num_paged_seqs=2,
        )
        eager = runner._forward_with_metadata(
            torch.from_numpy(input_ids), torch.from_numpy(positions), metadata
        )

    assert mixed.replayed_sizes == [8]
    changed = (after_graph != before).flatten(4).any(-1).any(0).any(0).flatten()  # per slot
    assert sorted(torch.nonzero(changed).flatten().tolist()) == sorted(slots.tolist())
    # equal up to float32 rounding: a GEMM over 8 rows may sum in another order than over 7
    torch.testing.assert_close(after_graph, kv_cache, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hidden, eager, atol=1e-5, rtol=1e-4)


def test_deterministic_mode_gives_the_same_bf16_tokens_through_padded_graphs(tiny_model_dir):
    """In the deterministic mode (bf16, batch-invariant kernels) padding a step to a
    bucket changes no bit of its real rows: tokens equal those of the unpadded engine,
    greedy and seeded sampled, with chunked prefill and n-gram speculation."""
    model_dir = tiny_model_dir("qwen3")
    shared = random_prompt(64, seed=770)
    prompts = [shared + random_prompt(40, seed=771), random_prompt(23, seed=772), shared + [9, 8, 7] * 9]
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.9, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    ]
    kwargs = {
        "dtype": "bfloat16",
        "device": "cpu",
        "deterministic": True,
        "max_num_batched_tokens": 48,
        "speculative": "ngram",
        "num_speculative_tokens": 3,
        "ngram_min_n": 1,
    }
    expected = [o.token_ids for o in LLM(model_dir, **kwargs).generate(prompts, params)]
    llm = LLM(model_dir, **kwargs)
    attach_graphs(llm, 48)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.runner.step_kinds["mixed_graph"] > 0


def test_loads_that_need_per_layer_hooks_run_eagerly(tiny_model_dir):
    """`layerwise` loads on CPU move each layer inside its hook: that step stays eager,
    the steps after it replay the graphs; tokens are the engine's without graphs."""
    model_dir = tiny_model_dir("llama")
    prefix = random_prompt(64, seed=780)
    prompt = prefix + random_prompt(9, seed=781)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    expected = LLM(model_dir, dtype="float32", device="cpu").generate([prompt], params)[0].token_ids
    offload = OffloadConfig(cpu_bytes=64 << 20, chunk_size=32, layerwise=True)
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_offload=offload)
    llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    llm.flush_kv_offload()
    assert llm.reset_prefix_cache()
    mixed, decode = attach_graphs(llm, 32)
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == expected and out.metrics.num_external_cached_tokens == 64
    assert llm.engine.runner.step_kinds == {"eager": 1, "decode_graph": 4}
    assert not mixed.replayed_sizes


def test_pipelined_loads_beside_graph_steps_keep_the_tokens(tiny_model_dir, redis_server):
    """A hit read slowly from a real Redis loads chunk by chunk in load-only steps (#16)
    while another request decodes through the graphs; both get their baseline tokens."""
    from tests.connector.test_async_loads import close
    from tests.connector.test_pipelined_loads import PROMPT_LEN, SlowRemote, remote_config

    model_dir = tiny_model_dir("llama")
    hit_prompt, other_prompt = random_prompt(PROMPT_LEN, seed=790), random_prompt(20, seed=791)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = LLM(model_dir, dtype="float32", device="cpu", enable_prefix_caching=False)
    expected = [o.token_ids for o in plain.generate([hit_prompt, other_prompt], params)]
    remote = SlowRemote(model_dir, redis_server, [hit_prompt])
    try:
        llm = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            enable_prefix_caching=False,
            kv_offload=remote_config(remote.url),
        )
        attach_graphs(llm, 64)
        engine = llm.engine
        engine.add_request("other", other_prompt, params)
        engine.step()  # its prompt, then it decodes while the hit is fetched
        engine.add_request("hit", hit_prompt, params)
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
        assert [finished["hit"].token_ids, finished["other"].token_ids] == expected
        assert finished["hit"].metrics.num_external_cached_tokens == PROMPT_LEN - 1
        kinds = engine.runner.step_kinds
        assert kinds["decode_graph"] > 0 and kinds["eager"] == 0
        close(llm)
    finally:
        remote.close()
