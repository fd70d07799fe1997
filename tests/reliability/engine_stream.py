"""Drive an engine with offload on through a stream of requests and score it against a
no-offload reference run (the reliability tests' workload).

Every request is greedy on a tiny float32 model, so its token ids must equal the
reference exactly whatever a tier does. A :class:`StreamTally` adds up, over the
phases of one scenario, how many requests ran, failed and differed, and how many
tokens came from the external tiers.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from engine import LLM, SamplingParams
from engine.request import RequestOutput

#: tokens per chunk in every reliability scenario (small, so a prompt spans several chunks)
CHUNK_SIZE = 32
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
#: requests handed to ``LLM.generate`` together (batched in the engine's steps)
BATCH_SIZE = 3
#: longest wait for hits to come back once a failed tier is healthy again
RESUME_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


def make_prompts(num_prompts: int, seed: int, min_tokens: int = 70, max_tokens: int = 140) -> list[list[int]]:
    """Random token-id prompts of ``min_tokens..max_tokens`` tokens (the tiny vocab is 512)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(3, 500) for _ in range(rng.randint(min_tokens, max_tokens))]
        for _ in range(num_prompts)
    ]


def new_llm(model_dir, kv_offload=None, dtype: str = "float32") -> LLM:
    """An engine on CPU; prefix caching off so every repeat goes to the offload tiers."""
    return LLM(str(model_dir), dtype=dtype, device="cpu", enable_prefix_caching=False, kv_offload=kv_offload)


def tiers_of(llm: LLM):
    """The connector's :class:`~connector.tiers.TierManager`."""
    return llm.engine.offload_cache_engine.tiers


def cache_engine_of(llm: LLM):
    return llm.engine.offload_cache_engine


def tier_errors(llm: LLM, tier_name: str) -> int:
    """Failed calls the connector counted for one tier (read from its health record, no I/O)."""
    return sum(h.counts["errors"] for h in tiers_of(llm).health.values() if h.name == tier_name)


class Reference:
    """Outputs of a no-offload engine of the same model and dtype, computed once per prompt."""

    def __init__(self, model_dir, dtype: str = "float32") -> None:
        self.llm = new_llm(model_dir, dtype=dtype)
        self._prompt_to_output: dict[tuple[int, ...], RequestOutput] = {}

    def outputs(self, prompts: Sequence[Sequence[int]]) -> list[RequestOutput]:
        missing = [list(p) for p in prompts if tuple(p) not in self._prompt_to_output]
        if missing:
            for prompt, output in zip(missing, self.llm.generate(missing, PARAMS), strict=True):
                self._prompt_to_output[tuple(prompt)] = output
        return [self._prompt_to_output[tuple(p)] for p in prompts]

    def tokens(self, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [output.token_ids for output in self.outputs(prompts)]


@dataclass
class StreamTally:
    """Totals over every request of one scenario."""

    num_requests: int = 0
    num_failed: int = 0
    num_differing_requests: int = 0
    num_tokens_compared: int = 0
    num_tokens_differing: int = 0
    num_external_hit_tokens: int = 0

    def run(self, llm: LLM, prompts: Sequence[Sequence[int]], reference: Reference) -> list[int]:
        """Serve ``prompts`` in batches of ``BATCH_SIZE``, compare with the reference and
        return each request's external hit tokens (-1 for a failed request)."""
        expected = reference.tokens(prompts)
        hits: list[int] = []
        for start in range(0, len(prompts), BATCH_SIZE):
            batch = [list(p) for p in prompts[start : start + BATCH_SIZE]]
            self.num_requests += len(batch)
            try:
                outputs = llm.generate(batch, PARAMS)
            except Exception:
                log.exception("a batch of %d requests failed", len(batch))
                self.num_failed += len(batch)
                hits += [-1] * len(batch)
                continue
            for output, want in zip(outputs, expected[start : start + BATCH_SIZE], strict=True):
                got = output.token_ids
                differing = sum(a != b for a, b in zip(got, want, strict=False)) + abs(len(got) - len(want))
                self.num_tokens_compared += len(want)
                self.num_tokens_differing += differing
                self.num_differing_requests += differing > 0
                if output.finish_reason != "length":
                    self.num_failed += 1
                hits.append(output.metrics.num_external_cached_tokens)
                self.num_external_hit_tokens += output.metrics.num_external_cached_tokens
        return hits

    def assert_clean(self) -> None:
        assert self.num_failed == 0, f"{self.num_failed} of {self.num_requests} requests failed"
        assert self.num_tokens_differing == 0, (
            f"{self.num_tokens_differing} tokens in {self.num_differing_requests} requests differ from the reference"
        )


def full_hits(prompts: Sequence[Sequence[int]]) -> list[int]:
    """External hit tokens when every prompt is wholly in the store (the last token is always computed)."""
    return [len(p) - 1 for p in prompts]


def incident_logs(caplog, tier_name: str) -> tuple[int, int]:
    """(number of "tier X failing" warnings, number of "tier X recovered" lines) captured so far."""
    failing = recovered = 0
    for record in caplog.records:
        if record.name != "connector.tiers":
            continue
        message = record.getMessage()
        failing += message.startswith(f"tier {tier_name} failing")
        recovered += message.startswith(f"tier {tier_name} recovered")
    return failing, recovered


def warnings_other_than_incidents(caplog) -> list[str]:
    """WARNING-or-worse lines that are not the tiers' once-per-incident lines."""
    return [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and not (r.name == "connector.tiers" and " failing (" in r.getMessage())
    ]


def run_until_full_hits(
    tally: StreamTally,
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    reference: Reference,
    expected_hits: list[int] | None = None,
) -> int:
    """Serve ``prompts`` round after round (write-through flushed after each) until every
    request hits as much as a healthy store allows (``expected_hits``, default
    :func:`full_hits`); returns the number of rounds that took. Fails when hits have
    not resumed within ``RESUME_TIMEOUT_S`` (a client may wait out a reconnect backoff)."""
    expected = full_hits(prompts) if expected_hits is None else expected_hits
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    num_rounds = 0
    while True:
        num_rounds += 1
        hits = tally.run(llm, prompts, reference)
        tiers_of(llm).flush()
        if hits == expected:
            return num_rounds
        if time.monotonic() > deadline:
            raise AssertionError(
                f"hits did not resume within {RESUME_TIMEOUT_S} s ({num_rounds} rounds): "
                f"last external hits {hits}, want {expected}"
            )
        time.sleep(0.25)
