"""Ranks that span hosts (engine.nodes, engine.pipeline.node, engine.pipeline.control),
with two "hosts" on one machine: two launches on loopback, as a user starts them on two
hosts (node 0 an `LLM(..., nnodes=2, node_rank=0)` program, node 1 `kvstash serve
--node-rank 1`), TP=2 × PP=2 as two nodes of 2 processes (gloo). Node 0's greedy
float32 tokens equal Hugging Face's and node 1 exits 0 once node 0's engine shut down;
node 1 without node 0 fails with a clear message; node 1 killed mid-run ends node 0's
requests with an error naming it. Bad flags are refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.config import EngineArgs
from tests.engine.hf_reference import hf_greedy, random_prompt

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [random_prompt(9, seed=340), random_prompt(70, seed=341), random_prompt(33, seed=342)]
NUM_NEW_TOKENS = 8
#: bounds a hang, not a speed: every launch here ends long before
HANG_TIMEOUT_S = 180

_NODE0_SCRIPT = textwrap.dedent(
    """
    import json
    import sys

    from engine import LLM, SamplingParams

    if __name__ == "__main__":
        model_dir, address, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
        llm = LLM(
            model_dir,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            max_num_batched_tokens=32,
            nnodes=2,
            node_rank=0,
            dist_init_addr=address,
            dist_init_timeout=120,
        )
        print("ready", *llm.engine.pipeline.stage_pids, flush=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
        print(json.dumps([[o.finish_reason, o.token_ids] for o in outputs]), flush=True)
        print("dead", llm.engine.device_error(), flush=True)
        llm.engine.shutdown()
    """
)


def _free_port_pair() -> int:
    """A port P with P and P + 1 free on loopback (the store and the control channel)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two neighbouring free ports")


def _node1(model_dir: Path, address: str, env: dict, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "engine.cli", "serve", str(model_dir), "--device", "cpu"]
    argv += ["--dtype", "float32", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    argv += ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", address, *extra]
    # a session of its own: killing it kills the "host"
    return subprocess.Popen(
        argv,
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _node0(script: Path, model_dir: Path, address: str, env: dict, max_tokens: int) -> subprocess.Popen:
    argv = [sys.executable, str(script), str(model_dir), address, json.dumps(PROMPTS), str(max_tokens)]
    return subprocess.Popen(
        argv, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"nnodes": 2}, "nnodes 2 needs dist_init_addr HOST:PORT"),
        (
            {"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:5"},
            r"node_rank must be in 0..1 \(nnodes 2\), got 2",
        ),
        ({"nnodes": 0}, "nnodes must be an integer >= 1, got 0"),
        ({"nnodes": 2, "dist_init_addr": "h"}, "dist_init_addr must be HOST:PORT"),
        ({"nnodes": 2, "dist_init_addr": "h:65535"}, "port must be in 1..65534"),
        (
            {"nnodes": 3, "dist_init_addr": "h:5", "tensor_parallel_size": 2, "pipeline_parallel_size": 2},
            r"nnodes 3 does not divide the 4 processes",
        ),
    ],
)
def test_bad_node_flags_are_refused(flags, message) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**flags).validate()


def test_two_nodes_on_loopback_match_hf_and_node_1_exits_with_node_0(
    tiny_model_dir, subprocess_env, tmp_path
) -> None:
    model_dir = tiny_model_dir("llama")
    expected = hf_greedy(model_dir, PROMPTS, NUM_NEW_TOKENS)
    script = tmp_path / "node0.py"  # a file, not -c: spawned processes re-import the main module
    script.write_text(_NODE0_SCRIPT)
    address = f"127.0.0.1:{_free_port_pair()}"
    node1 = _node1(model_dir, address, subprocess_env)  # first: it waits for node 0
    node0 = _node0(script, model_dir, address, subprocess_env, NUM_NEW_TOKENS)
    try:
        out0, err0 = node0.communicate(timeout=HANG_TIMEOUT_S)
        out1, err1 = node1.communicate(timeout=30)
    finally:
        _kill(node0)
        _kill(node1)
    assert node0.returncode == 0, err0
    lines = out0.splitlines()
    assert lines[0].startswith("ready") and len(lines[0].split()) == 2, (
        out0
    )  # one local process besides the engine's
    outputs = json.loads(lines[1])
    assert [reason for reason, _ in outputs] == ["length"] * len(PROMPTS), out0 + err0
    assert [tokens for _, tokens in outputs] == expected
    assert lines[2] == "dead None"
    assert node1.returncode == 0, err1
    assert "node 0's engine shut down" in err1


def test_node_1_without_node_0_fails_with_a_clear_message(tiny_model_dir, subprocess_env) -> None:
    address = f"127.0.0.1:{_free_port_pair()}"
    node1 = _node1(tiny_model_dir("llama"), address, subprocess_env, "--dist-init-timeout", "2")
    try:
        _, err = node1.communicate(timeout=HANG_TIMEOUT_S)
    finally:
        _kill(node1)
    assert node1.returncode == 1, err
    port = int(address.rsplit(":", 1)[1])
    assert f"node 1: no engine answered at 127.0.0.1:{port + 1}" in err
    assert "within 2 s" in err


def test_killing_node_1_mid_run_ends_node_0s_requests_with_an_error(
    tiny_model_dir, subprocess_env, tmp_path
) -> None:
    model_dir = tiny_model_dir("llama")
    script = tmp_path / "node0.py"
    script.write_text(_NODE0_SCRIPT)
    address = f"127.0.0.1:{_free_port_pair()}"
    node1 = _node1(model_dir, address, subprocess_env)
    node0 = _node0(script, model_dir, address, subprocess_env, 3000)
    try:
        line = node0.stdout.readline()
        assert line.startswith("ready"), line + node0.stderr.read()
        time.sleep(1.0)  # the requests are running
        os.killpg(node1.pid, signal.SIGKILL)  # the whole "host"
        out0, err0 = node0.communicate(timeout=HANG_TIMEOUT_S)
    finally:
        _kill(node0)
        _kill(node1)
    assert node0.returncode == 0, err0
    lines = out0.splitlines()
    outputs = json.loads(lines[0])
    assert [reason for reason, _ in outputs] == ["error"] * len(PROMPTS), out0
    assert lines[1].startswith("dead "), out0
    assert "node 1" in lines[1] or "on another node" in lines[1], lines[1]


def test_an_engine_core_of_node_1_is_refused() -> None:
    """Node 1 runs ranks only: `LLM(..., node_rank=1)` and the commands run it
    (engine.pipeline.node), never an engine."""
    from engine.engine_core import EngineCore

    with pytest.raises(ValueError, match="node_rank 1 runs its share of the ranks only"):
        EngineCore(
            "/nonexistent", EngineArgs(nnodes=2, node_rank=1, dist_init_addr="h:5", tensor_parallel_size=2)
        )


def test_a_collective_that_fails_to_start_is_a_collective_failure() -> None:
    """gloo raises when an op is started, not waited for, once a peer's connection is
    closed (a killed node): such an error is a consequence (CollectiveError), so the
    executor waits for the cause (the node's word) instead of reporting it as the first
    failure. CI once reported "rank 0 failed ... Connection closed by peer" instead of
    the killed node 1. Here a real gloo group refuses to start an op on a meta tensor."""
    import tempfile

    import torch
    import torch.distributed as dist

    from engine.pipeline.failure import CollectiveError, is_collective_failure, start_collective

    group = dist.ProcessGroupGloo(dist.FileStore(tempfile.mktemp(), 1), 0, 1)
    ones = torch.ones(2)
    start_collective(group.allreduce, [ones], dist.AllreduceOptions()).wait()  # a working op passes
    assert ones.tolist() == [1.0, 1.0]
    with pytest.raises(CollectiveError, match="meta") as raised:
        start_collective(group.allreduce, [torch.zeros(1, device="meta")], dist.AllreduceOptions())
    assert is_collective_failure(raised.value)
