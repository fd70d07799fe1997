#!/usr/bin/env bash
# Install everything the tests need (venv, dev extras, redis-server) and run
# lint plus the whole pytest suite. Exit status is non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh dev
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis-server not found: installing it with apt-get" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec .venv/bin/python -m pytest "$@"
