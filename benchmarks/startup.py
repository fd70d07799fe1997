"""Time to ready of an engine started from a sharded safetensors checkpoint (issue 33 item 3:
time-to-ready <= 1.5 x the raw read time of the weights + 10 s).

1. Makes (or reuses, in ``--work-dir``) a checkpoint in Hugging Face's sharded layout with
   random weights of the engine's own parameter names and shapes (``--model-size tiny |
   bench | 8b``, ``--dtype``, shards of ``--shard-gb``), with a tokenizer.
2. Drops the files from the page cache before every measurement (``posix_fadvise
   DONTNEED`` per file, which needs no root; ``--no-drop-cache`` keeps them cached).
3. Reads the files raw: one thread front to back (as ``cat``), and one thread per file.
4. Starts ``LLM()`` in a fresh process per CPU-tier size (``--cpu-tier-gb 0,60``: 0 = no
   offload) and reports its phases (engine.startup_phases) and total.
5. Starts ``kvstash serve`` per CPU-tier size and times process start to the first 200 of
   ``/health``, with the phases from ``/metrics``.

Prints a table and writes JSON (``--out``). On the GPU (one H100, 8B bf16):

    python benchmarks/startup.py --model-size 8b --dtype bfloat16 --device cuda \\
        --work-dir /tmp/kvstash-startup-8b --cpu-tier-gb 0,60 --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
READY_TIMEOUT_S = 600.0
_MARKER = "kvstash_startup_checkpoint.json"


def make_checkpoint(directory: Path, size: str, dtype_name: str, shard_bytes: int) -> Path:
    """Write ``size``'s checkpoint into ``directory`` (reused when its marker matches):
    config, tokenizer, ``model-0000i-of-0000n.safetensors`` and the index file."""
    import torch
    from safetensors.torch import save_file

    from bench.tiny_model import TINY_VOCAB_SIZE, _arch_config, _build_tokenizer
    from engine.config import ModelConfig
    from engine.models.llama import LlamaFamilyForCausalLM

    marker = {"size": size, "dtype": dtype_name, "shard_bytes": shard_bytes}
    if (directory / _MARKER).is_file() and json.loads((directory / _MARKER).read_text()) == marker:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors"):
        stale.unlink()
    tokenizer = _build_tokenizer(TINY_VOCAB_SIZE)
    if size == "8b":
        from bench.presets import llama31_8b_config

        config = llama31_8b_config()
        tokenizer.add_tokens([f"<t{i}>" for i in range(len(tokenizer), config.vocab_size)])
        vocab = tokenizer.get_vocab()
        config.bos_token_id, config.eos_token_id = vocab["<|bos|>"], vocab["<|eos|>"]
    else:
        vocab = tokenizer.get_vocab()
        config = _arch_config(
            "llama",
            vocab_size=TINY_VOCAB_SIZE,
            bos_id=vocab["<|bos|>"],
            eos_id=vocab["<|eos|>"],
            pad_id=vocab["<|pad|>"],
            size=size,
        )
    config.dtype = dtype_name
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    dtype = getattr(torch, dtype_name)
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(ModelConfig.from_hf_config(config), torch.device("meta"), dtype)
    # values: one random pool tiled over every tensor (fast to make, never NaN)
    pool = (torch.randn(1 << 24, generator=torch.Generator().manual_seed(0)) * 0.02).to(dtype)
    shard_names: list[list[str]] = [[]]
    shard_fill = 0
    name_to_param = dict(model.named_parameters())
    for name, param in name_to_param.items():
        nbytes = param.numel() * pool.element_size()
        if shard_names[-1] and shard_fill + nbytes > shard_bytes:
            shard_names.append([])
            shard_fill = 0
        shard_names[-1].append(name)
        shard_fill += nbytes
    weight_map = {}
    for index, names in enumerate(shard_names, start=1):
        tensors = {}
        for name in names:
            shape, numel = name_to_param[name].shape, name_to_param[name].numel()
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shape, dtype=dtype)
            else:
                tiled = pool.repeat(-(-numel // pool.numel())) if numel > pool.numel() else pool
                tensors[name] = tiled[:numel].clone().view(shape)
        file_name = f"model-{index:05d}-of-{len(shard_names):05d}.safetensors"
        save_file(tensors, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file_name))
    total = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (directory / _MARKER).write_text(json.dumps(marker))
    return directory


def drop_from_page_cache(files: list[Path]) -> bool:
    """Evict the files' pages (POSIX_FADV_DONTNEED, no root needed); False where the OS has
    no such call. Dirty pages are written first (fdatasync) so they can be dropped."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_whole(path: Path) -> int:
    buffer = bytearray(16 << 20)
    total = 0
    with path.open("rb", buffering=0) as file:
        while num_read := file.readinto(buffer):
            total += num_read
    return total


def raw_read_s(files: list[Path], *, parallel: bool) -> float:
    start = time.perf_counter()
    if parallel:
        with ThreadPoolExecutor(max_workers=len(files)) as pool:
            list(pool.map(_read_whole, files))
    else:
        for path in files:
            _read_whole(path)
    return time.perf_counter() - start


_LLM_CHILD = """
import json, sys, time
start = time.perf_counter()
from connector import OffloadConfig
from engine import LLM
args = json.loads(sys.argv[1])
offload = OffloadConfig(cpu_bytes=int(args["cpu_gb"] * (1 << 30))) if args["cpu_gb"] > 0 else None
imported = time.perf_counter()
llm = LLM(args["model"], dtype=args["dtype"], device=args["device"], kv_offload=offload,
          max_num_seqs=8, max_model_len=4096)
ready = time.perf_counter()
tier = llm.engine.startup.cpu_tier
if tier is not None:
    tier.wait_grown(600)
stats = llm.engine.startup.weight_read_stats
print("RESULT " + json.dumps({
    "imports_s": imported - start, "llm_s": ready - imported, "ready_s": ready - start,
    "phases": llm.engine.startup.snapshot(),
    "weights_gb": stats.num_bytes / 1e9 if stats else None,
}))
"""


def run_llm(model: Path, args, cpu_gb: float) -> dict:
    """``LLM()`` in a fresh process: its phases and wall times."""
    spec = {"model": str(model), "dtype": args.dtype, "device": args.device, "cpu_gb": cpu_gb}
    result = subprocess.run(
        [sys.executable, "-c", _LLM_CHILD, json.dumps(spec)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=READY_TIMEOUT_S,
        env={**os.environ, "KVSTASH_CACHE_DIR": str(args.work_dir / "cache")},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"LLM() failed:\n{result.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run_serve(model: Path, args, cpu_gb: float) -> dict:
    """``kvstash serve`` from process start to the first 200 of /health; its phases from /metrics."""
    command = [sys.executable, "-m", "engine.cli", "serve", str(model), "--host", "127.0.0.1", "--port", "0"]
    command += [
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "4096",
    ]
    if cpu_gb > 0:
        command += ["--kv-offload", "--kv-offload-cpu-gb", str(cpu_gb)]
    log_path = args.work_dir / f"serve-cpu{cpu_gb:g}.log"
    env = {**os.environ, "KVSTASH_CACHE_DIR": str(args.work_dir / "cache"), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        port = None
        while time.perf_counter() - start < READY_TIMEOUT_S:
            if process.poll() is not None:
                raise RuntimeError(
                    f"kvstash serve exited {process.returncode}:\n{log_path.read_text()[-3000:]}"
                )
            if port is None:
                match = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", log_path.read_text())
                port = int(match.group(1)) if match else None
            if port is not None:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
            time.sleep(0.05)
        else:
            raise RuntimeError(f"kvstash serve was not healthy within {READY_TIMEOUT_S} s")
        health_s = time.perf_counter() - start
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        phases = {
            match.group(1): float(match.group(2))
            for match in re.finditer(r'kvstash_startup_phase_seconds\{phase="(\w+)"\} ([0-9.e+-]+)', text)
        }
        return {"health_s": health_s, "phases": phases}
    finally:
        process.terminate()
        process.wait(timeout=60)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model-size", choices=("tiny", "bench", "8b"), default="tiny")
    add("--dtype", default="float32", help="checkpoint and engine dtype (bfloat16 on the GPU)")
    add("--device", default="cpu")
    add("--shard-gb", type=float, default=5.0, help="shard size in GB (Hugging Face's default: 5)")
    add(
        "--work-dir",
        type=Path,
        default=None,
        help="checkpoint folder, reused between runs (default: a temp dir)",
    )
    add("--cpu-tier-gb", default="0,4", help="comma-separated CPU tier sizes in GiB (0: no offload)")
    add("--no-drop-cache", action="store_true", help="leave the files in the page cache")
    add("--skip-serve", action="store_true")
    add("--out", type=Path, default=None, help="JSON file of the results")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cpu_tier_gbs = [float(value) for value in args.cpu_tier_gb.split(",")]
    except ValueError:
        parser.error(f"--cpu-tier-gb {args.cpu_tier_gb!r}: comma-separated numbers of GiB")
    if any(value < 0 for value in cpu_tier_gbs) or args.shard_gb <= 0:
        parser.error("sizes must be >= 0 (--shard-gb > 0)")
    args.work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="kvstash-startup-"))).resolve()
    made = time.perf_counter()
    model = make_checkpoint(args.work_dir / "model", args.model_size, args.dtype, int(args.shard_gb * 1e9))
    make_s = time.perf_counter() - made
    files = sorted(model.glob("*.safetensors"))
    checkpoint_gb = sum(path.stat().st_size for path in files) / 1e9

    def cold() -> bool:
        return False if args.no_drop_cache else drop_from_page_cache(files)

    dropped = cold()
    results = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "model_size": args.model_size,
        "dtype": args.dtype,
        "device": args.device,
        "checkpoint_gb": checkpoint_gb,
        "num_files": len(files),
        "make_checkpoint_s": make_s,
        "page_cache_dropped": dropped,
        "raw_read_s": raw_read_s(files, parallel=False),
    }
    cold()
    results["raw_read_parallel_s"] = raw_read_s(files, parallel=True)
    results["target_s"] = 1.5 * results["raw_read_s"] + 10
    results["runs"] = []
    for cpu_gb in cpu_tier_gbs:
        cold()
        row = {"cpu_tier_gb": cpu_gb, "llm": run_llm(model, args, cpu_gb)}
        if not args.skip_serve:
            cold()
            row["serve"] = run_serve(model, args, cpu_gb)
        results["runs"].append(row)
    print(
        f"{args.model_size} {args.dtype} on {args.device}: {checkpoint_gb:.2f} GB in {len(files)} file(s) "
        f"(made in {make_s:.1f} s); page cache dropped: {'yes' if dropped else 'no'}"
    )
    print(
        f"raw read: {results['raw_read_s']:.2f} s one thread, {results['raw_read_parallel_s']:.2f} s one thread per "
        f"file; target (1.5 x raw + 10 s): {results['target_s']:.2f} s"
    )
    phase_names = ["imports", "config", "weights", "fingerprint", "kv_cache", "tiers", "tokenizer", "warmup"]
    # "other": time to ready in no phase (process start, CUDA's first call, the model on meta)
    columns = [*phase_names, "other", "cpu_tier_background"]
    print(f"{'run':<24}{'ready s':>9}{'target':>7}" + "".join(f"{name[:10]:>11}" for name in columns))
    for row in results["runs"]:
        llm_phases = {"imports": row["llm"]["imports_s"], **row["llm"]["phases"]}
        runs = [("LLM()", row["llm"]["ready_s"], llm_phases)]
        if "serve" in row:
            runs.append(("serve to /health", row["serve"]["health_s"], row["serve"]["phases"]))
        for label, ready_s, phases in runs:
            phases = dict(phases)
            phases["other"] = ready_s - sum(phases.get(name, 0.0) for name in [*phase_names, "server"])
            cells = "".join(f"{phases[name]:>11.2f}" if name in phases else f"{'-':>11}" for name in columns)
            verdict = "met" if ready_s <= results["target_s"] else "MISSED"
            print(
                f"{label + ' cpu ' + format(row['cpu_tier_gb'], 'g') + ' GiB':<24}{ready_s:>9.2f}{verdict:>7}"
                + cells
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
