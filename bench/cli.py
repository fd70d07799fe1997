"""`kvstash bench`, the click command: flags to settings (bench.settings), both runs
(bench.runner), then the table, JSON and plot (bench.report)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path

import click

from bench.model_facts import engine_device_dtype, kv_bytes_per_token
from bench.presets import PRESET_NAMES
from bench.results import Workload
from bench.runner import run_bench
from bench.settings import BenchSettings, bench_settings, default_offload_config, ensure_bench_model
from engine.engine_flags import engine_args_from_options, engine_options
from engine.offload_cli import offload_config_from_options, offload_options


@contextlib.contextmanager
def _request_log(path: Path) -> Iterator[None]:
    """Send the per-request log lines of the engine and connector (and the bench's own) to
    `path` instead of the terminal (where they would break the progress bars); warnings
    still show."""
    file_handler = logging.FileHandler(path, mode="w")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    warning_handler = logging.StreamHandler()
    warning_handler.setLevel(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("engine", "connector", "storage_backends", "bench")]
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
    from bench.report import print_table, write_json, write_plot

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
        if settings.engine_args.get("node_rank", 0) > 0:
            _run_node_ranks(settings, offload)
            return
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


def _run_node_ranks(settings: BenchSettings, offload) -> None:
    """`bench --node-rank R` (R ≥ 1): this host's ranks of node 0's two engines, offload
    off then on (each `LLM` returns once node 0's engine of that run shut down); node 0
    measures and reports."""
    from engine.llm import LLM
    from engine.pipeline.control import NodeError

    for label, kv_offload in (("offload off", None), ("offload on", offload)):
        click.echo(f"node {settings.engine_args['node_rank']}: the ranks of node 0's {label} engine")
        try:
            LLM(settings.model_source, kv_offload=kv_offload, **settings.engine_args)
        except NodeError as error:
            raise click.ClickException(str(error)) from None


def _print_banner(settings: BenchSettings) -> None:
    """What runs, before any engine starts (the preset and its reason were printed first)."""
    workload = settings.workload
    device, dtype = engine_device_dtype(settings.model_source, settings.engine_args)
    click.echo(
        f"  model {settings.model_label}; {str(dtype).removeprefix('torch.')} on {device}; "
        f"{workload.num_users} users x {workload.num_rounds} rounds, {workload.context_len}-token contexts; "
        "both engines warm up on the same untimed prompts first"
    )
