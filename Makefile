# The two entry points a new machine needs; each sets up .venv first (a no-op when up to date).
.PHONY: chat test setup

chat: setup
	@.venv/bin/radixkv chat

test:
	scripts/setup_env.sh --test
	.venv/bin/python -m ruff check .
	.venv/bin/python -m ruff format --check .
	.venv/bin/python -m pytest -n 2

setup:
	@scripts/setup_env.sh
