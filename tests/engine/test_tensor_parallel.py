"""Tensor parallelism (engine.tensor_parallel): an engine of 2 ranks, one process each
(gloo on CPU), gives the greedy float32 tokens of Hugging Face and of one rank for
every tiny arch, with chunked prefill, preemption and prefix caching; a model of one KV
head replicates it on both ranks; 2 stages of 2 ranks (4 processes) give HF's tokens too;
offload hits come from each rank's own shard of every chunk (CPU
and disk tiers), and a chunk missing on one rank only is recomputed on every rank. Bad
sizes are refused, naming the numbers, before any process starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.tensor_parallel import check_tensor_parallel_size, rank_layout
from tests.engine.hf_reference import hf_greedy, random_prompt

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW_TOKENS = 10
_SHARED = random_prompt(200, seed=305)
#: the last prompt shares 160 tokens (10 blocks) with the 200-token one
PROMPTS = [
    random_prompt(1, seed=300),
    random_prompt(9, seed=301),
    random_prompt(70, seed=302),
    random_prompt(150, seed=303),
    _SHARED,
    _SHARED[:160] + random_prompt(40, seed=306),
]
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
#: 30 blocks of 16 = 480 tokens for 6 requests of 690 tokens in all: some are preempted
NUM_BLOCKS = 30


def _token_ids(outputs) -> list[list[int]]:
    assert all(o.finish_reason == "length" for o in outputs), [o.finish_reason for o in outputs]
    return [o.token_ids for o in outputs]


def _config(num_heads: int, num_kv_heads: int, vocab_size: int = 512, intermediate: int = 160):
    return SimpleNamespace(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        hf_config=SimpleNamespace(intermediate_size=intermediate),
    )


def test_each_rank_holds_its_heads_kv_heads_columns_and_vocab_rows() -> None:
    config = _config(8, 4, vocab_size=511, intermediate=161)
    layouts = [rank_layout(config, rank, 2) for rank in range(2)]
    assert [(s.head_start, s.head_end, s.kv_head_start, s.kv_head_end) for s in layouts] == [
        (0, 4, 0, 2),
        (4, 8, 2, 4),
    ]
    # uneven MLP width: the first rank takes one more column
    assert [(s.intermediate_start, s.intermediate_end) for s in layouts] == [(0, 81), (81, 161)]
    # vocabulary shards are padded to one size; the last rank's real rows end at the vocab
    assert [(s.vocab_start, s.vocab_end, s.vocab_shard) for s in layouts] == [(0, 256, 256), (256, 511, 256)]
    # fewer KV heads than ranks: each KV head is replicated on two ranks
    replicated = [rank_layout(_config(8, 2), rank, 4) for rank in range(4)]
    assert [(s.kv_head_start, s.kv_head_end) for s in replicated] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [(s.head_start, s.head_end) for s in replicated] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_sizes_that_cannot_split_the_model_name_the_numbers() -> None:
    with pytest.raises(
        ValueError, match="tensor_parallel_size 5 does not divide the model.s 12 attention heads"
    ):
        check_tensor_parallel_size(_config(12, 12), 5)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 3 KV heads"):
        check_tensor_parallel_size(_config(6, 3), 2)
    with pytest.raises(
        ValueError, match="4 KV heads cannot be replicated evenly over tensor_parallel_size 6"
    ):
        check_tensor_parallel_size(_config(12, 4), 6)


def test_bad_sizes_are_refused_before_any_process_starts(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"
    ):
        LLM(model_dir, device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size 8 exceeds the model's 4 attention heads"):
        LLM(model_dir, device="cpu", tensor_parallel_size=8)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        LLM(model_dir, device="cpu", tensor_parallel_size=0)
    with pytest.raises(
        ValueError, match="tensor_parallel_size 3 does not divide the model's 4 attention heads"
    ):
        LLM(model_dir, device="cpu", tensor_parallel_size=3, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="deterministic is not supported with tensor_parallel_size"):
        LLM(model_dir, device="cpu", tensor_parallel_size=2, deterministic=True)


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_the_commands_take_the_flag(command) -> None:
    from click.testing import CliRunner

    from engine.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "--tensor-parallel-size" in result.output


@pytest.fixture(scope="module", params=ARCHS)
def tp_case(request, tiny_model_dir):
    """(model dir, HF greedy outputs, a TP=2 engine with chunked prefill and a KV pool
    small enough to preempt), once per arch."""
    model_dir = tiny_model_dir(request.param)
    expected = hf_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        max_num_batched_tokens=64,
        num_gpu_blocks=NUM_BLOCKS,
        max_decode_gap_ms=0,  # chunk sizes from the budget alone, not from step times
    )
    yield model_dir, expected, llm
    llm.engine.shutdown()


def test_tp2_matches_hf_with_chunked_prefill_preemption_and_prefix_caching(tp_case) -> None:
    _, expected, llm = tp_case
    preemptions_before = llm.engine.scheduler.stats.num_preemptions
    assert _token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.engine.scheduler.stats.num_preemptions > preemptions_before
    assert llm.stats.num_steps > sum(len(p) for p in PROMPTS) // 64  # prompts were cut into chunks
    # one at a time again: each hits its full blocks in the prefix cache
    for prompt, tokens in zip(PROMPTS[4:], expected[4:], strict=True):
        (output,) = llm.generate([prompt], GREEDY)
        assert output.token_ids == tokens
        assert output.metrics.num_local_cached_tokens == (len(prompt) - 1) // 16 * 16


def test_tp2_verifies_drafts_and_samples_seeded_like_one_rank(tp_case) -> None:
    """Rank 0 alone samples and verifies drafts (the other rank joins the logits gather
    of the same rows); seeded requests keep their generators."""
    from engine.spec_decode.replay import ReplayProposer

    model_dir, expected, llm = tp_case
    llm.engine.scheduler.proposer = ReplayProposer(
        3,
        {tuple(p): c for p, c in zip(PROMPTS, expected, strict=True)},
        vocab_size=llm.engine.model_config.vocab_size,
        corrupt_fraction=0.35,
        seed=3,
    )
    try:
        assert _token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    finally:
        llm.engine.scheduler.proposer = None
    stats = llm.stats.spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    seeded = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11)
    one_rank = LLM(model_dir, dtype="float32", device="cpu").generate(PROMPTS[:4], seeded)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], seeded)] == [o.token_ids for o in one_rank]


def test_tp2_with_async_scheduling_takes_rank_0s_samples_as_input_ids(tp_case) -> None:
    """Two steps in flight: a step's input ids include the previous step's samples, which
    only rank 0 has (on its device); it fills them and broadcasts the ids to rank 1."""
    _, expected, llm = tp_case
    engine = llm.engine
    rank0 = engine.pipeline.runner
    filled_before = rank0.num_device_filled_input_ids
    engine.set_async_scheduling(True)
    try:
        assert _token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    finally:
        engine.set_async_scheduling(False)
    assert rank0.num_device_filled_input_ids > filled_before


def test_tp2_replicates_a_single_kv_head_with_random_weights_like_one_rank() -> None:
    """A model of one KV head over 2 ranks (each holds a copy of it), with random weights
    (`load_format="dummy"`: each rank keeps its slices of the whole model's draws)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=301,  # odd: the last rank's shard has one padding row
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.2,
        architectures=["LlamaForCausalLM"],
    )
    prompts = [random_prompt(9, seed=320, vocab_size=301), random_prompt(70, seed=321, vocab_size=301)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kwargs = {"dtype": "float32", "device": "cpu", "load_format": "dummy"}
    expected = _token_ids(LLM(config, **kwargs).generate(prompts, params))
    llm = LLM(config, tensor_parallel_size=2, **kwargs)
    try:
        rank0 = llm.engine.pipeline.runner
        assert rank0.config.num_kv_heads == 1 and rank0.kv_cache.shape[-2] == 1
        assert rank0.model.model.embed_tokens.weight.shape[0] == 151
        assert _token_ids(llm.generate(prompts, params)) == expected
    finally:
        llm.engine.shutdown()


def _offload_config(disk_path: Path) -> OffloadConfig:
    return OffloadConfig(chunk_size=64, cpu_bytes=16 << 20, disk_path=str(disk_path), disk_bytes=64 << 20)


@pytest.fixture(scope="module")
def offload_case(tiny_model_dir, tmp_path_factory):
    """A TP=2 engine with a CPU and a disk tier that stored PROMPTS' KV, its outputs,
    and one rank's outputs of the same prompts without offload."""
    model_dir = tiny_model_dir("llama")
    disk_path = tmp_path_factory.mktemp("tp-offload") / "disk"
    tp1 = _token_ids(LLM(model_dir, dtype="float32", device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        tensor_parallel_size=2,
        kv_offload=_offload_config(disk_path),
    )
    first = _token_ids(llm.generate(PROMPTS, GREEDY))
    llm.flush_kv_offload()
    yield model_dir, disk_path, llm, first, tp1
    llm.engine.shutdown()


def test_tp2_offload_hits_from_cpu_tier_match_tp1(offload_case) -> None:
    _, disk_path, llm, first, tp1 = offload_case
    assert first == tp1
    assert llm.reset_prefix_cache()
    outputs = llm.generate(PROMPTS[3:5], GREEDY)
    assert _token_ids(outputs) == tp1[3:5]
    # 150 and 200 tokens: their whole chunks of 64 and the partial chunk, all but the last token
    assert [o.metrics.tier_to_loaded_tokens for o in outputs] == [{"cpu": 149}, {"cpu": 199}]
    # each rank stored its own shard of every chunk in its own folder
    assert {p.name for p in disk_path.iterdir()} == {"tp2-rank0", "tp2-rank1"}
    rank_files = [sorted(p.name for p in (disk_path / f"tp2-rank{r}").rglob("*.kvc")) for r in range(2)]
    assert rank_files[0] and len(rank_files[0]) == len(rank_files[1])
    assert set(rank_files[0]).isdisjoint(rank_files[1])  # the rank is in every key


def test_tp2_disk_hits_and_a_chunk_missing_on_one_rank(offload_case) -> None:
    """A fresh engine on the same disk folders loads from disk. Rank 1's files deleted:
    rank 0 loads its shards, yet every rank recomputes from the same position and the
    tokens stay exact. A one-rank engine never reads a rank's shards as whole chunks."""
    model_dir, disk_path, llm, _, tp1 = offload_case
    llm.engine.shutdown()  # the disk tiers lock their folders
    llm.engine.runner.connector.close()

    def fresh_engine() -> LLM:
        return LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=2,
            kv_offload=_offload_config(disk_path),
        )

    fresh = fresh_engine()
    try:
        (from_disk,) = fresh.generate([PROMPTS[3]], GREEDY)
        assert from_disk.token_ids == tp1[3]
        assert from_disk.metrics.tier_to_loaded_tokens == {"disk": 149}
    finally:
        fresh.engine.shutdown()
        fresh.engine.runner.connector.close()
    removed = list((disk_path / "tp2-rank1").rglob("*.kvc"))
    assert removed
    for path in removed:
        path.unlink()
    # three chunks of the 200-token prompt, then 100 new tokens: rank 0 loads its shards
    # of the three, rank 1 finds none, and the step computes (and would save) the new ones
    extended = _SHARED[:192] + random_prompt(100, seed=307)
    (expected,) = _token_ids(LLM(model_dir, dtype="float32", device="cpu").generate([extended], GREEDY))
    again = fresh_engine()
    try:
        (output,) = again.generate([extended], GREEDY)
        assert output.token_ids == expected
        assert again.engine.scheduler.stats.num_load_failures == 1
        # the ranks agreed: rank 0's loaded tokens were recomputed too
        assert output.metrics.num_external_cached_tokens == 0
        # and no rank saved KV computed over rank 1's missing shards: the chunks stored
        # since (by the recomputation) serve a hit of every token but the last, exactly
        again.flush_kv_offload()
        assert again.reset_prefix_cache()
        (hit,) = again.generate([extended], GREEDY)
        assert hit.token_ids == expected
        assert hit.metrics.num_external_cached_tokens == len(extended) - 1
    finally:
        again.engine.shutdown()
        again.engine.runner.connector.close()
    # a one-rank engine pointed at rank 0's folder finds none of its chunks
    tp1_llm = LLM(
        model_dir, dtype="float32", device="cpu", kv_offload=_offload_config(disk_path / "tp2-rank0")
    )
    try:
        (plain,) = tp1_llm.generate([PROMPTS[3]], GREEDY)
        assert plain.token_ids == tp1[3] and plain.metrics.num_external_cached_tokens == 0
    finally:
        tp1_llm.engine.runner.connector.close()


_FAULTY_RANK_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from engine import LLM, SamplingParams
    from engine.tensor_parallel import rank_runner

    # Runs in every process (spawn re-imports this main module): rank 1 fails any step
    # that prefills a prompt of 13 tokens, before its forward pass.
    _prepare = rank_runner.TensorParallelStageRunner._prepare

    def _faulty_prepare(self, plan):
        if self.group.rank == 1 and any(
            r.num_tokens == 13 and r.num_computed_tokens == 0 for r in plan.requests
        ):
            raise RuntimeError("injected fault on rank 1")
        return _prepare(self, plan)

    rank_runner.TensorParallelStageRunner._prepare = _faulty_prepare

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2)
        prompts = json.loads(sys.argv[2])
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        print(json.dumps([[o.finish_reason, o.token_ids] for o in outputs]), flush=True)
        llm.engine.shutdown()
    """
)


def test_a_step_failing_on_another_rank_ends_only_its_request(
    tiny_model_dir, subprocess_env, tmp_path
) -> None:
    """Rank 1 fails before its forward pass and says so in the agreement: every rank ends
    the step, the engine retries its requests in smaller groups, and only the request
    that fails alone ends with an error; the others get one rank's tokens."""
    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(20, seed=310), random_prompt(13, seed=311), random_prompt(30, seed=312)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    script = tmp_path / "faulty_rank.py"  # a file, not -c: the ranks re-import the main module
    script.write_text(_FAULTY_RANK_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(model_dir), json.dumps(prompts)],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    outputs = json.loads(result.stdout.splitlines()[-1])
    assert [reason for reason, _ in outputs] == ["length", "error", "length"]
    assert [outputs[0][1], outputs[2][1]] == [expected[0], expected[2]]
    assert "injected fault on rank 1" in result.stderr


_KILLABLE_SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2)
        print("pids", *llm.engine.pipeline.stage_pids, flush=True)
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7]], params)
        print("done", outputs[0].finish_reason, len(outputs[0].token_ids), flush=True)
        print("dead", llm.engine.device_error(), flush=True)
    """
)


def test_a_killed_rank_ends_the_requests_with_an_error(tiny_model_dir, subprocess_env) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", _KILLABLE_SCRIPT, str(tiny_model_dir("llama"))],
        env=subprocess_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("pids"), line + process.stderr.read()
        (rank_pid,) = (int(pid) for pid in line.split()[1:])
        time.sleep(1.0)  # the request is decoding
        os.kill(rank_pid, signal.SIGKILL)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    done = stdout.splitlines()
    assert done[0].startswith("done error"), stdout + stderr
    assert done[1] == f"dead tensor-parallel rank 1 (pid {rank_pid}) was killed by signal 9", stdout


def test_serve_with_two_ranks_answers_like_one_and_stops_them(tiny_model_dir) -> None:
    import httpx
    import psutil

    from tests.serving.server_process import ServeProcess

    model_dir = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (expected,) = LLM(model_dir, dtype="float32", device="cpu").generate(["the ranks say"], params)
    server = ServeProcess(model_dir, "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2")
    server.start()
    try:
        rank_pids = [child.pid for child in psutil.Process(server.process.pid).children()]
        assert rank_pids
        body = {"model": "tiny", "prompt": "the ranks say", "max_tokens": 12, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected.text
        server.stop()  # SIGTERM
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in rank_pids):
            assert time.monotonic() < deadline, "a rank outlived the server"
            time.sleep(0.1)
    finally:
        server.close()


def test_tp2_pp2_matches_hf_with_offload_hits_and_a_chunk_missing_on_one_process(
    tiny_model_dir, tmp_path
) -> None:
    """2 stages of 2 ranks, 4 processes: each stage's ranks share its layers, each rank
    sends its hidden states to the next stage's rank of its number. Tokens equal HF's with
    chunked prefill; every process stores its own shard of its stage's layers; a chunk
    missing on the last stage's rank 1 only is recomputed everywhere."""
    model_dir = tiny_model_dir("llama")
    expected = hf_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)
    disk_path = tmp_path / "disk"

    def engine() -> LLM:
        return LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            max_num_batched_tokens=64,
            kv_offload=_offload_config(disk_path),
        )

    llm = engine()
    try:
        assert len(llm.engine.pipeline.stage_pids) == 3
        assert _token_ids(llm.generate(PROMPTS, GREEDY)) == expected
        assert llm.stats.num_steps > sum(len(p) for p in PROMPTS) // 64  # prompts were cut into chunks
        llm.flush_kv_offload()
        assert llm.reset_prefix_cache()
        outputs = llm.generate(PROMPTS[3:5], GREEDY)
        assert _token_ids(outputs) == expected[3:5]
        assert [o.metrics.tier_to_loaded_tokens for o in outputs] == [{"cpu": 149}, {"cpu": 199}]
    finally:
        llm.engine.shutdown()
        llm.engine.runner.connector.close()
    folders = sorted(str(p.relative_to(disk_path)) for p in disk_path.glob("*/*"))
    assert folders == [f"pp2-stage{k}/tp2-rank{r}" for k in range(2) for r in range(2)]
    removed = list((disk_path / "pp2-stage1" / "tp2-rank1").rglob("*.kvc"))
    assert removed
    for path in removed:
        path.unlink()
    extended = _SHARED[:192] + random_prompt(100, seed=307)
    (reference,) = _token_ids(LLM(model_dir, dtype="float32", device="cpu").generate([extended], GREEDY))
    again = engine()
    try:
        (output,) = again.generate([extended], GREEDY)
        assert output.token_ids == reference
        assert again.engine.scheduler.stats.num_load_failures == 1
        assert output.metrics.num_external_cached_tokens == 0
        again.flush_kv_offload()
        assert again.reset_prefix_cache()
        (hit,) = again.generate([extended], GREEDY)
        assert hit.token_ids == reference
        assert hit.metrics.num_external_cached_tokens == len(extended) - 1
    finally:
        again.engine.shutdown()
        again.engine.runner.connector.close()


_FAILING_FORWARD_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from engine import LLM, SamplingParams
    from engine.tensor_parallel import comm

    # Runs in every process (spawn re-imports this main module): rank FAILING_RANK raises
    # at its second all-reduce of the prompts' prefill, inside the forward pass, while the
    # other rank waits in that collective.
    FAILING_RANK = int(sys.argv[3])
    _all_reduce = comm.TensorParallelGroup.all_reduce_
    _num_calls = [0]

    def _failing_all_reduce(self, tensor):
        if self.rank == FAILING_RANK and tensor.shape[0] > 1:
            _num_calls[0] += 1
            if _num_calls[0] == 2:
                raise RuntimeError(f"injected fault inside the forward pass on rank {self.rank}")
        return _all_reduce(self, tensor)

    comm.TensorParallelGroup.all_reduce_ = _failing_all_reduce

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(json.loads(sys.argv[2]), params)
        print(json.dumps([o.finish_reason for o in outputs]), flush=True)
        print("dead", llm.engine.device_error(), flush=True)
        llm.engine.shutdown()
    """
)


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_rank_failing_inside_its_forward_pass_ends_the_engine_naming_it(
    tiny_model_dir, subprocess_env, tmp_path, failing_rank
) -> None:
    """The failing rank records its error and exits (or, rank 0, stops the others); the
    peer waiting in the all-reduce fails at once instead of at the group's 600 s timeout,
    and the engine ends its requests naming the rank and its exception. The subprocess
    timeout bounds a hang, it times nothing."""
    prompts = [random_prompt(20, seed=330), random_prompt(13, seed=331)]
    script = tmp_path / "failing_forward.py"
    script.write_text(_FAILING_FORWARD_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir("llama")), json.dumps(prompts), str(failing_rank)],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    reasons, dead = result.stdout.splitlines()[-2:]
    assert json.loads(reasons) == ["error", "error"]
    assert dead.startswith(f"dead tensor-parallel rank {failing_rank} failed step "), dead
    assert dead.endswith(
        f"inside its forward pass: RuntimeError: injected fault inside the forward pass on rank {failing_rank}"
    ), dead
