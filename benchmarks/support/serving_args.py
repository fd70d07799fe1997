"""Command-line flags, model and progress lines shared by the serving benchmarks
(``benchmarks/disaggregated.py``, ``benchmarks/router.py``): the model (made on the spot or
a folder), device, dtype, engine flags, logs and output. Each script adds its own flags and
calls `resolve_common` once after parsing; nothing here starts a process."""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

from benchmarks.support.model_folders import MODEL_SIZES, ModelFolder, make_model_folder

_STARTED = time.perf_counter()
MODEL_NAMES = {
    "tiny": "tiny-llama",
    "bench": "bench-llama (~25M)",
    "8b": "llama-3.1-8b-shaped (random weights)",
    "folder": "model folder",
}


def say(message: str) -> None:
    """A progress line with the seconds since the script started."""
    print(f"[{time.perf_counter() - _STARTED:6.1f} s] {message}", flush=True)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--model-size",
        choices=MODEL_SIZES,
        default="tiny",
        help="model made on the spot: tiny (CPU), bench (~25M) or 8b (Llama-3.1-8B shape, random weights)",
    )
    add("--model", type=Path, default=None, help="serve this model folder instead of making one")
    add("--device", default=None, help="serve's --device (default: cuda for 8b, else cpu)")
    add("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    add(
        "--engine-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more serve flag for every engine (repeat; e.g. --engine-arg=--max-decode-gap-ms=0)",
    )
    add("--engine-threads", type=int, default=None, help="OMP_NUM_THREADS of each CPU engine (default 1)")
    add("--request-timeout-s", type=float, default=600.0)
    add("--seed", type=int, default=0)
    add(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the processes' logs here (default: a temporary folder)",
    )
    add("--out", type=Path, default=None, help="write the results as JSON")


def resolve_common(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Defaults that depend on the model size; bad values are parser errors (exit 2)."""
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    args.device = args.device or ("cuda" if args.model_size == "8b" else "cpu")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    if args.engine_threads is not None and args.engine_threads < 1:
        parser.error(f"--engine-threads must be at least 1, got {args.engine_threads}")
    # On CPU the engines compute on torch's threads: one each, so that two engines (and the
    # client) do not fight over the cores. On CUDA the engine picks its own (engine.host_threads).
    args.engine_env = {"OMP_NUM_THREADS": str(args.engine_threads or 1)} if args.device == "cpu" else {}


def prepare_model(args: argparse.Namespace, work: Path) -> ModelFolder:
    if args.model is not None:
        return ModelFolder(args.model.resolve(), "folder")
    return make_model_folder(args.model_size, work / "model")


def base_engine_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device, "--dtype", args.dtype]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    return f"CPU ({platform.processor() or platform.machine()}, {_num_cpus()} cores)"


def _num_cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
