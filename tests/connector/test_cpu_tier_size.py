"""The CPU tier's automatic size (connector.cpu_tier_size): it follows the host's memory
figures, given here as a HostMemory (the engine reads them with psutil)."""

from __future__ import annotations

import logging

import pytest

from connector.config import GIB, OffloadConfig, config_from_fields, parse_fields
from connector.cpu_tier_size import HostMemory, auto_cpu_bytes
from engine.offload_cli import offload_config_from_options


def flags(**given):
    options = {
        name: None
        for name in (
            "kv_offload_cpu_gb",
            "kv_offload_disk_path",
            "kv_offload_disk_gb",
            "kv_offload_remote",
            "kv_offload_chunk_size",
            "kv_offload_codec",
            "kv_offload_key_prefix",
            "kv_offload_replicas_per_host",
            "kv_offload_config",
        )
    }
    options["kv_offload"] = True
    options.update(given)
    return options


@pytest.mark.parametrize(
    ("total_gib", "available_gib", "replicas", "expected_gib"),
    [
        (128, 120, 1, 59),  # the GPU host: half of (128 - 10 reserve)
        (128, 120, 2, 29),  # two replicas share that half
        (128, 40, 1, 29),  # a busy host: capped by what is available (40 - 10 - 1 save buffers)
        (256, 250, 4, 30),
        (16, 15, 1, 6),  # a small host keeps a quarter back: 0.5 x (16 - 4)
    ],
)
def test_auto_size_follows_the_host_memory(total_gib, available_gib, replicas, expected_gib):
    host = HostMemory(total_bytes=total_gib * GIB, available_bytes=available_gib * GIB)
    auto = auto_cpu_bytes(host, replicas_per_host=replicas, engine_host_bytes=1 * GIB)
    assert auto.cpu_bytes == expected_gib * GIB
    assert f"{expected_gib} GiB" in auto.reason


def test_replicas_started_together_never_take_more_than_the_host_share():
    """Each replica sees the same MemAvailable when they start together; the share comes
    from MemTotal, so N of them take half of the host between them, not N halves."""
    host = HostMemory(total_bytes=128 * GIB, available_bytes=126 * GIB)
    for replicas in (1, 2, 3, 8):
        per_replica = auto_cpu_bytes(host, replicas_per_host=replicas).cpu_bytes
        assert replicas * per_replica <= 0.5 * (128 - 10) * GIB


def test_auto_size_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match=r"cpu_gb auto: this host has 4\.0 GiB.*--kv-offload-cpu-gb N"):
        auto_cpu_bytes(HostMemory(total_bytes=4 * GIB, available_bytes=1 * GIB))


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True])
def test_bad_replica_counts_are_refused(bad):
    with pytest.raises(ValueError, match="replicas_per_host must be an integer >= 1"):
        auto_cpu_bytes(HostMemory(total_bytes=64 * GIB, available_bytes=64 * GIB), replicas_per_host=bad)


def test_kv_offload_without_a_size_is_auto_and_logs_why(caplog):
    host = HostMemory(total_bytes=128 * GIB, available_bytes=120 * GIB)
    with caplog.at_level(logging.INFO, logger="connector.config"):
        config = offload_config_from_options(flags(), {}, host_memory=host)
    assert config.cpu_bytes == 59 * GIB
    assert "CPU tier of 59 GiB" in caplog.text and "replica(s) per host" in caplog.text
    two = offload_config_from_options(flags(kv_offload_replicas_per_host=2), {}, host_memory=host)
    assert two.cpu_bytes == 29 * GIB
    # weights kept in host memory by --cpu-offload-gb come off what is available
    options = flags(cpu_offload_gb=100.0)
    assert offload_config_from_options(options, {}, host_memory=host).cpu_bytes == 9 * GIB
    assert options == {"cpu_offload_gb": 100.0}  # the engine's flag is left for the engine


def test_explicit_sizes_keep_working_and_auto_can_be_named_anywhere():
    host = HostMemory(total_bytes=64 * GIB, available_bytes=64 * GIB)
    assert offload_config_from_options(flags(kv_offload_cpu_gb=2.5), {}, host_memory=host).cpu_bytes == int(
        2.5 * GIB
    )
    assert (
        offload_config_from_options(flags(kv_offload_cpu_gb="auto"), {}, host_memory=host).cpu_bytes
        == 27 * GIB
    )
    environ = {"KVSTASH_KV_OFFLOAD_CPU_GB": "auto", "KVSTASH_KV_OFFLOAD_REPLICAS_PER_HOST": "3"}
    assert offload_config_from_options(flags(), environ, host_memory=host).cpu_bytes == 9 * GIB
    fields = parse_fields({"cpu_gb": "AUTO", "disk_path": "/tmp/kv"}, source="test")
    assert config_from_fields(fields, source="test", host_memory=host).cpu_bytes == 27 * GIB
    # the dataclass itself keeps a byte count (the Python API names its size)
    assert OffloadConfig().cpu_bytes == 4 * GIB


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {"KVSTASH_KV_OFFLOAD_CPU_GB": "lots"},
            "KVSTASH_KV_OFFLOAD_CPU_GB 'lots': cpu_gb must be a number of GiB",
        ),
        ({"KVSTASH_KV_OFFLOAD_REPLICAS_PER_HOST": "0"}, "REPLICAS_PER_HOST '0': replicas_per_host must be"),
    ],
)
def test_bad_values_name_their_source(environ, message):
    with pytest.raises(ValueError, match=message):
        offload_config_from_options(flags(), environ, host_memory=HostMemory(64 * GIB, 64 * GIB))


def test_the_cli_flag_accepts_auto_and_refuses_words():
    from click.testing import CliRunner

    from engine.cli import main

    result = CliRunner().invoke(main, ["generate", "/nonexistent-model", "--kv-offload-cpu-gb", "lots"])
    assert result.exit_code == 2
    assert "'lots': not a number of GiB nor 'auto'" in result.output
