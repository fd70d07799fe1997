"""Bad offload settings are refused before the model loads, quoting what the user typed
(issue 35): `kvstash serve`, `generate` and `bench` run for real as child processes over
the tiny model. "Before the model loads" is read from the output: the engine logs
`loading the model from …` first thing when it loads one (checked by the control test)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.serving.server_process import repo_env

LOADING = "loading the model from"
#: a guard against a hang only: a refused command exits long before it
HANG_GUARD_S = 300


def run_cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = repo_env()
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_GUARD_S,
        check=False,
    )


def assert_refused_before_loading(result: subprocess.CompletedProcess, *expected: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    assert LOADING not in output, output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(error_lines) == 1, output
    for text in expected:
        assert text in error_lines[0], output


def test_a_good_config_logs_loading_the_model(tiny_model_dir, tmp_path):
    """The control: the line the other tests look for is there when the model does load."""
    result = run_cli(
        "generate",
        str(tiny_model_dir("llama")),
        "--prompt",
        "hello",
        "--max-tokens",
        "2",
        "--kv-offload-cpu-gb",
        "0.01",
        "--kv-offload-chunk-size",
        "16",
    )
    assert result.returncode == 0, result.stderr
    assert LOADING in result.stderr


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (
            ["--kv-offload-remote", "grpc://127.0.0.1"],
            ["--kv-offload-remote", "'grpc://127.0.0.1'", "no port (expected grpc://HOST:PORT)"],
        ),
        (
            ["--kv-offload-remote", "grpc://127.0.0.1:http"],
            ["--kv-offload-remote", "'grpc://127.0.0.1:http'", "port 'http' is not a number"],
        ),
        (
            ["--kv-offload-remote", "grpc://127.0.0.1:5?bulk=maybe"],
            ["--kv-offload-remote", "bulk must be 'on' or 'off'"],
        ),
        (
            ["--kv-offload-remote", "redis://cache:6379/zero"],
            ["--kv-offload-remote", "'redis://cache:6379/zero'", "database number"],
        ),
        (["--kv-offload-remote", "http://cache:80"], ["--kv-offload-remote", "must start with one of"]),
        (["--kv-offload-cpu-gb", "-1"], ["--kv-offload-cpu-gb", "-1"]),
        (["--kv-offload-chunk-size", "0"], ["--kv-offload-chunk-size", "0"]),
        (["--kv-offload-key-prefix", "team a/"], ["--kv-offload-key-prefix", "'team a/'", "printable"]),
    ],
)
def test_bad_flags_are_refused_before_the_model_loads(tiny_model_dir, command, flags, expected):
    extra = ["--prompt", "hello"] if command == "generate" else ["--port", "0", "--host", "127.0.0.1"]
    result = run_cli(command, str(tiny_model_dir("llama")), *extra, *flags)
    assert_refused_before_loading(result, *expected)
    # the URL the user typed, never one the engine built from it
    assert "codec=none" not in result.stderr


def test_a_disk_path_under_a_file_is_refused(tiny_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli(
        "serve", str(tiny_model_dir("llama")), "--kv-offload-disk-path", str(blocker / "kv"), "--port", "0"
    )
    assert_refused_before_loading(result, "--kv-offload-disk-path", repr(str(blocker / "kv")), "not a folder")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("remote_url: grpc://127.0.0.1\n", ["remote_url 'grpc://127.0.0.1'", "no port"]),
        ("chunk_size: -4\n", ["chunk_size -4", "positive"]),
        ("cpu_gb: lots\n", ["cpu_gb 'lots'", "number of GiB"]),
        ("chunk_size: [1\n", ["not valid YAML"]),
        ("cpu_size: 3\n", ["unknown offload setting", "cpu_size"]),
    ],
)
def test_a_bad_yaml_file_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, text, expected):
    path = tmp_path / "offload.yaml"
    path.write_text(text)
    result = run_cli("serve", str(tiny_model_dir("llama")), "--port", "0", "--kv-offload-config", str(path))
    assert_refused_before_loading(result, f"offload config file {str(path)!r}", *expected)


def test_a_bad_environment_value_is_refused_naming_the_variable(tiny_model_dir):
    result = run_cli(
        "generate",
        str(tiny_model_dir("llama")),
        "--prompt",
        "hello",
        "--kv-offload",
        env_extra={"KVSTASH_KV_OFFLOAD_REMOTE_URL": "grpc://127.0.0.1"},
    )
    assert_refused_before_loading(result, "KVSTASH_KV_OFFLOAD_REMOTE_URL 'grpc://127.0.0.1'", "no port")


def test_bench_refuses_a_bad_config_file_before_making_or_loading_a_model(tmp_path):
    """Without --model, bench makes its preset's model first: the file is read before that."""
    path = tmp_path / "offload.yaml"
    path.write_text("remote_url: grpc://127.0.0.1\n")
    result = run_cli(
        "bench", "--model-size", "tiny", "--out", str(tmp_path / "out"), "--kv-offload-config", str(path)
    )
    assert_refused_before_loading(result, "remote_url 'grpc://127.0.0.1'", "no port")
    assert "preset" not in result.stdout  # printed once the preset (and its model) is resolved
    assert not (tmp_path / "out").exists()


def test_engine_args_check_the_role_offline_too():
    from connector.config import OffloadConfig
    from engine.config import EngineArgs

    for role, offload in [
        ("producer", None),
        ("consumer", OffloadConfig(cpu_bytes=1 << 20, kv_transfer="shared")),
        ("decode", None),
    ]:
        with pytest.raises(ValueError, match="kv_role"):
            EngineArgs(kv_role=role, kv_offload=offload).validate()
    EngineArgs(kv_role="producer", kv_offload=OffloadConfig(remote_url="redis://127.0.0.1:6379")).validate()
    EngineArgs(kv_role="both").validate()
    # the direct path needs a CPU tier (its memory is what NIXL reads) and one engine process
    direct = OffloadConfig(cpu_bytes=0, remote_url="redis://127.0.0.1:6379", kv_transfer="direct")
    with pytest.raises(ValueError, match="kv_transfer 'direct' needs a CPU tier"):
        EngineArgs(kv_role="consumer", kv_offload=direct).validate()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--kv-role", "producer"], ["kv_role 'producer' needs a tier shared", "--kv-offload-remote"]),
        (
            ["--kv-role", "consumer", "--kv-offload", "--kv-transfer", "shared"],
            ["kv_role 'consumer' needs a tier shared"],
        ),
        (
            ["--kv-role", "producer", "--kv-transfer", "direct", "--kv-offload", "--kv-offload-cpu-gb", "0"]
            + ["--kv-offload-remote", "redis://127.0.0.1:1"],
            ["kv_transfer 'direct' needs a CPU tier"],
        ),
        (["--kv-direct-hold-s", "5"], ["need --kv-offload"]),
        (["--kv-role", "prefill"], ["--kv-role", "'prefill' is not one of"]),
    ],
)
def test_a_role_without_a_shared_tier_is_refused_before_the_model_loads(tiny_model_dir, flags, expected):
    result = run_cli("serve", str(tiny_model_dir("llama")), "--port", "0", "--host", "127.0.0.1", *flags)
    assert_refused_before_loading(result, *expected)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--prefill", "http://127.0.0.1:1"], ["Missing option '--decode'"]),
        (["--decode", "127.0.0.1:8000"], ["--decode", "'127.0.0.1:8000' is no http(s)://HOST:PORT URL"]),
        (["--decode", "http://h:port"], ["--decode", "the port is no number"]),
    ],
)
def test_the_proxy_refuses_bad_engine_urls(flags, expected):
    result = run_cli("proxy", "--port", "0", "--host", "127.0.0.1", *flags)
    assert_refused_before_loading(result, *expected)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tokenizer", "."], ["Missing option '--replica'"]),
        (["--replica", "http://127.0.0.1:1"], ["Missing option '--tokenizer'"]),
        (
            ["--replica", "http://127.0.0.1:1", "--tokenizer", "/nonexistent"],
            ["'/nonexistent' does not exist"],
        ),
        (
            ["--replica", "http://127.0.0.1:1", "--tokenizer", ".", "--replica-events", "tcp://127.0.0.1:5"],
            ["--replica-events", "is not PUB,REPLAY"],
        ),
        (
            ["--replica", "http://127.0.0.1:1", "--replica", "http://127.0.0.1:2", "--tokenizer", "."]
            + ["--replica-events", "tcp://127.0.0.1:5,tcp://127.0.0.1:6"],
            ["1 --replica-events for 2 --replica"],
        ),
    ],
)
def test_the_router_refuses_bad_flags(flags, expected):
    result = run_cli("router", "--port", "0", "--host", "127.0.0.1", *flags)
    assert_refused_before_loading(result, *expected)
