"""On CUDA: a real device-side assert in a step (an out-of-bounds gather for a marked
request) is a sticky error. The engine must still end that step's requests and raise
`EngineStepError`, and `EngineCore.device_error()` must then report the device broken,
which makes `kvstash serve` stop its engine (503) instead of stepping on.

A sticky error ruins the process's CUDA context, so the engine runs in a child process.
Needs only torch and the engine (no serving stack)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.serving.server_process import REPO_ROOT, repo_env

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from engine import EngineArgs, EngineCore, SamplingParams
    from engine.engine_core import EngineStepError

    core = EngineCore(sys.argv[1], EngineArgs(num_gpu_blocks=64, enforce_eager=True))
    run_model = core.runner._run_model

    def run_model_with_device_assert(plan, host):
        if any(r.request_id == "marked" for r in plan.requests):
            out_of_bounds = torch.tensor([1 << 20], device=core.device)
            torch.zeros(4, device=core.device)[out_of_bounds]
            torch.cuda.synchronize(core.device)
        return run_model(plan, host)

    core.runner._run_model = run_model_with_device_assert
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    print("BEFORE", core.device_error(), flush=True)
    core.add_request("healthy", [5, 6, 7, 8], params)
    while core.has_unfinished_requests():
        core.step()
    print("HEALTHY_DONE", flush=True)
    core.add_request("marked", [9, 10, 11], params)
    try:
        while core.has_unfinished_requests():
            core.step()
    except EngineStepError as error:
        print("ENDED", sorted(o.request_id for o in error.outputs), flush=True)
    print("LEFT", sorted(core.requests), flush=True)
    print("DEVICE_ERROR", core.device_error() is not None, flush=True)
    """
)


@pytest.mark.gpu
def test_sticky_device_error_ends_the_step_and_is_reported(serving_model_dir) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(serving_model_dir)],
        cwd=REPO_ROOT,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = result.stdout
    assert "BEFORE None" in out, out + result.stderr[-3000:]
    assert "HEALTHY_DONE" in out, out + result.stderr[-3000:]
    assert "ENDED ['marked']" in out, out + result.stderr[-3000:]
    assert "LEFT []" in out, out
    assert "DEVICE_ERROR True" in out, out
