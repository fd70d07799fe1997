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

Outputs must be identical token for token between the two runs; a mismatch is
an error exit. The report (table, JSON, PNG) is written by `engine.bench_report`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options

#: engine KV pool = this many users' longest conversation: the pool cannot keep two users,
#: so the engine's own prefix cache loses a user's context before their next round
POOL_USERS = 1.0
#: tokens of the warm-up request each engine runs before the timed workload
WARMUP_LEN = 32


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
        return (
            self.system_prompt_len
            + self.context_len
            + self.num_rounds * self.question_len
            + (self.num_rounds - 1) * self.answer_len
        )

    def default_num_gpu_blocks(self, block_size: int) -> int:
        blocks_per_user = math.ceil((self.max_prompt_len + self.answer_len) / block_size)
        return math.ceil(POOL_USERS * blocks_per_user)


@dataclass(frozen=True)
class Conversations:
    """Token ids of the workload: `contexts[u]` (system prompt included), `questions[u][r]`,
    and a short warm-up prompt that shares nothing with them."""

    contexts: list[list[int]]
    questions: list[list[list[int]]]
    warmup: list[int]


def make_conversations(workload: Workload, token_ids: list[int]) -> Conversations:
    """Random token ids drawn from `token_ids` (the vocabulary minus special tokens)."""
    rng = random.Random(workload.seed)

    def draw(n: int) -> list[int]:
        return [rng.choice(token_ids) for _ in range(n)]

    system = draw(workload.system_prompt_len)
    contexts = [system + draw(workload.context_len) for _ in range(workload.num_users)]
    questions = [
        [draw(workload.question_len) for _ in range(workload.num_rounds)] for _ in range(workload.num_users)
    ]
    return Conversations(contexts, questions, draw(WARMUP_LEN))


@dataclass
class Turn:
    """One request's figures."""

    user: int
    round: int
    num_prompt_tokens: int
    ttft_s: float
    num_gpu_hit_tokens: int
    num_external_hit_tokens: int
    num_loaded_tokens: int
    #: tokens the model ran a forward pass on for this request (prefill + decode)
    num_computed_tokens: int
    output_token_ids: list[int]


def run_workload(llm, workload: Workload, conversations: Conversations, label: str) -> list[Turn]:
    """Run every user's rounds on `llm` (round by round, users in turn, one request at a
    time so TTFT is the request's own) after one untimed warm-up request. Returns the
    turns in that order."""
    from tqdm import tqdm

    from engine.config import SamplingParams

    params = SamplingParams(max_tokens=workload.answer_len, temperature=0.0, ignore_eos=True)
    llm.generate([conversations.warmup], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    connector = llm.engine.scheduler.connector
    histories = [list(context) for context in conversations.contexts]
    turns = []
    with tqdm(total=workload.num_users * workload.num_rounds, desc=label, unit="req", leave=True) as bar:
        for round_index in range(workload.num_rounds):
            for user in range(workload.num_users):
                prompt = histories[user] + conversations.questions[user][round_index]
                num_computed_before = llm.stats.num_computed_tokens_total
                output = llm.generate([prompt], params)[0]
                transfer = connector.request_stats(output.request_id) if connector is not None else None
                turns.append(
                    Turn(
                        user=user,
                        round=round_index,
                        num_prompt_tokens=len(prompt),
                        ttft_s=output.metrics.ttft_s or 0.0,
                        num_gpu_hit_tokens=output.metrics.num_local_cached_tokens,
                        num_external_hit_tokens=output.metrics.num_external_cached_tokens,
                        num_loaded_tokens=transfer.num_loaded_tokens if transfer is not None else 0,
                        num_computed_tokens=llm.stats.num_computed_tokens_total - num_computed_before,
                        output_token_ids=list(output.token_ids),
                    )
                )
                histories[user] = prompt + list(output.token_ids)
                bar.update(1)
    return turns


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

    @property
    def outputs_identical(self) -> bool:
        return [t.output_token_ids for t in self.turns_off] == [t.output_token_ids for t in self.turns_on]

    def to_json(self) -> dict[str, Any]:
        from engine.bench_report import round_rows

        return {
            "model": self.model,
            "workload": asdict(self.workload),
            "engine_args": self.engine_args,
            "offload": self.offload,
            "outputs_identical": self.outputs_identical,
            "wall_s": {"off": self.wall_s_off, "on": self.wall_s_on},
            "rounds": round_rows(self),
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


def default_offload_config():
    """CPU memory + a local disk folder under the cache folder (emptied first, so the
    on-run starts cold like the off-run)."""
    from connector.config import GIB, OffloadConfig

    disk_path = cache_dir() / "bench" / "kv-disk"
    shutil.rmtree(disk_path, ignore_errors=True)
    disk_path.mkdir(parents=True)
    return OffloadConfig(cpu_bytes=GIB // 2, disk_path=str(disk_path), disk_bytes=2 * GIB)


def run_bench(model: str, workload: Workload, engine_args: dict[str, Any], offload) -> BenchResult:
    """Both runs on fresh engines; raises ValueError on bad settings."""
    from engine.llm import LLM

    workload.validate()
    timings = {}
    turns = {}
    conversations = None
    for label, kv_offload in (("offload off", None), ("offload on", offload)):
        llm = LLM(model, kv_offload=kv_offload, **engine_args)
        if conversations is None:
            conversations = make_conversations(workload, _plain_token_ids(llm))
        start = time.perf_counter()
        turns[label] = run_workload(llm, workload, conversations, label)
        timings[label] = time.perf_counter() - start
        del llm  # free the KV pool and close the tiers before the next engine
    return BenchResult(
        workload=workload,
        model=model,
        engine_args=engine_args,
        offload=asdict(offload),
        turns_off=turns["offload off"],
        turns_on=turns["offload on"],
        wall_s_off=timings["offload off"],
        wall_s_on=timings["offload on"],
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


def _plain_token_ids(llm) -> list[int]:
    """Every token id of the vocabulary except the tokenizer's special ones (EOS and
    chat markers inside a context would change nothing but read oddly)."""
    special = set(getattr(llm.tokenizer, "all_special_ids", None) or ())
    return [i for i in range(llm.engine.model_config.vocab_size) if i not in special]


@click.command("bench")
@click.option(
    "--model", default=None, help="Model folder [default: make a bench-size model in the cache folder]."
)
@click.option(
    "--arch",
    type=click.Choice(["llama", "qwen2", "qwen3", "mistral"]),
    default="llama",
    show_default=True,
    help="Family of the generated model (ignored with --model).",
)
@click.option(
    "--model-size",
    type=click.Choice(["tiny", "bench"]),
    default="bench",
    show_default=True,
    help="Preset of the generated model (ignored with --model).",
)
@click.option(
    "--users",
    "num_users",
    type=int,
    default=Workload.num_users,
    show_default=True,
    help="Users, each with a context.",
)
@click.option(
    "--context-len",
    type=int,
    default=Workload.context_len,
    show_default=True,
    help="Tokens of each user's context.",
)
@click.option(
    "--rounds",
    "num_rounds",
    type=int,
    default=Workload.num_rounds,
    show_default=True,
    help="Questions per user.",
)
@click.option(
    "--question-len", type=int, default=Workload.question_len, show_default=True, help="Tokens per question."
)
@click.option(
    "--answer-len", type=int, default=Workload.answer_len, show_default=True, help="Tokens per answer."
)
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
def bench(
    model: str | None,
    arch: str,
    model_size: str,
    out_dir: str,
    num_users: int,
    context_len: int,
    num_rounds: int,
    question_len: int,
    answer_len: int,
    system_prompt_len: int,
    workload_seed: int,
    **options,
) -> None:
    """Multi-round QA with KV offload off, then on: TTFT per round, table, JSON and plot.

    With no --kv-offload* flag the offload run uses 0.5 GiB of CPU memory and a disk
    folder under ~/.cache/kvstash/bench (no external service). Without
    --num-gpu-blocks the engine's KV pool holds one user's longest conversation."""
    from engine.bench_report import print_table, write_json, write_plot

    workload = Workload(
        num_users, context_len, num_rounds, question_len, answer_len, system_prompt_len, workload_seed
    )
    out = Path(out_dir)
    try:
        workload.validate()
        offload = offload_config_from_options(options) or default_offload_config()
        engine_args = engine_args_from_options(options)
        if engine_args.get("num_gpu_blocks") is None:
            engine_args["num_gpu_blocks"] = workload.default_num_gpu_blocks(engine_args["block_size"])
        model_dir = model or str(ensure_bench_model(arch, model_size))
        out.mkdir(parents=True, exist_ok=True)
        with _request_log(out / "bench.log"):
            result = run_bench(model_dir, workload, engine_args, offload)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    print_table(result)
    json_path = write_json(result, out / "bench.json")
    plot_path = write_plot(result, out / "bench_ttft.png")
    click.echo(f"wrote {json_path}, {plot_path} and the per-request log {out / 'bench.log'}")
    if not result.outputs_identical:
        raise click.ClickException("output tokens differ between offload off and on (see bench.json)")
