#!/usr/bin/env bash
# Install everything the tests need (venv, dev extras, redis-server) and run
# lint plus the whole pytest suite. Exit status is non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh dev
# System packages the tests drive for real: redis-server (standalone and cluster)
# and docker-compose (only to validate docker-compose.yml; no Docker engine needed).
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v docker-compose >/dev/null 2>&1 || missing="$missing docker-compose"
# openssl makes the self-signed certificates of the TLS tests.
command -v openssl >/dev/null 2>&1 || missing="$missing openssl"
if [ -n "$missing" ]; then
  echo "installing with apt-get:$missing" >&2
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  $SUDO apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export TRITON_INTERPRET=${TRITON_INTERPRET:-1}
exec .venv/bin/python -m pytest "$@"
