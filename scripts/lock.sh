#!/usr/bin/env bash
# Refresh the dependency locks from pyproject.toml (make lock):
#   requirements/lock.txt      what `make bench` installs (the runtime dependencies)
#   requirements/lock-dev.txt  what `make test` installs (runtime + the dev and nixl extras, same versions)
# Every package is pinned with the hashes of its files, torch excepted: torch is pinned by
# version in scripts/setup_env.sh (the same version is a CPU build on the dev/CI machines and a
# CUDA build elsewhere, with other files and other dependencies). The locks are resolved for
# that CPU build of torch (no triton pin from torch's CUDA build), Python 3.11 on x86-64 Linux,
# with the newest releases PyPI has today; commit both files with the change that needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
# uv, pinned, in a small environment of its own: the project's .venv is made from the locks
# and cannot be trusted to install while they are stale.
UV_VERSION=0.13.9
TOOL_VENV=.venv-lock
if [ ! -x "$TOOL_VENV/bin/uv" ] || [ "$("$TOOL_VENV/bin/uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  python3 -m venv "$TOOL_VENV"
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$TOOL_VENV/bin/pip" install -q "uv==$UV_VERSION"
fi
UV=$TOOL_VENV/bin/uv
torch_version=${KVSTASH_TORCH_VERSION:-2.13.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The CPU wheel of torch lies on these machines' disk (pip's find-links); uv reads no pip
# configuration, so the folder is named here.
torch_wheels=${KVSTASH_TORCH_WHEELS:-/opt/wheels}
if ! compgen -G "$torch_wheels/torch-${torch_version}+cpu-*.whl" >/dev/null; then
  echo "no CPU wheel of torch ${torch_version} in $torch_wheels (set KVSTASH_TORCH_WHEELS to its folder)" >&2
  exit 1
fi
echo "torch==${torch_version}+cpu" >"$work/torch-cpu.txt"
compile=("$UV" pip compile pyproject.toml --quiet --generate-hashes --no-emit-package torch
  --python-version 3.11 --python-platform x86_64-manylinux_2_28
  --find-links "$torch_wheels"
  -c "$work/torch-cpu.txt" --custom-compile-command "make lock")
"${compile[@]}" -o requirements/lock.txt
# The dev lock takes every shared package at the runtime lock's version.
"${compile[@]}" --extra dev --extra nixl -c requirements/lock.txt -o requirements/lock-dev.txt
echo "wrote requirements/lock.txt and requirements/lock-dev.txt (torch ${torch_version} pinned in scripts/setup_env.sh)"
