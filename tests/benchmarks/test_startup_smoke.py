"""benchmarks/startup.py makes a sharded checkpoint, reads it raw, starts LLM() and
kvstash serve from it and reports their start-up phases (tiny size, on CPU)."""

from __future__ import annotations

import json


def test_startup_at_tiny_size(tmp_path, run_benchmark):
    out = tmp_path / "startup.json"
    result = run_benchmark(
        [
            "benchmarks/startup.py",
            "--model-size",
            "tiny",
            "--shard-gb",
            "0.0002",
            "--cpu-tier-gb",
            "1",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert data["num_files"] >= 2 and data["checkpoint_gb"] > 0 and data["raw_read_s"] > 0
    (run,) = data["runs"]
    llm, serve = run["llm"], run["serve"]
    assert {"weights", "fingerprint", "kv_cache", "tiers", "warmup"} <= set(llm["phases"])
    assert llm["weights_gb"] >= data["checkpoint_gb"]  # every byte read (and hashed: offload is on)
    assert {"imports", "weights", "fingerprint", "tiers", "server"} <= set(serve["phases"])
    assert serve["health_s"] >= serve["phases"]["weights"]
    assert "serve to /health cpu 1 GiB" in result.stdout and "target (1.5 x raw + 10 s)" in result.stdout
