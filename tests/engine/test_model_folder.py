"""A model folder at engine start (engine.model_folder, engine.models.checkpoint_prefetch):
the checkpoint's heads are read into the page cache within a memory budget, the config
and the tokenizer come from the folder, and a bad folder is an error that loses nothing."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from bench.tiny_model import make_tiny_model
from engine import LLM
from engine.model_folder import ModelFolder
from engine.models.checkpoint_prefetch import STEP_BYTES, CheckpointPrefetch
from engine.startup_phases import StartupPhases


def write_checkpoint(folder, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    for index, num_floats in enumerate(sizes):
        save_file({"w": torch.zeros(num_floats)}, str(folder / f"model-{index}.safetensors"))
    return sorted(folder.glob("*.safetensors"))


def test_every_file_is_read_whole_when_the_budget_allows(tmp_path):
    files = write_checkpoint(tmp_path, [1000, 50_000])
    prefetch = CheckpointPrefetch.start(tmp_path, available_bytes=1 << 30)
    assert prefetch is not None and prefetch.files == files
    assert prefetch.join(10)
    assert prefetch.num_prefetched_bytes == sum(path.stat().st_size for path in files)


def test_a_small_budget_reads_the_head_of_each_file_only(tmp_path):
    files = write_checkpoint(tmp_path, [250_000, 250_000])  # 1 MB each
    budget = 1 << 20  # half of what the 2 files hold, taken as available x 0.5 below
    prefetch = CheckpointPrefetch.start(tmp_path, available_bytes=2 * budget)
    assert prefetch.join(10)
    assert prefetch.per_file_bytes == budget // 2 < STEP_BYTES
    assert prefetch.num_prefetched_bytes == budget < sum(path.stat().st_size for path in files)


def test_stop_before_start_reads_nothing(tmp_path):
    files = write_checkpoint(tmp_path, [1000])
    prefetch = CheckpointPrefetch(files, 1 << 30)
    prefetch.stop()
    for thread in prefetch._threads:
        thread.start()
    assert prefetch.join(10) and prefetch.num_prefetched_bytes == 0


def test_nothing_to_prefetch_is_none_and_a_negative_budget_an_error(tmp_path):
    assert CheckpointPrefetch.start(tmp_path, available_bytes=1 << 30) is None  # no files
    write_checkpoint(tmp_path, [10])
    assert CheckpointPrefetch.start(tmp_path, available_bytes=0) is None  # no memory figure
    with pytest.raises(ValueError, match="budget_bytes"):
        CheckpointPrefetch(sorted(tmp_path.glob("*.safetensors")), -1)


def test_a_folder_gives_its_config_and_tokenizer_and_times_the_config(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    startup = StartupPhases()
    folder = ModelFolder.open(model_dir, startup, prefetch_weights=True)
    folder.weights_read()
    assert folder.config.num_layers >= 1 and "config" in startup.snapshot()
    assert folder.tokenizer().encode("hello world")
    if folder.prefetch is not None:
        assert folder.prefetch.join(10)


def test_a_missing_or_bad_folder_is_an_error_that_names_it(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ModelFolder.open(tmp_path / "nowhere", StartupPhases(), prefetch_weights=True)
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        ModelFolder.open(tmp_path / "bad", StartupPhases(), prefetch_weights=True)


def test_a_folder_without_a_tokenizer_fails_the_engine_with_the_tokenizer_error(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    for path in model_dir.iterdir():
        if "token" in path.name:
            path.unlink()
    folder = ModelFolder.open(model_dir, StartupPhases(), prefetch_weights=False)
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises, it reaches the caller
        folder.tokenizer()


def test_an_engine_start_times_config_and_tokenizer_and_never_imports_dynamo(tmp_path):
    """Run in a fresh interpreter: another test of this session may have imported dynamo."""
    import subprocess

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", seed=3)
    code = (
        "import sys, json\n"
        "from engine import LLM\n"
        f"llm = LLM({str(model_dir)!r}, dtype='float32', device='cpu')\n"
        "print(json.dumps({'phases': sorted(llm.engine.startup.snapshot()),"
        " 'dynamo': 'torch._dynamo' in sys.modules, 'tokenizer': llm.engine.tokenizer is not None}))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    import json

    facts = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"config", "weights", "tokenizer", "kv_cache"} <= set(facts["phases"])
    assert facts["tokenizer"] and not facts["dynamo"]
    # the same engine in this process still generates
    assert LLM(model_dir, dtype="float32", device="cpu").generate([[1, 2, 3]])
