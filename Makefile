# The two commands of the README. Each installs what it needs into .venv.
.PHONY: bench test lint format protos lock

bench:
	@scripts/setup_env.sh
	.venv/bin/kvstash bench

test:
	@scripts/test.sh

lint:
	@scripts/setup_env.sh dev
	.venv/bin/ruff check . && .venv/bin/ruff format --check .

format:
	@scripts/setup_env.sh dev
	.venv/bin/ruff check --fix . && .venv/bin/ruff format .

protos:
	@scripts/setup_env.sh dev
	.venv/bin/python scripts/gen_protos.py

# Refresh requirements/lock.txt and lock-dev.txt from pyproject.toml (newest releases today).
lock:
	@scripts/lock.sh
