"""Disaggregated prefill/decode by the direct path (NIXL) against one engine, on one device
(issue 32 item 3b): a reference `kvstash serve`, a producer and a consumer (`--kv-transfer
direct`, no shared tier) and `kvstash proxy` in front of the two, all on the same GPU (or CPU).

Two parts:
1. transfer: two NIXL agents in this process move a prompt's chunks (the model's KV shape)
   from one CPU tier to another as the consumer's fetcher does (``--reads-in-flight``
   threads of ``DirectPeerTier.get_into``), against a plain ``torch`` copy of the same bytes
   between the same kind of host memory;
2. serving: per prompt length, fresh random prompts through the proxy and to the reference
   engine (streamed, greedy): the tokens must be equal (``--deterministic`` on the GPU), and
   TTFT through the proxy against the reference's; the consumer's loaded bytes and the
   producer's hand-overs come from their /metrics.

    python benchmarks/pd_direct.py --out pd_direct.json                      # GPU: bench model
    python benchmarks/pd_direct.py --model-size 8b --out pd_direct_8b.json  # GPU: 8B shape, dummy weights
    python benchmarks/pd_direct.py --cpu --lengths 300,600 --repeats 1       # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.soak import kv_bytes_per_token, make_8b_folder  # noqa: E402
from benchmarks.support.soak_children import Child, start_serve  # noqa: E402

MODEL_NAME = "soak"  # start_serve's served model name


def transfer_rates(
    config: dict, dtype: torch.dtype, num_tokens: int, reads_in_flight: int, pinned: bool
) -> dict:
    """GB/s of a prompt's chunks read by the direct path (two agents, this process) and of a
    torch copy of the same bytes between two host buffers of the same kind."""
    from connector.cpu_tier import PinnedChunkPool
    from connector.direct_export import DirectExporter
    from connector.direct_peer import DirectPeerTier
    from connector.token_db import KV_LAYOUT, TokenDatabase
    from storage_backends.chunk import KVChunk

    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    chunk_shape = (config["num_hidden_layers"], 2, 256, kv_heads, head_dim)
    spans = TokenDatabase("bench", 256, True).chunk_spans(list(range(num_tokens)))
    num_bytes = num_tokens * kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
    capacity = (
        (len(spans) + 1) * torch.Size(chunk_shape).numel() * torch.empty((), dtype=dtype).element_size()
    )
    producer = PinnedChunkPool(capacity, chunk_shape, dtype, pin_memory=pinned, layout=KV_LAYOUT)
    consumer = PinnedChunkPool(capacity, chunk_shape, dtype, pin_memory=pinned, layout=KV_LAYOUT)
    chunk = torch.ones(chunk_shape, dtype=dtype)
    for span in spans:
        producer.put(span.key, KVChunk(chunk[:, :, : span.end - span.start], KV_LAYOUT))
    exporter = DirectExporter(producer, hold_s=600)
    peer = DirectPeerTier(consumer, fetch_deadline_s=300)
    try:
        offer = exporter.offer(spans)
        peer.expect("bench", offer, [span.key for span in spans])
        reservations = [
            consumer.reserve(span.key, (*chunk_shape[:2], span.end - span.start, *chunk_shape[3:]))
            for span in spans
        ]
        read_chunk = lambda pair: peer.get_into(pair[0].key, pair[1].buffer)  # noqa: E731
        with ThreadPoolExecutor(reads_in_flight) as pool:
            list(pool.map(read_chunk, zip(spans[:1], reservations[:1], strict=True)))  # connects
            started = time.perf_counter()
            results = list(pool.map(read_chunk, zip(spans, reservations, strict=True)))
            direct_s = time.perf_counter() - started
        if any(result is None for result in results):
            raise RuntimeError("a direct read failed")
        source, target = producer.slab[: len(spans)], consumer.slab[: len(spans)]
        target.copy_(source)
        started = time.perf_counter()
        target.copy_(source)
        copy_s = time.perf_counter() - started
    finally:
        peer.close()
        exporter.close()
    return {
        "tokens": num_tokens,
        "bytes": num_bytes,
        "direct_gbps": num_bytes / direct_s / 1e9,
        "torch_host_copy_gbps": num_bytes / copy_s / 1e9,
        "direct_vs_copy": copy_s / direct_s,
    }


def streamed(url: str, prompt: list[int], max_tokens: int) -> tuple[list[str], float]:
    """(the streamed text pieces, seconds to the first one) of a greedy completion."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True}
    pieces, first = [], None
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(f"{url}: {event}")
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - started
                    pieces.append(choice["text"])
    return pieces, first if first is not None else float("nan")


def metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=60).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def serve_all(model: str, flags: list[str], cpu_gb: float, work: Path) -> tuple[list[Child], str, str, str]:
    """The reference, the producer, the consumer (started at once) and the proxy; their URLs."""
    direct = ["--kv-offload", "--kv-offload-cpu-gb", str(cpu_gb), "--kv-transfer", "direct"]
    specs = [
        (flags, "reference"),
        ([*flags, "--kv-role", "producer", *direct], "producer"),
        ([*flags, "--kv-role", "consumer", *direct], "consumer"),
    ]
    with ThreadPoolExecutor(3) as pool:
        children = list(
            pool.map(lambda spec: start_serve(model, spec[0], work / f"{spec[1]}.log", spec[1]), specs)
        )
    reference, producer, consumer = (f"http://127.0.0.1:{child.port}" for child in children)
    command = [sys.executable, "-m", "engine.cli", "proxy", "--host", "127.0.0.1", "--port", "0"]
    command += ["--prefill", producer, "--decode", consumer]
    proxy = Child(
        command, work / "proxy.log", r"Uvicorn running on http://127\.0\.0\.1:(\d+)", "proxy"
    ).start()
    children.append(proxy)
    return children, reference, f"http://127.0.0.1:{proxy.port}", consumer


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cpu", action="store_true", help="run on CPU (float32, the bench model)")
    parser.add_argument("--model-size", choices=("bench", "8b"), default="bench")
    parser.add_argument("--lengths", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--repeats", type=int, default=3, help="fresh prompts per length")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (GPU)")
    parser.add_argument("--reads-in-flight", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    cuda = not args.cpu and torch.cuda.is_available()
    lengths = [int(n) for n in (args.lengths or ("2048,8192,16000" if cuda else "300,600")).split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvstash-pd-direct-"))
    flags = ["--device", "cuda" if cuda else "cpu", "--dtype", "bfloat16" if cuda else "float32"]
    longest = max(lengths) + args.max_tokens
    flags += ["--num-gpu-blocks", str(2 * (longest // 16 + 2)), "--max-model-len", str(longest + 16)]
    if args.deterministic:
        flags.append("--deterministic")
    if args.model_size == "8b":
        model = str(make_8b_folder(work / "model"))
        flags += ["--load-format", "dummy", "--model-id", "pd-direct-llama-3.1-8b-shape-dummy"]
    else:
        from bench.tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "model", size="bench"))
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = torch.bfloat16 if cuda else torch.float32
    kv_token = kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
    cpu_gb = max(1.0, 3 * longest * kv_token / 2**30)
    print(
        f"transfer: {max(lengths)} tokens of KV ({max(lengths) * kv_token / 2**30:.2f} GiB) ...", flush=True
    )
    transfer = transfer_rates(config, dtype, max(lengths), args.reads_in_flight, pinned=cuda)
    print(
        f"  direct {transfer['direct_gbps']:.2f} GB/s, torch host copy {transfer['torch_host_copy_gbps']:.2f} GB/s "
        f"({transfer['direct_vs_copy']:.2f}x)",
        flush=True,
    )
    children, reference, proxy, consumer = serve_all(model, flags, cpu_gb, work)
    rows, all_equal = [], True
    try:
        rng = random.Random(0)
        vocab = config["vocab_size"]
        for length in lengths:
            ref_ttfts, pd_ttfts, equal = [], [], True
            loaded_before = metric(consumer, "kvstash_kv_loaded_bytes_total")
            seconds_before = metric(consumer, "kvstash_kv_load_seconds_total")
            for _ in range(args.repeats):
                prompt = [rng.randrange(10, min(vocab, 32000)) for _ in range(length)]
                pd_pieces, pd_ttft = streamed(proxy, prompt, args.max_tokens)
                ref_pieces, ref_ttft = streamed(reference, prompt, args.max_tokens)
                equal = equal and pd_pieces == ref_pieces
                pd_ttfts.append(pd_ttft)
                ref_ttfts.append(ref_ttft)
            loaded = metric(consumer, "kvstash_kv_loaded_bytes_total") - loaded_before
            seconds = metric(consumer, "kvstash_kv_load_seconds_total") - seconds_before
            all_equal = all_equal and equal
            rows.append(
                {
                    "tokens": length,
                    "tokens_equal": equal,
                    "reference_ttft_ms": 1e3 * statistics.median(ref_ttfts),
                    "pd_ttft_ms": 1e3 * statistics.median(pd_ttfts),
                    "consumer_loaded_gib": loaded / 2**30,
                    "consumer_load_gbps": loaded / seconds / 1e9 if seconds > 0 else float("nan"),
                }
            )
            row = rows[-1]
            print(
                f"{length:>7} tokens  equal={equal!s:<5}  TTFT one engine {row['reference_ttft_ms']:8.1f} ms  "
                f"through the proxy {row['pd_ttft_ms']:8.1f} ms  consumer loaded {row['consumer_loaded_gib']:.3f} GiB "
                f"at {row['consumer_load_gbps']:.2f} GB/s",
                flush=True,
            )
        fallbacks = sum(
            metric(consumer, "kvstash_pd_fallbacks_total", reason=reason)
            for reason in ("missing", "fetch", "timeout", "load", "short", "namespace")
        )
        direct_handoffs = metric(consumer, "kvstash_pd_handoffs_total", path="direct")
    finally:
        for child in reversed(children):
            child.stop()
    device = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    print(
        f"{device}: tokens equal everywhere: {all_equal}; direct hand-overs {direct_handoffs:.0f}, fallbacks {fallbacks:.0f}"
    )
    result = {
        "device": device,
        "model_size": args.model_size,
        "deterministic": args.deterministic,
        "transfer": transfer,
        "rows": rows,
        "tokens_equal": all_equal,
        "direct_handoffs": direct_handoffs,
        "fallbacks": fallbacks,
        "logs": str(work),
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    sys.exit(0 if all_equal and fallbacks == 0 else 1)


if __name__ == "__main__":
    main()
