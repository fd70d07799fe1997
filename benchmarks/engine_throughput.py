"""Output tokens/s of kvstash's engine vs Hugging Face `generate`, same prompts, same run.

Default (the GPU run): a Llama-3.1-8B-shaped model with random bf16 weights made on
the GPU (nothing is written to disk), 64 requests of 512 random prompt tokens + 128
new tokens, EOS ignored so both generate exactly the same number of tokens. Each
side gets one warm-up pass first (Triton compilation, cuBLAS autotuning), and runs
alone on the GPU: Hugging Face first, then its model is freed before the engine
starts.

    python benchmarks/engine_throughput.py --out engine_throughput.json
    python benchmarks/engine_throughput.py --tiny --out /tmp/tiny.json   # CPU, seconds

`--offload` adds the cost of offloading on misses: the same workload on a second
engine with the CPU tier on, in the same run. Every measured prompt is fresh
(0% hits), so that engine saves the KV of every prompt and loads nothing; the
ratio of the two throughputs is the price of offload on a miss (target: within 3%).
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

from engine import LLM, SamplingParams  # noqa: E402


def llama_config(tiny: bool):
    """An in-memory transformers config: Llama-3.1-8B's shapes, or a tiny one."""
    from transformers import LlamaConfig

    if tiny:
        shapes = dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
            max_position_embeddings=16384,
        )
    else:
        shapes = dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            max_position_embeddings=131072,
        )
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(
        **shapes, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=rope, tie_word_embeddings=False
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


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


def run_kvstash(
    config,
    prompt_sets: list[list[list[int]]],
    warmup_prompts,
    new_tokens: int,
    device: torch.device,
    dtype_name: str,
    kv_offload=None,
):
    """-> (fastest seconds over the prompt sets, steps of that run, KV blocks, external
    hit tokens) for each set of prompts in one `generate` call, after a warm-up. The
    engine is freed before returning."""
    llm = LLM(config, load_format="dummy", device=str(device), dtype=dtype_name, kv_offload=kv_offload)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(warmup_prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    best = None
    num_external = 0
    for prompts in prompt_sets:
        steps_before = llm.stats.num_steps
        synchronize(device)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        synchronize(device)
        seconds = time.perf_counter() - start
        if any(len(o.token_ids) != new_tokens for o in outputs):
            raise RuntimeError("kvstash generated a wrong number of tokens")
        num_external += sum(o.metrics.num_external_cached_tokens for o in outputs)
        if best is None or seconds < best[0]:
            best = (seconds, llm.stats.num_steps - steps_before)
    num_blocks = llm.engine.block_manager.num_blocks
    if llm.engine.runner.connector is not None:
        llm.engine.runner.connector.close()  # its writer thread and pinned slab
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return best[0], best[1], num_blocks, num_external


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
    kv_seconds, num_steps, num_blocks, _ = run_kvstash(
        config, prompt_sets, warmup_prompts, new_tokens, device, dtype_name
    )
    offload_seconds = offload_hits = None
    if args.offload:
        from connector import OffloadConfig

        kv_bytes = num_requests * (prompt_len + new_tokens) * kv_bytes_per_token(config, dtype)
        offload_prompt_sets = [
            make_prompts(num_requests, prompt_len, config.vocab_size, seed=2 * i + 101)
            for i in range(args.repeats)
        ]
        offload_seconds, _, _, offload_hits = run_kvstash(
            config,
            offload_prompt_sets,
            warmup_prompts,
            new_tokens,
            device,
            dtype_name,
            kv_offload=OffloadConfig(cpu_bytes=kv_bytes + (1 << 30)),
        )

    num_output_tokens = num_requests * new_tokens
    kv_tps = num_output_tokens / kv_seconds
    hf_tps = None if hf_seconds is None else num_output_tokens / hf_seconds
    offload_tps = None if offload_seconds is None else num_output_tokens / offload_seconds
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
        "offload_seconds": offload_seconds,
        "offload_output_tokens_per_s": offload_tps,
        "offload_external_hit_tokens": offload_hits,
        "offload_vs_off": None if offload_tps is None else offload_tps / kv_tps,
        "torch": torch.__version__,
    }
    print(f"{'engine':<10} {'seconds':>9} {'output tok/s':>13}")
    if hf_seconds is not None:
        print(f"{'hf':<10} {hf_seconds:>9.3f} {hf_tps:>13.1f}")
    print(f"{'kvstash':<10} {kv_seconds:>9.3f} {kv_tps:>13.1f}")
    if offload_tps is not None:
        print(f"{'+offload':<10} {offload_seconds:>9.3f} {offload_tps:>13.1f}")
        print(
            f"offload on / off: {offload_tps / kv_tps:.3f}  (CPU tier on, fresh prompts, "
            f"{offload_hits} external hit tokens)"
        )
    if hf_tps is not None:
        print(
            f"kvstash / hf: {kv_tps / hf_tps:.2f}x  ({num_requests} requests x {prompt_len} prompt + {new_tokens} new)"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
