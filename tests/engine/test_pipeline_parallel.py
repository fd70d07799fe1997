"""Pipeline parallelism (engine.pipeline): an engine of 2 stages, one process each
(gloo on CPU), gives the greedy float32 tokens of Hugging Face and of one stage for
every tiny arch, with chunked prefill, prefix caching, preemption and offload hits
(CPU and disk tiers, each stage storing its own layers); a load that fails on one
stage only is recomputed on every stage; a killed stage ends the engine's requests
with an error and its processes. Engines are shared per module: each stage process
imports torch, which takes seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from connector import OffloadConfig
from engine import LLM, SamplingParams
from engine.pipeline import split_layers
from tests.engine.hf_reference import hf_greedy, random_prompt

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
NUM_NEW_TOKENS = 12
_SHARED = random_prompt(300, seed=205)
#: 6 prompts of 1..300 tokens; the last shares 160 tokens (10 blocks) with the 300-token one
PROMPTS = [
    random_prompt(1, seed=200),
    random_prompt(9, seed=201),
    random_prompt(70, seed=202),
    random_prompt(150, seed=203),
    _SHARED,
    _SHARED[:160] + random_prompt(60, seed=206),
]
GREEDY = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
#: 40 blocks of 16 = 640 tokens for 6 requests of 856 tokens in all: some are preempted
NUM_BLOCKS = 40


def _token_ids(outputs) -> list[list[int]]:
    assert all(o.finish_reason == "length" for o in outputs), [o.finish_reason for o in outputs]
    return [o.token_ids for o in outputs]


def test_layers_split_into_contiguous_stages() -> None:
    layouts = split_layers(7, 3)
    assert [(s.first_layer, s.end_layer) for s in layouts] == [(0, 3), (3, 5), (5, 7)]
    assert layouts[0].is_first and layouts[-1].is_last and not layouts[1].is_last
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        split_layers(2, 3)


def test_every_stage_gets_as_many_cpu_tier_slots_as_a_whole_model_engine() -> None:
    """Stages of 3 and 2 layers: the CPU tier's bytes are shared by layers, so both hold the
    same number of chunks (before: half the bytes each, 1.5x the slots in the 2-layer stage)."""
    from engine.pipeline.layer_split import stage_offload_config

    config = OffloadConfig(cpu_bytes=10_000_000)
    per_layer_slot_bytes = 2 * 256 * 8 * 64 * 2  # K and V of 256 tokens, 8 KV heads of 64, bf16
    whole_model_slots = config.cpu_bytes // (5 * per_layer_slot_bytes)
    for layout in split_layers(5, 2):
        stage_bytes = stage_offload_config(config, layout).cpu_bytes
        assert stage_bytes // (layout.num_layers * per_layer_slot_bytes) == whole_model_slots


def test_bad_sizes_are_refused_before_any_process_starts(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        LLM(tiny_model_dir("llama"), device="cpu", pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        LLM(tiny_model_dir("llama"), device="cpu", pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="cpu_offload_gb is not supported"):
        LLM(tiny_model_dir("llama"), device="cpu", pipeline_parallel_size=2, cpu_offload_gb=1)
    with pytest.raises(ValueError, match="deterministic is not supported"):
        LLM(tiny_model_dir("llama"), device="cpu", pipeline_parallel_size=2, deterministic=True)


@pytest.mark.parametrize("command", ["serve", "generate", "bench"])
def test_the_commands_take_the_flag(command) -> None:
    from click.testing import CliRunner

    from engine.cli import main

    result = CliRunner().invoke(main, [command, "--help"])
    assert result.exit_code == 0 and "--pipeline-parallel-size" in result.output


@pytest.fixture(scope="module", params=ARCHS)
def pp_case(request, tiny_model_dir):
    """(model dir, HF greedy outputs, a PP=2 engine with chunked prefill and a KV pool
    small enough to preempt), once per arch."""
    model_dir = tiny_model_dir(request.param)
    expected = hf_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        pipeline_parallel_size=2,
        max_num_batched_tokens=64,
        num_gpu_blocks=NUM_BLOCKS,
        # chunk sizes from the budget alone, not from measured step times: the asserted
        # preemptions and prefix hits must not depend on how busy the machine is
        max_decode_gap_ms=0,
    )
    yield model_dir, expected, llm
    llm.engine.shutdown()


def test_pp2_matches_hf_with_chunked_prefill_preemption_and_prefix_caching(pp_case) -> None:
    _, expected, llm = pp_case
    stats_before = llm.engine.scheduler.stats.num_preemptions
    assert _token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    assert llm.engine.scheduler.stats.num_preemptions > stats_before
    # 850 prompt tokens at 64 per step: prompts were cut into chunks
    assert llm.stats.num_steps > sum(len(p) for p in PROMPTS) // 64
    # the same prompts again, one at a time: each hits its full blocks in the prefix cache
    for prompt, tokens in zip(PROMPTS[4:], expected[4:], strict=True):
        (output,) = llm.generate([prompt], GREEDY)
        assert output.token_ids == tokens
        assert output.metrics.num_local_cached_tokens == (len(prompt) - 1) // 16 * 16


def test_pp2_verifies_drafts_and_samples_seeded_like_one_stage(pp_case) -> None:
    """The last stage verifies speculative drafts (a replay proposer whose drafts are partly
    wrong) and keeps seeded requests' generators across steps."""
    from engine.spec_decode.replay import ReplayProposer

    model_dir, expected, llm = pp_case
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
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    one_stage = LLM(model_dir, dtype="float32", device="cpu").generate(PROMPTS[:4], seeded)
    assert [o.token_ids for o in llm.generate(PROMPTS[:4], seeded)] == [o.token_ids for o in one_stage]


def test_two_micro_batches_in_flight_through_the_stages(pp_case) -> None:
    """`submit` of a second plan before the first is collected (what a batch queue will
    do): stage 0 runs both, the last stage answers both in order, tokens exact."""
    model_dir, _, llm = pp_case
    prompts = [random_prompt(40, seed=220), random_prompt(25, seed=221)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    engine, pipeline = llm.engine, llm.engine.pipeline
    requests = [engine.add_request(f"micro-{i}", p, params) for i, p in enumerate(prompts)]
    plans = [engine.scheduler.schedule(only={request}) for request in requests]
    assert [plan.requests for plan in plans] == [[requests[0]], [requests[1]]]
    in_flight = [pipeline.submit(plan) for plan in plans]
    for plan, step in zip(plans, in_flight, strict=True):
        output = pipeline.collect(step)
        engine.scheduler.update_from_output(
            plan,
            output.request_id_to_token,
            output.load_failures,
            request_id_to_accepted_draft_ids=output.request_id_to_accepted_draft_ids,
        )
    engine.scheduler.step_requests = []
    for request in requests:
        engine.requests.pop(request.request_id)
    assert [r.output_token_ids for r in requests] == expected
    assert all(r.is_finished for r in requests)


def _offload_config(disk_path: Path) -> OffloadConfig:
    return OffloadConfig(chunk_size=64, cpu_bytes=16 << 20, disk_path=str(disk_path), disk_bytes=64 << 20)


@pytest.fixture(scope="module")
def offload_case(tiny_model_dir, tmp_path_factory):
    """A PP=2 engine with a CPU and a disk tier that stored PROMPTS' KV, its outputs,
    and PP=1's outputs of the same prompts."""
    model_dir = tiny_model_dir("llama")
    disk_path = tmp_path_factory.mktemp("pp-offload") / "disk"
    pp1 = _token_ids(LLM(model_dir, dtype="float32", device="cpu").generate(PROMPTS, GREEDY))
    llm = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        pipeline_parallel_size=2,
        kv_offload=_offload_config(disk_path),
    )
    first = _token_ids(llm.generate(PROMPTS, GREEDY))
    llm.flush_kv_offload()
    yield model_dir, disk_path, llm, first, pp1
    llm.engine.shutdown()


def test_pp2_offload_hits_from_cpu_tier_match_pp1(offload_case) -> None:
    _, _, llm, first, pp1 = offload_case
    assert first == pp1
    assert llm.reset_prefix_cache()
    outputs = llm.generate(PROMPTS[3:5], GREEDY)
    assert _token_ids(outputs) == pp1[3:5]
    # 150 and 300 tokens: their whole chunks of 64 and the partial chunk, all but the last token
    assert [o.metrics.tier_to_loaded_tokens for o in outputs] == [{"cpu": 149}, {"cpu": 299}]
    # each stage stored its own layers in its own folder
    assert {p.name for p in offload_case[1].iterdir()} == {"pp2-stage0", "pp2-stage1"}


def test_pp2_disk_hits_and_a_chunk_missing_on_one_stage(offload_case) -> None:
    """A fresh engine on the same disk folders loads from disk. A chunk deleted from the
    last stage's folder only is a load failure there: stage 0 loaded it, yet every stage
    recomputes from the same position and the tokens stay exact."""
    model_dir, disk_path, llm, _, pp1 = offload_case
    llm.engine.shutdown()  # the disk tiers lock their folders
    llm.engine.runner.connector.close()
    stage1_files = sorted((disk_path / "pp2-stage1").rglob("*.kvc"))
    assert stage1_files
    fresh = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        pipeline_parallel_size=2,
        kv_offload=_offload_config(disk_path),
    )
    try:
        (from_disk,) = fresh.generate([PROMPTS[3]], GREEDY)
        assert from_disk.token_ids == pp1[3]
        assert from_disk.metrics.tier_to_loaded_tokens == {"disk": 149}
        fresh.engine.shutdown()
        fresh.engine.runner.connector.close()
        for path in (disk_path / "pp2-stage1").rglob("*.kvc"):
            path.unlink()
        again = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            pipeline_parallel_size=2,
            kv_offload=_offload_config(disk_path),
        )
        try:
            (output,) = again.generate([PROMPTS[4]], GREEDY)
            assert output.token_ids == pp1[4]
            assert again.engine.scheduler.stats.num_load_failures == 1
            # the stages agreed: stage 0's loaded tokens were recomputed too
            assert output.metrics.num_external_cached_tokens == 0
        finally:
            again.engine.shutdown()
            again.engine.runner.connector.close()
    finally:
        fresh.engine.shutdown()
        # a one-stage engine pointed at stage 0's folder finds none of its chunks
        pp1_llm = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            kv_offload=_offload_config(disk_path / "pp2-stage0"),
        )
        (plain,) = pp1_llm.generate([PROMPTS[3]], GREEDY)
        assert plain.token_ids == pp1[3] and plain.metrics.num_external_cached_tokens == 0
        pp1_llm.engine.runner.connector.close()


def test_pp2_flushes_every_stages_writes_to_redis_and_hits_them(tiny_model_dir, redis_server) -> None:
    """A later stage builds its worker side alone (its scheduler side is the first
    stage's) and flushes through it: after ``flush_kv_offload`` every stage's chunks are
    in Redis (each under its own layer-range namespace), and a fresh engine of two
    stages with no CPU tier loads them from Redis, with PP=1's tokens."""
    import redis

    redis_server.flushall()
    model_dir = tiny_model_dir("llama")
    pp1 = _token_ids(LLM(model_dir, dtype="float32", device="cpu").generate(PROMPTS[3:5], GREEDY))
    config = OffloadConfig(chunk_size=64, cpu_bytes=16 << 20, remote_url=redis_server.url)
    llm = LLM(model_dir, dtype="float32", device="cpu", pipeline_parallel_size=2, kv_offload=config)
    try:
        assert _token_ids(llm.generate(PROMPTS[3:5], GREEDY)) == pp1
        llm.flush_kv_offload()
        stage0_namespace = "kvstash:" + llm.engine.offload_cache_engine.token_db.namespace
        with redis.Redis(port=redis_server.port) as client:
            # chunk keys only: an engine of an earlier test may still measure this Redis
            keys = [key.decode() for key in client.scan_iter("*") if not key.endswith(b"kvstash-tier-probe")]
    finally:
        llm.engine.shutdown()
        llm.engine.runner.connector.close()
    # 150 and 300 tokens: 2 + 4 whole chunks of 64 and 2 partial ones, per stage
    # (counted per namespace: another test's engine not collected yet may write its own)
    namespace_to_num_keys = Counter(key.rsplit(":", 1)[0] for key in keys)
    assert namespace_to_num_keys.pop(stage0_namespace) == 8, namespace_to_num_keys
    assert 8 in namespace_to_num_keys.values(), namespace_to_num_keys  # the last stage's
    fresh = LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        pipeline_parallel_size=2,
        kv_offload=OffloadConfig(chunk_size=64, cpu_bytes=0, remote_url=redis_server.url),
    )
    try:
        outputs = fresh.generate(PROMPTS[3:5], GREEDY)
        assert _token_ids(outputs) == pp1
        assert [o.metrics.tier_to_loaded_tokens for o in outputs] == [{"redis": 149}, {"redis": 299}]
    finally:
        fresh.engine.shutdown()
        fresh.engine.runner.connector.close()


def test_serve_with_two_stages_answers_like_one_stage_and_stops_them(tiny_model_dir) -> None:
    import httpx

    from tests.serving.server_process import ServeProcess

    model_dir = tiny_model_dir("llama")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    (expected,) = LLM(model_dir, dtype="float32", device="cpu").generate(["the pipeline says"], params)
    server = ServeProcess(model_dir, "--device", "cpu", "--dtype", "float32", "--pipeline-parallel-size", "2")
    server.start()
    try:
        stage_pids = [child.pid for child in psutil.Process(server.process.pid).children()]
        assert stage_pids
        body = {"model": "tiny", "prompt": "the pipeline says", "max_tokens": 12, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected.text
        server.stop()  # SIGTERM
        assert _wait_gone(stage_pids, 10) == []
    finally:
        server.close()


_KILLABLE_SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", device="cpu", pipeline_parallel_size=2)
        print("pids", *llm.engine.pipeline.stage_pids, flush=True)
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([[5, 6, 7]], params)
        print("done", outputs[0].finish_reason, len(outputs[0].token_ids), flush=True)
        print("dead", llm.engine.device_error(), flush=True)
    """
)


_FAULTY_STAGE_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from engine import LLM, SamplingParams
    from engine.pipeline import stage_runner

    # Runs in every process (spawn re-imports this main module): the last stage fails
    # any step that prefills a prompt of 13 tokens, before it receives its input.
    _run_model = stage_runner.StageRunner._run_model

    def _faulty_run_model(self, plan, host):
        if self.layout.is_last and any(
            r.num_tokens == 13 and r.num_computed_tokens == 0 for r in plan.requests
        ):
            raise RuntimeError("injected fault on the last stage")
        return _run_model(self, plan, host)

    stage_runner.StageRunner._run_model = _faulty_run_model

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", device="cpu", pipeline_parallel_size=2)
        prompts = json.loads(sys.argv[2])
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        print(json.dumps([[o.finish_reason, o.token_ids] for o in outputs]), flush=True)
        llm.engine.shutdown()
    """
)


def test_a_step_failing_on_a_later_stage_ends_only_its_request(
    tiny_model_dir, subprocess_env, tmp_path
) -> None:
    """The failing stage sends no hidden states and every stage ends the step; the
    engine retries the step's requests in smaller groups: only the request that fails
    alone ends with an error, the others get the tokens of one stage."""
    import json

    model_dir = tiny_model_dir("llama")
    prompts = [random_prompt(20, seed=210), random_prompt(13, seed=211), random_prompt(30, seed=212)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model_dir, dtype="float32", device="cpu").generate(prompts, params)]
    # a file, not -c: the stage processes re-import the main module from its path
    script = tmp_path / "faulty_stage.py"
    script.write_text(_FAULTY_STAGE_SCRIPT)
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
    assert "injected fault on the last stage" in result.stderr


def _start(script: str, model_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, list[int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(model_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()
    assert line.startswith("pids"), line + process.stderr.read()
    return process, [int(pid) for pid in line.split()[1:]]


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def test_a_killed_stage_ends_the_requests_with_an_error_and_the_engine_exits(
    tiny_model_dir, subprocess_env
) -> None:
    process, (stage_pid,) = _start(_KILLABLE_SCRIPT, tiny_model_dir("llama"), subprocess_env)
    try:
        time.sleep(1.0)  # the request is decoding
        os.kill(stage_pid, signal.SIGKILL)
        # the bound: error reported and every process gone within 10 s
        stdout, stderr = process.communicate(timeout=10)
    finally:
        process.kill()
    assert process.returncode == 0, stderr
    done = stdout.splitlines()
    assert done[0].startswith("done error"), stdout + stderr
    assert done[1] == f"dead pipeline stage 1 (pid {stage_pid}) was killed by signal 9", stdout


def test_sigterm_to_the_engine_process_stops_every_stage(tiny_model_dir, subprocess_env) -> None:
    process, stage_pids = _start(_KILLABLE_SCRIPT, tiny_model_dir("llama"), subprocess_env)
    try:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        assert _wait_gone(stage_pids, 10) == []
    finally:
        process.kill()


@pytest.mark.gpu
def test_pp2_on_one_cuda_device_matches_pp1(tiny_model_dir) -> None:
    """Both stages on the engine's GPU (gloo through host memory when they share it, NCCL
    when the host has a GPU per stage): the CUDA path end to end, offload included."""
    import torch

    model_dir = tiny_model_dir("qwen3")
    prompts = PROMPTS + [random_prompt(600, seed=207)]
    # no start-up warm-up (a pipeline runs none): the test stays short
    kwargs = {"dtype": "float32", "device": "cuda", "max_num_batched_tokens": 64, "warmup": False}
    pp1 = _token_ids(LLM(model_dir, **kwargs).generate(prompts, GREEDY))
    config = OffloadConfig(chunk_size=64, cpu_bytes=64 << 20)
    llm = LLM(model_dir, pipeline_parallel_size=2, kv_offload=config, **kwargs)
    try:
        expected_backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
        assert llm.engine.pipeline.backend == expected_backend
        assert _token_ids(llm.generate(prompts, GREEDY)) == pp1
        # the stages replay CUDA graphs (the first stage's runner is in this process)
        step_kinds = llm.engine.pipeline.runner.step_kinds
        assert step_kinds["decode_graph"] > 0 and llm.engine.stats.num_step_errors == 0, step_kinds
        llm.flush_kv_offload()
        assert llm.reset_prefix_cache()
        outputs = llm.generate(prompts[3:], GREEDY)
        assert _token_ids(outputs) == pp1[3:]
        # every prompt token but the last came from the CPU tier or the GPU prefix cache
        hits = [o.metrics.num_external_cached_tokens + o.metrics.num_local_cached_tokens for o in outputs]
        assert hits == [len(p) - 1 for p in prompts[3:]]
        assert all(o.metrics.num_external_cached_tokens > 0 for o in outputs)
    finally:
        llm.engine.shutdown()
