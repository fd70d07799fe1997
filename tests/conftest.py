"""Shared pytest configuration: markers, GPU skipping, tiny models, real servers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.cache_server.server_process import cache_server, cache_server_url  # noqa: F401
from tests.redis_fixtures import redis_cluster, redis_cluster_url, redis_server, redis_url, restartable_redis  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu`` tests when no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def kvstash_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Engines started by tests cache their weight hashes in a session folder, not in ~/.cache."""
    folder = tmp_path_factory.mktemp("kvstash-cache")
    previous = os.environ.get("KVSTASH_CACHE_DIR")
    os.environ["KVSTASH_CACHE_DIR"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("KVSTASH_CACHE_DIR", None)
    else:
        os.environ["KVSTASH_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: ``tiny_model_dir("qwen3") -> Path`` of a tiny checkpoint, made once per
    arch (and seed) per test session."""
    from bench.tiny_model import make_tiny_model

    made: dict[tuple[str, int], Path] = {}

    def get(arch: str = "llama", seed: int = 0) -> Path:
        key = (arch, seed)
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-{seed}"), arch=arch, seed=seed)
        return made[key]

    return get


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for child processes that import the repo's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
