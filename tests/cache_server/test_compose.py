"""docker-compose.yml: valid for ``docker-compose config`` when installed, and its services,
commands and health checks are the ones the stack needs (checked on the parsed file).
Auth is on (the cache server's token and the engine's API key come from `.env`; compose
refuses to start without them) and the cache server publishes no port on the host unless
the opt-in override asks, and then on 127.0.0.1 only."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import tempfile

import click
import pytest
import yaml

from benchmarks.support.cache_server_process import REPO_ROOT
from cache_server.cli import admin, cache_server
from engine.cli import main

COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
CACHE_PORT_OVERRIDE = REPO_ROOT / "docker-compose.cache-port.yml"
PD_OVERRIDE = REPO_ROOT / "docker-compose.pd.yml"
ROUTER_OVERRIDE = REPO_ROOT / "docker-compose.router.yml"
SECRETS = {"KVSTASH_AUTH_TOKEN": "cache-token-for-the-test", "KVSTASH_API_KEY": "api-key-for-the-test"}
HAS_COMPOSE = shutil.which("docker-compose") is not None


def compose_config(env_text: str, *files) -> subprocess.CompletedProcess:
    """`docker-compose config` over `files` with `env_text` as the env file (a developer's
    own .env never leaks in) and no KVSTASH_* variables from this process."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("KVSTASH_")}
    with tempfile.NamedTemporaryFile("w", suffix=".env") as env_file:
        env_file.write(env_text)
        env_file.flush()
        command = ["docker-compose", *(arg for f in files for arg in ("-f", str(f)))]
        return subprocess.run(
            [*command, "--env-file", env_file.name, "config"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )


def load_compose(*overrides) -> dict:
    """The file (and `overrides`) as docker-compose resolves them with the secrets of
    `.env.example` filled in, when docker-compose is installed (CI installs it); else the
    plain YAML, merged by hand (only what these tests read)."""
    files = [COMPOSE_FILE, *overrides]
    if HAS_COMPOSE:
        result = compose_config("".join(f"{k}={v}\n" for k, v in SECRETS.items()), *files)
        assert result.returncode == 0, f"docker-compose config rejected the file:\n{result.stderr}"
        return yaml.safe_load(result.stdout)
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    for override in overrides:
        for name, service in yaml.safe_load(override.read_text())["services"].items():
            compose["services"].setdefault(name, {}).update(service)
    return compose


def published_ports(service: dict) -> list[tuple[str, int]]:
    """(host address, container port) of each published port, in either of compose's forms."""
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            ports.append((port.get("host_ip", "0.0.0.0"), int(port["target"])))
            continue
        parts = str(port).split("/")[0].split(":")
        host_ip = parts[0] if len(parts) == 3 else "0.0.0.0"
        ports.append((host_ip, int(parts[-1])))
    return ports


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
    serve_command = main.get_command(click.Context(main), "serve")
    serve_params = serve_command.make_context("serve", serve_argv, resilient_parsing=True).params
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
    assert "download.pytorch.org/whl/cpu" in dockerfile
    assert "--require-hashes --no-deps -r requirements/lock.txt" in dockerfile
    assert "pip install --no-deps --no-build-isolation ." in dockerfile
    ignored = (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


def test_compose_turns_auth_on_and_keeps_the_cache_server_inside() -> None:
    compose = load_compose()
    services = compose["services"]
    cache_server_env = services["cache-server"]["environment"]
    engine_env = services["engine"]["environment"]
    if HAS_COMPOSE:  # resolved from the env file
        assert cache_server_env["KVSTASH_AUTH_TOKEN"] == SECRETS["KVSTASH_AUTH_TOKEN"]
        assert engine_env["KVSTASH_AUTH_TOKEN"] == SECRETS["KVSTASH_AUTH_TOKEN"]
        assert engine_env["KVSTASH_API_KEY"] == SECRETS["KVSTASH_API_KEY"]
    else:  # mandatory, never defaulted to empty
        for value in (*cache_server_env.values(), *engine_env.values()):
            assert value.startswith("${KVSTASH_") and ":?" in value
    # the cache server reads its token from KVSTASH_AUTH_TOKEN: no flag may turn it off
    server_argv = as_argv(services["cache-server"]["command"])
    params = cache_server.make_context("cache-server", server_argv[2:]).params
    assert not params.get("auth_token")  # from the environment, not baked into the command
    # nothing of the cache server or Redis is published on the host; the engine is, with its key
    assert published_ports(services["cache-server"]) == []
    assert published_ports(services["redis"]) == []
    assert [port for _, port in published_ports(services["engine"])] == [8000]

    # The opt-in override publishes the cache server on the loopback address only.
    exposed = load_compose(CACHE_PORT_OVERRIDE)["services"]["cache-server"]
    assert published_ports(exposed) == [("127.0.0.1", 50051)]


@pytest.mark.skipif(not HAS_COMPOSE, reason="needs docker-compose (CI installs it)")
def test_compose_refuses_to_start_without_the_secrets() -> None:
    example = (REPO_ROOT / ".env.example").read_text()
    assert "KVSTASH_AUTH_TOKEN=" in example and "KVSTASH_API_KEY=" in example
    # .env.example as it ships (empty values), and nothing at all
    for env_text in (example, ""):
        result = compose_config(env_text, COMPOSE_FILE)
        assert result.returncode != 0
        assert "KVSTASH_AUTH_TOKEN in .env" in result.stderr or "KVSTASH_API_KEY in .env" in result.stderr
    result = compose_config(f"KVSTASH_AUTH_TOKEN={SECRETS['KVSTASH_AUTH_TOKEN']}\n", COMPOSE_FILE)
    assert result.returncode != 0 and "KVSTASH_API_KEY in .env" in result.stderr
    # the secrets stay out of the image and the repository
    assert ".env" in (REPO_ROOT / ".dockerignore").read_text().split()
    assert ".env" in (REPO_ROOT / ".gitignore").read_text().split()


def _serve_params(service: dict) -> dict:
    """The `kvstash serve` flags of an engine service, parsed by the real command."""
    command = " ".join(as_argv(service["command"]))
    serve_command = main.get_command(click.Context(main), "serve")
    argv = shlex.split(command.split("exec kvstash serve", 1)[1])
    return serve_command.make_context("serve", argv, resilient_parsing=True).params


def test_the_pd_override_runs_a_producer_a_consumer_and_the_proxy() -> None:
    services = load_compose(PD_OVERRIDE)["services"]
    assert {"prefill", "decode", "proxy"} <= set(services)
    base_port = _serve_params(services["engine"])["port"]
    for name, role in (("prefill", "producer"), ("decode", "consumer")):
        params = _serve_params(services[name])
        assert params["kv_role"] == role and params["kv_offload"] is True
        # the tier they share is the cache server, which engines on other hosts reach too
        assert params["kv_offload_remote"].startswith("grpc://cache-server:")
        assert published_ports(services[name]) == []
        assert f"localhost:{params['port']}/health" in " ".join(
            as_argv(services[name]["healthcheck"]["test"])
        )
    proxy_argv = as_argv(services["proxy"]["command"])
    assert proxy_argv[:2] == ["kvstash", "proxy"]
    proxy_command = main.get_command(click.Context(main), "proxy")
    params = proxy_command.make_context("proxy", proxy_argv[2:]).params
    prefill_port = _serve_params(services["prefill"])["port"]
    decode_port = _serve_params(services["decode"])["port"]
    assert list(params["prefill_urls"]) == [f"http://prefill:{prefill_port}"]
    assert list(params["decode_urls"]) == [f"http://decode:{decode_port}"]
    # one endpoint for clients besides the base engine's, the engines' own stay inside
    assert [port for _, port in published_ports(services["proxy"])] == [params["port"]] != [base_port]
    for name in ("prefill", "decode"):
        assert services["proxy"]["depends_on"][name]["condition"] == "service_healthy"


def test_the_router_override_runs_two_replicas_with_events_and_the_router() -> None:
    services = load_compose(ROUTER_OVERRIDE)["services"]
    replica_names = ["replica-1", "replica-2"]
    assert {*replica_names, "router"} <= set(services)
    router_argv = as_argv(services["router"]["command"])
    assert router_argv[:2] == ["kvstash", "router"]
    router_command = main.get_command(click.Context(main), "router")
    # resilient: the tokenizer folder exists only in the container
    params = router_command.make_context("router", router_argv[2:], resilient_parsing=True).params
    expected_urls, expected_events = [], []
    for name in replica_names:
        replica = _serve_params(services[name])
        assert replica["kv_offload"] is True and replica["kv_offload_remote"].startswith(
            "grpc://cache-server:"
        )
        assert replica["engine_id"] == name
        pub_port = replica["kv_events_endpoint"].rsplit(":", 1)[1]
        replay_port = replica["kv_events_replay_endpoint"].rsplit(":", 1)[1]
        expected_urls.append(f"http://{name}:{replica['port']}")
        expected_events.append(f"tcp://{name}:{pub_port},tcp://{name}:{replay_port}")
        assert published_ports(services[name]) == []
    assert list(params["replica_urls"]) == expected_urls
    # the raw flag values, one per replica and in the same order
    events = [router_argv[i + 1] for i, arg in enumerate(router_argv) if arg == "--replica-events"]
    assert events == expected_events
    assert [port for _, port in published_ports(services["router"])] == [params["port"]]
    for name in replica_names:
        assert services["router"]["depends_on"][name]["condition"] == "service_healthy"
