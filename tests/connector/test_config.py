"""OffloadConfig validation and its three sources (flags > YAML > environment)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from connector import OffloadConfig
from connector.config import GIB
from connector.cpu_tier_size import HostMemory
from engine.offload_cli import offload_config_from_options


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"chunk_size": 2.5}, "chunk_size must be a positive integer"),
        ({"cpu_bytes": -1}, "cpu_bytes must be a non-negative integer"),
        ({"codec": "zstd"}, "codec must be one of none, lz4"),
        ({"remote_url": "http://cache:80"}, "must start with one of redis://, rediss://"),
        ({"cpu_bytes": 0}, "no tier configured"),
        ({"disk_path": "/tmp/x", "disk_bytes": 0}, "disk_bytes must be positive"),
        ({"pin_timeout_s": 0}, "pin_timeout_s must be a positive number"),
        ({"save_queue_size": 0}, "save_queue_size must be positive"),
        ({"layerwise": "yes"}, "layerwise must be a boolean"),
        ({"tier_probe_interval_s": -1}, "tier_probe_interval_s must be a finite number of seconds >= 0"),
        ({"tier_probe_interval_s": float("inf")}, "tier_probe_interval_s must be a finite number"),
    ],
)
def test_bad_values_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**fields)


@pytest.mark.parametrize("scheme", ["redis", "rediss", "redis+cluster", "rediss+cluster", "grpc", "grpcs"])
def test_every_remote_scheme_is_accepted(scheme):
    assert OffloadConfig(remote_url=f"{scheme}://host:1234").remote_url == f"{scheme}://host:1234"


def test_offload_config_and_the_backend_registry_accept_the_same_remote_schemes():
    """Issue #17: rediss+cluster:// (Redis Cluster over TLS) was accepted by one, refused by the other."""
    from connector.config import REMOTE_SCHEMES
    from storage_backends.registry import SCHEME_TO_FACTORY

    assert set(REMOTE_SCHEMES) == set(SCHEME_TO_FACTORY) - {"cpu", "file"}
    url = "rediss+cluster://node-1:7000?ssl_ca_certs=/etc/ca.pem"
    assert offload_config_from_options(no_flags(kv_offload_remote=url), {}).remote_url == url


def test_every_offload_variable_the_docs_name_is_one_the_engine_reads():
    """Issue #17: docs/configuration.md named KVSTASH_KV_OFFLOAD_REMOTE (the variable is
    KVSTASH_KV_OFFLOAD_REMOTE_URL; an unknown one stops the engine at start-up). Every
    KVSTASH_* name in the docs is read by the code."""
    import re
    from pathlib import Path

    repo_root = Path(__file__).resolve().parents[2]
    documents = [
        repo_root / "README.md",
        repo_root / "docker-compose.yml",
        *sorted((repo_root / "docs").glob("*.md")),
    ]
    names = {
        (path.name, name)
        for path in documents
        for name in re.findall(r"\bKVSTASH_[A-Z0-9_]*[A-Z0-9]\b", path.read_text())
    }
    assert any(doc == "configuration.md" and name.startswith("KVSTASH_KV_OFFLOAD_") for doc, name in names)
    sources = "\n".join(
        path.read_text()
        for folder in ("engine", "connector", "cache_server", "storage_backends", "tests", "benchmarks")
        for path in (repo_root / folder).rglob("*.py")
    )
    wrong = []
    for document, name in sorted(names):
        if name.startswith("KVSTASH_KV_OFFLOAD_") and name != "KVSTASH_KV_OFFLOAD_CONFIG":
            try:
                OffloadConfig.from_env({name: "0"})
            except ValueError as error:
                if "unknown offload setting" in str(error):
                    wrong.append((document, name))
        elif f'"{name}"' not in sources:  # read as a string constant somewhere in the code
            wrong.append((document, name))
    assert not wrong, f"variables the docs name but no code reads: {wrong}"


def test_a_disk_size_without_a_disk_folder_is_an_error(tmp_path):
    """Issue #17: --kv-offload-disk-gb alone silently gave no disk tier."""
    with pytest.raises(ValueError, match="disk tier size .* no disk folder"):
        offload_config_from_options(no_flags(kv_offload_disk_gb=8.0), {})
    with pytest.raises(ValueError, match="no disk folder"):
        offload_config_from_options(
            no_flags(), {"KVSTASH_KV_OFFLOAD": "1", "KVSTASH_KV_OFFLOAD_DISK_GB": "8"}
        )
    with pytest.raises(ValueError, match="no disk folder"):
        OffloadConfig.from_mapping({"disk_gb": 8})
    path = tmp_path / "offload.yaml"
    path.write_text(f"disk_path: {tmp_path / 'kv'}\n")
    merged = offload_config_from_options(no_flags(kv_offload_config=str(path), kv_offload_disk_gb=2.0), {})
    assert (merged.disk_path, merged.disk_bytes) == (str(tmp_path / "kv"), 2 * GIB)


def test_from_yaml_reads_settings_and_gib_sizes(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("cpu_gb: 0.5\nchunk_size: 128\nremote_url: redis://cache:6379/0\nlayerwise: true\n")
    config = OffloadConfig.from_yaml(path)
    assert (config.cpu_bytes, config.chunk_size, config.remote_url, config.layerwise) == (
        GIB // 2,
        128,
        "redis://cache:6379/0",
        True,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("chunk_size: 64\ncpu_size: 3\n", "unknown offload setting"),
        ("chunk_size: [1\n", "not valid YAML"),
        ("- 1\n- 2\n", "must hold a mapping"),
        ("cpu_gb: lots\n", "cpu_gb must be a number of GiB"),
    ],
)
def test_bad_yaml_files_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "offload.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        OffloadConfig.from_yaml(path)


def test_from_env_converts_strings():
    config = OffloadConfig.from_env(
        {
            "KVSTASH_KV_OFFLOAD_CHUNK_SIZE": "64",
            "KVSTASH_KV_OFFLOAD_LAYERWISE": "true",
            "KVSTASH_KV_OFFLOAD_DISK_PATH": "/var/cache/kv",
            "KVSTASH_KV_OFFLOAD_DISK_GB": "2",
            "UNRELATED": "x",
        }
    )
    assert (config.chunk_size, config.layerwise, config.disk_path, config.disk_bytes) == (
        64,
        True,
        "/var/cache/kv",
        2 * GIB,
    )
    with pytest.raises(
        ValueError, match="environment: KVSTASH_KV_OFFLOAD_CHUNK_SIZE 'big': chunk_size must be an integer"
    ):
        OffloadConfig.from_env({"KVSTASH_KV_OFFLOAD_CHUNK_SIZE": "big"})


def no_flags(**flags):
    options = {
        "kv_offload": False,
        "kv_offload_cpu_gb": None,
        "kv_offload_disk_path": None,
        "kv_offload_disk_gb": None,
        "kv_offload_remote": None,
        "kv_offload_chunk_size": None,
        "kv_offload_codec": None,
        "kv_offload_load_policy": None,
        "kv_offload_key_prefix": None,
        "kv_offload_config": None,
    }
    options.update(flags)
    return options


def test_precedence_is_flags_then_yaml_then_environment(tmp_path):
    path = tmp_path / "offload.yaml"
    path.write_text("chunk_size: 128\ncodec: lz4\n")
    environ = {
        "KVSTASH_KV_OFFLOAD_CHUNK_SIZE": "64",
        "KVSTASH_KV_OFFLOAD_CPU_GB": "1",
        "KVSTASH_KV_OFFLOAD": "1",
    }
    both = offload_config_from_options(
        no_flags(kv_offload_config=str(path), kv_offload_chunk_size=32), environ
    )
    assert (both.chunk_size, both.codec, both.cpu_bytes) == (32, "lz4", GIB)
    yaml_over_env = offload_config_from_options(no_flags(kv_offload_config=str(path)), environ)
    assert yaml_over_env.chunk_size == 128
    env_only = offload_config_from_options(no_flags(), environ)
    assert (env_only.chunk_size, env_only.codec) == (64, "none")


def test_key_prefix_flag_wins_over_the_environment():
    environ = {"KVSTASH_KV_OFFLOAD_KEY_PREFIX": "team-b/"}
    assert (
        offload_config_from_options(no_flags(kv_offload_key_prefix="team-a/"), environ).key_prefix
        == "team-a/"
    )
    assert offload_config_from_options(no_flags(kv_offload=True), environ).key_prefix == "team-b/"
    with pytest.raises(ValueError, match="printable ASCII"):
        offload_config_from_options(no_flags(kv_offload_key_prefix="team a/"), {})


def test_load_policy_flag_wins_over_the_environment_and_is_on_its_own_a_request_for_offload():
    environ = {"KVSTASH_KV_OFFLOAD_LOAD_POLICY": "always"}
    assert offload_config_from_options(no_flags(kv_offload=True), environ).load_policy == "always"
    assert (
        offload_config_from_options(no_flags(kv_offload_load_policy="planned"), environ).load_policy
        == "planned"
    )
    config = offload_config_from_options(no_flags(kv_offload_load_policy="always"), {})
    assert config is not None and config.load_policy == "always"
    assert offload_config_from_options(no_flags(kv_offload=True), {}).load_policy == "planned"


def test_offload_is_off_unless_asked_for():
    assert offload_config_from_options(no_flags(), {}) is None
    host = HostMemory(total_bytes=64 * GIB, available_bytes=60 * GIB)
    # no size given: the CPU tier is sized from the host (connector.cpu_tier_size)
    assert offload_config_from_options(no_flags(kv_offload=True), {}, host_memory=host) == OffloadConfig(
        cpu_bytes=27 * GIB
    )
    assert offload_config_from_options(no_flags(kv_offload_cpu_gb=0.25), {}).cpu_bytes == GIB // 4


def test_options_are_popped_and_bad_flag_values_raise():
    options = no_flags(kv_offload=True, kv_offload_remote="ftp://x", dtype="float32")
    with pytest.raises(ValueError, match="command line: --kv-offload-remote 'ftp://x': must start with"):
        offload_config_from_options(options, {})
    assert set(options) == {"dtype"}


def test_generate_lists_the_offload_flags():
    from engine.cli import main

    result = CliRunner().invoke(main, ["generate", "--help"])
    assert result.exit_code == 0
    for flag in (
        "--kv-offload ",
        "--kv-offload-cpu-gb",
        "--kv-offload-disk-path",
        "--kv-offload-disk-gb",
        "--kv-offload-remote",
        "--kv-offload-chunk-size",
        "--kv-offload-codec",
        "--kv-offload-load-policy",
        "--kv-offload-key-prefix",
        "--kv-offload-config",
    ):
        assert flag in result.output
