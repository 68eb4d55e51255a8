# The two entry points a new machine needs; each sets up .venv first (a no-op when up to date).
.PHONY: chat test lint setup

chat: setup
	.venv/bin/radixkv chat

test:
	scripts/setup_env.sh --test
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/pytest

setup:
	scripts/setup_env.sh
