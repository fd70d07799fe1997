"""What `kvstash bench` shows and writes: per-round rows, a rich table, JSON (bench.json)
and a PNG plot of TTFT per round for the off and on runs."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from statistics import mean
from typing import Any

from bench.results import BenchResult, Turn


def _of_round(turns: list[Turn], round_index: int) -> list[Turn]:
    return [t for t in turns if t.round == round_index]


def _mean_per_tier(turns: list[Turn]) -> dict[str, float]:
    """Mean loaded tokens per request from each tier (tiers no request loaded from are absent)."""
    tiers = sorted({tier for t in turns for tier in t.tier_to_loaded_tokens})
    return {tier: mean(t.tier_to_loaded_tokens.get(tier, 0) for t in turns) for tier in tiers}


def round_rows(result: BenchResult) -> list[dict[str, Any]]:
    """One row per round: means over users of TTFT (ms) and token counts, where the
    on-run's loaded tokens came from, the planner's recompute choice (None without a
    planner), the physical bound of the hit, and whether the round's outputs are
    identical between the runs."""
    round_to_bound = {bound.round: bound for bound in result.bounds}
    rows = []
    for round_index in range(result.workload.num_rounds):
        off = _of_round(result.turns_off, round_index)
        on = _of_round(result.turns_on, round_index)
        ttft_off_ms = 1e3 * mean(t.ttft_s for t in off)
        ttft_on_ms = 1e3 * mean(t.ttft_s for t in on)
        planned = [t.num_planned_recompute_tokens for t in on if t.num_planned_recompute_tokens is not None]
        bound = round_to_bound.get(round_index + 1)
        bound_s = bound.bound_s if bound is not None else None
        rows.append(
            {
                "round": round_index + 1,
                "prompt_tokens": mean(t.num_prompt_tokens for t in on),
                "ttft_off_ms": ttft_off_ms,
                "ttft_on_ms": ttft_on_ms,
                "speedup": ttft_off_ms / ttft_on_ms if ttft_on_ms > 0 else None,
                "gpu_hit_tokens_off": mean(t.num_gpu_hit_tokens for t in off),
                "gpu_hit_tokens_on": mean(t.num_gpu_hit_tokens for t in on),
                "external_hit_tokens_on": mean(t.num_external_hit_tokens for t in on),
                "loaded_tokens_on": mean(t.num_loaded_tokens for t in on),
                "tier_to_loaded_tokens_on": _mean_per_tier(on),
                "planned_recompute_tokens_on": mean(planned) if planned else None,
                "computed_tokens_off": mean(t.num_computed_tokens for t in off),
                "computed_tokens_on": mean(t.num_computed_tokens for t in on),
                "hit_bytes_on": bound.hit_bytes if bound is not None else None,
                "copy_gbps": (
                    bound.hit_bytes / bound.copy_s / 1e9 if bound is not None and bound.copy_s > 0 else None
                ),
                "decode_step_ms": (
                    1e3 * bound.decode_step_s
                    if bound is not None and bound.decode_step_s is not None
                    else None
                ),
                "bound_ms": 1e3 * bound_s if bound_s is not None else None,
                "outputs_identical": [t.output_token_ids for t in off] == [t.output_token_ids for t in on],
            }
        )
    return rows


def outputs_note(result: BenchResult) -> str:
    """Why the outputs must (float32) or may not (bf16/fp16) be identical between the runs."""
    if result.outputs_must_match:
        return "float32: outputs must be identical token for token (a mismatch is an error exit)"
    return (
        f"{result.dtype}: outputs may differ between the runs without a bug. Offload off recomputes "
        "each prompt (a chunked prefill), offload on loads the prefix's KV and computes only the rest; "
        "the two sum in different orders, and in a 16-bit dtype that can flip a near-tied greedy "
        "token, after which the answers diverge. Runs in float32 (--dtype float32) must match exactly."
    )


def _model_short(result: BenchResult) -> str:
    """The model in a few words for the plot's title: a folder's name, else its label."""
    return Path(result.model).name if os.sep in result.model else result.model


def _loaded_from(tier_to_tokens: dict[str, float]) -> str:
    """ "cpu 8192" or "cpu 6144\ndisk 2048" ("-" when nothing was loaded)."""
    cells = [f"{tier} {tokens:.0f}" for tier, tokens in tier_to_tokens.items() if tokens > 0]
    return "\n".join(cells) if cells else "-"


def _same_output_cell(row: dict[str, Any], must_match: bool) -> str:
    if row["outputs_identical"]:
        return "yes"
    return "NO" if must_match else "no*"


def print_table(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    workload = result.workload
    rows = round_rows(result)
    with_planner = any(row["planned_recompute_tokens_on"] is not None for row in rows)
    table = Table(
        title=(
            f"kvstash bench: {workload.num_users} users x {workload.num_rounds} rounds, "
            f"{workload.context_len}-token contexts, {result.dtype} on {result.device_name or result.device} "
            "(means per request)"
        )
    )
    headers = [
        "round",
        "prompt\ntokens",
        "TTFT off\nms",
        "TTFT on\nms",
        "speed\nup",
        "bound\nms",
        "computed\noff",
        "computed\non",
        "ext hit\ntokens",
        "loaded\nfrom",
    ]
    if with_planner:
        headers.append("planned\nrecompute")
    headers.append("same\noutput")
    for header in headers:
        table.add_column(header, justify="right")
    for row in rows:
        speedup = f"{row['speedup']:.1f}x" if row["speedup"] is not None else "-"
        cells = [
            str(row["round"]),
            f"{row['prompt_tokens']:.0f}",
            f"{row['ttft_off_ms']:.0f}",
            f"{row['ttft_on_ms']:.0f}",
            speedup,
            f"{row['bound_ms']:.1f}" if row["bound_ms"] is not None else "-",
            f"{row['computed_tokens_off']:.0f}",
            f"{row['computed_tokens_on']:.0f}",
            f"{row['external_hit_tokens_on']:.0f}",
            _loaded_from(row["tier_to_loaded_tokens_on"]),
        ]
        if with_planner:
            planned = row["planned_recompute_tokens_on"]
            cells.append(f"{planned:.0f}" if planned is not None else "-")
        cells.append(_same_output_cell(row, result.outputs_must_match))
        table.add_row(*cells)
    # rich assumes 80 columns when not writing to a terminal; the table needs about 110
    console = Console() if sys.stdout.isatty() else Console(width=130)
    console.print(table)
    rates = [row["copy_gbps"] for row in rows if row["copy_gbps"] is not None]
    steps = [row["decode_step_ms"] for row in rows if row["decode_step_ms"] is not None]
    if rates:
        console.print(
            f"bound = hit KV bytes ({result.kv_bytes_per_token}/token) at this run's {result.copy_kind} rate "
            f"({min(rates):.1f}-{max(rates):.1f} GB/s) + 1 decode step "
            f"({min(steps, default=0):.1f}-{max(steps, default=0):.1f} ms)"
        )
    if not result.outputs_must_match and not result.outputs_identical:
        console.print(f"* {outputs_note(result)}")
    console.print(
        f"wall time: off {result.wall_s_off:.1f} s, on {result.wall_s_on:.1f} s (after identical warm-ups); "
        f"outputs identical: {'yes' if result.outputs_identical else 'NO' if result.outputs_must_match else 'no*'}"
    )


def bench_json(result: BenchResult) -> dict[str, Any]:
    """The content of bench.json: the settings, the per-round rows, every request's figures
    (warm-up included) and whether the outputs are identical."""
    return {
        "model": result.model,
        "preset": result.preset,
        "device": result.device,
        "device_name": result.device_name,
        "dtype": result.dtype,
        "kv_bytes_per_token": result.kv_bytes_per_token,
        "copy_kind": result.copy_kind,
        "workload": asdict(result.workload),
        "engine_args": result.engine_args,
        "offload": result.offload,
        "outputs_identical": result.outputs_identical,
        "outputs_must_match": result.outputs_must_match,
        "outputs_note": outputs_note(result),
        "wall_s": {"off": result.wall_s_off, "on": result.wall_s_on},
        "gpu_bytes_between_runs": result.gpu_bytes_between_runs,
        "gpu_peak_bytes": result.gpu_peak_bytes,
        "host_peak_rss_bytes": result.host_peak_rss_bytes,
        "rounds": round_rows(result),
        "warmup": {
            "off": [asdict(t) for t in result.warmup_off],
            "on": [asdict(t) for t in result.warmup_on],
        },
        "turns": {"off": [asdict(t) for t in result.turns_off], "on": [asdict(t) for t in result.turns_on]},
    }


def write_json(result: BenchResult, path: Path) -> Path:
    path.write_text(json.dumps(bench_json(result), indent=2) + "\n")
    return path


def write_plot(result: BenchResult, path: Path) -> Path:
    """Left: mean TTFT per round (lines) over each request's TTFT (dots), off vs on.
    Right: tokens the model computed per request (the noise-free cause of the gap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = round_rows(result)
    rounds = [row["round"] for row in rows]
    figure, (ttft_axes, computed_axes) = plt.subplots(
        1, 2, figsize=(9.6, 3.8), dpi=100, gridspec_kw={"width_ratios": [3, 2]}
    )
    runs = (
        ("offload off (recompute)", result.turns_off, "off", "tab:red"),
        ("offload on (load KV)", result.turns_on, "on", "tab:blue"),
    )
    for label, turns, run, color in runs:
        ttft_axes.scatter(
            [t.round + 1 for t in turns], [1e3 * t.ttft_s for t in turns], color=color, alpha=0.3, s=14
        )
        ttft_axes.plot(rounds, [row[f"ttft_{run}_ms"] for row in rows], marker="o", color=color, label=label)
        computed_axes.plot(
            rounds, [row[f"computed_tokens_{run}"] for row in rows], marker="o", color=color, label=label
        )
    bound_points = [(row["round"], row["bound_ms"]) for row in rows if row["bound_ms"] is not None]
    if bound_points:
        ttft_axes.plot(
            [p[0] for p in bound_points],
            [p[1] for p in bound_points],
            linestyle="--",
            marker="_",
            color="tab:gray",
            label=f"bound: hit KV at {result.copy_kind} rate + 1 decode step",
        )
    for row in rows[1:]:
        if row["speedup"] is not None:
            ttft_axes.annotate(
                f"{row['speedup']:.1f}x",
                (row["round"], row["ttft_on_ms"]),
                textcoords="offset points",
                xytext=(0, -14),
                ha="center",
                fontsize=8,
                color="tab:blue",
            )
    workload = result.workload
    ttft_axes.set_title(
        f"TTFT per round: {workload.num_users} users, {workload.context_len}-token contexts\n"
        f"{_model_short(result)}, {result.dtype} on {result.device_name or result.device}",
        fontsize=9,
    )
    ttft_axes.set_ylabel("time to first token (ms)")
    ttft_axes.legend(fontsize=8)
    computed_axes.set_title("tokens computed per request", fontsize=10)
    for axes in (ttft_axes, computed_axes):
        axes.set_xlabel("round")
        axes.set_xticks(rounds)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path
