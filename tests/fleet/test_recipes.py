"""The recipes run as a user runs them: `examples/fleet/fleet.py RECIPE -- SERVE_ARGS` starts the
fleet, prints where to send requests, serves until Ctrl-C, then stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fleet
import pytest
from processes import sigint_restored

RECIPE = Path(fleet.__file__)


def run_recipe(
    recipe: str,
    model_dir: Path,
    log_dir: Path,
    last: str,
    while_up: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Start `recipe`, read what it prints up to the line starting with `last`, call
    `while_up(lines)`, then Ctrl-C it. Returns the lines; fails unless it exits 0."""
    argv = [sys.executable, str(RECIPE), recipe, "--served-model-name", "tiny"]
    argv += ["--log-dir", str(log_dir), "--"]
    argv += ["--model", str(model_dir), "--num-blocks", "256"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, preexec_fn=sigint_restored, start_new_session=True
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        while not lines or not lines[-1].startswith(last):
            line = proc.stdout.readline()
            assert line, f"the recipe stopped: {lines}"
            lines.append(line.rstrip("\n"))
        if while_up is not None:
            while_up(lines)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            returncode = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the recipe and every process it started
            raise
    assert returncode == 0
    return lines


def test_session_hash_recipe_serves_and_stops(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    if fleet.router_python("vllm-router") is None:
        pytest.skip("vllm-router is not installed: run scripts/setup_routers.sh")
    import openai

    def chat(lines: list[str]) -> None:
        base_url = lines[-1].split()[1]
        client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w10 w11"}], max_tokens=2
        )
        assert reply.usage.completion_tokens == 2

    lines = run_recipe("session-hash", tiny_model_dir("gqa"), tmp_path, "router", chat)
    assert lines[0] == f"logs     {tmp_path}"  # where a user finds what went wrong
    assert [line.split()[0] for line in lines[1:]] == ["replica", "replica", "router"]
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "replica0.log",
        "replica1.log",
        "router.log",
    ]


def test_dynamo_recipe_runs_in_its_own_namespace(
    tiny_model_dir: Callable[[str], Path], tmp_path: Path
) -> None:
    if fleet.router_python("ai-dynamo-runtime") is None:
        pytest.skip("ai-dynamo-runtime is not installed: run scripts/setup_routers.sh")
    if not fleet.namespace_available():
        pytest.skip("needs `unshare -n` (a loopback-only network namespace; root)")
    lines = run_recipe("dynamo-indexer", tiny_model_dir("gqa"), tmp_path, "indexer")[1:]
    assert [line.split()[0] for line in lines] == ["replica", "replica", "indexer"]
    assert all("events tcp://127.0.0.1:" in line for line in lines[:2])
