#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv.
# Idempotent: a second run with an unchanged pyproject.toml returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVSTASH_VENV:-.venv}
STAMP="$VENV/.kvstash-installed"
want_dev=${1:-}

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
stamp_key="$(sha256sum pyproject.toml | cut -c1-16)${want_dev:+-dev}"
if [ -f "$STAMP" ] && grep -qx -- "$stamp_key" "$STAMP" 2>/dev/null; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned 'torch' would pull a multi-GB CUDA build.
# 2.13.0 is the CPU wheel these machines keep on disk; any installed torch >= 2.11 is kept.
if ! "$PY" -c 'import torch, sys; v=tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(v < (2, 11))' 2>/dev/null; then
  "$PY" -m pip install -q "torch==${KVSTASH_TORCH_VERSION:-2.13.0}"
fi
if [ -n "$want_dev" ]; then
  "$PY" -m pip install -q -e ".[dev]"
else
  "$PY" -m pip install -q -e .
fi
# The dev extra is a superset: remember which install happened.
echo "$stamp_key" > "$STAMP"
if [ -n "$want_dev" ]; then echo "${stamp_key%-dev}" >> "$STAMP"; fi
