"""The soak's result for people: a table of the figures after warm-up with the checks'
verdicts (``print_table``), and a plot of the figures over time (``plot``).

Called by ``benchmarks/soak.py`` once, with the result it wrote to ``soak.json``. Prints,
or writes the one image file it is given; changes nothing else.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.support.soak_summary import STEADY, TRACKED

MIB = 1 << 20


def warmup_restart_line(summary: dict) -> str:
    """The warm-up restart in a few words (empty when there was none)."""
    warmup = summary.get("warmup_restart") or {}
    if "back_t_s" not in warmup:
        return ""
    late = warmup["window_end_t_s"] > summary["warmup_s"]
    return (
        f"; a first restart during the warm-up: SIGTERM at {warmup['sigterm_t_s']} s, back at "
        f"{warmup['back_t_s']} s{' (its window outlasted the warm-up)' if late else ''}"
    )


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = result["summary"]
    console = Console(soft_wrap=True)
    table = Table(
        title=f"soak: figures after {summary['warmup_s']:g} s of warm-up ({summary['num_samples']} samples)"
    )
    for column in ("figure", "first", "last", "min", "max", "drift %", "farthest %"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for key, label, unit in TRACKED:
        fig = summary["figures_after_warmup"].get(key)
        if fig is None:
            table.add_row(label, "n/a", "n/a", "n/a", "n/a", "n/a", "n/a")
            continue
        cells = [fig[k] for k in ("first", "last", "min", "max")]
        table.add_row(
            label,
            *(f"{v / unit:,.1f}" if unit != 1 else f"{v:,.0f}" for v in cells),
            f"{fig['drift_pct']:+.1f}",
            f"{fig['max_deviation_pct']:.1f}",
        )
    console.print(table)
    counters = summary["server_counters"]
    restart = summary["restart"]
    hits = counters["tier_hit_chunks"]
    console.print(
        "* open files other than the load's own connections to the HTTP port and serve's pool towards the "
        "cache server (**: those connections and their shared-memory staging areas, opened on demand up to "
        "the pool's size; not held to the tolerance)\n"
        f"disk tier: max {summary['disk_max_bytes'] / MIB:.2f} MiB of files (du: "
        f"{summary['disk_max_du_bytes'] / MIB:.2f}) of a {summary['disk_cap_bytes'] / MIB:.2f} MiB cap\n"
        f"requests: {summary['requests']} ({summary['requests_ok']} ok, {summary['streamed']} streamed, "
        f"{summary['aborted_streams']} aborted mid-stream; server counted "
        f"{counters['requests_finished']['abort']:g} aborts)\n"
        f"errors: {summary['errors_outside_restart_window']} outside the restart window, "
        f"{summary['errors_in_restart_window']} in it; tier errors in it "
        f"{sum(summary['tier_errors_in_restart_window'].values()):g}, outside "
        f"{sum(summary['tier_errors_outside_restart_window'].values()):g}; engine step errors "
        f"{counters['engine_step_errors']:g}\n"
        f"hits: {summary['requests_with_external_hits']} requests loaded KV; external hit tokens "
        f"{counters['external_hit_tokens']:,.0f} of {counters['prompt_tokens']:,.0f} prompt tokens "
        f"(GPU prefix cache {counters['gpu_prefix_hit_tokens']:,.0f}); chunks read: cpu {hits['cpu']:g}, "
        f"disk {hits['disk']:g}, grpc {hits['grpc']:g}\n"
        f"cache-server restart: SIGTERM at {restart.get('sigterm_t_s', '-')} s, back at "
        f"{restart.get('back_t_s', '-')} s (window until {restart.get('window_end_t_s', '-')} s); "
        f"{restart['served_after']} requests served after it, {restart['grpc_hit_chunks_after']:g} grpc chunks read "
        f"after it{'; ERROR ' + restart['error'] if 'error' in restart else ''}"
        f"{warmup_restart_line(summary)}\n"
        f"greedy: {summary['greedy']['differing']} of {summary['greedy']['prompts']} outputs differ from an engine "
        f"without offload ({summary['greedy']['with_external_hits_on_soaked']} of them loaded KV on the soaked server)"
    )
    for check in summary["checks"]:
        console.print(
            f"  [{'ok' if check['ok'] else 'FAIL'}] {check['name']}: {check['detail']}", markup=False
        )
    if summary["sample_failures"]:
        console.print(f"sample failures: {summary['sample_failures'][:5]}", markup=False)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    summary = result["summary"]
    restart = summary["restart"]
    rows = [(k, label, unit) for k, label, unit in TRACKED if any(s.get(k) is not None for s in samples)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 1.6 * len(rows) + 0.6), sharex=True)
    for ax, (key, label, unit) in zip(axes, rows, strict=True):
        points = [(s["t_s"], s[key] / unit) for s in samples if s.get(key) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", markersize=3, linewidth=1)
        ax.set_ylabel(label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.axvspan(0, summary["warmup_s"], color="0.9", linewidth=0)
        for down in (restart, summary.get("warmup_restart") or {}):
            if "sigterm_t_s" in down and "back_t_s" in down:
                ax.axvspan(down["sigterm_t_s"], down["back_t_s"], color="tab:red", alpha=0.15, linewidth=0)
        if key == "disk_bytes":
            ax.axhline(summary["disk_cap_bytes"] / unit, color="tab:red", linestyle="--", linewidth=0.8)
        if key in STEADY:
            first = summary["figures_after_warmup"].get(key)
            if first:
                ax.set_ylim(
                    min(ax.get_ylim()[0], first["first"] / unit * 0.9),
                    max(ax.get_ylim()[1], first["first"] / unit * 1.1),
                )
    axes[-1].set_xlabel("seconds (grey: warm-up, red: cache server down; dashed: disk cap)", fontsize=8)
    fig.suptitle(f"kvstash soak, {summary['requests']} requests in {summary['duration_s']:g} s", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
