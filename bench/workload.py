"""The bench's workload on one engine: the users' conversations (random token ids), the
untimed warm-up both engines run first, and the timed rounds, one request at a time.

Workload: `num_users` users, each with a long context of their own (random token ids,
after an optional shared system prompt), ask `num_rounds` questions in turn. Each
round's prompt is the previous prompt + the previous answer + a new question, so every
round after the first repeats a long prefix."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.model_facts import model_config
from bench.results import Turn, WarmupTurn, Workload


@dataclass(frozen=True)
class WarmupStep:
    """One untimed request of the warm-up, the same for both engines. Before it, the
    engine flushes its offload writes and forgets its GPU prefix cache when `reset`,
    and also drops its CPU tier's chunks when `drop_cpu_tier` (so the offload engine
    loads from the disk tier; the other engine recomputes, as it does for every load)."""

    name: str
    prompt: list[int]
    reset: bool = False
    drop_cpu_tier: bool = False


@dataclass(frozen=True)
class Conversations:
    """Token ids of the workload: `contexts[u]` (system prompt included),
    `questions[u][r]`, and the warm-up's requests, which share no prefix with them."""

    contexts: list[list[int]]
    questions: list[list[list[int]]]
    warmup: list[WarmupStep]


def make_conversations(workload: Workload, token_ids: list[int], chunk_size: int = 256) -> Conversations:
    """Random token ids drawn from `token_ids` (the vocabulary minus special tokens);
    `chunk_size` is the offload run's (the warm-up's disk-tier load reads one chunk)."""
    rng = random.Random(workload.seed)

    def draw(n: int) -> list[int]:
        return [rng.choice(token_ids) for _ in range(n)]

    system = draw(workload.system_prompt_len)
    contexts = [system + draw(workload.context_len) for _ in range(workload.num_users)]
    questions = [
        [draw(workload.question_len) for _ in range(workload.num_rounds)] for _ in range(workload.num_users)
    ]
    return Conversations(contexts, questions, warmup_steps(workload, draw, chunk_size))


def warmup_steps(workload: Workload, draw, chunk_size: int) -> list[WarmupStep]:
    """A warm-up user's conversation with the workload's prompt lengths (its own tokens,
    no shared system prompt, answers drawn rather than generated, so both engines get
    the very same prompts whatever they output):

    1. each round's prompt, the later ones after a reset: round 1 prefills its length
       (and with offload saves it); later rounds recompute their length (off) or load
       the history from the CPU tier and prefill the rest over it (on); all decode;
    2. the last prompt with another question on a warm GPU cache: a prefill over a
       GPU-cached prefix (the kernels a loaded prefix uses, for the off engine too);
    3. round 1's first chunk + 1 token after dropping the CPU tier: the disk tier's
       load path (on), a short recompute (off). Its cost does not depend on the length
       (no kernel of its own), so one chunk keeps the warm-up short on a CPU."""
    history = draw(workload.system_prompt_len + workload.context_len)
    steps = []
    for round_index in range(workload.num_rounds):
        prompt = history + draw(workload.question_len)
        steps.append(WarmupStep(f"round {round_index + 1}", prompt, reset=round_index > 0))
        history = prompt + draw(workload.answer_len)
    # The last prompt with another question: same length (the KV pool holds it), and
    # everything before the question is in the GPU prefix cache.
    last_prompt = steps[-1].prompt
    steps.append(
        WarmupStep("GPU prefix hit", last_prompt[: -workload.question_len] + draw(workload.question_len))
    )
    first_prompt = steps[0].prompt
    disk_prompt = first_prompt[: chunk_size + 1] if len(first_prompt) > chunk_size + 1 else first_prompt
    steps.append(WarmupStep("disk tier", disk_prompt, reset=True, drop_cpu_tier=True))
    return steps


def _run_one(llm, prompt: list[int], params) -> tuple[Any, float, int]:
    """-> (output, seconds to the last token, tokens the model computed for it)."""
    num_computed_before = llm.stats.num_computed_tokens_total
    began = time.perf_counter()
    output = llm.generate([prompt], params)[0]
    return output, time.perf_counter() - began, llm.stats.num_computed_tokens_total - num_computed_before


def run_warmup(llm, workload: Workload, steps: list[WarmupStep], label: str = "") -> list[WarmupTurn]:
    """Run the warm-up steps on `llm`, then flush and forget the GPU prefix cache, so
    the timed run starts with nothing of the warm-up on the GPU. Untimed."""
    from tqdm import tqdm

    from engine.config import SamplingParams

    params = SamplingParams(max_tokens=workload.answer_len, temperature=0.0, ignore_eos=True)
    turns = []
    for step in tqdm(steps, desc=f"{label} warm-up", unit="req", leave=False):
        if step.reset:
            _forget_gpu_cache(llm, drop_cpu_tier=step.drop_cpu_tier)
        planner = getattr(llm.engine.scheduler.connector, "planner", None)
        # The disk step exists to warm the disk load path: load it whatever the planner
        # would choose (on a fast GPU it rightly recomputes one chunk; on a busy CPU a
        # sub-millisecond fetch deadline may pass), so the timed run meets it warm.
        forced = (
            planner.forced_loading()
            if step.drop_cpu_tier and planner is not None
            else contextlib.nullcontext()
        )
        with forced:
            output, _, num_computed = _run_one(llm, step.prompt, params)
        turns.append(
            WarmupTurn(
                step=step.name,
                num_prompt_tokens=len(step.prompt),
                prompt_digest=prompt_digest(step.prompt),
                ttft_s=output.metrics.ttft_s or 0.0,
                num_computed_tokens=num_computed,
                num_external_hit_tokens=output.metrics.num_external_cached_tokens,
                tier_to_loaded_tokens=dict(output.metrics.tier_to_loaded_tokens),
                num_planned_recompute_tokens=output.metrics.num_planned_recompute_tokens,
            )
        )
    _forget_gpu_cache(llm, drop_cpu_tier=False)
    return turns


def prompt_digest(token_ids: list[int]) -> str:
    return hashlib.blake2b(str(token_ids).encode(), digest_size=8).hexdigest()


def _forget_gpu_cache(llm, *, drop_cpu_tier: bool) -> None:
    """Finish offload writes, optionally empty the CPU tier (its chunks stay in the lower
    tiers), and drop the GPU prefix cache. Raises RuntimeError when the engine refuses."""
    llm.flush_kv_offload()
    cache_engine = llm.engine.offload_cache_engine
    if drop_cpu_tier and cache_engine is not None:
        cpu_tier = cache_engine.tiers.cpu
        if cpu_tier is not None:
            kept = [key for key in cpu_tier.keys() if not cpu_tier.delete(key)]  # noqa: SIM118 (not a mapping)
            if kept:  # pinned by a reader: the warm-up's disk step would load them from the CPU tier
                logging.getLogger(__name__).warning("warm-up: %d CPU-tier chunks still pinned", len(kept))
    if not llm.reset_prefix_cache():
        raise RuntimeError("the engine refused to drop its prefix cache (requests still running)")


def run_workload(llm, workload: Workload, conversations: Conversations, label: str) -> list[Turn]:
    """Run every user's rounds on `llm` (round by round, users in turn, one request at a
    time so TTFT is the request's own). Returns the turns in that order."""
    from tqdm import tqdm

    from engine.config import SamplingParams

    params = SamplingParams(max_tokens=workload.answer_len, temperature=0.0, ignore_eos=True)
    connector = llm.engine.scheduler.connector
    histories = [list(context) for context in conversations.contexts]
    turns = []
    with tqdm(total=workload.num_users * workload.num_rounds, desc=label, unit="req", leave=True) as bar:
        for round_index in range(workload.num_rounds):
            for user in range(workload.num_users):
                prompt = histories[user] + conversations.questions[user][round_index]
                output, e2e_s, num_computed = _run_one(llm, prompt, params)
                transfer = connector.request_stats(output.request_id) if connector is not None else None
                metrics = output.metrics
                turns.append(
                    Turn(
                        user=user,
                        round=round_index,
                        num_prompt_tokens=len(prompt),
                        ttft_s=metrics.ttft_s or 0.0,
                        e2e_s=e2e_s,
                        num_gpu_hit_tokens=metrics.num_local_cached_tokens,
                        num_external_hit_tokens=metrics.num_external_cached_tokens,
                        num_loaded_tokens=transfer.num_loaded_tokens if transfer is not None else 0,
                        num_computed_tokens=num_computed,
                        output_token_ids=list(output.token_ids),
                        prompt_digest=prompt_digest(prompt),
                        tier_to_loaded_tokens=dict(metrics.tier_to_loaded_tokens),
                        num_planned_recompute_tokens=metrics.num_planned_recompute_tokens,
                    )
                )
                histories[user] = prompt + list(output.token_ids)
                bar.update(1)
    return turns


def conversations_for(model, workload: Workload, chunk_size: int) -> Conversations:
    """The workload's token ids over the model's vocabulary minus its special tokens (EOS
    and chat markers inside a context would change nothing but read oddly)."""
    special: set[int] = set()
    if isinstance(model, str | Path):
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except (OSError, ValueError):
            tokenizer = None  # a folder without tokenizer files: only the config's EOS ids are special
        special |= set(getattr(tokenizer, "all_special_ids", None) or ())
    config = model_config(model)
    special |= set(config.eos_token_ids)
    return make_conversations(workload, [i for i in range(config.vocab_size) if i not in special], chunk_size)
