"""The garbage collector's passes during any ``kvstash`` command (issue 23).

A pass holds the GIL from start to end, in whichever thread allocated the object that
triggered it: a full (generation 2) pass over a process that has imported torch and
kvstash takes 64-76 ms on the shared 2-core CPU machine. This runs a ``kvstash``
command in this process with ``gc.callbacks`` timing every pass, then prints passes per
generation (count, total, max) and the longest ones with their time since start, and
writes them as JSON: whether the collector explains a step's outliers (e.g. a CPU-tier
hit of 40 ms where its neighbours take 28).

    python benchmarks/gc_pauses.py --out gc.json -- bench --model-size 8b --context-len 8192 --users 6
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from engine.cli import main as kvstash_main  # noqa: E402

#: passes at least this long are listed one by one
LONG_PASS_S = 0.002
NUM_LISTED = 20


class PassTimer:
    """Times every collector pass through ``gc.callbacks``: (seconds since start, generation, seconds)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.passes: list[tuple[float, int, float]] = []
        self._pass_started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._pass_started = now
        else:
            self.passes.append(
                (self._pass_started - self.start, info["generation"], now - self._pass_started)
            )


def summary(passes: list[tuple[float, int, float]]) -> dict:
    generations = {}
    for generation in (0, 1, 2):
        seconds = [duration for _, gen, duration in passes if gen == generation]
        generations[str(generation)] = {
            "count": len(seconds),
            "total_ms": sum(seconds) * 1e3,
            "max_ms": max(seconds, default=0.0) * 1e3,
        }
    longest = sorted(passes, key=lambda row: -row[2])[:NUM_LISTED]
    return {
        "generations": generations,
        "long_passes": [
            {"at_s": at, "generation": gen, "ms": duration * 1e3}
            for at, gen, duration in sorted(longest)
            if duration >= LONG_PASS_S
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the kvstash command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the kvstash command after --, e.g. -- bench --model-size 8b")

    timer = PassTimer()
    gc.callbacks.append(timer)
    exit_code = 0
    try:
        kvstash_main(args=command, prog_name="kvstash")  # click exits when the command ends
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    finally:
        gc.callbacks.remove(timer)
    result = {"command": command, "exit_code": exit_code, **summary(timer.passes)}

    print(f"{'generation':<11} {'passes':>7} {'total ms':>9} {'max ms':>8}")
    for generation, row in result["generations"].items():
        print(f"{generation:<11} {row['count']:>7} {row['total_ms']:>9.1f} {row['max_ms']:>8.2f}")
    for row in result["long_passes"]:
        print(f"  pass of generation {row['generation']} at {row['at_s']:.2f} s: {row['ms']:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
