"""What `kvstash bench` shows and writes: per-round rows, a rich table, JSON and a
PNG plot of TTFT per round for the off and on runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.bench import BenchResult, Turn


def _of_round(turns: list[Turn], round_index: int) -> list[Turn]:
    return [t for t in turns if t.round == round_index]


def round_rows(result: BenchResult) -> list[dict[str, Any]]:
    """One row per round: means over users of TTFT (ms) and token counts, and whether
    the round's outputs are identical between the runs."""
    rows = []
    for round_index in range(result.workload.num_rounds):
        off = _of_round(result.turns_off, round_index)
        on = _of_round(result.turns_on, round_index)
        ttft_off_ms = 1e3 * mean(t.ttft_s for t in off)
        ttft_on_ms = 1e3 * mean(t.ttft_s for t in on)
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
                "computed_tokens_off": mean(t.num_computed_tokens for t in off),
                "computed_tokens_on": mean(t.num_computed_tokens for t in on),
                "outputs_identical": [t.output_token_ids for t in off] == [t.output_token_ids for t in on],
            }
        )
    return rows


def print_table(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    workload = result.workload
    table = Table(
        title=(
            f"kvstash bench: {workload.num_users} users x {workload.num_rounds} rounds, "
            f"{workload.context_len}-token contexts (means per request)"
        )
    )
    headers = (
        "round",
        "prompt\ntokens",
        "TTFT off\nms",
        "TTFT on\nms",
        "speed\nup",
        "computed\noff",
        "computed\non",
        "ext hit\ntokens",
        "loaded\ntokens",
        "same\noutput",
    )
    for header in headers:
        table.add_column(header, justify="right")
    for row in round_rows(result):
        speedup = f"{row['speedup']:.1f}x" if row["speedup"] is not None else "-"
        table.add_row(
            str(row["round"]),
            f"{row['prompt_tokens']:.0f}",
            f"{row['ttft_off_ms']:.0f}",
            f"{row['ttft_on_ms']:.0f}",
            speedup,
            f"{row['computed_tokens_off']:.0f}",
            f"{row['computed_tokens_on']:.0f}",
            f"{row['external_hit_tokens_on']:.0f}",
            f"{row['loaded_tokens_on']:.0f}",
            "yes" if row["outputs_identical"] else "NO",
        )
    # rich assumes 80 columns when not writing to a terminal; the table needs about 100
    console = Console() if sys.stdout.isatty() else Console(width=120)
    console.print(table)
    console.print(
        f"wall time: off {result.wall_s_off:.1f} s, on {result.wall_s_on:.1f} s; "
        f"outputs identical: {'yes' if result.outputs_identical else 'NO'}"
    )


def write_json(result: BenchResult, path: Path) -> Path:
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
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
        f"TTFT per round: {workload.num_users} users, {workload.context_len}-token contexts", fontsize=10
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
