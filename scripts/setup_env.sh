#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv from the dependency locks.
#   scripts/setup_env.sh        the runtime packages (requirements/lock.txt): make bench
#   scripts/setup_env.sh dev    runtime + dev packages (requirements/lock-dev.txt): make test
# Every package comes at the version and with the file hashes of the lock, so a new machine
# gets what passed on the last one (scripts/lock.sh, `make lock`, refreshes the locks); torch is
# pinned by version here. Idempotent: a second run with unchanged locks returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTASH_VENV:-.venv}
STAMP="$VENV/.kvstash-installed"
want_dev=${1:-}
TORCH_VERSION=${KVSTASH_TORCH_VERSION:-2.13.0}
lock=requirements/lock.txt
if [ -n "$want_dev" ]; then lock=requirements/lock-dev.txt; fi

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp_key="$(cat pyproject.toml "$lock" | sha256sum | cut -c1-16)-torch$TORCH_VERSION${want_dev:+-dev}"
if [ -f "$STAMP" ] && grep -qx -- "$stamp_key" "$STAMP" 2>/dev/null; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The locked packages, exactly (hash-checked; --no-deps: the lock holds every dependency).
"$PY" -m pip install -q --require-hashes --no-deps -r "$lock"
# torch pinned by version: on the dev/CI machines 2.13.0 is a CPU wheel that lies on disk
# (an unpinned 'torch' would pull a multi-GB CUDA build); its dependencies are in the lock.
# An installed torch >= 2.11 (a GPU host's own build) is kept.
if ! "$PY" -c 'import torch, sys; v=tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
# kvstash itself, editable, built with the locked setuptools.
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
# A lock that no longer covers pyproject.toml's dependencies fails here, not in a test.
if ! "$PY" -m pip check >"$VENV/pip-check.txt" 2>&1; then
  cat "$VENV/pip-check.txt" >&2
  echo "the installed packages do not satisfy their requirements: refresh the locks with 'make lock'" >&2
  exit 1
fi
# The dev lock is a superset: remember both installs.
echo "$stamp_key" >"$STAMP"
if [ -n "$want_dev" ]; then echo "$(cat pyproject.toml requirements/lock.txt | sha256sum | cut -c1-16)-torch$TORCH_VERSION" >>"$STAMP"; fi
