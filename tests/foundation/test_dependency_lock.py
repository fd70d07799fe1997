"""The dependency locks (requirements/lock.txt, lock-dev.txt) cover pyproject.toml: every
dependency pinned at a version its specifier admits, with file hashes, the same version in
both locks, and torch pinned by version in scripts/setup_env.sh (and the Dockerfile)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def read_lock(path: Path) -> dict[str, tuple[Version, list[str]]]:
    """name -> (pinned version, sha256 hashes) of a `uv pip compile --generate-hashes` file."""
    entries: dict[str, tuple[Version, list[str]]] = {}
    name = None
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            name = canonicalize_name(match.group(1))
            if name in entries:
                raise ValueError(f"{path.name}: {name} pinned twice")
            entries[name] = (Version(match.group(2)), [])
        elif line.strip().startswith("--hash=") and name is not None:
            entries[name][1].append(line.strip().removeprefix("--hash=").rstrip(" \\"))
        elif line and not line.startswith((" ", "#")):
            raise ValueError(f"{path.name}: unexpected line {line!r}")
    return entries


def pyproject_requirements() -> tuple[list[Requirement], list[Requirement]]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = [Requirement(text) for text in project["dependencies"]]
    extras = project["optional-dependencies"]
    # the dev lock holds the nixl extra too (CI tests the direct P/D path)
    dev = [Requirement(text) for name in ("dev", "nixl") for text in extras[name]]
    return runtime, dev


def torch_pin(text: str, pattern: str) -> Version:
    match = re.search(pattern, text)
    if match is None:
        raise AssertionError(f"no torch pin matching {pattern!r}")
    return Version(match.group(1))


@pytest.mark.parametrize(("lock_name", "with_dev"), [("lock.txt", False), ("lock-dev.txt", True)])
def test_every_dependency_is_pinned_with_hashes_at_an_admitted_version(lock_name, with_dev):
    lock = read_lock(REPO_ROOT / "requirements" / lock_name)
    runtime, dev = pyproject_requirements()
    for requirement in runtime + (dev if with_dev else []):
        name = canonicalize_name(requirement.name)
        if name == "torch":
            assert name not in lock, "torch is pinned by version in scripts/setup_env.sh, not in the lock"
            continue
        assert name in lock, f"{lock_name} lacks {requirement}: run make lock"
        version, _ = lock[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            lock_name,
            str(requirement),
            version,
        )
    for name, (_, hashes) in lock.items():
        assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes), name


def test_the_dev_lock_takes_the_runtime_lock_s_versions():
    runtime_lock = read_lock(REPO_ROOT / "requirements" / "lock.txt")
    dev_lock = read_lock(REPO_ROOT / "requirements" / "lock-dev.txt")
    _, dev = pyproject_requirements()
    assert set(runtime_lock) < set(dev_lock)
    assert {canonicalize_name(r.name) for r in dev} <= set(dev_lock)
    for name, (version, _) in runtime_lock.items():
        assert dev_lock[name][0] == version, name


def test_torch_is_pinned_once_at_a_version_pyproject_admits():
    setup = (REPO_ROOT / "scripts" / "setup_env.sh").read_text()
    pinned = torch_pin(setup, r"KVSTASH_TORCH_VERSION:-([0-9.]+)\}")
    assert (
        torch_pin((REPO_ROOT / "scripts" / "lock.sh").read_text(), r"KVSTASH_TORCH_VERSION:-([0-9.]+)\}")
        == pinned
    )
    assert torch_pin((REPO_ROOT / "Dockerfile").read_text(), r'"torch==([0-9.]+)"') == pinned
    runtime, _ = pyproject_requirements()
    (torch_requirement,) = [r for r in runtime if r.name == "torch"]
    assert torch_requirement.specifier.contains(pinned)
    assert "--require-hashes --no-deps -r" in setup and "pip check" in setup
