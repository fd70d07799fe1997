"""Fault injection for the step-failure tests.

No real input reliably crashes an engine step, so the tests make the model runner's
forward pass raise for any step whose batch holds a marked request (a prompt that starts
with `POISON_PREFIX`), the way a request-scoped bug, a kernel error on one input or an
out-of-memory fails a real step: after the connector bound the step's loads and saves,
before the forward pass wrote anything.

In-process: `StepFault(after_tokens).install(engine_core, monkeypatch)`. For a real
server process: `python -m tests.serving.step_faults serve MODEL ...` is the `kvstash`
CLI with every `ModelRunner` patched (`KVSTASH_TEST_FAULT_AFTER_TOKENS` sets
`after_tokens`, `KVSTASH_TEST_FAULT_EVERY_STEP=1` fails every step).
"""

from __future__ import annotations

import os

#: a prompt starting with these token ids fails every step it is scheduled in
POISON_PREFIX = [7, 7, 7, 7, 7, 7]
#: the message of the injected exception (the server log must show it, no client may)
FAULT_MESSAGE = "injected step fault"


def is_poisoned(request) -> bool:
    return list(request.prompt_token_ids[: len(POISON_PREFIX)]) == POISON_PREFIX


class StepFault:
    """Raises RuntimeError(FAULT_MESSAGE) from `ModelRunner._run_model` for a step that
    holds a poisoned request with at least `after_tokens` output tokens (0: its first
    step), or for every step when `every_step`. `failed_step_request_ids` records the
    request ids of each step it failed."""

    def __init__(self, after_tokens: int = 0, every_step: bool = False) -> None:
        self.after_tokens = after_tokens
        self.every_step = every_step
        self.failed_step_request_ids: list[set[str]] = []

    def should_fail(self, plan) -> bool:
        return self.every_step or any(
            is_poisoned(r) and len(r.output_token_ids) >= self.after_tokens for r in plan.requests
        )

    def wrap(self, run_model):
        """`run_model(plan, host)` -> the same, raising for the steps this fault picks."""

        def run_model_with_fault(plan, host):
            if self.should_fail(plan):
                self.failed_step_request_ids.append({r.request_id for r in plan.requests})
                raise RuntimeError(FAULT_MESSAGE)
            return run_model(plan, host)

        return run_model_with_fault

    def install(self, engine_core, monkeypatch) -> StepFault:
        runner = engine_core.runner
        monkeypatch.setattr(runner, "_run_model", self.wrap(runner._run_model))
        return self


def _patch_every_runner() -> None:
    from engine.model_runner import ModelRunner

    fault = StepFault(
        after_tokens=int(os.environ.get("KVSTASH_TEST_FAULT_AFTER_TOKENS", "0")),
        every_step=os.environ.get("KVSTASH_TEST_FAULT_EVERY_STEP") == "1",
    )
    unpatched = ModelRunner._run_model

    def run_model(self, plan, host):
        return fault.wrap(lambda p, h: unpatched(self, p, h))(plan, host)

    ModelRunner._run_model = run_model


if __name__ == "__main__":
    _patch_every_runner()
    from engine.cli import main

    main(prog_name="kvstash")
