"""`kvstash bench`: the main job. A multi-round QA workload run twice on fresh
engines, with KV offload off and on, same prompts, greedy.

Workload: `num_users` users, each with a long context of their own (random
token ids, after an optional shared system prompt), ask `num_rounds` questions
in turn. Each round's prompt is the previous prompt + the previous answer + a
new question, so every round after the first repeats a long prefix. The
engine's KV pool holds one user's longest conversation (unless
`--num-gpu-blocks` says otherwise), so by the time a user comes back the engine's own prefix cache has
lost their context: without offload it is recomputed, with offload it is loaded
from the CPU/disk (or remote) tiers.

Both engines first run the same untimed warm-up (`warmup_steps`): a conversation of
their own with the workload's prompt lengths, through every path the timed run takes
(prefill of each round's length, decode, a prefill over a GPU-cached prefix, and with
offload a CPU-tier and a disk-tier load), so round 1 compares two equally warm engines.
The engines run one after the other; the first is released before the second starts.

Outputs must be identical token for token between the two runs in float32 (a
mismatch is an error exit); in bf16/fp16 the table reports whether they are. The
report (table, JSON, PNG) is written by `engine.bench_report`; the presets live in
`engine.bench_presets`.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import os
import platform
import random
import resource
import shutil
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import click

from engine.bench_presets import PRESET_NAMES, ModelPreset, llama31_8b_config, resolve_preset
from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options

#: engine KV pool = this many users' longest conversation: the pool cannot keep two users,
#: so the engine's own prefix cache loses a user's context before their next round
POOL_USERS = 1.0
#: default tiers hold every user's longest conversation (and the warm-up's) with this headroom
TIER_HEADROOM = 1.25
#: timed copies per size for the host->device rate (after one untimed copy that faults pages in);
#: the fastest counts: a bound is what the hardware can do, not what a busy machine did once
NUM_COPY_REPEATS = 10


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
    connector = llm.engine.scheduler.connector
    if drop_cpu_tier and connector is not None:
        cpu_tier = connector.cache_engine.tiers.cpu
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

    def to_json(self) -> dict[str, Any]:
        from engine.bench_report import outputs_note, round_rows

        return {
            "model": self.model,
            "preset": self.preset,
            "device": self.device,
            "device_name": self.device_name,
            "dtype": self.dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "copy_kind": self.copy_kind,
            "workload": asdict(self.workload),
            "engine_args": self.engine_args,
            "offload": self.offload,
            "outputs_identical": self.outputs_identical,
            "outputs_must_match": self.outputs_must_match,
            "outputs_note": outputs_note(self),
            "wall_s": {"off": self.wall_s_off, "on": self.wall_s_on},
            "gpu_bytes_between_runs": self.gpu_bytes_between_runs,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "host_peak_rss_bytes": self.host_peak_rss_bytes,
            "rounds": round_rows(self),
            "warmup": {
                "off": [asdict(t) for t in self.warmup_off],
                "on": [asdict(t) for t in self.warmup_on],
            },
            "turns": {"off": [asdict(t) for t in self.turns_off], "on": [asdict(t) for t in self.turns_on]},
        }


def cache_dir() -> Path:
    """kvstash's folder in the user's cache directory (`$XDG_CACHE_HOME/kvstash`, else `~/.cache/kvstash`)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstash"


def ensure_bench_model(arch: str, size: str) -> Path:
    """The generated model of `kvstash bench` (made once, then reused from the cache folder)."""
    import json

    from engine.tiny_model import make_tiny_model

    directory = cache_dir() / "models" / f"{size}-{arch}"
    marker = directory / "kvstash_tiny_model.json"
    wanted = {"arch": arch, "seed": 0, "size": size}
    if (
        marker.is_file()
        and json.loads(marker.read_text()) == wanted
        and (directory / "config.json").is_file()
    ):
        return directory
    click.echo(f"making a {size} {arch} model in {directory} (once)", err=True)
    return make_tiny_model(directory, arch=arch, seed=0, size=size)


def engine_device_dtype(model, engine_args: dict[str, Any]):
    """(torch.device, torch.dtype) of the engine that `engine_args` would start on `model`
    (a folder or an in-memory config), without starting it."""
    from engine.config import EngineArgs

    args = EngineArgs(**engine_args)
    device = args.resolve_device()
    return device, args.resolve_dtype(device, _model_config(model).checkpoint_dtype)


def kv_bytes_per_token(model, engine_args: dict[str, Any]) -> int:
    """KV bytes of one token in the engine that `engine_args` would start (all layers, K and V)."""
    from engine.model_runner import kv_bytes_per_block

    _, dtype = engine_device_dtype(model, engine_args)
    return kv_bytes_per_block(_model_config(model), 1, dtype)


def _model_config(model):
    from engine.config import ModelConfig

    return ModelConfig.from_dir(model) if isinstance(model, str | Path) else ModelConfig.from_hf_config(model)


def default_offload_config(workload: Workload, bytes_per_token: int):
    """CPU memory + a local disk folder under the cache folder (emptied first, so the
    on-run starts cold like the off-run), each sized for every user's longest
    conversation and the warm-up's (at least 0.5 GiB of CPU memory and 2 GiB of disk)."""
    from connector.config import GIB, OffloadConfig

    chunk_size = OffloadConfig.chunk_size
    tokens_per_user = math.ceil(workload.max_prompt_len / chunk_size) * chunk_size
    wanted = math.ceil((workload.num_users + 1) * tokens_per_user * bytes_per_token * TIER_HEADROOM)
    disk_path = cache_dir() / "bench" / "kv-disk"
    shutil.rmtree(disk_path, ignore_errors=True)
    disk_path.mkdir(parents=True)
    return OffloadConfig(
        cpu_bytes=max(GIB // 2, wanted), disk_path=str(disk_path), disk_bytes=max(2 * GIB, wanted)
    )


def copy_seconds(num_bytes: int, device) -> float:
    """Fewest seconds to copy `num_bytes` from pinned host memory to `device` (CUDA), or
    between two host buffers (CPU), over `NUM_COPY_REPEATS` tries: the floor under
    loading that much KV."""
    import torch

    if num_bytes <= 0:
        return 0.0
    on_cuda = device.type == "cuda"
    source = torch.ones(num_bytes, dtype=torch.uint8, pin_memory=on_cuda)
    target = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(NUM_COPY_REPEATS + 1):
        if on_cuda:
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        target.copy_(source, non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - began)
    del source, target
    return min(times[1:])


def measure_bounds(
    workload: Workload, turns_off: list[Turn], turns_on: list[Turn], bytes_per_token: int, device
):
    """One `RoundBound` per round: the on-run's mean hit bytes, their copy time measured
    now, and the off-run's median decode step of the round."""
    bounds = []
    for round_index in range(workload.num_rounds):
        on = [t for t in turns_on if t.round == round_index]
        hit_bytes = statistics.mean(t.num_external_hit_tokens for t in on) * bytes_per_token
        steps = [s for t in turns_off if t.round == round_index if (s := t.decode_step_s) is not None]
        bounds.append(
            RoundBound(
                round=round_index + 1,
                hit_bytes=hit_bytes,
                copy_s=copy_seconds(int(hit_bytes), device),
                decode_step_s=statistics.median(steps) if steps else None,
            )
        )
    return bounds


class EngineRun(NamedTuple):
    """One engine's share of the bench."""

    turns: list[Turn]
    warmup: list[WarmupTurn]
    wall_s: float
    device: Any  # torch.device
    dtype: Any  # torch.dtype
    #: most GPU bytes allocated at once while this engine lived (None on CPU)
    gpu_peak_bytes: int | None


def _run_engine(
    model, engine_args: dict[str, Any], kv_offload, workload: Workload, conversations, label: str
) -> EngineRun:
    """Start one engine, warm it up, run the timed workload, close its tiers (their
    writer thread would keep them alive). The engine is unreachable once this returns:
    the caller collects it before starting the next."""
    import torch

    from engine.llm import LLM

    device, _ = engine_device_dtype(model, engine_args)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    llm = LLM(model, kv_offload=kv_offload, **engine_args)
    warmup = run_warmup(llm, workload, conversations.warmup, label)
    start = time.perf_counter()
    turns = run_workload(llm, workload, conversations, label)
    seconds = time.perf_counter() - start
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.close()
    llm.engine.shutdown()  # pipeline stage processes (pipeline_parallel_size > 1)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return EngineRun(turns, warmup, seconds, llm.engine.device, llm.engine.dtype, peak)


def _free_device_memory(device) -> int | None:
    """Collect released engines and return their cached GPU blocks to the driver; -> GPU
    bytes still allocated (None on CPU)."""
    import torch

    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine() or 'cpu'} ({os.cpu_count()} cores)"


def run_bench(
    model, workload: Workload, engine_args: dict[str, Any], offload, *, model_label: str | None = None
) -> BenchResult:
    """Both runs on fresh engines, one after the other (the first is released before the
    second starts), each warmed up the same way; then the bound's copy rates. `model`
    is a model folder or an in-memory transformers config (with load_format "dummy").
    Raises ValueError on bad settings."""
    workload.validate()
    conversations = _conversations_for(model, workload, offload.chunk_size)
    runs = {}
    gpu_bytes_between_runs = None
    for label, kv_offload in (("offload off", None), ("offload on", offload)):
        runs[label] = _run_engine(model, engine_args, kv_offload, workload, conversations, label)
        bytes_left = _free_device_memory(runs[label].device)
        if label == "offload off":
            gpu_bytes_between_runs = bytes_left
    off, on = runs["offload off"], runs["offload on"]
    bytes_per_token = kv_bytes_per_token(model, engine_args)
    return BenchResult(
        workload=workload,
        model=model_label or str(model),
        engine_args=engine_args,
        offload=asdict(offload),
        turns_off=off.turns,
        turns_on=on.turns,
        wall_s_off=off.wall_s,
        wall_s_on=on.wall_s,
        warmup_off=off.warmup,
        warmup_on=on.warmup,
        bounds=measure_bounds(workload, off.turns, on.turns, bytes_per_token, on.device),
        device=str(on.device),
        device_name=device_name(on.device),
        dtype=str(on.dtype).removeprefix("torch."),
        kv_bytes_per_token=bytes_per_token,
        copy_kind="pinned host->device copy" if on.device.type == "cuda" else "host memcpy",
        gpu_bytes_between_runs=gpu_bytes_between_runs,
        gpu_peak_bytes={"off": off.gpu_peak_bytes, "on": on.gpu_peak_bytes},
        host_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


@contextlib.contextmanager
def _request_log(path: Path) -> Iterator[None]:
    """Send the per-request log lines of the engine and connector to `path` instead of
    the terminal (where they would break the progress bars); warnings still show."""
    file_handler = logging.FileHandler(path, mode="w")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    warning_handler = logging.StreamHandler()
    warning_handler.setLevel(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("engine", "connector", "storage_backends")]
    saved = [(logger.propagate, logger.level) for logger in loggers]
    for logger in loggers:
        logger.addHandler(file_handler)
        logger.addHandler(warning_handler)
        logger.propagate = False
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, (propagate, level) in zip(loggers, saved, strict=True):
            logger.removeHandler(file_handler)
            logger.removeHandler(warning_handler)
            logger.propagate = propagate
            logger.setLevel(level)
        file_handler.close()


def _conversations_for(model, workload: Workload, chunk_size: int) -> Conversations:
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
    config = _model_config(model)
    special |= set(config.eos_token_ids)
    return make_conversations(workload, [i for i in range(config.vocab_size) if i not in special], chunk_size)


def _workload_option(flag: str, name: str, help_text: str):
    """A workload flag whose default comes from the preset (shown in --help)."""
    return click.option(flag, name, type=int, default=None, help=f"{help_text} [default: from the preset]")


@click.command("bench")
@click.option("--model", default=None, help="Model folder [default: the preset's model, made on the spot].")
@click.option(
    "--arch",
    type=click.Choice(["llama", "qwen2", "qwen3", "mistral"]),
    default="llama",
    show_default=True,
    help="Family of the generated tiny/bench model (the 8b preset is Llama; ignored with --model).",
)
@click.option(
    "--model-size",
    type=click.Choice(PRESET_NAMES),
    default=None,
    help="Preset: 8b (Llama-3.1-8B shape, random weights, 6 users x 8k tokens), bench "
    "(~25M parameters, 4 users x 1k tokens) or tiny (tests) [default: 8b on CUDA, bench on CPU].",
)
@_workload_option("--users", "num_users", "Users, each with a context.")
@_workload_option("--context-len", "context_len", "Tokens of each user's context.")
@_workload_option("--rounds", "num_rounds", "Questions per user.")
@_workload_option("--question-len", "question_len", "Tokens per question.")
@_workload_option("--answer-len", "answer_len", "Tokens per answer.")
@click.option(
    "--system-prompt-len",
    type=int,
    default=Workload.system_prompt_len,
    show_default=True,
    help="Tokens of a system prompt shared by every user.",
)
@click.option(
    "--workload-seed", type=int, default=Workload.seed, show_default=True, help="Seed of the token ids."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="bench-out",
    show_default=True,
    help="Folder for bench.json and bench_ttft.png.",
)
@engine_options
@offload_options
@click.pass_context
def bench(
    ctx: click.Context,
    model: str | None,
    arch: str,
    model_size: str | None,
    out_dir: str,
    num_users: int | None,
    context_len: int | None,
    num_rounds: int | None,
    question_len: int | None,
    answer_len: int | None,
    system_prompt_len: int,
    workload_seed: int,
    **options,
) -> None:
    """Multi-round QA with KV offload off, then on: TTFT per round, table, JSON and plot.

    The preset (--model-size) picks the model and the workload's defaults: on CUDA
    the Llama-3.1-8B shape with random weights (bf16) and 8k-token contexts, on CPU
    the bench-size model and 1k-token contexts. Both engines run the same untimed
    warm-up first. With no --kv-offload* flag the offload run uses CPU memory and a
    disk folder under ~/.cache/kvstash/bench, sized for every user (no external
    service). Without --num-gpu-blocks the engine's KV pool holds one user's longest
    conversation."""
    from engine.bench_report import print_table, write_json, write_plot

    out = Path(out_dir)
    explicit_engine_args = {
        name
        for name in engine_args_from_options(options)
        if ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT)
    }
    try:
        # checked before any model is made or loaded
        explicit_offload = offload_config_from_options(options)
        settings = bench_settings(
            model,
            arch,
            model_size,
            {
                "num_users": num_users,
                "context_len": context_len,
                "num_rounds": num_rounds,
                "question_len": question_len,
                "answer_len": answer_len,
                "system_prompt_len": system_prompt_len,
                "seed": workload_seed,
            },
            engine_args_from_options(options),
            explicit_engine_args,
        )
        click.echo(f"preset {settings.preset.name}: {settings.preset.description}")
        click.echo(f"  why: {settings.reason}")
        if settings.model_dir_to_make is not None:
            settings.model_source = str(ensure_bench_model(arch, settings.preset.name))
            settings.model_label = settings.model_source
        offload = explicit_offload or default_offload_config(
            settings.workload, kv_bytes_per_token(settings.model_source, settings.engine_args)
        )
        _print_banner(settings)
        out.mkdir(parents=True, exist_ok=True)
        with _request_log(out / "bench.log"):
            result = run_bench(
                settings.model_source,
                settings.workload,
                settings.engine_args,
                offload,
                model_label=settings.model_label,
            )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    preset = settings.preset
    result.preset = {"name": preset.name, "description": preset.description, "reason": settings.reason}
    print_table(result)
    json_path = write_json(result, out / "bench.json")
    plot_path = write_plot(result, out / "bench_ttft.png")
    click.echo(f"wrote {json_path}, {plot_path} and the per-request log {out / 'bench.log'}")
    if result.outputs_must_match and not result.outputs_identical:
        raise click.ClickException("output tokens differ between offload off and on (see bench.json)")


@dataclass
class BenchSettings:
    """What one `kvstash bench` run will do, resolved from its flags and preset."""

    preset: ModelPreset
    #: why this preset (printed at start, kept in bench.json)
    reason: str
    workload: Workload
    engine_args: dict[str, Any]
    #: a model folder, or an in-memory transformers config (the 8b preset); None until made
    model_source: Any
    model_label: str
    #: the generated preset whose folder must be made (or found) in the cache folder
    model_dir_to_make: str | None = None


def bench_settings(
    model: str | None,
    arch: str,
    model_size: str | None,
    workload_flags: dict[str, int | None],
    engine_args: dict[str, Any],
    explicit_engine_args: set[str],
) -> BenchSettings:
    """Resolve the preset (by `model_size`, else by device), the workload (flags that are
    None take the preset's defaults), the engine arguments (the preset's, unless in
    `explicit_engine_args`; a KV pool of one user's longest conversation) and the model.
    Makes nothing and starts nothing. Raises ValueError on bad settings."""
    preset, reason = resolve_preset(
        model_size, _resolves_to_cuda(engine_args["device"]), own_model=model is not None
    )
    defaults = asdict(preset.workload)
    workload = Workload(
        **{name: value if value is not None else defaults[name] for name, value in workload_flags.items()}
    )
    workload.validate()
    engine_args = dict(engine_args)
    if model is None:
        for name, value in preset.engine_defaults.items():
            if name not in explicit_engine_args:
                engine_args[name] = value
    if engine_args.get("num_gpu_blocks") is None:
        engine_args["num_gpu_blocks"] = workload.default_num_gpu_blocks(engine_args["block_size"])
    settings = BenchSettings(preset, reason, workload, engine_args, model, model or "")
    if model is not None:
        return settings
    if preset.generates_full_size:
        if arch != "llama":
            raise ValueError(
                f"the 8b preset is the Llama-3.1-8B shape; --arch {arch} needs --model-size bench"
            )
        if engine_args.get("load_format") != "dummy":
            raise ValueError(
                "the 8b preset has no weights to read: it needs --load-format dummy (its default)"
            )
        settings.model_source, settings.model_label = (
            llama31_8b_config(),
            "llama-3.1-8b shape (random weights)",
        )
    else:
        settings.model_dir_to_make = preset.name
    return settings


def _resolves_to_cuda(device: str) -> bool:
    """Whether the engine's `--device` means a GPU here ("auto": CUDA when available)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def _print_banner(settings: BenchSettings) -> None:
    """What runs, before any engine starts (the preset and its reason were printed first)."""
    workload = settings.workload
    device, dtype = engine_device_dtype(settings.model_source, settings.engine_args)
    click.echo(
        f"  model {settings.model_label}; {str(dtype).removeprefix('torch.')} on {device}; "
        f"{workload.num_users} users x {workload.num_rounds} rounds, {workload.context_len}-token contexts; "
        "both engines warm up on the same untimed prompts first"
    )
