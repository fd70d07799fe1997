"""benchmarks/write_through_stalls.py runs end to end on CPU with small chunks: every probe
has samples in both phases and the write-through window holds the disk writes."""

from __future__ import annotations

import json

PROBES = {"gc", "ticker_proc", "ticker", "get_prefix", "pin", "torch_ops"}


def test_write_through_stalls_small_run(tmp_path, run_benchmark):
    out = tmp_path / "stalls.json"
    result = run_benchmark(
        ["benchmarks/write_through_stalls.py", "--chunk-shape", "2", "2", "256", "2", "64"]
        + ["--num-read-chunks", "4", "--num-write-chunks", "16", "--idle-s", "0.3"]
        + ["--dir", str(tmp_path), "--out", str(out)],
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["num_write_chunks"] == 16 and run["chunk_mib"] == 0.25
    assert set(run["phases"]) == {"idle", "write_through"}
    for phase in ("idle", "write_through"):
        assert set(run["phases"][phase]) == PROBES
    idle = run["phases"]["idle"]
    assert all(idle[name]["count"] > 0 for name in ("ticker", "get_prefix", "pin", "torch_ops"))
    assert run["direct_writes"] in (True, False)
    assert "get_prefix" in result.stdout and "write_through" in result.stdout
    assert not list(tmp_path.glob("kvstash-wt-stalls-*"))  # its disk-tier folder is removed
