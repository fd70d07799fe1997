"""Output tokens/s of kvstash's engine vs Hugging Face `generate`, same prompts, same run.

Default (the GPU run): a Llama-3.1-8B-shaped model with random bf16 weights made on
the GPU (nothing is written to disk), 64 requests of 512 random prompt tokens + 128
new tokens, EOS ignored so both generate exactly the same number of tokens. Each
side gets one warm-up pass first (Triton compilation, cuBLAS autotuning), and runs
alone on the GPU: Hugging Face first, then its model is freed before the engine
starts.

    python benchmarks/engine_throughput.py --out engine_throughput.json
    python benchmarks/engine_throughput.py --tiny --out /tmp/tiny.json   # CPU, seconds

`--offload` adds the cost of offloading on misses: two engines alive side by side
with the same KV blocks, one with the CPU tier on, timed in alternating order for
`--repeats` rounds on fresh prompts (0% hits), so the offload engine saves the KV of
every prompt and loads nothing. The median per-round throughput ratio is the price
of offload on a miss (target: within 3%).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402


def llama_config(tiny: bool):
    """An in-memory transformers config: Llama-3.1-8B's shapes, or a tiny one."""
    from bench.presets import llama31_config

    if not tiny:
        return llama31_config()
    return llama31_config(
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
    )


def make_prompts(num_requests: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab_size, (num_requests, prompt_len), generator=generator).tolist()


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_size = torch.empty((), dtype=dtype).element_size()
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_size


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf(config, prompts, new_tokens: int, device: torch.device, dtype: torch.dtype) -> float:
    """Seconds for one batched greedy `generate` over all prompts (after a warm-up)."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor(prompts, device=device)
    attention_mask = torch.ones_like(input_ids)

    options = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(
            input_ids[:2], attention_mask=attention_mask[:2], max_new_tokens=4, **options
        )  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens, **options)
        synchronize(device)
        seconds = time.perf_counter() - start
    if out.shape[1] - input_ids.shape[1] != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - input_ids.shape[1]} tokens, expected {new_tokens}")
    del model, out
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def make_engine(config, device: torch.device, dtype_name: str, warmup_prompts, **engine_args) -> LLM:
    """An engine on random weights, warmed up (Triton compilation, graphs, cuBLAS)."""
    llm = LLM(config, load_format="dummy", device=str(device), dtype=dtype_name, **engine_args)
    llm.generate(warmup_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    return llm


def timed_generate(
    llm: LLM, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> tuple[float, int, int]:
    """-> (seconds, engine steps, external hit tokens) of one `generate` over all prompts."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    steps_before = llm.stats.num_steps
    synchronize(device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    synchronize(device)
    seconds = time.perf_counter() - start
    if any(len(o.token_ids) != new_tokens for o in outputs):
        raise RuntimeError("kvstash generated a wrong number of tokens")
    num_external = sum(o.metrics.num_external_cached_tokens for o in outputs)
    return seconds, llm.stats.num_steps - steps_before, num_external


def close_engine(llm: LLM, device: torch.device) -> None:
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.close()  # its writer thread and pinned slab
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_kvstash(config, prompt_sets, warmup_prompts, new_tokens: int, device: torch.device, dtype_name: str):
    """-> (fastest seconds over the prompt sets, steps of that run, KV blocks); one
    engine with the default memory budget, freed before returning."""
    llm = make_engine(config, device, dtype_name, warmup_prompts)
    runs = [timed_generate(llm, prompts, new_tokens, device) for prompts in prompt_sets]
    seconds, num_steps, _ = min(runs)
    num_blocks = llm.engine.block_manager.num_blocks
    close_engine(llm, device)
    return seconds, num_steps, num_blocks


def run_offload_pair(
    config,
    prompt_sets_off,
    prompt_sets_on,
    warmup_prompts,
    new_tokens,
    device,
    dtype_name,
    kv_offload,
    num_gpu_blocks,
) -> dict:
    """Offload off and on side by side: two engines alive at once with the same KV
    blocks, timed in alternating order round by round (off first in even rounds), so
    drift of the machine over the run falls on both. Every prompt is fresh (0% hits).
    -> each engine's fastest seconds, the per-round ratios and the external hit tokens."""
    off = make_engine(config, device, dtype_name, warmup_prompts, num_gpu_blocks=num_gpu_blocks)
    on = make_engine(
        config, device, dtype_name, warmup_prompts, num_gpu_blocks=num_gpu_blocks, kv_offload=kv_offload
    )
    off_seconds, on_seconds, num_external = [], [], 0
    for round_index, (prompts_off, prompts_on) in enumerate(
        zip(prompt_sets_off, prompt_sets_on, strict=True)
    ):
        pair = [(off, prompts_off, off_seconds), (on, prompts_on, on_seconds)]
        for llm, prompts, seconds in pair if round_index % 2 == 0 else reversed(pair):
            elapsed, _, hits = timed_generate(llm, prompts, new_tokens, device)
            seconds.append(elapsed)
            num_external += hits if llm is on else 0
    close_engine(on, device)
    close_engine(off, device)
    ratios = [a / b for a, b in zip(off_seconds, on_seconds, strict=True)]  # throughput on / off
    return {
        "off_seconds": min(off_seconds),
        "on_seconds": min(on_seconds),
        "round_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "external_hit_tokens": num_external,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU in float32 (seconds)")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--skip-hf", action="store_true", help="measure kvstash only")
    parser.add_argument(
        "--offload",
        action="store_true",
        help="also run kvstash with the CPU tier on (fresh prompts, 0%% hits)",
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed prompt sets per engine (fastest)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()

    num_requests = args.num_requests or (4 if args.tiny else 64)
    prompt_len = args.prompt_len or (32 if args.tiny else 512)
    new_tokens = args.new_tokens or (8 if args.tiny else 128)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    dtype_name = args.dtype or ("float32" if args.tiny else "bfloat16")
    dtype = getattr(torch, dtype_name)
    config = llama_config(args.tiny)
    # Fresh prompts for every timed set: no set hits the GPU prefix cache or a tier.
    prompt_sets = [
        make_prompts(num_requests, prompt_len, config.vocab_size, seed=2 * i) for i in range(args.repeats)
    ]
    prompts = prompt_sets[0]
    warmup_prompts = make_prompts(min(num_requests, 8), prompt_len, config.vocab_size, seed=1)

    hf_seconds = None if args.skip_hf else run_hf(config, prompts, new_tokens, device, dtype)
    kv_seconds, num_steps, num_blocks = run_kvstash(
        config, prompt_sets, warmup_prompts, new_tokens, device, dtype_name
    )
    pair = None
    if args.offload:
        from connector import OffloadConfig

        kv_bytes = num_requests * (prompt_len + new_tokens) * kv_bytes_per_token(config, dtype)
        blocks_per_request = -(-(prompt_len + new_tokens) // 16) + 1
        pair = run_offload_pair(
            config,
            [
                make_prompts(num_requests, prompt_len, config.vocab_size, seed=2 * i + 51)
                for i in range(args.repeats)
            ],
            [
                make_prompts(num_requests, prompt_len, config.vocab_size, seed=2 * i + 101)
                for i in range(args.repeats)
            ],
            warmup_prompts,
            new_tokens,
            device,
            dtype_name,
            kv_offload=OffloadConfig(cpu_bytes=kv_bytes + (1 << 30)),
            num_gpu_blocks=2 * num_requests * blocks_per_request,
        )

    num_output_tokens = num_requests * new_tokens
    kv_tps = num_output_tokens / kv_seconds
    hf_tps = None if hf_seconds is None else num_output_tokens / hf_seconds
    result = {
        "benchmark": "engine_throughput",
        "model": "tiny-llama" if args.tiny else "llama-3.1-8b-shaped (random weights)",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "dtype": dtype_name,
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "num_output_tokens": num_output_tokens,
        "hf_seconds": hf_seconds,
        "hf_output_tokens_per_s": hf_tps,
        "kvstash_seconds": kv_seconds,
        "kvstash_output_tokens_per_s": kv_tps,
        "kvstash_steps": num_steps,
        "kvstash_kv_blocks": num_blocks,
        "speedup_vs_hf": None if hf_tps is None else kv_tps / hf_tps,
        "repeats": args.repeats,
        "offload_pair": pair,
        "offload_vs_off": None if pair is None else pair["median_ratio"],
        "torch": torch.__version__,
    }
    print(f"{'engine':<10} {'seconds':>9} {'output tok/s':>13}")
    if hf_seconds is not None:
        print(f"{'hf':<10} {hf_seconds:>9.3f} {hf_tps:>13.1f}")
    print(f"{'kvstash':<10} {kv_seconds:>9.3f} {kv_tps:>13.1f}")
    if pair is not None:
        print(
            f"offload off / on side by side ({len(pair['round_ratios'])} alternating rounds, same KV blocks, "
            f"{pair['external_hit_tokens']} external hit tokens): off {num_output_tokens / pair['off_seconds']:.1f} "
            f"tok/s, on {num_output_tokens / pair['on_seconds']:.1f} tok/s"
        )
        rounds = " ".join(f"{r:.3f}" for r in pair["round_ratios"])
        print(f"offload on / off throughput: median {pair['median_ratio']:.3f} (rounds: {rounds})")
    if hf_tps is not None:
        print(
            f"kvstash / hf: {kv_tps / hf_tps:.2f}x  ({num_requests} requests x {prompt_len} prompt + {new_tokens} new)"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
