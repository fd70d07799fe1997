"""Benchmark the Triton kernels on a CUDA GPU (Llama-3.1-8B KV shape).

pack_kv / unpack_kv GB/s (payload bytes counted once) beside, in the same run:
a plain device-to-device copy_ of the same bytes, 64 torch index_select /
index_copy_ calls doing the same gather/scatter, and LMCache 0.5.3's CUDA kernel
`multi_layer_kv_transfer` when its wheel is importable (unpack it with
`pip install --no-index --no-deps --target /tmp/site .whl/lmcache-*.whl` and put
/tmp/site on PYTHONPATH); the same against pinned host memory; and paged attention
against torch SDPA over the already-gathered KV (decode and prefill over a prefix).

Timing: CUDA events around back-to-back calls ("loop", median over repeats of the
per-call time) and triton.testing.do_bench with an L2 flush before every call
("cold", median). Usage:

    python3 benchmarks/kernels.py --out kernels.json [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import glob
import importlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels  # noqa: E402
from kernels import pack as pack_module  # noqa: E402
from kernels import reference  # noqa: E402

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
NUM_HEADS = 32
DTYPE = torch.bfloat16
NUM_BLOCKS = 8192  # 131072 token slots per layer: 17 GB of paged KV
DEVICE = torch.device("cuda")


def time_loop(fn: Callable[[], object], inner: int, repeats: int) -> tuple[float, float]:
    """-> (GPU seconds per call, host seconds to issue one call), medians over `repeats` loops.

    GPU time comes from CUDA events around `inner` back-to-back calls; when the host
    needs longer to issue a call than the GPU to run it, the loop is launch-bound.
    """
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    per_call, issue = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issue_start = time.perf_counter()
        for _ in range(inner):
            fn()
        issue.append((time.perf_counter() - issue_start) / inner)
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(per_call), statistics.median(issue)


def time_cold(fn: Callable[[], object], quick: bool) -> float:
    """Median seconds per call with the L2 cache flushed before each call."""
    return (
        triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")
        / 1e3
    )


def load_peer() -> tuple[object | None, str]:
    """-> (LMCache's compiled op module or None, a note). Skips lmcache/__init__.py and its imports."""
    spec = importlib.util.find_spec("lmcache")
    if spec is None or not spec.submodule_search_locations:
        return (
            None,
            "peer not available: lmcache is not importable (put the unpacked 0.5.3 wheel on PYTHONPATH)",
        )
    package = types.ModuleType("lmcache")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["lmcache"] = package
    try:
        ops = importlib.import_module("lmcache.c_ops")
    except ImportError:
        # The extension links libcudart.so.13; pip's nvidia runtime wheel may hold it off the loader path.
        for folder in sys.path:
            for library in glob.glob(
                os.path.join(folder, "nvidia", "**", "libcudart.so.13*"), recursive=True
            ):
                with contextlib.suppress(OSError):
                    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        try:
            ops = importlib.import_module("lmcache.c_ops")
        except ImportError as error:  # a missing CUDA runtime or ABI mismatch: report and go on without it
            return None, f"peer not available: importing lmcache.c_ops failed: {error}"
    version = "unknown"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        version = importlib.metadata.version("lmcache")
    return ops, f"LMCache {version} ({ops.__file__})"


class Peer:
    """LMCache's multi_layer_kv_transfer on our cache: per-layer views [2, NB, BS, H, D] (NL_X_TWO_NB_BS_NH_HS)."""

    def __init__(self, ops: object, kv_cache: torch.Tensor) -> None:
        self.ops = ops
        self.layer_ptrs = torch.tensor(
            [kv_cache[layer].data_ptr() for layer in range(NUM_LAYERS)], device=DEVICE
        )
        self.page_buffer_size = NUM_BLOCKS * BLOCK_SIZE

    def transfer(self, buffer: torch.Tensor, slots: torch.Tensor, to_buffer: bool) -> None:
        """buffer: [2, num_layers, num_tokens, num_kv_heads * head_dim] (LMCache's KV_2LTD)."""
        direction = self.ops.TransferDirection.D2H if to_buffer else self.ops.TransferDirection.H2D
        self.ops.multi_layer_kv_transfer(
            buffer,
            self.layer_ptrs,
            slots,
            DEVICE,
            self.page_buffer_size,
            direction,
            self.ops.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS,
            block_size=BLOCK_SIZE,
            head_size=HEAD_DIM,
            skip_prefix_n_tokens=0,
        )


def bench_transfers(kv_cache, peer, token_counts, quick, rows):
    """pack/unpack and the baselines at each token count; appends result rows."""
    for num_tokens in token_counts:
        bench_transfer_size(kv_cache, peer, num_tokens, quick, rows)
        torch.cuda.empty_cache()


def bench_transfer_size(kv_cache, peer, num_tokens, quick, rows):
    """All transfer cases at one token count (buffers are freed when this returns)."""
    generator = torch.Generator().manual_seed(num_tokens)
    block_ids = torch.randperm(NUM_BLOCKS, generator=generator)[: num_tokens // BLOCK_SIZE]
    slots = (block_ids[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten().to(DEVICE)
    shape = (NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM)
    packed = torch.empty(shape, dtype=DTYPE, device=DEVICE)
    copy_target = torch.empty_like(packed)
    pinned = torch.empty(shape, dtype=DTYPE).pin_memory()
    payload = packed.numel() * packed.element_size()
    row = NUM_KV_HEADS * HEAD_DIM
    flat_planes = kv_cache.view(NUM_LAYERS, 2, NUM_BLOCKS * BLOCK_SIZE, row)
    packed_planes = packed.view(NUM_LAYERS, 2, num_tokens, row)

    # Correctness first: pack equals the torch reference; the peer gathers the same bytes.
    kernels.pack_kv(kv_cache, slots, packed)
    expected = reference.pack_kv_ref(kv_cache, slots)
    checks = {"pack == reference": bool(torch.equal(packed, expected))}
    peer_buffer = None
    if peer is not None:
        peer_buffer = torch.empty(2, NUM_LAYERS, num_tokens, row, dtype=DTYPE, device=DEVICE)
        peer.transfer(peer_buffer, slots, to_buffer=True)
        checks["peer gather == ours"] = bool(
            torch.equal(peer_buffer.transpose(0, 1), packed.view(NUM_LAYERS, 2, num_tokens, row))
        )
    del expected
    print(f"tokens={num_tokens} correctness: {checks}", flush=True)

    def index_select_all():
        for layer in range(NUM_LAYERS):
            for kind in range(2):
                torch.index_select(flat_planes[layer, kind], 0, slots, out=packed_planes[layer, kind])

    def index_copy_all():
        for layer in range(NUM_LAYERS):
            for kind in range(2):
                flat_planes[layer, kind].index_copy_(0, slots, packed_planes[layer, kind])

    cases: dict[str, Callable[[], object]] = {
        "pack": lambda: kernels.pack_kv(kv_cache, slots, packed, check_values=False),
        "pack (check_values)": lambda: kernels.pack_kv(kv_cache, slots, packed),
        "unpack": lambda: kernels.unpack_kv(packed, kv_cache, slots, check_values=False),
        "copy_ gpu->gpu": lambda: copy_target.copy_(packed),
        "64 x index_select": index_select_all,
        "64 x index_copy_": index_copy_all,
        "pack -> pinned": lambda: kernels.pack_kv(kv_cache, slots, pinned),
        "unpack <- pinned": lambda: kernels.unpack_kv(pinned, kv_cache, slots),
        "copy_ gpu->pinned": lambda: pinned.copy_(packed, non_blocking=True),
        "copy_ pinned->gpu": lambda: packed.copy_(pinned, non_blocking=True),
    }
    if peer is not None:
        peer_pinned = torch.empty(peer_buffer.shape, dtype=DTYPE).pin_memory()
        cases["LMCache paged->buffer"] = lambda: peer.transfer(peer_buffer, slots, True)
        cases["LMCache buffer->paged"] = lambda: peer.transfer(peer_buffer, slots, False)
        cases["LMCache paged->pinned"] = lambda: peer.transfer(peer_pinned, slots, True)
        cases["LMCache pinned->paged"] = lambda: peer.transfer(peer_pinned, slots, False)
    if not quick:
        for block_tokens in (2, 4, 8, 16, 32):
            for num_warps in (4, 8):
                for pack in (True, False):
                    name = f"{'pack' if pack else 'unpack'} BLOCK_T={block_tokens} warps={num_warps}"
                    cases[name] = lambda pack=pack, block_tokens=block_tokens, num_warps=num_warps: (
                        pack_module._move(
                            kv_cache,
                            packed,
                            slots,
                            pack=pack,
                            check_values=False,
                            block_tokens=block_tokens,
                            num_warps=num_warps,
                        )
                    )
    inner = max(1, min(50, (2 << 30) // payload * 4))
    for name, fn in cases.items():
        loop_s, issue_s = time_loop(fn, inner=inner, repeats=3 if quick else 10)
        cold_s = time_cold(fn, quick)
        rows.append(
            {
                "group": "transfer",
                "case": name,
                "tokens": num_tokens,
                "payload_bytes": payload,
                "loop_us": loop_s * 1e6,
                "host_issue_us": issue_s * 1e6,
                "cold_us": cold_s * 1e6,
                "loop_GBps": payload / loop_s / 1e9,
                "cold_GBps": payload / cold_s / 1e9,
                "checks": checks,
            }
        )
        print(
            f"tokens={num_tokens:6d} {name:38s} loop {rows[-1]['loop_GBps']:8.1f} GB/s  "
            f"cold {rows[-1]['cold_GBps']:8.1f} GB/s  ({loop_s * 1e6:8.1f} us GPU, {issue_s * 1e6:6.1f} us host issue)",
            flush=True,
        )


def bench_attention(quick, rows):
    """Decode (batch 64, 2k context) and prefill (4k new over a 12k prefix) vs torch SDPA on gathered KV."""
    scenarios = {
        "decode": ([1] * (8 if quick else 64), 512 if quick else 2048),
        "prefill": ([512 if quick else 4096], 2048 if quick else 16384),
    }
    for scenario, (num_new, seq_len) in scenarios.items():
        bench_attention_scenario(scenario, num_new, seq_len, quick, rows)
        torch.cuda.empty_cache()


def bench_attention_scenario(scenario, num_new, seq_len, quick, rows):
    """Ours, SDPA on pre-gathered KV, and gather + SDPA for one batch shape."""
    num_seqs = len(num_new)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = num_seqs * blocks_per_seq
    generator = torch.Generator().manual_seed(7)
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, blocks_per_seq).int().to(DEVICE)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *num_new]).cumsum(0).int().to(DEVICE)
    kv_layer = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    query = torch.randn(sum(num_new), NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE)
    scale = HEAD_DIM**-0.5
    max_query_len = max(num_new)

    def ours():
        return kernels.paged_attention(
            query,
            kv_layer,
            tables,
            seq_lens,
            starts,
            scale,
            max_query_len=max_query_len,
            max_seq_len=seq_len,  # as the engine passes it: no device sync to size split-KV
            check_values=False,
        )

    def gather():
        # [2, num_seqs, num_kv_heads, seq_len, head_dim]
        return kv_layer[:, tables.long()].flatten(2, 3).transpose(2, 3)

    gathered = gather()
    num_q = max_query_len
    # [num_seqs, num_heads, num_q, head_dim]; every sequence has the same number of new tokens here
    sdpa_query = query.view(num_seqs, num_q, NUM_HEADS, HEAD_DIM).transpose(1, 2)
    positions = torch.arange(seq_len - num_q, seq_len, device=DEVICE)
    mask = None if num_q == 1 else torch.arange(seq_len, device=DEVICE)[None, :] <= positions[:, None]

    def sdpa(kv=gathered):
        return torch.nn.functional.scaled_dot_product_attention(
            sdpa_query, kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True
        )

    # The same with KV heads repeated to the query heads, so SDPA may pick a backend without GQA support.
    repeated = gathered.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=2)

    def sdpa_repeated():
        return torch.nn.functional.scaled_dot_product_attention(
            sdpa_query, repeated[0], repeated[1], attn_mask=mask, scale=scale
        )

    def gather_and_sdpa():
        return sdpa(gather())

    out = ours()
    expected = sdpa().transpose(1, 2).reshape(out.shape)
    max_error = float((out.float() - expected.float()).abs().max())
    visible_keys = num_seqs * sum(seq_len - num_q + i + 1 for i in range(num_q))
    flops = 4 * NUM_HEADS * HEAD_DIM * visible_keys
    kv_bytes = kv_layer.numel() * kv_layer.element_size()
    for name, fn in (
        ("paged_attention", ours),
        ("SDPA on gathered KV", sdpa),
        ("SDPA, KV heads repeated", sdpa_repeated),
        ("gather + SDPA", gather_and_sdpa),
    ):
        seconds, issue_s = time_loop(fn, inner=5 if quick else 20, repeats=3 if quick else 10)
        rows.append(
            {
                "group": "attention",
                "case": f"{scenario}: {name}",
                "tokens": sum(num_new),
                "seq_len": seq_len,
                "num_seqs": num_seqs,
                "loop_us": seconds * 1e6,
                "host_issue_us": issue_s * 1e6,
                "TFLOPs": flops / seconds / 1e12,
                "kv_read_GBps": kv_bytes / seconds / 1e9,
                "max_abs_error_vs_sdpa": max_error,
            }
        )
        print(
            f"{scenario:8s} {name:22s} {seconds * 1e6:10.1f} us  {flops / seconds / 1e12:7.1f} TFLOP/s  "
            f"KV read {kv_bytes / seconds / 1e9:7.1f} GB/s  host issue {issue_s * 1e6:6.1f} us  "
            f"(max |ours - sdpa| {max_error:.3g})",
            flush=True,
        )


def print_summary(rows):
    """Pack/unpack against the copy and the peer, per token count."""
    by_key = {(row["case"], row["tokens"]): row for row in rows if row["group"] == "transfer"}
    token_counts = sorted({row["tokens"] for row in rows if row["group"] == "transfer"})
    print("\nGB/s, payload counted once (loop | cold L2)")
    header = f"{'case':38s}" + "".join(f"{t:>20d}" for t in token_counts)
    print(header)
    names = list(dict.fromkeys(row["case"] for row in rows if row["group"] == "transfer"))
    for name in names:
        cells = []
        for tokens in token_counts:
            row = by_key.get((name, tokens))
            cells.append(f"{row['loop_GBps']:9.0f} |{row['cold_GBps']:6.0f}  " if row else f"{'-':>20s}")
        print(f"{name:38s}" + "".join(f"{cell:>20s}" for cell in cells))
    print("\nratio to copy_ gpu->gpu (loop | cold)")
    for name in ("pack", "unpack", "LMCache paged->buffer", "LMCache buffer->paged"):
        cells = []
        for tokens in token_counts:
            row, copy = by_key.get((name, tokens)), by_key.get(("copy_ gpu->gpu", tokens))
            if row and copy:
                cells.append(
                    f"{row['loop_GBps'] / copy['loop_GBps']:6.3f} |{row['cold_GBps'] / copy['cold_GBps']:6.3f}"
                )
            else:
                cells.append("-")
        print(f"{name:38s}" + "".join(f"{cell:>20s}" for cell in cells))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 2 sizes, few repeats, small attention"
    )
    parser.add_argument("--tokens", default="256,1024,4096,16384", help="comma-separated token counts")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels.py needs a CUDA GPU")
    token_counts = [256, 1024] if args.quick else [int(t) for t in args.tokens.split(",")]
    if any(t % BLOCK_SIZE or t > NUM_BLOCKS * BLOCK_SIZE for t in token_counts):
        raise SystemExit(f"token counts must be multiples of {BLOCK_SIZE} up to {NUM_BLOCKS * BLOCK_SIZE}")
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "shape": {
            "num_layers": NUM_LAYERS,
            "num_kv_heads": NUM_KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "num_blocks": NUM_BLOCKS,
            "dtype": str(DTYPE),
        },
        "quick": args.quick,
    }
    print(f"device {result['device']}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    ops, peer_note = load_peer()
    print(peer_note, flush=True)
    result["peer"] = peer_note
    rows: list[dict] = []
    kv_cache = torch.randn(
        NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=DEVICE
    )
    peer = Peer(ops, kv_cache) if ops is not None else None
    bench_transfers(kv_cache, peer, token_counts, args.quick, rows)
    del kv_cache, peer
    torch.cuda.empty_cache()
    bench_attention(args.quick, rows)
    result["rows"] = rows
    print_summary(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
