"""docker-compose.yml: valid for ``docker-compose config`` when installed, and its services,
commands and health checks are the ones the stack needs (checked on the parsed file)."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import yaml

from cache_server.cli import admin, cache_server
from engine.cli import main
from tests.cache_server.server_process import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"


def load_compose() -> dict:
    """The file as docker-compose resolves it when available (CI installs it), else as plain YAML."""
    if shutil.which("docker-compose") is not None:
        result = subprocess.run(
            ["docker-compose", "-f", str(COMPOSE_FILE), "config"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, f"docker-compose config rejected the file:\n{result.stderr}"
        return yaml.safe_load(result.stdout)
    return yaml.safe_load(COMPOSE_FILE.read_text())


def as_argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def test_compose_stack_services_commands_and_health_checks() -> None:
    compose = load_compose()
    services = compose["services"]
    assert set(services) == {"redis", "cache-server", "engine"}
    for name, service in services.items():
        assert as_argv(service["healthcheck"]["test"])[0] in ("CMD", "CMD-SHELL"), name

    assert as_argv(services["redis"]["command"])[0] == "redis-server"
    assert "redis-cli" in as_argv(services["redis"]["healthcheck"]["test"])

    server_argv = as_argv(services["cache-server"]["command"])
    assert server_argv[:2] == ["kvstash", "cache-server"]
    # The flags must be ones the real command accepts (parsing only; nothing starts).
    context = cache_server.make_context("cache-server", server_argv[2:])
    assert context.params["host"] == "0.0.0.0" and context.params["redis_url"] == "redis://redis:6379/0"
    port = context.params["port"]
    health_argv = as_argv(services["cache-server"]["healthcheck"]["test"])[1:]
    assert health_argv[:2] == ["kvstash", "admin"] and health_argv[-1] == "health"
    admin_context = admin.make_context("admin", health_argv[2:], resilient_parsing=True)
    assert admin_context.params["server"] == f"localhost:{port}"
    assert services["cache-server"]["depends_on"]["redis"]["condition"] == "service_healthy"

    engine = services["engine"]
    engine_command = " ".join(as_argv(engine["command"]))
    assert f"--kv-offload --kv-offload-remote grpc://cache-server:{port}" in engine_command
    serve_argv = shlex.split(engine_command.split("exec kvstash serve", 1)[1])
    # Parsed by the real `kvstash serve` (resilient: the model folder exists only in the container).
    serve_params = main.commands["serve"].make_context("serve", serve_argv, resilient_parsing=True).params
    assert (
        serve_params["kv_offload"] is True
        and serve_params["kv_offload_remote"] == f"grpc://cache-server:{port}"
    )
    assert serve_params["host"] == "0.0.0.0"
    assert f"localhost:{serve_params['port']}/health" in " ".join(as_argv(engine["healthcheck"]["test"]))
    assert engine["depends_on"]["cache-server"]["condition"] == "service_healthy"


def test_dockerfile_installs_the_package_on_a_cpu_torch() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "FROM python:3.11-slim" in dockerfile
    assert "download.pytorch.org/whl/cpu" in dockerfile and "pip install ." in dockerfile
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
