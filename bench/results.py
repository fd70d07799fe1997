"""The bench's data: what the users ask (`Workload`), one request's figures (`Turn`,
`WarmupTurn`), one round's physical bound (`RoundBound`) and a whole run's result
(`BenchResult`). Plain dataclasses: the workload, runner and report modules all read
them, and this module imports none of those."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

#: engine KV pool = this many users' longest conversation: the pool cannot keep two users,
#: so the engine's own prefix cache loses a user's context before their next round
POOL_USERS = 1.0


@dataclass(frozen=True)
class Workload:
    """What the users ask; the same for the off and on runs."""

    num_users: int = 4
    context_len: int = 1024
    num_rounds: int = 3
    question_len: int = 32
    answer_len: int = 16
    system_prompt_len: int = 0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("num_users", "context_len", "num_rounds", "question_len", "answer_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system_prompt_len < 0:
            raise ValueError(f"system_prompt_len must be >= 0, got {self.system_prompt_len}")

    @property
    def max_prompt_len(self) -> int:
        """Tokens of the last round's prompt."""
        return self.prompt_len(self.num_rounds - 1)

    def prompt_len(self, round_index: int) -> int:
        """Tokens of round `round_index`'s prompt (0-based)."""
        return (
            self.system_prompt_len
            + self.context_len
            + (round_index + 1) * self.question_len
            + round_index * self.answer_len
        )

    def default_num_gpu_blocks(self, block_size: int) -> int:
        blocks_per_user = math.ceil((self.max_prompt_len + self.answer_len) / block_size)
        return math.ceil(POOL_USERS * blocks_per_user)


@dataclass
class Turn:
    """One request's figures."""

    user: int
    round: int
    num_prompt_tokens: int
    ttft_s: float
    #: seconds from submission to the last output token (TTFT + the decode steps)
    e2e_s: float
    num_gpu_hit_tokens: int
    num_external_hit_tokens: int
    num_loaded_tokens: int
    #: tokens the model ran a forward pass on for this request (prefill + decode)
    num_computed_tokens: int
    output_token_ids: list[int]
    #: blake2b of the prompt's token ids (bench.json shows warm-up prompts are not among them)
    prompt_digest: str = ""
    #: loaded tokens per tier they came from ("cpu", "disk", "redis", "grpc")
    tier_to_loaded_tokens: dict[str, int] = field(default_factory=dict)
    #: tokens a load-or-recompute planner chose to recompute (None: no planner in this engine)
    num_planned_recompute_tokens: int | None = None

    @property
    def decode_step_s(self) -> float | None:
        """Mean seconds per decode step after the first token (None with one output token)."""
        num_steps = len(self.output_token_ids) - 1
        return (self.e2e_s - self.ttft_s) / num_steps if num_steps > 0 else None


@dataclass
class WarmupTurn:
    """What one warm-up request did on one engine (bench.json shows both engines' lists)."""

    step: str
    num_prompt_tokens: int
    #: blake2b of the prompt's token ids: equal lists mean equal warm-up prompts
    prompt_digest: str
    ttft_s: float
    num_computed_tokens: int
    num_external_hit_tokens: int
    tier_to_loaded_tokens: dict[str, int]
    #: the planner's choice for this prompt (None without offload): tokens it recomputes
    num_planned_recompute_tokens: int | None = None


@dataclass
class RoundBound:
    """The physical bound of one round's mean hit: its KV bytes at the host->device rate
    measured in this run, plus one decode step (the least compute a hit leaves)."""

    round: int
    hit_bytes: float
    #: seconds to copy `hit_bytes` (pinned host->device on CUDA, a host memcpy on CPU)
    copy_s: float
    #: median seconds per decode step of the round's offload-off requests (None: no decode step)
    decode_step_s: float | None

    @property
    def bound_s(self) -> float | None:
        if self.hit_bytes <= 0:
            return None
        return self.copy_s + (self.decode_step_s or 0.0)


@dataclass
class BenchResult:
    workload: Workload
    model: str
    engine_args: dict[str, Any]
    offload: dict[str, Any]
    turns_off: list[Turn]
    turns_on: list[Turn]
    wall_s_off: float
    wall_s_on: float
    warmup_off: list[WarmupTurn] = field(default_factory=list)
    warmup_on: list[WarmupTurn] = field(default_factory=list)
    bounds: list[RoundBound] = field(default_factory=list)
    device: str = "cpu"
    device_name: str = ""
    dtype: str = "float32"
    kv_bytes_per_token: int = 0
    #: "pinned host->device copy" or "host memcpy": what the bound's rate measured
    copy_kind: str = ""
    preset: dict[str, Any] | None = None
    #: GPU bytes still allocated after the first engine was released (None on CPU)
    gpu_bytes_between_runs: int | None = None
    #: most GPU bytes allocated at once during each run ({"off": None, "on": None} on CPU)
    gpu_peak_bytes: dict[str, int | None] = field(default_factory=dict)
    #: the process's peak resident host memory (Linux ru_maxrss), pinned CPU tier included
    host_peak_rss_bytes: int | None = None

    @property
    def outputs_identical(self) -> bool:
        return [t.output_token_ids for t in self.turns_off] == [t.output_token_ids for t in self.turns_on]

    @property
    def outputs_must_match(self) -> bool:
        """float32 is the exactness rule's dtype (docs/architecture.md, Engine); in bf16/fp16 the chunked
        prefill of the off run and the loaded prefix of the on run sum in different orders."""
        return self.dtype == "float32"
