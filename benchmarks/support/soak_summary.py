"""The soak's summary and its checks: from the load's records, the samples and the greedy
outputs, the figures the soak is judged by (drift after warm-up, errors outside the
cache-server restart windows, the server's counters) and whether each target is met.

Called by ``benchmarks/soak.py`` once, after the soak; pure computation over what the
soak collected (changes nothing). `TRACKED`, `STEADY` and `COUNTED` name the sampled
figures; ``benchmarks/support/soak_report.py`` prints and plots the result.
"""

from __future__ import annotations

import argparse
import math
import statistics
from typing import TYPE_CHECKING

from connector.config import OffloadConfig

if TYPE_CHECKING:
    from benchmarks.support.soak_load import Load
    from benchmarks.support.soak_sampler import Sampler

MIB = 1 << 20
#: what the plot and the drift table show: (sample key, label, unit divisor)
TRACKED = (
    ("serve_rss_bytes", "serve RSS (MiB)", MIB),
    ("serve_threads", "serve threads", 1),
    ("serve_fds", "serve open files*", 1),
    ("cache_server_fds", "cache-server files**", 1),
    ("disk_bytes", "disk tier (MiB)", MIB),
    ("gpu_bytes", "GPU memory (MiB)", MIB),
)
#: the figures that must stay within --tolerance-pct after warm-up
STEADY = ("serve_rss_bytes", "serve_threads", "serve_fds", "gpu_bytes")
#: serve's connections to the cache server beside the bulk ones: the gRPC channel's (one
#: more while it reconnects)
CACHE_SERVER_CHANNEL_FDS = 2
#: figures that count things (threads, open files): a change of one is within any tolerance
COUNTED = ("serve_threads", "serve_fds")


def summarize(
    args: argparse.Namespace,
    restart: dict,
    warmup_restart: dict,
    load: Load,
    sampler: Sampler,
    load_end_t: float,
    prompts: list[list[int]],
    soaked: list[dict],
    reference: list[dict],
    clean_shutdown: bool,
) -> dict:
    """The soak's summary: figures after warm-up (outside the restart windows), errors in
    and outside those windows, the server's counters, the greedy comparison, and `checks`
    with whether they all ``passed``. ``restart`` and ``warmup_restart`` are the two
    cache-server restarts' times (empty when there was none)."""
    windows = [
        (r.get("sigterm_t_s", math.inf), r.get("window_end_t_s", math.inf)) for r in (warmup_restart, restart)
    ]

    def in_window(t: float) -> bool:
        return any(begin <= t <= end for begin, end in windows)

    records = load.records
    errors = [r for r in records if r["error"]]
    errors_in_window = [r for r in errors if in_window(r["t_s"]) or in_window(r["t_s"] + r["latency_s"])]
    errors_outside = [r for r in errors if r not in errors_in_window]
    served_after = [r for r in records if r["ok"] and r["t_s"] > restart.get("back_t_s", math.inf)]
    samples = sampler.samples
    after_warmup = [s for s in samples if s["t_s"] >= args.warmup]
    # the drift is taken outside the restart window: while the cache server is down its
    # connections (sockets, shared-memory staging areas) are gone, by design
    steady = [s for s in after_warmup if not in_window(s["t_s"])]
    figures = {}
    for key, _label, _unit in TRACKED:
        values = [s[key] for s in after_warmup if s.get(key) is not None]
        steady_values = [s[key] for s in steady if s.get(key) is not None]
        if not values or not steady_values:
            figures[key] = None
            continue
        # medians of the first and the last quarter (at least 3 samples each): a leak is a
        # trend, a write or a request in flight at one sample is not (a serve process holds
        # ~20 files, so one file open for a write in flight is 5% of them)
        k = max(3, len(steady_values) // 4)
        start, end = statistics.median(steady_values[:k]), statistics.median(steady_values[-k:])
        figures[key] = {
            "first": values[0],
            "last": values[-1],
            "min": min(values),
            "max": max(values),
            "start_median": start,
            "end_median": end,
            "samples_per_median": k,
            "drift_pct": 100.0 * (end - start) / start if start else 0.0,
            # the farthest any sample after warm-up (outside the window) went from the start
            "max_deviation_pct": 100.0 * max(abs(v - start) for v in steady_values) / start if start else 0.0,
        }
    disk_cap = int(args.disk_mib * MIB)
    disk_max = max((s["disk_bytes"] for s in samples), default=0)
    disk_du_max = max((s["disk_du_bytes"] for s in samples), default=0)

    # tier errors per interval between samples, apart for intervals touching the window
    tier_errors_outside: dict[str, float] = {}
    tier_errors_window: dict[str, float] = {}
    for before, after in zip(samples, samples[1:], strict=False):
        touches = any(before["t_s"] <= end and after["t_s"] >= begin for begin, end in windows)
        for name, value in after["metrics"].items():
            if name.startswith("kvstash_tier_errors_total"):
                delta = value - before["metrics"].get(name, 0.0)
                if delta:
                    bucket = tier_errors_window if touches else tier_errors_outside
                    bucket[name] = bucket.get(name, 0.0) + delta
    first_metrics = samples[0]["metrics"] if samples else {}
    last = samples[-1]["metrics"] if samples else {}

    def counter(name: str) -> float:
        return last.get(name, 0.0) - first_metrics.get(name, 0.0)

    grpc_hits_after = 0.0
    back = restart.get("back_t_s", math.inf)
    after_back = [s for s in samples if s["t_s"] >= back]
    if after_back:
        before_back = [s for s in samples if s["t_s"] < back]
        base = before_back[-1]["metrics"] if before_back else first_metrics
        name = "kvstash_tier_hit_chunks_total{tier=grpc}"
        grpc_hits_after = after_back[-1]["metrics"].get(name, 0.0) - base.get(name, 0.0)
    differing = [
        {"prompt_tokens": len(p), "soaked": s, "reference": r}
        for p, s, r in zip(prompts, soaked, reference, strict=True)
        if (s["text"], s["completion_tokens"]) != (r["text"], r["completion_tokens"])
    ]
    summary = {
        "duration_s": args.duration,
        "load_end_t_s": round(load_end_t, 2),
        "warmup_s": args.warmup,
        "requests": len(records),
        "requests_ok": sum(1 for r in records if r["ok"]),
        "streamed": sum(1 for r in records if r["stream"]),
        "aborted_streams": sum(1 for r in records if r["aborted"]),
        "errors": len(errors),
        "errors_in_restart_window": len(errors_in_window),
        "errors_outside_restart_window": len(errors_outside),
        "error_examples": [{k: r[k] for k in ("t_s", "stream", "error")} for r in errors[:20]],
        "requests_with_external_hits": sum(1 for r in records if r["external_hit_tokens"] > 0),
        "client_external_hit_tokens": sum(r["external_hit_tokens"] for r in records),
        "prompt_tokens_sent": sum(r["prompt_tokens"] for r in records),
        "server_counters": {
            "requests_finished": {
                reason: counter(f"kvstash_requests_total{{finish_reason={reason}}}")
                for reason in ("stop", "length", "abort", "error")
            },
            "prompt_tokens": counter("kvstash_prompt_tokens_total"),
            "gpu_prefix_hit_tokens": counter("kvstash_gpu_prefix_hit_tokens_total"),
            "external_hit_tokens": counter("kvstash_external_hit_tokens_total"),
            "kv_loaded_tokens": counter("kvstash_kv_loaded_tokens_total"),
            "kv_saved_tokens": counter("kvstash_kv_saved_tokens_total"),
            "tier_hit_chunks": {
                t: counter(f"kvstash_tier_hit_chunks_total{{tier={t}}}") for t in ("cpu", "disk", "grpc")
            },
            "tier_errors": {
                t: counter(f"kvstash_tier_errors_total{{tier={t}}}") for t in ("cpu", "disk", "grpc")
            },
            "tier_breaker_trips": {
                t: counter(f"kvstash_tier_breaker_trips_total{{tier={t}}}") for t in ("cpu", "disk", "grpc")
            },
            "engine_step_errors": counter("kvstash_engine_step_errors_total"),
        },
        "tier_errors_in_restart_window": tier_errors_window,
        "tier_errors_outside_restart_window": tier_errors_outside,
        "restart": {
            **restart,
            "served_after": len(served_after),
            "grpc_hit_chunks_after": grpc_hits_after,
        },
        "warmup_restart": dict(warmup_restart),
        "figures_after_warmup": figures,
        "disk_cap_bytes": disk_cap,
        "disk_max_bytes": disk_max,
        "disk_max_du_bytes": disk_du_max,
        "sample_failures": sampler.failures,
        "num_samples": len(samples),
        "greedy": {
            "prompts": len(prompts),
            "max_tokens": args.greedy_max_tokens,
            "with_external_hits_on_soaked": sum(1 for s in soaked if s["external_hit_tokens"]),
            "differing": len(differing),
            "differing_examples": differing[:5],
        },
        "serve_shutdown_clean": clean_shutdown,
    }
    summary["checks"] = checks(args, summary)
    summary["passed"] = all(c["ok"] for c in summary["checks"])
    return summary


def checks(args: argparse.Namespace, summary: dict) -> list[dict]:
    """The soak's targets (``--check`` fails the run when one is not met): each a name,
    ``ok`` and a line of detail."""
    tol = args.tolerance_pct
    checks = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"name": name, "ok": bool(ok), "detail": detail})

    for key in STEADY:
        fig = summary["figures_after_warmup"].get(key)
        if fig is None:
            check(f"{key} within {tol:g}%", True, "n/a (not measured here)")
        else:
            # Threads and open files are counts of ~20-80: one more or fewer (a write or a
            # connection in flight at the sampled moment) is the resolution, not a trend.
            change = abs(fig["end_median"] - fig["start_median"])
            within_one = key in COUNTED and change <= 1
            check(
                f"{key} within {tol:g}%",
                abs(fig["drift_pct"]) <= tol or within_one,
                f"drift {fig['drift_pct']:+.1f}%{' (one unit)' if within_one and abs(fig['drift_pct']) > tol else ''} "
                f"(median of the first {fig['samples_per_median']} samples "
                f"after warm-up -> of the last {fig['samples_per_median']}; farthest sample "
                f"{fig['max_deviation_pct']:.1f}% away)",
            )
    pool = summary["figures_after_warmup"].get("cache_server_fds")
    if pool is not None:
        # serve's tier opens at most remote_reads_in_flight bulk connections (a socket and a
        # staging area each) and the gRPC channel's: a leak grows past that, a pool does not
        num_bulk = OffloadConfig().remote_reads_in_flight
        bound = 2 * num_bulk + CACHE_SERVER_CHANNEL_FDS
        check(
            "cache-server files within the pool's bound",
            pool["max"] <= bound,
            f"max {pool['max']} of {bound} (2 per bulk connection, {num_bulk} at most, and the gRPC channel's)",
        )
    check(
        "disk tier within its cap",
        summary["disk_max_bytes"] <= summary["disk_cap_bytes"],
        f"max {summary['disk_max_bytes'] / MIB:.2f} MiB of files (du: "
        f"{summary['disk_max_du_bytes'] / MIB:.2f}) of {summary['disk_cap_bytes'] / MIB:.2f} MiB",
    )
    check(
        "no request error outside the restart window",
        summary["errors_outside_restart_window"] == 0,
        f"{summary['errors_outside_restart_window']} (in the window: {summary['errors_in_restart_window']})",
    )
    counters = summary["server_counters"]
    check(
        "no engine error",
        counters["engine_step_errors"] == 0 and counters["requests_finished"]["error"] == 0,
        f"{counters['engine_step_errors']:g} step errors, {counters['requests_finished']['error']:g} failed requests",
    )
    outside = sum(summary["tier_errors_outside_restart_window"].values())
    check("no tier error outside the restart window", outside == 0, f"{outside:g}")
    restart = summary["restart"]
    check(
        "cache server restarted, engine served after it",
        args.no_restart or ("back_t_s" in restart and "error" not in restart and restart["served_after"] > 0),
        f"{restart.get('error') or ''}{restart['served_after']} requests served after the restart",
    )
    check("requests served", summary["requests_ok"] > 0, f"{summary['requests_ok']}")
    greedy = summary["greedy"]
    check(
        "greedy outputs identical to an engine without offload",
        greedy["prompts"] > 0 and greedy["differing"] == 0,
        f"{greedy['differing']} of {greedy['prompts']} differ",
    )
    check("serve shut down cleanly", summary["serve_shutdown_clean"], "SIGTERM -> exit 0")
    return checks
