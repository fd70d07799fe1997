"""Pipeline parallelism: the same engine with 1 and 2 stages, the 2 stages with and
without async scheduling (issue #21: up to one micro-batch per stage in flight).

On one GPU both stages share it (they talk through host memory over gloo): PP=2 then
measures the pipeline's overhead (plans to the other process, hidden states across,
tokens back), and async scheduling what overlapping the two stages' micro-batches wins
back on a shared device. With 2 GPUs each stage has its own (NCCL) and async
scheduling keeps both busy. Each engine runs an untimed warm-up pass, then a prefill
pass (`--requests` prompts of `--prompt-len` tokens, one new token each) and a decode
pass (`--requests` short prompts, `--new-tokens` each); greedy tokens of every engine
must be identical. `overlapped` counts the micro-batches submitted while another was
in flight (0 without async scheduling).

    python benchmarks/pipeline_parallel.py --out pp.json            # CUDA: Llama-3.1-8B shapes, 8 layers, bf16
    python benchmarks/pipeline_parallel.py --tiny --out /tmp/pp.json  # CPU, tiny model
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import llama_config, make_prompts  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def run_engine(config, engine_args: dict, prefill_prompts, decode_prompts, new_tokens: int) -> dict:
    llm = LLM(config, load_format="dummy", warmup=False, **engine_args)
    try:
        greedy_one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prefill_prompts[:2], greedy_one)  # warm-up: kernels, allocator
        llm.generate(decode_prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        _sync()
        began = time.perf_counter()
        prefill_outputs = llm.generate(prefill_prompts, greedy_one)
        _sync()
        prefill_s = time.perf_counter() - began
        began = time.perf_counter()
        decode_outputs = llm.generate(decode_prompts, greedy)
        _sync()
        decode_s = time.perf_counter() - began
        pipeline = llm.engine.pipeline
        return {
            "overlapped_submits": pipeline.num_overlapped_submits if pipeline is not None else 0,
            "prefill_s": prefill_s,
            "prefill_tokens_per_s": sum(len(p) for p in prefill_prompts) / prefill_s,
            "decode_s": decode_s,
            "decode_tokens_per_s": len(decode_prompts) * new_tokens / decode_s,
            "token_ids": [o.token_ids for o in prefill_outputs + decode_outputs],
        }
    finally:
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (CI smoke run)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the 8B-shaped model")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("pipeline_parallel.json"))
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available() and not args.tiny
    config = llama_config(tiny=not on_cuda)
    if on_cuda:
        config.num_hidden_layers = args.layers
    requests = args.requests or (32 if on_cuda else 4)
    prompt_len = args.prompt_len or (1024 if on_cuda else 128)
    new_tokens = args.new_tokens or (64 if on_cuda else 16)
    prefill_prompts = make_prompts(requests, prompt_len, config.vocab_size, seed=1)
    decode_prompts = make_prompts(requests, 16, config.vocab_size, seed=2)
    common = {
        "device": "cuda" if on_cuda else "cpu",
        "dtype": "bfloat16" if on_cuda else "float32",
        "max_num_batched_tokens": 8192,
        "max_model_len": 4096,
        "num_gpu_blocks": requests * (prompt_len // 16 + 8),
    }
    num_gpus = torch.cuda.device_count() if on_cuda else 0
    where = "2 GPUs" if num_gpus >= 2 else "one device"
    engines = {
        "pp1": {},
        "pp1 eager": {"enforce_eager": True},
        f"pp2 ({where})": {"pipeline_parallel_size": 2},
        f"pp2 async ({where})": {"pipeline_parallel_size": 2, "async_scheduling": True},
        f"pp2 eager ({where})": {"pipeline_parallel_size": 2, "enforce_eager": True},
    }
    results = {}
    for name, extra in engines.items():
        results[name] = run_engine(config, common | extra, prefill_prompts, decode_prompts, new_tokens)
    reference = results["pp1"]["token_ids"]
    header = (
        f"{'engine':<22} {'prefill s':>10} {'prefill tok/s':>14} {'decode s':>9} {'decode tok/s':>13} "
        f"{'overlapped':>10} same tokens"
    )
    print(f"{requests} requests: prefill {prompt_len} tokens each, decode {new_tokens} tokens each; {common}")
    print(header)
    for name, r in results.items():
        same = "yes" if r["token_ids"] == reference else "NO"
        print(
            f"{name:<22} {r['prefill_s']:>10.3f} {r['prefill_tokens_per_s']:>14.0f} "
            f"{r['decode_s']:>9.3f} {r['decode_tokens_per_s']:>13.0f} {r['overlapped_submits']:>10} {same}"
        )
    report = {
        "machine": platform.machine(),
        "device": torch.cuda.get_device_name() if on_cuda else "cpu",
        "torch": torch.__version__,
        "requests": requests,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "layers": config.num_hidden_layers,
        "num_gpus": num_gpus,
        "engine_args": common,
        "results": {
            name: {k: v for k, v in r.items() if k != "token_ids"}
            | {"same_tokens_as_pp1": r["token_ids"] == reference}
            for name, r in results.items()
        },
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
