"""Host time of an eager engine step (no CUDA graph), per step and per layer.

A step that does not replay a CUDA graph (speculative verification, prompt chunks,
pipeline stages, graphs off) is issued op by op from Python: when issuing costs more
than the device needs, the step is host-bound. This benchmark runs three step shapes
through `engine.LLM` with the decode graphs removed (the engine's own glue: Triton
kernels on CUDA in bf16) and measures, median of `--repeats`:

- ``step ms``: wall time of `engine.step()` (scheduler, inputs, forward, sampling);
- ``fwd host ms``: host time to issue the forward pass (model pre-hook -> post-hook,
  no synchronisation): when it is close to ``step ms`` the step is host-bound; ``fwd cpu
  ms``: the CPU time the issuing thread spent in it (steady on a loaded machine);
- ``per layer us``: ``fwd host`` per decoder layer, then split into the layer's parts
  (norms, attention module = QKV GEMM + RoPE + cache write + attention + output GEMM,
  of which ``attn call`` is the paged-attention call, and the MLP), in an instrumented run;
- CUDA only: ``device ms``, the forward's device time alone (CUDA events around it while
  a sleep kernel of ~300 ms holds the stream until the whole pass is queued), ``fwd host
  behind sleep ms``, the host time of that pass (about ``fwd host ms`` unless the pass
  waits for the device somewhere, then ~300 ms more), ``syncs``, the number
  of host<->device synchronisations inside the forward (`torch.cuda.set_sync_debug_mode`,
  each with the line that caused it), and ``graph ms``, the same step replaying a CUDA
  graph where the engine has one for it (decode graphs; mixed graphs for small steps of
  any mix where the engine captures them). The eager rows remove every captured graph
  from the runner for their steps.

On CUDA it also prints the host microseconds per call of each op a layer issues (the
glue kernels, their eager torch forms, one aten op, a GEMM), back to back on one token.

Shapes: decode at batch 1 and 8 (contexts of `--decode-context` tokens) and a chunk of
`--chunk` new tokens over a `--prefix`-token prefix held in the GPU prefix cache.

    python benchmarks/eager_step.py --out eager.json                    # GPU: Llama-3.1-8B shape, bf16
    python benchmarks/eager_step.py --tiny --out /tmp/eager_tiny.json   # CPU: same 32 layers, tiny width
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.presets import llama31_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

#: the decoder-layer parts timed in the instrumented run (module attribute names)
LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def model_config(tiny: bool):
    """The Llama-3.1-8B shape, or its 32 layers at a tiny width (host time only)."""
    if not tiny:
        return llama31_config()
    return llama31_config(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
    )


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class ForwardClock:
    """Forward hooks on the model (and optionally its layers' parts) that record host
    clocks; on CUDA optionally a sleep kernel before the pass and events around it."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.model = self.engine.model
        self.device = self.engine.device
        self.forward_host_s: list[float] = []
        self.forward_cpu_s: list[float] = []
        self.part_host_s: dict[str, list[float]] = defaultdict(list)
        self.device_ms: list[float] = []
        self.sleep_cycles = 0
        self.debug_syncs = False
        self._handles = []
        self._starts: dict[str, float] = {}
        self._events = None
        self._handles.append(self.model.register_forward_pre_hook(self._before_forward))
        self._handles.append(self.model.register_forward_hook(self._after_forward))

    def _before_forward(self, _module, _args) -> None:
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        if self.debug_syncs:
            torch.cuda.set_sync_debug_mode("warn")
        self._starts["forward"] = time.perf_counter()
        self._starts["forward cpu"] = time.thread_time()

    def _after_forward(self, _module, _args, _output) -> None:
        self.forward_host_s.append(time.perf_counter() - self._starts["forward"])
        self.forward_cpu_s.append(time.thread_time() - self._starts["forward cpu"])
        if self.debug_syncs:
            torch.cuda.set_sync_debug_mode("default")
        if self._events is not None:
            self._events[1].record()

    def collect_device_ms(self) -> None:
        """After a synchronised step with `sleep_cycles` set: its forward's device time."""
        if self._events is not None:
            self.device_ms.append(self._events[0].elapsed_time(self._events[1]))
            self._events = None

    def instrument_parts(self) -> None:
        """Time every layer, its parts, and the runner's attention call (host clocks)
        until `remove_parts()`."""
        self._part_handles = []
        for layer in self.model.model.layers:
            self._time_module("layer", layer)
            for part in LAYER_PARTS:
                self._time_module(part, getattr(layer, part))
        runner = self.engine.runner
        attention = runner._attention  # the bound method the forward pass looks up per step
        samples = self.part_host_s["attn call"]

        def timed_attention(*args):
            start = time.perf_counter()
            out = attention(*args)
            samples.append(time.perf_counter() - start)
            return out

        runner._attention = timed_attention
        self._restore_attention = lambda: delattr(runner, "_attention")

    def _time_module(self, name: str, module: torch.nn.Module) -> None:
        key = f"{name}@{id(module)}"

        def before(_module, _args):
            self._starts[key] = time.perf_counter()

        def after(_module, _args, _output):
            self.part_host_s[name].append(time.perf_counter() - self._starts[key])

        self._part_handles.append(module.register_forward_pre_hook(before))
        self._part_handles.append(module.register_forward_hook(after))

    def remove_parts(self) -> None:
        for handle in self._part_handles:
            handle.remove()
        self._part_handles = []
        self._restore_attention()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3 if samples else float("nan")


class Shapes:
    """Engine steps of one shape, each `run_one()` a single timed `engine.step()`."""

    def __init__(self, llm: LLM, seed: int) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.vocab_size = self.engine.model_config.vocab_size
        self.generator = torch.Generator().manual_seed(seed)
        self.counter = 0

    def tokens(self, n: int) -> list[int]:
        return torch.randint(10, self.vocab_size, (n,), generator=self.generator).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> None:
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"eager-{self.counter}", prompt, params)

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def start_decode(self, batch_size: int, context: int, num_steps: int) -> None:
        """`batch_size` requests past their prompts: every later step decodes all of them."""
        for _ in range(batch_size):
            self.add(self.tokens(context), max_tokens=num_steps + 8)
        scheduler = self.engine.scheduler
        while scheduler.waiting or any(not r.output_token_ids for r in scheduler.running):
            self.engine.step()

    def start_chunk(self, prefix: list[int], num_new: int) -> None:
        """A request that prefills `num_new` fresh tokens after `prefix` (cached on the GPU)."""
        self.add(prefix + self.tokens(num_new), max_tokens=1)


def measure_shape(
    llm: LLM, clock: ForwardClock, shapes: Shapes, kind: str, args, batch_size: int, prefix
) -> dict:
    """Warm, then time `args.repeats` steps of the shape (plain, instrumented, CUDA extras)."""
    engine = llm.engine
    device = engine.device
    runner = engine.runner
    # every kind of captured graph the runner has (decode graphs; mixed graphs where they
    # exist): removed for the eager rows, restored for the graph row
    graph_attributes = [name for name in ("decode_graphs", "mixed_graphs") if getattr(runner, name, None)]
    saved_graphs = {name: getattr(runner, name) for name in graph_attributes}

    def set_graphs(on: bool) -> None:
        for name, graphs in saved_graphs.items():
            setattr(runner, name, graphs if on else None)

    def one_step() -> float:
        if kind == "chunk":
            shapes.start_chunk(prefix, args.chunk)
        synchronize(device)
        start = time.perf_counter()
        engine.step()
        synchronize(device)
        return time.perf_counter() - start

    def steps(n: int) -> list[float]:
        return [one_step() for _ in range(n)]

    if kind == "decode":
        shapes.start_decode(batch_size, args.decode_context, num_steps=5 * args.repeats + 16)
    set_graphs(False)
    steps(2)  # warm: compilation and kernel variants of this shape
    clock.forward_host_s.clear()
    clock.forward_cpu_s.clear()
    wall = steps(args.repeats)
    forward_host = list(clock.forward_host_s)
    forward_cpu = list(clock.forward_cpu_s)
    row = {
        "shape": kind,
        "batch_size": batch_size,
        "new_tokens": batch_size if kind == "decode" else args.chunk,
        "context": args.decode_context if kind == "decode" else len(prefix),
        "step_ms": median_ms(wall),
        "forward_host_ms": median_ms(forward_host),
        # CPU time of the issuing thread: what the host spent, whatever else loads the machine
        "forward_cpu_ms": median_ms(forward_cpu),
    }
    num_layers = len(engine.model.model.layers)
    row["per_layer_host_us"] = row["forward_host_ms"] * 1e3 / num_layers
    # instrumented run: the parts' host time per layer (hooks add a few us each)
    clock.part_host_s.clear()
    clock.instrument_parts()
    steps(args.repeats)
    clock.remove_parts()
    per_step = args.repeats
    row["parts_us_per_layer"] = {
        name: sum(samples) / per_step / num_layers * 1e6 for name, samples in clock.part_host_s.items()
    }
    if device.type == "cuda":
        # device time alone: a sleep holds the stream until the whole pass is queued; the
        # host time of that pass stays the plain one unless the pass waits for the device
        clock.sleep_cycles = args.sleep_cycles
        clock.forward_host_s.clear()
        for _ in range(args.repeats):
            one_step()
            clock.collect_device_ms()
        clock.sleep_cycles = 0
        row["forward_host_ms_behind_sleep"] = median_ms(clock.forward_host_s)
        row["device_ms"] = statistics.median(clock.device_ms)
        clock.device_ms.clear()
        row.update(count_syncs(clock, one_step))
    if args.profile:
        row["profile"] = profiled_step(one_step, args.profile)
        if saved_graphs:
            # the same step where the engine would replay a graph (if one covers it: the
            # forward hook then records no pass)
            set_graphs(True)
            steps(2)
            clock.forward_host_s.clear()
            row["graph_step_ms"] = median_ms(steps(args.repeats))
            row["graph_replayed"] = not clock.forward_host_s
    set_graphs(True)
    if kind == "decode":
        shapes.drain()
    return row


def count_syncs(clock: ForwardClock, one_step) -> dict:
    """Host<->device synchronisations inside one eager forward pass, with their lines."""
    clock.debug_syncs = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            one_step()
    finally:
        clock.debug_syncs = False
        torch.cuda.set_sync_debug_mode("default")
    sources: dict[str, int] = defaultdict(int)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            sources[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return {"forward_syncs": sum(sources.values()), "sync_sources": dict(sources)}


def profiled_step(one_step, limit: int) -> dict:
    """One step under torch.profiler: its top ops by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.hit_profile import top_ops

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        one_step()
    device_key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    result = {
        "top_host": top_ops(prof, "self_cpu_time_total", limit),
        "top_device": top_ops(prof, device_key, limit),
    }
    for title, rows in result.items():
        print(
            f"  {title}: "
            + "; ".join(f"{r['name']} x{r['count']} {r['host_ms']:.2f}/{r['device_ms']:.2f} ms" for r in rows)
        )
    return result


def launch_costs(
    device: torch.device, dtype: torch.dtype, hidden: int, num_calls: int = 300
) -> dict[str, float]:
    """Host microseconds per call of the ops one layer issues, back to back on one-token
    inputs (the device keeps up, so the time is the host's): what an eager step's ~10
    launches per layer cost. CUDA only."""
    import torch.nn.functional as F

    from engine.models import glue
    from kernels.rms_norm import rms_norm

    try:
        from kernels.elementwise import rotary_qk, silu_and_mul
    except ImportError:  # a tree before the glue kernels (the "before" run of this script)
        rotary_qk = silu_and_mul = None

    x = torch.randn(1, hidden, device=device, dtype=dtype)
    weight = torch.ones(hidden, device=device, dtype=dtype)
    matrix = torch.randn(hidden, hidden, device=device, dtype=dtype)
    qkv = torch.randn(1, 48 * 128, device=device, dtype=dtype)
    query, key = qkv[:, : 32 * 128].view(1, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(1, 8, 128)
    cos = torch.randn(1, 128, device=device, dtype=dtype)
    gate_up = torch.randn(1, 2 * hidden, device=device, dtype=dtype)
    gate, up = gate_up.split(hidden, dim=-1)
    ops = {
        "rms_norm kernel": lambda: rms_norm(x, weight, 1e-5),
        "rms_norm eager torch": lambda: glue.rms_norm(x, weight, 1e-5),
        "rotary_qk eager torch": lambda: glue.rotary_qk(query, key, cos, cos),
        "add (one aten op)": lambda: x + x,
        "linear (cuBLAS)": lambda: F.linear(x, matrix),
    }
    if rotary_qk is not None:
        ops["rotary_qk kernel"] = lambda: rotary_qk(query, key, cos, cos)
        ops["silu_and_mul kernel"] = lambda: silu_and_mul(gate, up)
    costs = {}
    for name, op in ops.items():
        for _ in range(20):
            op()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(num_calls):
            op()
        costs[name] = (time.perf_counter() - start) / num_calls * 1e6
        synchronize(device)
    return costs


def calibrate_sleep(device: torch.device, target_ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that last about `target_ms`."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # first call loads the kernel
    synchronize(device)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    synchronize(device)
    return int(cycles * target_ms / max(start.elapsed_time(end), 1e-3))


def print_table(rows: list[dict], on_cuda: bool) -> None:
    header = ["shape", "batch", "new tok", "ctx", "step ms", "fwd host ms", "fwd cpu ms", "per layer us"]
    if on_cuda:
        header += ["device ms", "fwd host behind sleep ms", "syncs", "graph ms"]
    header += ["norms us", "attn mod us", "attn call us", "mlp us"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        parts = row["parts_us_per_layer"]
        cells = [
            row["shape"],
            row["batch_size"],
            row["new_tokens"],
            row["context"],
            f"{row['step_ms']:.2f}",
            f"{row['forward_host_ms']:.2f}",
            f"{row['forward_cpu_ms']:.2f}",
            f"{row['per_layer_host_us']:.0f}",
        ]
        if on_cuda:
            graph = row.get("graph_step_ms") if row.get("graph_replayed") else None
            cells += [
                f"{row['device_ms']:.2f}",
                f"{row['forward_host_ms_behind_sleep']:.2f}",
                row["forward_syncs"],
                "-" if graph is None else f"{graph:.2f}",
            ]
        norms = parts.get("input_layernorm", 0.0) + parts.get("post_attention_layernorm", 0.0)
        cells += [
            f"{norms:.0f}",
            f"{parts.get('self_attn', 0.0):.0f}",
            f"{parts.get('attn call', 0.0):.0f}",
            f"{parts.get('mlp', 0.0):.0f}",
        ]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="32 layers at a tiny width (CPU smoke run)")
    parser.add_argument(
        "--device", default=None, help="default: cuda when available (8B shape), else cpu (tiny)"
    )
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes")
    parser.add_argument(
        "--decode-context", type=int, default=None, help="prompt tokens of each decoding request"
    )
    parser.add_argument("--prefix", type=int, default=None, help="cached prefix of the chunk step (tokens)")
    parser.add_argument("--chunk", type=int, default=80, help="new tokens of the chunk step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: host time without thread contention)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print the top N ops of one profiled step per shape (host and device)",
    )
    args = parser.parse_args(argv)
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.device = args.device or ("cuda" if on_cuda else "cpu")
    args.tiny = args.tiny or not on_cuda
    args.dtype = args.dtype or ("bfloat16" if on_cuda else "float32")
    args.decode_context = args.decode_context or (1024 if on_cuda else 256)
    args.prefix = args.prefix or (8192 if on_cuda else 1024)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    torch.set_num_threads(args.threads)
    config = model_config(args.tiny)
    # each decode request runs through every measurement of its shape (about 5 x repeats steps)
    max_model_len = max(args.prefix + args.chunk, args.decode_context + 5 * args.repeats + 24) + 64
    llm = LLM(
        config,
        load_format="dummy",
        device=args.device,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=max(batches),
        max_num_batched_tokens=max(8192, args.prefix + args.chunk, max(batches) * args.decode_context),
        warmup=False,
    )
    engine = llm.engine
    device = engine.device
    on_cuda = device.type == "cuda"
    clock = ForwardClock(llm)
    shapes = Shapes(llm, args.seed)
    if on_cuda:
        args.sleep_cycles = calibrate_sleep(device, 300.0)
    rows = []
    for batch_size in batches:
        rows.append(measure_shape(llm, clock, shapes, "decode", args, batch_size, None))
    prefix = shapes.tokens(args.prefix)
    shapes.add(prefix, max_tokens=1)  # prefill the prefix once: its blocks stay in the prefix cache
    shapes.drain()
    rows.append(measure_shape(llm, clock, shapes, "chunk", args, 1, prefix))
    clock.remove()
    costs = launch_costs(device, engine.dtype, engine.model_config.hidden_size) if on_cuda else {}
    print(
        f"eager steps ({'Llama-3.1-8B shape' if not args.tiny else '32 layers, tiny width'}, {args.dtype}, "
        f"{device}, {len(engine.model.model.layers)} layers), median of {args.repeats}:"
    )
    print_table(rows, on_cuda)
    if costs:
        print(
            "host us per call, back to back, one token: "
            + ", ".join(f"{k} {v:.1f}" for k, v in costs.items())
        )
    result = {
        "benchmark": "eager_step",
        "device": torch.cuda.get_device_name(device) if on_cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": "tiny-width 32 layers" if args.tiny else "llama-3.1-8b shape",
        "dtype": args.dtype,
        "repeats": args.repeats,
        "decode_context": args.decode_context,
        "prefix": args.prefix,
        "chunk": args.chunk,
        "rows": rows,
        "launch_costs_us": costs,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
